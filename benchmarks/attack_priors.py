"""Measurements behind docs/attacks.md for ``ig-bn``, ``ig-fr`` and ``robbing`` (larger than the tests).

Every victim update comes from :func:`fedsim.training.local.local_train` on fmnist-small (seeded global model,
PyTorch default init unless ``--trained``); scores are :func:`fedsim.metrics.score_reconstruction`
means over the batches (MSE, RMSE = sqrt(mean MSE), PSNR, SSIM).

Sections (``--sections``, comma-separated):

* ``robbing``: images recovered above 40 dB out of a batch, against the number alone in their bin
  (counted from the truth), for measurements x bin sources x bin counts; then several local steps
  with the two block scalings;
* ``bn``: Inverting Gradients on the BatchNorm LeNet at batch 4 without the BN prior and with its three
  targets (running / update / victim);
* ``fr``: plain ``ig`` against ``ig-fr`` and its ablations at the same iteration budget.

    PYTHONPATH=. .venv/bin/python benchmarks/attack_priors.py [--sections robbing,bn,fr] [--batches 4]
        [--iterations 400] [--batch-size 4] [--trained]
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from attacks import AttackInput, build_attack
from attacks.bn_prior import batch_bn_stats
from fedsim.data.registry import load_dataset
from fedsim.metrics import score_reconstruction
from fedsim.models import build_model
from fedsim.models.imprint import (
    build_imprinted,
    gaussian_bins,
    imprint_model,
    measurement_vector,
    quantile_bins,
)
from fedsim.training.batches import batch_schedule
from fedsim.training.local import local_train
from fedsim.training.recipe import Recipe

DS = load_dataset("fmnist-small")
SHAPE = DS.in_shape
BN = dict(activation="relu", norm="batch")


def trained_state(model_kw: dict, steps: int = 300, seed: int = 99) -> dict[str, torch.Tensor]:
    """A global model after ``steps`` SGD steps (batch 32, lr 0.05) on images 1000-1999 (not victims)."""
    torch.manual_seed(seed)
    net = build_model("lenet", SHAPE, 10, **model_kw)
    recipe = Recipe(lr=0.05, batch_size=32, local_steps=steps)
    res = local_train(net, DS.x_train[1000:2000], DS.y_train[1000:2000], recipe, seed=seed, round=0, client=0)
    return {k: torch.as_tensor(w) for k, w in zip(net.state_dict(), res.weights)}


def victim(indices, *, seed=0, model_kw=None, wrap=None, state=None, steps=1, batch_size=None, lr=0.1):
    model_kw = dict(model_kw or {})
    torch.manual_seed(seed)
    net = build_model("lenet", SHAPE, 10, **model_kw)
    if state is not None:
        net.load_state_dict(state)
    if wrap is not None:
        net = wrap(net)
    nbins = net.imprint.num_bins if wrap is not None else 0

    def model_fn():
        base = build_model("lenet", SHAPE, 10, **model_kw)
        return build_imprinted(base, SHAPE, nbins) if wrap is not None else base

    g = {k: v.detach().clone() for k, v in net.state_dict().items()}
    x, y = DS.x_train[list(indices)], DS.y_train[list(indices)]
    recipe = Recipe(lr=lr, batch_size=batch_size or len(y), local_steps=steps)
    res = local_train(net, x, y, recipe, seed=seed, round=0, client=0)
    update = {k: torch.as_tensor(w) - g[k] for k, w in zip(g, res.weights)}
    used = sorted({int(i) for b in batch_schedule(seed, 0, 0, len(y), recipe) for i in b})
    inp = AttackInput(model_fn, g, update, recipe.to_mapping(), SHAPE, 10, len(y), seed=seed)
    return inp, x[used], y[used]


def summary(rows: list[dict]) -> str:
    m = float(np.mean([r["mse"] for r in rows]))
    return (f"{m:.4f} | {math.sqrt(m):.3f} | {np.mean([r['psnr'] for r in rows]):.2f} | "
            f"{np.mean([r['ssim'] for r in rows]):.3f}")


# ---------------------------------------------------------------------------------------- robbing
def robbing(args) -> None:
    print("\n## Robbing the Fed: images > 40 dB / alone in their bin (mean over batches), LeNet ReLU, 1 step\n")
    print("| measurement | bins from | bins | batch | > 40 dB | alone | uniform-bin expectation |")
    print("|---|---|---|---|---|---|---|")
    for meas in ("brightness", "random"):
        w = measurement_vector(SHAPE, meas, torch.Generator().manual_seed(1))
        vals = DS.x_root.flatten(1) @ w
        for source in ("gaussian", "quantile"):
            for batch, ks in ((16, (32, 64, 128, 256)), (64, (256, 1024))):
                for k in ks:
                    bins = gaussian_bins(float(vals.mean()), float(vals.std()), k) if source == "gaussian" \
                        else quantile_bins(vals, k)
                    good, alone = [], []
                    for b in range(args.robbing_batches):
                        idx = range(b * batch, (b + 1) * batch)
                        inp, x, y = victim(idx, seed=b, model_kw={"activation": "relu"},
                                           wrap=lambda base, bins=bins, w=w: imprint_model(base, bins, SHAPE,
                                                                                           measurement=w))
                        res = build_attack("robbing").run(inp)
                        sc = score_reconstruction(res.inputs, res.labels, x, y)
                        good.append(sum(p > 40 for p in sc["per_image"]["psnr"]))
                        bo = ((x.flatten(1) @ w)[:, None] > bins[None]).sum(1)
                        alone.append(int((torch.bincount(bo)[bo] == 1).sum()))
                    exp = batch * (1 - 1 / k) ** (batch - 1)
                    print(f"| {meas} | {source} | {k} | {batch} | {np.mean(good):.2f} | {np.mean(alone):.2f} | "
                          f"{exp:.2f} |", flush=True)
    print("\n## Robbing the Fed over several local steps (batch 16 of 64 local images, 128 Gaussian "
          "brightness bins)\n")
    print("| local steps | gain | scale | images used | > 40 dB | > 20 dB |")
    print("|---|---|---|---|---|---|")
    w = measurement_vector(SHAPE, "brightness")
    vals = DS.x_root.flatten(1) @ w
    bins = gaussian_bins(float(vals.mean()), float(vals.std()), 128)
    for steps in (1, 2, 4):
        for gain, scale in ((1e-3, 1.0), (1.0, 1e-3)):
            good, ok20, used = [], [], []
            for b in range(args.robbing_batches):
                inp, x, y = victim(range(b * 64, (b + 1) * 64), seed=b, model_kw={"activation": "relu"}, steps=steps,
                                   batch_size=16, wrap=lambda base, g=gain, s=scale: imprint_model(
                                       base, bins, SHAPE, measurement=w, gain=g, scale=s))
                res = build_attack("robbing").run(inp)
                sc = score_reconstruction(res.inputs, res.labels, x, y)
                good.append(sum(p > 40 for p in sc["per_image"]["psnr"]))
                ok20.append(sum(p > 20 for p in sc["per_image"]["psnr"]))
                used.append(len(y))
            print(f"| {steps} | {gain:g} | {scale:g} | {np.mean(used):.0f} | {np.mean(good):.2f} | "
                  f"{np.mean(ok20):.2f} |", flush=True)


# ---------------------------------------------------------------------------------------- IG variants
def run_configs(args, configs: dict[str, tuple[str, dict]], title: str) -> None:
    state = trained_state(BN) if args.trained else None
    rows: dict[str, list] = {k: [] for k in configs}
    secs: dict[str, list] = {k: [] for k in configs}
    B = args.batch_size
    for b in range(args.batches):
        start = 100 + 100 * b
        inp, x, y = victim(range(start, start + B), seed=b, model_kw=BN, state=state)
        inp.bn_stats = batch_bn_stats(inp.global_model(), x)  # used only by bn_target="victim"
        for key, (name, kw) in configs.items():
            t0 = time.perf_counter()
            kw = {"iterations": args.iterations, **kw}
            res = build_attack(name, **kw).run(inp)
            secs[key].append(time.perf_counter() - t0)
            rows[key].append(score_reconstruction(res.inputs, res.labels, x, y))
    model = "trained 300 steps" if args.trained else "untrained"
    print(f"\n## {title}: BatchNorm LeNet ({model}), batch {B}, {args.iterations} iterations, "
          f"{args.batches} batches\n")
    print("| attack | MSE | RMSE | PSNR | SSIM | s/run |")
    print("|---|---|---|---|---|---|")
    for key in configs:
        print(f"| {key} | {summary(rows[key])} | {np.mean(secs[key]):.1f} |", flush=True)


def bn(args) -> None:
    run_configs(args, {
        "ig (registered)": ("ig", {"lr": 0.1, "tv": 1e-2}),
        "ig-bn, bn_prior=0": ("ig-bn", {"bn_prior": 0.0}),
        "ig-bn, running": ("ig-bn", {"bn_target": "running"}),
        "ig-bn, update": ("ig-bn", {"bn_target": "update"}),
        "ig-bn, victim": ("ig-bn", {"bn_target": "victim"}),
    }, "BN-statistics prior (weight 0.1)")


def fr(args) -> None:
    run_configs(args, {
        "ig (registered)": ("ig", {"lr": 0.1, "tv": 1e-2}),
        "ig, 4x the iterations (about ig-fr's time)": ("ig", {"lr": 0.1, "tv": 1e-2,
                                                              "iterations": 4 * args.iterations}),
        "ig-fr (defaults)": ("ig-fr", {}),
        "ig-fr, no features": ("ig-fr", {"features": 0.0}),
        "ig-fr, no BN prior": ("ig-fr", {"bn_prior": 0.0}),
        "ig-fr, no image prior (pixels)": ("ig-fr", {"image_prior": False}),
        "ig-fr, BN target victim": ("ig-fr", {"bn_target": "victim"}),
        "ig-fr, layer_weights=norm": ("ig-fr", {"layer_weights": "norm"}),
    }, "Seed 004's attack and its ablations")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="robbing,bn,fr")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--robbing-batches", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--trained", action="store_true", help="attack a global model trained for 300 steps")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for s in args.sections.split(","):
        {"robbing": robbing, "bn": bn, "fr": fr}[s](args)


if __name__ == "__main__":
    main()
