"""Seed 002 (accuracy-lossless perturbation) measured: accuracy, numerics, cost and curious-client attacks.

Prints Markdown tables (copied into docs/lossless.md):

* ``table1``  - Table 1 in miniature: FedSGD regression (MSE) on breast-cancer (label as a real target),
  FC ReLU nets with L = 3, 5, 7 layers, K = 1, 5, 10 clients, batch 32, plain vs perturbed + recovered;
* ``classify`` - fmnist-small, MLP (64, 32), 5 clients: MSE on one-hot targets (m = 1 and 10) and
  cross-entropy in shift mode, plain vs perturbed;
* ``numerics`` - recovery error in float64 / float32 for several noise ranges and m;
* ``cost``    - client time of :func:`fedsim.lossless.client_terms` vs a plain backward, upload size;
* ``mia``     - membership inference (§6.4.1) over seeds and feature choices;
* ``inversion`` - gradient inversion from consecutive global models over seeds.

    PYTHONPATH=. .venv/bin/python benchmarks/lossless.py [--sections table1,mia,...] [--seeds 3]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F

from attacks.curious_client import (
    invert_optimisation,
    invert_rows,
    invert_single,
    others_gradient,
    span_inversion,
)
from attacks.membership import layer_features, membership_inference
from fedsim import lossless as ll
from fedsim.data import load_dataset
from fedsim.metrics import score_reconstruction
from fedsim.models import build_model

SECTIONS = ("table1", "classify", "numerics", "cost", "mia", "inversion")


def mlp(in_shape, n_out, hidden, seed):
    torch.manual_seed(seed)
    return ll.get_layers(build_model("mlp", in_shape, n_out, hidden=hidden), dtype=torch.float64)


def batches(sizes_or_parts, rnd, seed, batch):
    g = torch.Generator().manual_seed(seed * 100_003 + rnd)
    return [p[torch.randperm(len(p), generator=g)[:batch]] for p in sizes_or_parts]


def federated(layers, x, y, parts, rounds, lr, batch, *, loss, secrets_fn=None, target=lambda t: t, seed=0):
    """FedSGD; with ``secrets_fn(round)`` every round goes through perturb / client_terms / recover."""
    for rnd in range(rounds):
        bs = batches(parts, rnd, seed, batch)
        w = [len(b) for b in bs]
        if secrets_fn is None:
            grads = [ll.true_gradients(layers, x[b], target(y[b]), loss=loss) for b in bs]
            agg = [(sum(wk * g[i][0] for wk, g in zip(w, grads)) / sum(w),
                    sum(wk * g[i][1] for wk, g in zip(w, grads)) / sum(w)) for i in range(len(layers))]
        else:
            sec = secrets_fn(rnd)
            sent, public = ll.perturb(layers, sec)
            terms = [ll.client_terms(sent, public, x[b], target(y[b]), loss=loss) for b in bs]
            agg = ll.recover(ll.aggregate(terms), sec)
        layers = ll.sgd_step(layers, agg, lr)
    return layers


def maxdiff(a, b):
    return max(float((u - v).abs().max()) for (u, ub), (v, vb) in zip(a, b) for u, v in ((u, v), (ub, vb)))


def table1(args):
    d = load_dataset("breast-cancer")
    x, y = d.x_train.double(), d.y_train.double()[:, None]
    xt, yt = d.x_test.double(), d.y_test.double()[:, None]
    print("| L | K | test MSE FedSGD | test MSE perturbed | max weight diff | seconds (plain / perturbed) |")
    print("|---|---|---|---|---|---|")
    for L in (3, 5, 7):
        for K in (1, 5, 10):
            parts = list(torch.randperm(len(y), generator=torch.Generator().manual_seed(0)).chunk(K))
            init = mlp((30,), 1, (32,) * (L - 1), 0)
            t0 = time.perf_counter()
            plain = federated(init, x, y, parts, args.rounds, args.lr, 32, loss="mse")
            t1 = time.perf_counter()
            pert = federated(init, x, y, parts, args.rounds, args.lr, 32, loss="mse", secrets_fn=lambda r, sh=ll.layer_shapes(init): ll.draw_secrets(
                sh, 1, torch.Generator().manual_seed(10_000 + r)))
            t2 = time.perf_counter()
            mse = [float(((ll.forward(m, xt)[0] - yt) ** 2).mean()) for m in (plain, pert)]
            print(f"| {L} | {K} | {mse[0]:.4f} | {mse[1]:.4f} | {maxdiff(plain, pert):.1e} | "
                  f"{t1 - t0:.1f} / {t2 - t1:.1f} |")


def classify(args):
    d = load_dataset("fmnist-small")
    x, y, xt, yt = d.x_train.double(), d.y_train, d.x_test.double(), d.y_test
    parts = list(torch.randperm(len(y), generator=torch.Generator().manual_seed(0)).chunk(5))
    init = mlp((1, 28, 28), 10, (64, 32), 0)
    print("| loss | noise | test acc FedSGD | test acc perturbed | max weight diff |")
    print("|---|---|---|---|---|")
    for loss, mode, m, lr in (("mse", "paper", 1, 0.1), ("mse", "paper", 10, 0.1), ("cross_entropy", "shift", 1, 0.1)):
        tgt = (lambda t: F.one_hot(t, 10).double()) if loss == "mse" else (lambda t: t)
        plain = federated(init, x, y, parts, args.rounds, lr, 32, loss=loss, target=tgt)
        pert = federated(init, x, y, parts, args.rounds, lr, 32, loss=loss, target=tgt,
                         secrets_fn=lambda r, m=m, mode=mode: ll.draw_secrets(
                             ll.layer_shapes(init), m, torch.Generator().manual_seed(20_000 + r), mode=mode))
        acc = [float((ll.forward(v, xt)[0].argmax(1) == yt).double().mean()) for v in (plain, pert)]
        print(f"| {loss} | {mode}, m={m} | {acc[0]:.3f} | {acc[1]:.3f} | {maxdiff(plain, pert):.1e} |")


def numerics(args):
    d = load_dataset("fmnist-small")
    x, y = d.x_train[:32].double(), F.one_hot(d.y_train[:32], 10).double()
    true = mlp((1, 28, 28), 10, (64, 32), 0)
    ref = ll.true_gradients(true, x, y)
    print("| dtype | r^(l), gamma range | m | max abs error | max relative error (per tensor) |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float64, torch.float32):
        for rng in ((0.1, 10.0), (0.01, 100.0), (1e-3, 1e3)):
            for m in (1, 10):
                layers = [(w.to(dt), b.to(dt)) for w, b in true]
                sec = ll.draw_secrets(ll.layer_shapes(layers), m, g, multiplicative=rng, gamma=rng, dtype=dt)
                sent, public = ll.perturb(layers, sec)
                rec = ll.recover(ll.client_terms(sent, public, x.to(dt), y.to(dt)), sec)
                err = max(float((a.double() - b).abs().max()) for (a, _), (b, _) in zip(rec, ref))
                rel = max(float((a.double() - b).norm() / b.norm()) for (a, _), (b, _) in zip(rec, ref))
                print(f"| {str(dt)[6:]} | {rng} | {m} | {err:.1e} | {rel:.1e} |")


def cost(args):
    d = load_dataset("fmnist-small")
    x, y = d.x_train[:32].double(), F.one_hot(d.y_train[:32], 10).double()
    layers = mlp((1, 28, 28), 10, (64, 32), 0)
    n_params = sum(w.numel() + b.numel() for w, b in layers)
    print(f"MLP 784-64-32-10 ({n_params} parameters), batch 32, float64, best of 20")
    print("| m | client time, plain backward | client time, client_terms | arrays up | MB up (float64) |")
    print("|---|---|---|---|---|")

    def best(fn):
        out = []
        for _ in range(20):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return min(out)

    plain = best(lambda: ll.true_gradients(layers, x, y))
    for m in (1, 2, 5, 10):
        sec = ll.draw_secrets(ll.layer_shapes(layers), m, torch.Generator().manual_seed(0))
        sent, public = ll.perturb(layers, sec)
        t = best(lambda sent=sent, public=public: ll.client_terms(sent, public, x, y))
        arrays = ll.client_terms(sent, public, x, y).to_arrays()
        mb = sum(a.nbytes for a in arrays) / 1e6
        print(f"| {m} | {plain * 1e3:.2f} ms | {t * 1e3:.2f} ms | {len(arrays)} | {mb:.2f} |")


def mia(args):
    d = load_dataset("fmnist-small")
    feats = ("last", "second", "third", "last3")
    print("| seed | train / test acc | features | plain, calibrated round T-1 | plain, same round | "
          "perturbed, round T-1 (mean of 4 draws) | perturbed m=1, same round | perturbed m=10, same round |")
    print("|---|---|---|---|---|---|---|---|")
    for seed in range(args.seeds):
        g = torch.Generator().manual_seed(seed)
        mem = torch.randperm(len(d.y_train), generator=g)[:200]
        non = torch.randperm(len(d.y_test), generator=g)[:200]
        xm, ym, xn, yn = d.x_train[mem].double(), d.y_train[mem], d.x_test[non].double(), d.y_test[non]
        layers = mlp((1, 28, 28), 10, (64, 32), seed)
        for _ in range(600):
            prev, layers = layers, ll.sgd_step(layers, ll.true_gradients(layers, xm, F.one_hot(ym, 10).double()), 0.5)
        accs = [float((ll.forward(layers, a)[0].argmax(1) == b).double().mean()) for a, b in
                ((xm, ym), (d.x_test.double(), d.y_test))]
        draws = []
        for _ in range(4):
            s0, s1 = (ll.draw_secrets(ll.layer_shapes(layers), 1, g) for _ in range(2))
            draws.append((ll.perturb(prev, s0)[0], ll.perturb(layers, s1)[0]))
        same10 = ll.perturb(layers, ll.draw_secrets(ll.layer_shapes(layers), 10, g))[0]

        def run(vc, vt, f, data=(xm, ym, xn, yn)):
            xm, ym, xn, yn = data
            cm, cn = layer_features(vc, xm, ym, 10, f), layer_features(vc, xn, yn, 10, f)
            tm, tn = layer_features(vt, xm, ym, 10, f), layer_features(vt, xn, yn, 10, f)
            return membership_inference((cm[:100], cn[:100]), (tm[100:], tn[100:]), features=f, epochs=100,
                                        seed=0).accuracy

        for f in feats:
            pc = sum(run(a, b, f) for a, b in draws) / len(draws)
            print(f"| {seed} | {accs[0]:.3f} / {accs[1]:.3f} | {f} | {run(prev, layers, f):.3f} | "
                  f"{run(layers, layers, f):.3f} | {pc:.3f} | {run(draws[0][1], draws[0][1], f):.3f} | "
                  f"{run(same10, same10, f):.3f} |")


def inversion(args):
    d = load_dataset("fmnist-small")

    def oh(t):
        return F.one_hot(t, 10).double()

    def round_views(layers, xs, ys, secrets):
        K = len(xs)
        if secrets is None:
            gs = [ll.true_gradients(layers, xs[k:k + 1], oh(ys[k:k + 1])) for k in range(K)]
            agg = [(sum(g[i][0] for g in gs) / K, sum(g[i][1] for g in gs) / K) for i in range(len(layers))]
            return layers, ll.sgd_step(layers, agg, 0.1), gs[0]
        sent, public = ll.perturb(layers, secrets[0])
        terms = [ll.client_terms(sent, public, xs[k:k + 1], oh(ys[k:k + 1])) for k in range(K)]
        new = ll.sgd_step(layers, ll.recover(ll.aggregate(terms), secrets[0]), 0.1)
        return sent, ll.perturb(new, secrets[1])[0], terms[0].grads

    print("| seed | single: plain max err | single: perturbed PSNR | span attack on perturbed: max err (rows) | "
          "4 others: rows exact plain / perturbed | DLG plain PSNR / SSIM | DLG perturbed PSNR / SSIM |")
    print("|---|---|---|---|---|---|---|")
    for seed in range(args.seeds):
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(len(d.y_train), generator=g)[:5]
        xs, ys = d.x_train[idx].double(), d.y_train[idx]
        layers = mlp((1, 28, 28), 10, (64, 32), seed)
        secrets = tuple(ll.draw_secrets(ll.layer_shapes(layers), 1, g) for _ in range(2))
        p, n, o = round_views(layers, xs[:2], ys[:2], None)
        e_single = float((invert_single(others_gradient(p, n, o, 0.1, 0.5)) - xs[1].reshape(-1)).abs().max())
        p, n, o = round_views(layers, xs[:2], ys[:2], secrets)
        guess = invert_single(others_gradient(p, n, o, 0.1, 0.5)).clamp(0, 1).reshape(1, 1, 28, 28).float()
        ps = score_reconstruction(guess, ys[1:2], xs[1:2].float(), ys[1:2])["psnr"]
        try:
            rec, tr = span_inversion(p[0], n[0], xs[:1])
            span = f"{float((rec - xs[1].reshape(-1)).abs().max()):.1e} ({tr['rows']})"
        except ValueError as e:
            span = f"failed: {e}"
        res = []
        for sec in (None, secrets):
            p, n, o = round_views(layers, xs, ys, sec)
            go = others_gradient(p, n, o, 0.1, 0.2)
            rows = invert_rows(go)
            exact = sum(bool(((rows - x.reshape(-1)).abs().amax(1) <= 1e-8).any()) for x in xs[1:]) if len(rows) else 0
            xr, yr, _ = invert_optimisation(p, go, 4, (1, 28, 28), iterations=300, seed=seed)
            s = score_reconstruction(xr.float(), yr, xs[1:].float(), ys[1:])
            res.append((exact, s["psnr"], s["ssim"]))
        print(f"| {seed} | {e_single:.1e} | {ps:.1f} dB | {span} | {res[0][0]} / {res[1][0]} | "
              f"{res[0][1]:.1f} / {res[0][2]:.2f} | {res[1][1]:.1f} / {res[1][2]:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.05, help="table1 learning rate")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.sections.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"--sections: unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        print(f"\n### {name}\n")
        t0 = time.perf_counter()
        globals()[name](args)
        print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
