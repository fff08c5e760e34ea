"""What Flower's SecAgg+ costs per round, next to plain FedAvg, for several federation sizes.

One Flower simulation (Ray by default; ``--backend inprocess`` for the in-process grid) with
``max(--clients)`` nodes. Inside its ServerApp, for each size n two fedsim servers share the grid: the
plain channel and ``channel.name = "secagg+"`` (num_shares / reconstruction_threshold from the
command line), both FedAvg over the first n partitions, same seed and workload. Their rounds are
interleaved (plain, secagg+, plain, ... with the order swapped every round) so that machine load hits
both alike. Timed: ``RoundEngine.run_round`` (the training exchange and the aggregation; the central
evaluation is the same for both and left out). Round 1 of each server is warm-up (first backward of
every actor, the clients' caches); rounds 2.. are measured.

Printed per size: the median round of each channel, the ratio of the medians, the median of the
per-round ratios (each secagg+ round over the plain round next to it) and their range, SecAgg+'s
messages per round, and the largest difference between the two global models after the last round
(SecAgg+'s quantization error; plain and secagg+ aggregate the same client models).

Workload (fast, so that the protocol's share shows): LeNet/ReLU on fmnist-small, IID, SGD lr 0.05,
batch 16, ``--local-steps`` steps.

    .venv/bin/python benchmarks/secagg_overhead.py [--clients 5 10 20] [--rounds 8] [--backend ray]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def make_cfg(n: int, secagg: bool, args: argparse.Namespace) -> dict:
    from fedsim.app import load_config

    sets = ["name=\"secagg-bench\"", "federation.rounds=1", f"federation.num_clients={n}",
            "data.dataset=\"fmnist-small\"", "data.partition=\"iid\"", "model.name=\"lenet\"",
            "model.activation=\"relu\"", "train.lr=0.05", "train.batch_size=16",
            f"train.local_steps={args.local_steps}", "output.observers=[]", f"seed={args.seed}"]
    if secagg:
        sets += ['channel.name="secagg+"', f"channel.num_shares={args.num_shares}",
                 f"channel.reconstruction_threshold={args.threshold}"]
    return load_config(None, sets)


def measure(grid, args: argparse.Namespace) -> list[dict]:
    from fedsim.app.server import Server

    rows = []
    for n in args.clients:
        servers = {name: Server(make_cfg(n, name == "secagg+", args), None, [], progress=False)
                   for name in ("plain", "secagg+")}
        states = {}
        for name, s in servers.items():
            s.engine.discover(grid)
            states[name] = s.engine.channel.initial(s.initial)
        times: dict[str, list[float]] = {name: [] for name in servers}
        messages = []
        stages: dict[str, list[float]] = {}
        for rnd in range(1, args.rounds + 1):
            order = list(servers) if rnd % 2 else list(reversed(servers))
            for name in order:
                t0 = time.perf_counter()
                states[name], record = servers[name].engine.run_round(grid, rnd, states[name])
                times[name].append(time.perf_counter() - t0)
                if record.replies != n or record.failures:
                    raise RuntimeError(f"{name}, {n} clients, round {rnd}: {record.replies} replies, "
                                       f"failures {record.failures[:1]}")
                if name == "secagg+":
                    messages.append(record.channel_metrics.get("messages", float("nan")))
                    if rnd > 1:
                        for k, v in record.channel_metrics.items():
                            if k.endswith("_seconds"):
                                stages.setdefault(k[: -len("_seconds")], []).append(v)
        plain, sec = times["plain"][1:], times["secagg+"][1:]
        ratios = [s / p for s, p in zip(sec, plain)]
        diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                   for a, b in zip(states["plain"], states["secagg+"]))
        rows.append({"clients": n, "plain_s": statistics.median(plain), "secagg_s": statistics.median(sec),
                     "ratio_of_medians": statistics.median(sec) / statistics.median(plain),
                     "median_ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "messages": statistics.median(messages), "max_model_diff": diff,
                     "stages": {k: statistics.median(v) for k, v in stages.items()}})
        print(f"[bench] {n} clients: plain {rows[-1]['plain_s']:.3f} s, secagg+ {rows[-1]['secagg_s']:.3f} s "
              f"({rows[-1]['ratio_of_medians']:.2f}x)", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[5, 10, 20])
    ap.add_argument("--rounds", type=int, default=8, help="rounds per channel and size (round 1 is warm-up)")
    ap.add_argument("--local-steps", type=int, default=3)
    ap.add_argument("--num-shares", type=int, default=3)
    ap.add_argument("--threshold", type=int, default=2)
    ap.add_argument("--backend", choices=("ray", "inprocess"), default="ray")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (round 1 is warm-up)")

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import torch

    torch.set_num_threads(1)
    from fedsim.app.client import client_app
    from fedsim.app.runner import quiet_logs

    quiet_logs()
    nodes = max(args.clients)
    out: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    if args.backend == "inprocess":
        from fedsim.inprocess import InProcessGrid

        out["rows"] = measure(InProcessGrid(client_app, nodes), args)
    else:
        from flwr.serverapp import ServerApp
        from flwr.simulation import run_simulation

        server_app = ServerApp()
        errors: list[BaseException] = []

        @server_app.main()
        def _main(grid, context) -> None:
            grid.pull_interval = 0.01  # as `fedsim run` does
            logging.getLogger("flwr").setLevel(logging.ERROR)
            try:
                out["rows"] = measure(grid, args)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=nodes,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"logging_level": "ERROR", "log_to_driver": False,
                                                     "include_dashboard": False}})
        if errors:
            raise errors[0]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n{args.backend}, {args.rounds - 1} measured rounds per channel and size, num_shares {args.num_shares}, "
          f"threshold {args.threshold}, {args.local_steps} local steps; {time.perf_counter() - t0:.0f} s in all; "
          f"load average at the end {load:.2f}\n")
    print("| clients | plain round s | secagg+ round s | ratio of medians | median ratio (min-max) | "
          "secagg+ messages | max model diff |")
    print("|---|---|---|---|---|---|---|")
    for r in out.get("rows", []):
        print(f"| {r['clients']} | {r['plain_s']:.3f} | {r['secagg_s']:.3f} | {r['ratio_of_medians']:.2f}x | "
              f"{r['median_ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['messages']:.0f} | "
              f"{r['max_model_diff']:.1e} |")
    names = ["setup", "share_keys", "collect_masked_vectors", "unmask", "protocol"]
    print("\nsecagg+ round, median seconds by protocol stage (collect_masked_vectors includes the training; "
          "protocol = the whole exchange):\n")
    print("| clients | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for r in out.get("rows", []):
        print(f"| {r['clients']} | " + " | ".join(f"{r['stages'].get(k, float('nan')):.3f}" for k in names) + " |")


if __name__ == "__main__":
    main()
