"""Attack strength at each attack's defaults: success rate, label accuracy, budget and cost per batch size.

Victims: DLG's LeNet (sigmoid, U(-0.5, 0.5) init; with BatchNorm after each convolution for the
attacks that need it, ``ig-bn``) on fmnist-small **test** images (images no attack was tuned on), one
FedSGD step (SGD lr 0.1, ``local_steps=1``) on a batch of ``B`` images, so the update is exactly ``-lr``
times the batch gradient. Per batch size ``max(--min-batches, ceil(--images / B))`` victims per round
hold disjoint images; ``--rounds`` global models (one per seed). Every victim is attacked on its own
(``Attack.run``; the stacked ``run_many`` gives the same reconstructions up to float rounding,
benchmarks/attack_speed.py measures its speed), with its own attacker seed.

Per attack and batch size it prints: images attacked, the share of images whose matched
reconstruction has SSIM >= 0.9 (``ASR``), the number of batches with at least half of their images
recovered, the median SSIM, the mean PSNR (capped at 100 dB), the label accuracy (multiset,
order-free), the mean evaluations of the gradient-matching objective per victim (iterations over all
restarts and stages), the wall time per victim, the time per evaluation (``ms/eval``) and the floor's
(``floor ms``), and their ratio (``/floor``:
the whole run, set-up included, divided by its evaluations, over one evaluation of the floor of
benchmarks/attack_speed.py - forward, parameter gradient with ``create_graph``, distance, double
backward - timed on the same victim in the same process just before the attack).

Attack parameters are each attack's defaults unless ``--set ATTACK.key=value`` overrides them (values
parsed as Python literals). ``NAME@LABEL`` in ``--attacks`` is attack ``NAME`` as a variant with its own
``--set NAME@LABEL.key=value`` (e.g. ``grnn@w16`` with ``--set grnn@w16.max_width=16``). ``--jobs N``
runs the victims in ``N`` processes of one torch thread each (the timings then come from processes
sharing the machine).

    PYTHONPATH=. .venv/bin/python benchmarks/attack_strength.py [--batches 1,4,8,16] [--images 10]
        [--min-batches 3] [--rounds 1] [--attacks dlg,idlg,cpl,ig,grnn,ig-fr,ig-bn,strongest]
        [--set grnn.iterations=500] [--jobs 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_speed import floor_seconds, parse_sets  # noqa: E402

from attacks import AttackInput, build_attack  # noqa: E402
from fedsim.data.registry import load_dataset  # noqa: E402
from fedsim.metrics import score_reconstruction  # noqa: E402
from fedsim.models import build_model  # noqa: E402
from fedsim.training.batches import batch_schedule  # noqa: E402
from fedsim.training.local import local_train  # noqa: E402
from fedsim.training.recipe import Recipe  # noqa: E402

ATTACKS = ("dlg", "idlg", "cpl", "ig", "grnn", "ig-fr", "ig-bn", "strongest")
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


def victims_for(batch: int, images: int, min_batches: int) -> int:
    return max(min_batches, math.ceil(images / batch))


def attack_victim(spec: str, params: dict[str, Any], batch: int, round_seed: int, victim: int,
                  victims: int) -> dict[str, Any]:
    """One task: attack victim ``victim`` of round ``round_seed`` with ``spec`` (``NAME[@LABEL]``)."""
    torch.set_num_threads(1)
    name = spec.split("@")[0]
    inp, x, y = round_victims(batch, round_seed, victims, norm="batch" if name in NEEDS_BN else None)[victim]
    floor = floor_seconds(inp, 0.3)
    attack = build_attack(name, **params)
    t0 = time.perf_counter()
    res = attack.run(inp)
    secs = time.perf_counter() - t0
    sc = score_reconstruction(res.inputs, res.labels, x, y, ssim_threshold=0.9)
    its = int(res.trace["iterations"])
    return {"spec": spec, "batch": batch, "round": round_seed, "victim": victim,
            "ssim": [float(s) for s in sc["per_image"]["ssim"]],
            "psnr": [min(float(p), 100.0) for p in sc["per_image"]["psnr"]], "label_acc": float(sc["label_acc"]),
            "iterations": its, "attempts": int(res.trace.get("attempts", 1)), "seconds": secs,
            "ms_per_eval": 1e3 * secs / max(its, 1), "floor_ms": 1e3 * floor, "ratio": secs / max(its, 1) / floor}


def summarise(spec: str, batch: int, tasks: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
    s = np.asarray([v for t in tasks for v in t["ssim"]])
    half = sum(int(np.mean(np.asarray(t["ssim"]) >= 0.9) >= 0.5) for t in tasks)
    return {"attack": spec, "batch": batch, "images": len(s), "batches": len(tasks), "asr": float((s >= 0.9).mean()),
            "batches_half": half, "median_ssim": float(np.median(s)),
            "psnr": float(np.mean([v for t in tasks for v in t["psnr"]])),
            "label_acc": float(np.mean([t["label_acc"] for t in tasks])),
            "iterations": float(np.mean([t["iterations"] for t in tasks])),
            "attempts": float(np.mean([t["attempts"] for t in tasks])),
            "seconds_per_victim": float(np.mean([t["seconds"] for t in tasks])),
            "ms_per_eval": float(np.median([t["ms_per_eval"] for t in tasks])),
            "floor_ms": float(np.median([t["floor_ms"] for t in tasks])),
            "ratio": float(np.median([t["ratio"] for t in tasks])), "params": params}


def _run(task: tuple) -> dict[str, Any]:
    return attack_victim(*task)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--images", type=int, default=10, help="at least this many images per batch size and round")
    ap.add_argument("--min-batches", type=int, default=3, help="at least this many victims per batch size and round")
    ap.add_argument("--rounds", type=int, default=1, help="global models (seeds 0..rounds-1)")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--set", action="append", default=[], metavar="ATTACK.KEY=VALUE")
    ap.add_argument("--jobs", type=int, default=1, help="processes (one torch thread each)")
    ap.add_argument("--json", default=None, help="also write the rows (and every victim's result) to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sets = parse_sets(args.set)
    specs = args.attacks.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    tasks = [(spec, sets.get(spec, {}), b, r, v, victims_for(b, args.images, args.min_batches))
             for b in batches for spec in specs for r in range(args.rounds)
             for v in range(victims_for(b, args.images, args.min_batches))]
    print(f"torch {torch.__version__}, 1 thread per process, {args.jobs} process(es), {os.cpu_count()} CPUs; "
          f"{len(tasks)} victims", flush=True)
    t_all = time.perf_counter()

    def progress(k: int, r: dict[str, Any]) -> None:  # one line per finished victim, on stderr
        spent = time.perf_counter() - t_all
        print(f"[{k}/{len(tasks)}] {r['spec']} batch {r['batch']} victim {r['victim']}: median SSIM "
              f"{float(np.median(r['ssim'])):.3f}, {r['seconds']:.0f} s  (elapsed {spent / 60:.1f} min, "
              f"ETA {spent / k * (len(tasks) - k) / 60:.1f} min)", file=sys.stderr, flush=True)

    if args.jobs > 1:
        order = sorted(range(len(tasks)), key=lambda i: -tasks[i][2])  # the largest batches first
        done: dict[int, dict[str, Any]] = {}
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = {pool.submit(_run, tasks[i]): i for i in order}
            for k, future in enumerate(as_completed(futures), 1):
                done[futures[future]] = future.result()
                progress(k, done[futures[future]])
        results = [done[i] for i in range(len(tasks))]
    else:
        results = []
        for k, t in enumerate(tasks, 1):
            results.append(_run(t))
            progress(k, results[-1])
    rows = []
    print(f"{'attack':12} {'B':>2} {'images':>6} {'ASR':>5} {'half/batches':>12} {'med SSIM':>8} {'PSNR':>6} "
          f"{'labels':>6} {'evals':>7} {'tries':>5} {'s/victim':>8} {'ms/eval':>7} {'floor ms':>8} {'/floor':>6}")
    for b in batches:
        for spec in specs:
            row = summarise(spec, b, [t for t in results if t["spec"] == spec and t["batch"] == b], sets.get(spec, {}))
            rows.append(row)
            print(f"{spec:12} {b:2d} {row['images']:6d} {row['asr']:5.2f} {row['batches_half']:5d}/{row['batches']:<6d} "
                  f"{row['median_ssim']:8.3f} {row['psnr']:6.1f} {row['label_acc']:6.3f} {row['iterations']:7.0f} "
                  f"{row['attempts']:5.2f} {row['seconds_per_victim']:8.1f} {row['ms_per_eval']:7.2f} {row['floor_ms']:8.2f} "
                  f"{row['ratio']:6.2f}", flush=True)
    print("ASR: share of images with SSIM >= 0.9 to their matched reconstruction; half/batches: victims with at least "
          "half of their images recovered; labels: label accuracy; evals: mean evaluations (iterations over all "
          "restarts and stages); ms/eval: median over victims of the run's milliseconds per evaluation (set-up "
          "included); floor ms: the floor's per evaluation; /floor: median over victims of their ratio. "
          f"{time.perf_counter() - t_all:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "victims": results}, fh, indent=1)


if __name__ == "__main__":
    main()
