"""End-to-end round time of the encrypted channels next to plaintext FedAvg (issue 27's headline figure).

One federation (``--clients`` nodes) and four fedsim servers sharing its grid, same seed and workload:
the plain channel, ``paillier`` at ``--key-bits`` (default 2048: its defaults, update encryption with the
round's clip from the updates' range), ``ckks`` (TenSEAL, 128-bit parameters) and, for reference,
``secagg+`` (Flower's SecAgg+, num_shares 3, threshold 2). Each server runs its channel's setup exchange
(key delivery) first; then their rounds are interleaved (the order rotates every round) so machine load
hits all alike. Timed per round: ``RoundEngine.run_round`` plus the round's evaluation (centrally for
the plain and SecAgg+ channels, by a client for the encrypted ones: that is what a round costs). Round 1
of each server is warm-up; rounds 2.. are measured.

Printed per backend (in-process, and Ray with ``--actors`` actors): each channel's median round, the
ratio of medians to plain, the median of the per-round ratios (each round over the plain round next to
it) and their range, and what the encrypted channels report (online encryption time, combination time,
payload size). Targets (issue 27): Paillier <= 3x in-process and <= 2x on Ray, CKKS <= 1.5x.

Memory (``--memory``, in-process): one child process per channel runs the same federation for 2 rounds
and reports its peak resident memory (``ru_maxrss``), printed as the difference to the plain child (target:
<= +1 GB for 10 clients). On Ray the clients live in the actors' processes: not measured here.

Workload: LeNet/ReLU on fmnist-small, IID over ``--clients`` clients, SGD lr 0.05, batch 16,
``--epochs`` local epochs (1); torch runs one thread in this process, as in each Ray actor (so the
clients' decryption runs in one thread too).

    .venv/bin/python benchmarks/he_round.py [--clients 10] [--rounds 4] [--backends inprocess ray]
        [--actors 2] [--key-bits 2048] [--memory]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHANNELS = ("plain", "paillier", "ckks", "secagg+")


def make_cfg(channel: str, args: argparse.Namespace) -> dict:
    """The workload's config for ``channel``: one of :data:`CHANNELS`, or a ``--variant``'s label."""
    from fedsim.app import load_config

    variants = {v[0]: v[1:] for v in args.variant or []}
    extra: list[str] = []
    if channel in variants:
        channel, *extra = variants[channel]

    sets = ['name="he-round"', f"federation.rounds={args.rounds}", f"federation.num_clients={args.clients}",
            'data.dataset="fmnist-small"', 'data.partition="iid"', 'model.name="lenet"', 'model.activation="relu"',
            "train.lr=0.05", "train.batch_size=16", f"train.local_epochs={args.epochs}", "output.observers=[]",
            f"seed={args.seed}"]
    if channel == "paillier":
        sets += ['channel.name="paillier"', f"channel.key_bits={args.key_bits}"]
    elif channel == "ckks":
        sets += ['channel.name="ckks"']
    elif channel == "secagg+":
        sets += ['channel.name="secagg+"', "channel.num_shares=3", "channel.reconstruction_threshold=2"]
    return load_config(None, sets + extra)


def base_channel(name: str, args: argparse.Namespace) -> str:
    return {v[0]: v[1] for v in args.variant or []}.get(name, name)


def _servers(grid_for, args: argparse.Namespace, channels) -> tuple[dict, dict, dict]:
    from fedsim.app.server import Server
    from fedsim.seams import RoundContext, RoundRecord

    servers, states, grids = {}, {}, {}
    for name in channels:
        grids[name] = grid = grid_for(name)
        s = Server(make_cfg(name, args), None, [], progress=False)
        s.engine.discover(grid)
        states[name] = s.engine.channel.initial(s.initial)
        t0 = time.perf_counter()
        s.engine.channel.handshake(RoundContext(s.engine, grid, 0, s.engine.channel, None, None, RoundRecord(0)))
        print(f"[bench] {name}: setup exchange {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
        servers[name] = s
    return servers, states, grids


PHASES = ("train", "train encrypt", "advance", "evaluate")  # the exchanges timed apart (RoundEngine.send's stage)


def _timed_exchanges(engine, phases: dict[str, float]) -> None:
    """Add each exchange's wall time (send to last reply, by stage) to ``phases``."""
    send = engine.send

    def timed(grid, partitions, message_type, shared, per_partition, stage, *rest, **kw):
        t0 = time.perf_counter()
        try:
            return send(grid, partitions, message_type, shared, per_partition, stage, *rest, **kw)
        finally:
            phases[stage] = phases.get(stage, 0.0) + time.perf_counter() - t0

    engine.send = timed


def tree_cpu() -> float:
    """CPU seconds of this process and its live descendants (on Ray: this run's raylet, workers and client
    actors), read from ``/proc``; this process's alone where there is no ``/proc``. Less sensitive to other
    processes' load than wall time (they delay the round's processes, not their work)."""
    if not os.path.isdir("/proc/self"):
        return time.process_time()
    stats: dict[int, tuple[int, int]] = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            stats[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
        except (OSError, ValueError, IndexError):
            continue
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    todo, ticks = [os.getpid()], 0
    while todo:
        pid = todo.pop()
        ticks += stats.get(pid, (0, 0))[1]
        todo += children.get(pid, [])
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(grid_for, args: argparse.Namespace, channels=CHANNELS) -> dict:
    """``grid_for(name)``: the grid of a channel's server (in-process: a federation each, the same work; on
    Ray: the one federation)."""
    servers, states, grids = _servers(grid_for, args, channels)
    times: dict[str, list[float]] = {n: [] for n in servers}
    cpu: dict[str, list[float]] = {n: [] for n in servers}
    extra: dict[str, dict[str, list[float]]] = {n: {} for n in servers}
    phases: dict[str, dict[str, float]] = {n: {} for n in servers}
    for name, s in servers.items():
        _timed_exchanges(s.engine, phases[name])
    for rnd in range(1, args.rounds + 1):
        k = rnd % len(servers)
        order = list(servers)[k:] + list(servers)[:k]
        for name in order:
            s = servers[name]
            phases[name].clear()
            c0 = tree_cpu()
            t0 = time.perf_counter()
            states[name], record = s.engine.run_round(grids[name], rnd, states[name])
            ev = s.evaluator.evaluate(grids[name], states[name], record)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(tree_cpu() - c0)
            exchanged = sum(phases[name].values())
            for ph in PHASES:
                extra[name].setdefault(f"{ph} s", []).append(phases[name].get(ph, 0.0))
            extra[name].setdefault("server s", []).append(times[name][-1] - exchanged)
            if record.replies != args.clients or record.failures or ev["accuracy"] is None:
                raise RuntimeError(f"{name}, round {rnd}: {record.replies} replies, failures {record.failures[:1]}")
            for key in ("encrypt_seconds_mean", "decrypt_seconds_max", "combine_seconds", "payload_bytes", "reply_bytes", "clip",
                        "quantization_bound", "error_bound"):
                if key in record.channel_metrics:
                    extra[name].setdefault(key, []).append(float(record.channel_metrics[key]))
            split = ", ".join(f"{ph} {phases[name][ph]:.2f}" for ph in phases[name])
            print(f"[bench] round {rnd} {name}: {times[name][-1]:.2f} s (CPU {cpu[name][-1]:.2f} s; "
                  f"{split}; server {extra[name]['server s'][-1]:.2f}), accuracy {ev['accuracy']:.4f}",
                  file=sys.stderr, flush=True)
    plain = times["plain"][1:]
    rows = {}
    for name in servers:
        mine = times[name][1:]
        ratios = [a / b for a, b in zip(mine, plain)]
        rows[name] = {"median_s": statistics.median(mine), "ratio_of_medians": statistics.median(mine) / statistics.median(plain),
                      # CPU seconds of this process and its children (all the clients' work, in-process or in
                      # the Ray actors): less sensitive to other processes' load than wall time
                      "cpu_s": statistics.median(cpu[name][1:]),
                      "cpu_ratio": statistics.median(cpu[name][1:]) / statistics.median(cpu["plain"][1:]),
                      "median_ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                      **{k: statistics.median(v[1:] or v) for k, v in extra[name].items()}}
    return rows


def run_backend(backend: str, args: argparse.Namespace) -> dict:
    from fedsim.app.client import client_app

    if backend == "inprocess":
        from fedsim.inprocess import InProcessGrid

        return measure(lambda name: InProcessGrid(client_app, args.clients), args, args.channels)
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    server_app, out, errors = ServerApp(), {}, []

    @server_app.main()
    def _main(grid, context) -> None:
        grid.pull_interval = 0.01  # as `fedsim run` does
        logging.getLogger("flwr").setLevel(logging.ERROR)
        try:
            out["rows"] = measure(lambda name: grid, args, args.channels)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": max(1, (os.cpu_count() or 2) // args.actors),
                                                        "num_gpus": 0.0},
                                   "init_args": {"logging_level": "ERROR", "log_to_driver": False,
                                                 "include_dashboard": False, "num_cpus": os.cpu_count() or 2}})
    if errors:
        raise errors[0]
    return out["rows"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_child(channel: str, args: argparse.Namespace) -> None:
    """One channel, 2 rounds in-process; prints as JSON the peak RSS and the resident memory the channel's
    setup and rounds added (RSS after the rounds minus RSS before the setup), in MB."""
    from fedsim.app.client import client_app
    from fedsim.inprocess import InProcessGrid

    grid = InProcessGrid(client_app, args.clients)
    before = _rss_mb()
    servers, states, _ = _servers(lambda name: grid, args, [channel])
    s = servers[channel]
    for rnd in (1, 2):
        states[channel], record = s.engine.run_round(grid, rnd, states[channel])
        s.evaluator.evaluate(grid, states[channel], record)
    print(json.dumps({"channel": channel, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "added_mb": _rss_mb() - before}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4, help="rounds per channel (round 1 is warm-up)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--key-bits", type=int, default=2048)
    ap.add_argument("--backends", nargs="+", choices=("inprocess", "ray"), default=["inprocess", "ray"])
    ap.add_argument("--actors", type=int, default=2, help="Ray: client actors (CPUs / actors each)")
    ap.add_argument("--memory", action="store_true", help="also measure peak memory per channel (in-process)")
    ap.add_argument("--channels", nargs="+", choices=CHANNELS, default=list(CHANNELS),
                    help="channels to compare (plain is always measured: the ratios' reference)")
    ap.add_argument("--variant", nargs="+", action="append", metavar=("LABEL CHANNEL", "SET"),
                    help="one more server, interleaved with the others: LABEL, a channel of --channels' choices and "
                         "config settings, e.g. --variant paillier-12bit paillier channel.bits=12")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-child", choices=CHANNELS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (round 1 is warm-up)")
    args.channels = ["plain", *[c for c in CHANNELS if c in args.channels and c != "plain"]]
    for v in args.variant or []:
        if len(v) < 2 or v[1] not in CHANNELS or v[0] in CHANNELS:
            ap.error(f"--variant {' '.join(v)}: give a new label, then one of {', '.join(CHANNELS)}, then settings")
        args.channels.append(v[0])
    bases = [base_channel(c, args) for c in args.channels]
    twice = sorted({b for b in bases if bases.count(b) > 1 and b in ("paillier", "ckks")})
    if "ray" in args.backends and twice:  # their clients keep one key (Context.state) per node
        ap.error(f"on Ray the servers share one federation, whose clients hold one {' / '.join(twice)} key each: "
                 "compare variants of an encrypted channel in separate runs (--backends ray), or in-process")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from fedsim.app.runner import quiet_logs

    torch.set_num_threads(1)  # one core per client, as each Ray actor runs (and stable on a busy machine)
    quiet_logs()
    if args.memory_child:
        memory_child(args.memory_child, args)
        return
    t0 = time.perf_counter()
    results = {b: run_backend(b, args) for b in args.backends}
    mem = {}
    if args.memory:
        for ch in [c for c in args.channels if c in CHANNELS]:  # variants: not measured apart
            out = subprocess.run([sys.executable, __file__, "--memory-child", ch, "--clients", str(args.clients),
                                  "--key-bits", str(args.key_bits), "--epochs", str(args.epochs)],
                                 capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            line = [x for x in out.stdout.splitlines() if x.startswith("{")]
            mem[ch] = json.loads(line[-1]) if line else {"peak_mb": float("nan"), "added_mb": float("nan")}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n{args.clients} clients, LeNet on fmnist-small, {args.epochs} local epoch(s), Paillier {args.key_bits}-bit; "
          f"{args.rounds - 1} measured rounds per channel; {time.perf_counter() - t0:.0f} s in all; "
          f"{os.cpu_count()} CPUs, load average at the end {load:.2f}\n")
    for backend, rows in results.items():
        print(f"**{backend}**" + (f" ({args.actors} actors)" if backend == "ray" else "") + "\n")
        print("| channel | round s (median) | ratio of medians | median ratio (min-max) | CPU s, with children (ratio) | "
              "encrypt s/client | combine s | reply / aggregate MB |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            enc = f"{r['encrypt_seconds_mean']:.3f}" if "encrypt_seconds_mean" in r else "-"
            comb = f"{r['combine_seconds']:.3f}" if "combine_seconds" in r else "-"
            size = " / ".join(f"{r[k] / 1e6:.2f}" if k in r else "-" for k in ("reply_bytes", "payload_bytes"))
            print(f"| {name} | {r['median_s']:.2f} | {r['ratio_of_medians']:.2f}x | {r['median_ratio']:.2f}x "
                  f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['cpu_s']:.2f} ({r['cpu_ratio']:.2f}x) | {enc} | "
                  f"{comb} | {size} |")
        print("\nwhere the round goes (medians, s): each exchange from send to its last reply, and the server's "
              "own work\n")
        print("| channel | " + " | ".join(PHASES) + " | server | decryption in the advance (slowest client) |")
        print("|---|" + "---|" * (len(PHASES) + 2))
        for name, r in rows.items():
            dec = f"{r['decrypt_seconds_max']:.2f}" if "decrypt_seconds_max" in r else "-"
            print(f"| {name} | " + " | ".join(f"{r.get(f'{ph} s', 0.0):.2f}" for ph in PHASES)
                  + f" | {r['server s']:.2f} | {dec} |")
        print()
    if mem:
        print("resident memory, one process per channel (in-process, setup + 2 rounds):\n")
        print("| channel | peak MB | added by setup and rounds MB | over plain MB |")
        print("|---|---|---|---|")
        for ch, m in mem.items():
            print(f"| {ch} | {m['peak_mb']:.0f} | {m['added_mb']:.0f} | {m['added_mb'] - mem['plain']['added_mb']:+.0f} |")


if __name__ == "__main__":
    main()
