"""Attack strength at each attack's defaults: success rate, label accuracy and budget per batch size.

Victims: DLG's LeNet (sigmoid, U(-0.5, 0.5) init; with BatchNorm after each convolution for the
attacks that need it, ``ig-bn``) on fmnist-small **test** images (images no attack was tuned on), one FedSGD step (SGD lr 0.1, ``local_steps=1``) on a batch of ``B`` images, so the
update is exactly ``-lr`` times the batch gradient. ``--rounds`` global models (one per seed) with
``--victims`` victims each; the victims of a round share the global model, hold disjoint images and
are attacked together with :meth:`attacks.base.Attack.run_many` (each with its own attacker seed).

Per attack and batch size it prints: images attacked, the share of images whose matched
reconstruction has SSIM >= 0.9 (``ASR``), the median SSIM, the mean PSNR (capped at 100 dB), the label
accuracy (multiset, order-free), the mean iterations (summed over restarts) and attempts per victim,
and the wall time per victim (batched). Attack parameters are each attack's defaults unless
``--set attack.key=value`` overrides them (values parsed as Python literals).

    .venv/bin/python benchmarks/attack_strength.py [--batches 1,4,8] [--rounds 2] [--victims 5]
        [--attacks dlg,idlg,cpl,ig,grnn,ig-fr,ig-bn] [--set grnn.iterations=500] [--json out.json]
"""
from __future__ import annotations

import argparse
import ast
import json
import time
from typing import Any

import numpy as np
import torch

from attacks import AttackInput, build_attack
from fedsim.data.registry import load_dataset
from fedsim.metrics import score_reconstruction
from fedsim.models import build_model
from fedsim.training import Recipe, batch_schedule, local_train

ATTACKS = ("dlg", "idlg", "cpl", "ig", "grnn", "ig-fr", "ig-bn")
NEEDS_BN = {"ig-bn"}  # attacked on the same LeNet with BatchNorm after each convolution


def train_global(net: torch.nn.Module, steps: int, seed: int, lr: float = 0.1, batch: int = 32) -> None:
    """``steps`` SGD steps (lr ``lr``, batches of ``batch`` fmnist-small training images drawn from
    ``seed``) on ``net`` in place: a global model that has trained for a while."""
    if not steps:
        return
    ds = load_dataset("fmnist-small")
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(10_000 + seed)
    net.train()
    for _ in range(steps):
        idx = torch.randint(0, len(ds.y_train), (batch,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(ds.x_train[idx]), ds.y_train[idx]).backward()
        opt.step()


def round_victims(batch: int, round_seed: int, victims: int, *, lr: float = 0.1, image_seed: int = 1234,
                  norm: str | None = None, train_steps: int = 0) -> list[tuple[AttackInput, torch.Tensor, torch.Tensor]]:
    """The victims of one round: a seeded sigmoid LeNet (``norm = "batch"``: with BatchNorm; trained for
    ``train_steps`` SGD steps first, :func:`train_global`), ``victims`` disjoint batches of test images."""
    ds = load_dataset("fmnist-small")
    shape = ds.in_shape
    perm = np.random.default_rng(image_seed + 7919 * round_seed).permutation(len(ds.y_test))

    def model_fn():
        return build_model("lenet", shape, 10, norm=norm)

    torch.manual_seed(round_seed)
    net = build_model("lenet", shape, 10, init="uniform", norm=norm)
    train_global(net, train_steps, round_seed)
    global_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    out = []
    for v in range(victims):
        idx = torch.as_tensor(perm[v * batch:(v + 1) * batch])
        x, y = ds.x_test[idx], ds.y_test[idx]
        net.load_state_dict(global_state)
        recipe = Recipe(lr=lr, batch_size=batch, local_steps=1)
        res = local_train(net, x, y, recipe, seed=round_seed, round=0, client=v)
        update = {k: torch.as_tensor(w) - global_state[k] for k, w in zip(global_state, res.weights)}
        first = torch.as_tensor(batch_schedule(round_seed, 0, v, batch, recipe)[0])
        inp = AttackInput(model_fn, global_state, update, recipe.to_mapping(), shape, 10, batch,
                          seed=1000 * round_seed + v)
        out.append((inp, x[first], y[first]))
    return out


def parse_sets(items: list[str]) -> dict[str, dict[str, Any]]:
    params: dict[str, dict[str, Any]] = {}
    for item in items:
        key, _, value = item.partition("=")
        name, _, param = key.partition(".")
        if not param or not _:
            raise SystemExit(f"--set needs attack.key=value, got {item!r}")
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = value
        params.setdefault(name, {})[param] = parsed
    return params


def evaluate(name: str, params: dict[str, Any], batch: int, rounds: int, victims: int) -> dict[str, Any]:
    ssims, psnrs, labels, its, attempts, secs = [], [], [], [], [], []
    for r in range(rounds):
        vs = round_victims(batch, r, victims, norm="batch" if name in NEEDS_BN else None)
        attack = build_attack(name, **params)
        t0 = time.perf_counter()
        results = attack.run_many([v[0] for v in vs])
        secs.append((time.perf_counter() - t0) / len(vs))
        for res, (_, x, y) in zip(results, vs):
            sc = score_reconstruction(res.inputs, res.labels, x, y, ssim_threshold=0.9)
            ssims.extend(sc["per_image"]["ssim"])
            psnrs.extend(min(p, 100.0) for p in sc["per_image"]["psnr"])
            labels.append(sc["label_acc"])
            its.append(res.trace["iterations"])
            attempts.append(res.trace.get("attempts", 1))
    s = np.asarray(ssims)
    return {"attack": name, "batch": batch, "images": len(s), "asr": float((s >= 0.9).mean()),
            "median_ssim": float(np.median(s)), "psnr": float(np.mean(psnrs)), "label_acc": float(np.mean(labels)),
            "iterations": float(np.mean(its)), "attempts": float(np.mean(attempts)),
            "seconds_per_victim": float(np.mean(secs)), "params": params}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=2, help="global models (seeds 0..rounds-1)")
    ap.add_argument("--victims", type=int, default=5, help="victims per round")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--set", action="append", default=[], metavar="ATTACK.KEY=VALUE")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sets = parse_sets(args.set)
    rows = []
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.rounds} rounds x {args.victims} "
          f"victims per batch size")
    print(f"{'attack':6} {'B':>2} {'images':>6} {'ASR':>5} {'med SSIM':>8} {'PSNR':>6} {'labels':>6} "
          f"{'iters':>7} {'tries':>5} {'s/victim':>8}")
    for batch in [int(b) for b in args.batches.split(",")]:
        for name in args.attacks.split(","):
            row = evaluate(name, sets.get(name, {}), batch, args.rounds, args.victims)
            rows.append(row)
            print(f"{name:6} {batch:2d} {row['images']:6d} {row['asr']:5.2f} {row['median_ssim']:8.3f} "
                  f"{row['psnr']:6.1f} {row['label_acc']:6.3f} {row['iterations']:7.0f} {row['attempts']:5.2f} "
                  f"{row['seconds_per_victim']:8.1f}", flush=True)
    print("ASR: share of images with SSIM >= 0.9 to their matched reconstruction; labels: label accuracy; "
          "iters/tries: mean iterations (over all restarts) and attempts per victim; s/victim: batched wall time.")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
