"""Flower's own knobs at 1,000 clients per round, measured side by side (interleaved) on the Ray backend:
the grid's pull interval and the number of client actors, with one client per node and with virtual
clients (fedsim's ``simulation.clients_per_node``).

What Flower 1.41 offers (read from its source, ``flwr/simulation``, ``flwr/server/superlink``):

* ``grid.pull_interval`` (``InMemoryGrid``, default 0.1 s): how often the ServerApp polls for replies;
  fedsim sets 0.01 (``fedsim.app.runner.PULL_INTERVAL``). Each poll checks every outstanding message
  under the state's lock, which the engine's dispatcher also needs.
* ``backend_config``: ``client_resources`` (``num_cpus``/``num_gpus`` per actor; fedsim's
  ``simulation.num_cpus``/``num_gpus``), ``init_args`` (``ray.init`` arguments; ``num_cpus`` there sets
  how many CPUs Ray believes it has, so ``init_args.num_cpus / client_resources.num_cpus`` actors run),
  ``actor`` (only ``tensorflow``). ``flwr run``'s federation config has the same fields
  (``num-supernodes``, ``client-resources-num-cpus/gpus``, ``init-args-num-cpus/gpus``, logging).
* Not configurable: the engine's dispatcher hands out at most one message per node per pass, scans
  the whole message store for every node on every pass and waits 0.1 s between passes; the node config
  is fixed (``partition-id``, ``num-partitions``); the simulation's state is always the in-memory
  LinkState; there is no message batching - a node gets one message at a time (fedsim's virtual
  clients are the batching: one message carries several clients' work).

Variants (``--pull``, ``--actors``, ``--layouts``): every combination of pull interval, actor count
(2 = one per core, Flower's default here; 4 = ``init_args.num_cpus = 4``, two actors per core) and
layout (``one``: one client per node, 1,000 nodes; ``virtual``: 20 nodes serving 50 clients each).
Each repeat runs every variant once, in the same order, in this process (Ray started and stopped per
run). Workload: the issue's FedSGD (one step, batch 8), ReLU LeNet, full Fashion-MNIST, IID, no
observers; ``--dataset``/``--model`` change it (``synthetic-2d``/``mlp`` for a quick check).

Columns: ``round s`` median and range over rounds >= 2 of all repeats; ``compute s``: the clients' own
training time per round (``train_seconds``, summed over clients); ``ready s``: Ray's launch until every
client was discovered; ``round 1 s``; ``discovered``: partitions mapped / configured.

    python benchmarks/flower_knobs.py [--clients 1000] [--per-round 1000] [--rounds 3] [--repeats 3]
        [--pull 0.1,0.01,0.001] [--actors 2,4] [--layouts one,virtual] [--dataset fmnist --model lenet]
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sim_overhead import compute_observer, quiet  # the same folder: run as a script

ROOT = Path(__file__).resolve().parents[1]
VIRTUAL_NODES = 20


def make_cfg(args, out_dir: Path, per_node: int) -> dict:
    from fedsim.app import load_config

    sets = [f"federation.num_clients={args.clients}", f"federation.clients_per_round={args.per_round}",
            f"federation.rounds={args.rounds}", f"simulation.clients_per_node={per_node}", "train.local_steps=1",
            "train.batch_size=8", "train.lr=0.05", 'model.activation="relu"', 'data.partition="iid"',
            "output.observers=[]", "output.checkpoint=false", 'simulation.backend="ray"', 'device="cpu"',
            f'data.dataset="{args.dataset}"', f'model.name="{args.model}"', f'output.dir="{out_dir}"',
            f"seed={args.seed}"]
    if args.data_dir:
        sets.append(f'data.data_dir="{args.data_dir}"')
    return load_config(None, sets)


def run_variant(cfg: dict, out: Path, pull: float, actors: int) -> dict:
    """One fedsim run on Ray with the grid's pull interval and the actor count set."""
    import json

    import fedsim.app.runner as runner
    from fedsim.reports import read_jsonl

    real_backend_config = runner._backend_config

    def backend_config(c):
        bc = real_backend_config(c)
        bc["init_args"]["num_cpus"] = actors * int(c["simulation"]["num_cpus"])  # actors = this / per actor
        return bc

    before = runner.PULL_INTERVAL
    runner.PULL_INTERVAL, runner._backend_config = pull, backend_config
    obs = compute_observer()
    try:
        run_dir = runner.run_experiment(cfg, out=out, observers=[obs], progress=False)
    finally:
        runner.PULL_INTERVAL, runner._backend_config = before, real_backend_config
    rows = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"rows": [{"round": r["round"], "seconds": r["seconds"], "compute": obs.compute.get(r["round"], 0.0)}
                     for r in rows if r["round"] >= 1],
            "ready": summary.get("startup_seconds"), "discovered": summary["clients"],
            "configured": summary["clients_configured"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--per-round", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pull", default="0.1,0.01,0.001", help="grid pull intervals (s)")
    p.add_argument("--actors", default="2,4", help="client actors (Ray's CPUs / CPUs per actor)")
    p.add_argument("--layouts", default="one,virtual", help="one: a client per node; virtual: "
                   f"{VIRTUAL_NODES} nodes of virtual clients")
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--model", default="lenet")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (rounds >= 2 are measured)")
    quiet()
    import torch

    torch.set_num_threads(1)
    per_node = {"one": 1, "virtual": max(1, math.ceil(args.clients / VIRTUAL_NODES))}
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if any(x not in per_node for x in layouts):
        p.error(f"--layouts: choose from {sorted(per_node)}")
    variants = list(itertools.product(layouts, [float(x) for x in args.pull.split(",")],
                                      [int(x) for x in args.actors.split(",")]))
    results: dict[tuple, list[dict]] = {v: [] for v in variants}
    print(f"fedsim flower_knobs: {args.clients} clients, {args.per_round} per round, {args.rounds} rounds x "
          f"{args.repeats} repeats, {args.model} on {args.dataset}; {len(variants)} variants; load average "
          f"{os.getloadavg()[0]:.2f} (start)", flush=True)
    with tempfile.TemporaryDirectory(prefix="fedsim-knobs-") as tmp:
        tmp = Path(tmp)
        os.environ.setdefault("RAY_TMPDIR", str(tmp))
        for rep in range(args.repeats):
            for i, (layout, pull, actors) in enumerate(variants):
                cfg = make_cfg(args, tmp, per_node[layout])
                t0 = time.perf_counter()
                res = run_variant(cfg, tmp / f"r{rep}-{i}", pull, actors)
                results[(layout, pull, actors)].append(res)
                med = statistics.median(r["seconds"] for r in res["rows"] if r["round"] >= 2)
                print(f"  repeat {rep + 1}: {layout}, pull {pull:g} s, {actors} actors: median round {med:.3f} s "
                      f"({time.perf_counter() - t0:.0f} s run)", flush=True)
    print()
    print("| layout | nodes | pull s | actors | round s median | range | compute s | ready s | round 1 s | discovered |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (layout, pull, actors), res in results.items():
        rows = [r for x in res for r in x["rows"] if r["round"] >= 2]
        secs = [r["seconds"] for r in rows]
        r1 = statistics.median(r["seconds"] for x in res for r in x["rows"] if r["round"] == 1)
        nodes = math.ceil(args.clients / per_node[layout])
        found = ", ".join(sorted({f"{x['discovered']}/{x['configured']}" for x in res}))
        print(f"| {layout} | {nodes} | {pull:g} | {actors} | {statistics.median(secs):.3f} | "
              f"{min(secs):.3f}-{max(secs):.3f} | {statistics.median(r['compute'] for r in rows):.3f} | "
              f"{statistics.median(x['ready'] for x in res):.1f} | {r1:.3f} | {found} |")
    print(f"\nload average {os.getloadavg()[0]:.2f} (end); other processes on this machine inflate every row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
