"""``--jobs N`` against a sequential sweep: the same runs, side by side in one invocation.

Workload: a named experiment's runs (default: seed001-local's quick variant, CPL on LFW faces; ``--full``
its full scale, ``--seeds`` how many seeds), run twice through the real command line - ``fedsim experiment
NAME --jobs 1`` and ``--jobs N`` - each into a fresh folder, alternately ``--repeats`` times (the order
alternates, so the machine's slow phases hit both alike). Printed: each invocation's wall time (import,
start-up and the runs: what a user waits for), the ratio sequential / pooled per pair and its median, and
whether the two invocations' rows are equal metric for metric (every column but wall times).

Expectation: on N free cores, close to N for runs much longer than a worker's start (a spawned worker
imports torch and fedsim once: 4-8 s); on a machine with other work, less.

    python benchmarks/sweep_jobs.py [--experiment seed001-local] [--jobs 2] [--repeats 2] [--seeds 1] [--full]
        [--set SECTION.KEY=VALUE ...] [--only LABEL ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"round_seconds", "time_ratio"}


def invoke(args: argparse.Namespace, jobs: int, out: Path) -> float:
    cmd = [sys.executable, "-m", "fedsim", "experiment", args.experiment, "--out", str(out), "-q",
           "--jobs", str(jobs), "--seeds", ",".join(str(s) for s in range(args.seeds))]
    if not args.full:
        cmd.append("--quick")
    for o in args.set or []:
        cmd += ["--set", o]
    for o in args.only or []:
        cmd += ["--only", o]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def rows(out: Path) -> list[dict]:
    path = out / ("runs.jsonl" if (out / "runs.jsonl").exists() else "sweep.jsonl")
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in path.read_text().splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="seed001-local")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=1, help="seeds 0..S-1 of every variant")
    ap.add_argument("--full", action="store_true", help="the experiment's full scale instead of --quick")
    ap.add_argument("--set", action="append", help="a config override for every run (repeatable)")
    ap.add_argument("--only", action="append", help="only this variant (repeatable)")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"{args.experiment} ({'full' if args.full else 'quick'}, {args.seeds} seed(s), --set {args.set or []}, "
          f"--only {args.only or []}), --jobs 1 vs --jobs "
          f"{args.jobs}, {args.repeats} pair(s); {os.cpu_count()} cores, load {load:.1f}", flush=True)
    ratios, same = [], True
    with tempfile.TemporaryDirectory(prefix="sweep-jobs-") as tmp:
        for rep in range(args.repeats):
            order = (1, args.jobs) if rep % 2 == 0 else (args.jobs, 1)
            t, outs = {}, {}
            for jobs in order:
                outs[jobs] = Path(tmp) / f"r{rep}-j{jobs}"
                t[jobs] = invoke(args, jobs, outs[jobs])
            ratio = t[1] / t[args.jobs]
            ratios.append(ratio)
            equal = rows(outs[1]) == rows(outs[args.jobs])
            same = same and equal
            print(f"pair {rep + 1}: --jobs 1 {t[1]:.1f} s, --jobs {args.jobs} {t[args.jobs]:.1f} s, ratio "
                  f"{ratio:.2f}x; rows equal: {equal}", flush=True)
    print(f"median ratio {statistics.median(ratios):.2f}x over {len(ratios)} pair(s); every pair's rows equal: "
          f"{same}; load {os.getloadavg()[0]:.1f} at the end")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
