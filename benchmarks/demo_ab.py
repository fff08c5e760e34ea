"""The README demo from two checkouts, interleaved: ``python -m fedsim run experiments/demo.toml -q`` (plus any
``--set``) run from a baseline checkout and from this one, in alternating order, each in a fresh process with
a fresh ``--out``.

Per run: the command's wall time, the load average at its start, ``startup_seconds`` (``summary.json``) and
the median ``seconds`` of rounds >= 2 (``metrics.jsonl``: the round without observers, so round 1's attack
is left out). Then the medians of both sides and their ratio (this checkout / baseline).

    python benchmarks/demo_ab.py --baseline /tmp/fedsim-base [--pairs 3] [--set federation.rounds=40 ...]

(the baseline: ``git archive <commit> | tar -x -C /tmp/fedsim-base``). Prints the machine (CPUs, load
average before and after).
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


def machine() -> str:
    return f"{os.cpu_count()} CPUs, load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(checkout: Path, sets: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="fedsim-demo-ab-")) / "r"
    env = dict(os.environ, PYTHONPATH=str(checkout), RAY_USAGE_STATS_ENABLED="0")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "fedsim", "run", "experiments/demo.toml", "--out", str(out), "-q",
                        *(x for s in sets for x in ("--set", s))], cwd=checkout, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{checkout}: exit {p.returncode}\n{p.stderr[-2000:]}")
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    startup = json.loads((out / "summary.json").read_text())["startup_seconds"]
    return {"wall": wall, "load": load, "startup": startup,
            "round": statistics.median(r["seconds"] for r in rounds if r["round"] >= 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, type=Path)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    print(f"before: {machine()}")
    sides = {"baseline": args.baseline.resolve(), "this": ROOT}
    got: dict[str, list[dict]] = {k: [] for k in sides}
    for i in range(args.pairs):
        for side in (["baseline", "this"] if i % 2 == 0 else ["this", "baseline"]):
            r = run(sides[side], args.set)
            got[side].append(r)
            print(f"pair {i + 1} {side:8s} wall {r['wall']:6.2f} s  start-up {r['startup']:6.2f} s  "
                  f"median round {r['round']:.3f} s  (load {r['load']:.2f})", flush=True)
    for key in ("wall", "startup", "round"):
        b, c = (statistics.median(r[key] for r in got[s]) for s in ("baseline", "this"))
        print(f"median {key}: baseline {b:.3f}  this {c:.3f}  ratio {c / b:.3f}")
    print(f"after: {machine()}")


if __name__ == "__main__":
    main()
