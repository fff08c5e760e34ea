"""What seed 000's global update compensation costs per round, and why compensated runs look slower.

Runs the Table II federation (experiments/table2.toml: 50 clients, FedSGD batch 1, tanh LeNet) for a
few rounds, without attacks, as three variants - LRP alone, LRP + compensation, LRP + compensation
with error feedback - and prints, side by side:

* ``round``: median wall time of rounds >= 2 (training, aggregation, evaluation);
* ``comp``: median time of the mp-compensation transform's ``after_aggregate`` (the compensation itself);
* ``step``: the time of one batch-1 forward/backward of each variant's final global model over
  ``--steps`` training images, with
  subnormal floats computed as usual and with ``torch.set_flush_denormal(True)`` (flush to zero);
  interleaved over the variants, best of ``--repeats``.

If ``step`` differs between the variants only without flushing, the extra round time of the
compensated runs comes from the CPU's slow subnormal arithmetic in the clients, not from the
compensation.

    .venv/bin/python benchmarks/compensation_cost.py [--rounds 10] [--steps 300] [--repeats 5]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

import strategies.compensation as compensation
from fedsim.app.runner import run_experiment
from fedsim.app.sweep import load_sweep
from fedsim.data.registry import load_dataset
from fedsim.models import build_model
from fedsim.reports import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("LRP, no compensation", "LRP + compensation (ours)", "LRP + compensation + feedback")


def step_ms(state: dict, xs: torch.Tensor, ys: torch.Tensor, flush: bool) -> float:
    """Mean time of a batch-1 forward/backward over the training images ``xs`` (what a client does)."""
    model = build_model("lenet", (1, 28, 28), 10, activation="tanh")
    model.load_state_dict(state)
    torch.set_flush_denormal(flush)
    try:
        for i in range(20):  # warm-up
            model.zero_grad()
            F.cross_entropy(model(xs[i:i + 1]), ys[i:i + 1]).backward()
        t = time.perf_counter()
        for i in range(len(ys)):
            model.zero_grad()
            F.cross_entropy(model(xs[i:i + 1]), ys[i:i + 1]).backward()
        return (time.perf_counter() - t) / len(ys) * 1e3
    finally:
        torch.set_flush_denormal(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)

    finalize_times: list[float] = []
    original = compensation.MPCompensation.after_aggregate

    def timed(self, *a, **kw):
        t = time.perf_counter()
        out = original(self, *a, **kw)
        finalize_times.append(time.perf_counter() - t)
        return out

    compensation.MPCompensation.after_aggregate = timed
    _, variants = load_sweep(ROOT / "experiments" / "table2.toml",
                             [f"federation.rounds={args.rounds}", "attack.rounds=[]"], only=VARIANTS)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, cfg in variants:
            finalize_times.clear()
            cfg["output"]["dir"] = tmp
            run_dir = run_experiment(cfg, out=Path(tmp) / cfg["name"], progress=False)
            rows = read_jsonl(run_dir / "metrics.jsonl")
            round_ms = 1e3 * float(np.median([r["seconds"] for r in rows if r["round"] >= 2]))
            comp_ms = 1e3 * float(np.median(finalize_times)) if finalize_times else 0.0  # no transform
            results.append((label, round_ms, comp_ms, torch.load(run_dir / "model.pt")))
    # step times: interleaved over the variants, best of the repeats (order and warm-up effects cancel)
    ds = load_dataset("fmnist-small")
    xs, ys = ds.x_train[:args.steps], ds.y_train[:args.steps]
    best = {(i, f): float("inf") for i in range(len(results)) for f in (False, True)}
    for _ in range(args.repeats):
        for i, (_, _, _, state) in enumerate(results):
            for flush in (False, True):
                best[i, flush] = min(best[i, flush], step_ms(state, xs, ys, flush))
    print(f"{'variant':<32} {'round ms':>9} {'comp ms':>8} {'step ms':>8} {'step ms (flush)':>16}")
    for i, (label, round_ms, comp_ms, _) in enumerate(results):
        print(f"{label:<32} {round_ms:>9.1f} {comp_ms:>8.2f} {best[i, False]:>8.3f} {best[i, True]:>16.3f}")

if __name__ == "__main__":
    main()
