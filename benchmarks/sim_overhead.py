"""How much does Flower (+ Ray) add to a federated round, compared with the same local training in a
plain torch loop?

Workload: the default experiment (experiments/default.toml: LeNet/ReLU on fmnist-small, IID, SGD lr 0.1,
batch 16, 4 local epochs) with ``--clients`` clients and ``--rounds`` rounds. Rounds >= 2 are measured
(round 1 pays each process's first-backward warm-up; Ray's start-up comes before round 1).

Rows (per-round wall seconds, mean and min over the measured rounds):

* ``plain torch loop``: the clients trained one after the other in this process with
  ``fedsim.training.local_train`` on the same partitions, then the example-weighted mean and the
  central evaluation: the work of a round without Flower. Run with torch's default thread count and
  with 1 thread.
* ``fedsim in-process``: ``run_experiment`` with the in-process grid (Flower strategy, messages,
  ClientApp; no transport), with 1 torch thread by default (``--inprocess-threads``).
* ``fedsim Ray``: ``run_experiment`` with Flower's simulation engine (one Ray actor per CPU,
  ``simulation.num_cpus=1``), for each ``--pull-intervals`` value of the ServerApp grid's
  ``pull_interval`` (Flower's default 0.1 s). ``--fast-dispatch`` adds a run where Flower's
  simulation-engine dispatcher loop (which looks for new messages every 0.1 s) polls every 5 ms.

``client compute`` is the sum of the clients' own ``train_seconds`` (measured inside the ClientApp) per
round; ``framework s`` = round - compute / parallel clients (1, or the number of Ray actors) is what
the round costs beyond local training (evaluation, aggregation, messaging, polling, imbalance). It is
the column to compare when other processes load the machine: they slow the training itself, most of
all for the parallel Ray actors, and swing the ratio columns from run to run.

Threads: Ray gives each 1-CPU actor ``OMP_NUM_THREADS=1`` (probed at the end). With torch's default
2 threads on a 2-core machine that other processes also load, OpenMP's spinning workers made single
rounds take 20-40 s instead of 0.55 s (``OMP_WAIT_POLICY=PASSIVE`` removed the stalls but left rounds
4x slower); one thread per process is the robust setting there.

    python benchmarks/sim_overhead.py [--rounds 5] [--clients 10] [--skip-ray]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quiet() -> None:
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import logging

    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.ERROR)


def make_cfg(args, out_dir: Path, backend: str) -> dict:
    from fedsim.app import load_config

    return load_config(ROOT / "experiments" / "default.toml", [
        f"federation.rounds={args.rounds}", f"federation.num_clients={args.clients}", "output.observers=[]",
        f'output.dir="{out_dir}"', f'simulation.backend="{backend}"', 'device="cpu"', f"seed={args.seed}"])


# -------------------------------------------------------------------------------- plain torch loop
def plain_loop(cfg: dict, threads: int | None) -> dict:
    """The same rounds without Flower: sequential local_train over the clients, weighted mean, eval."""
    import numpy as np
    import torch

    from fedsim.factories import client_data, dataset_for, model_for
    from fedsim.training import Recipe, evaluate, get_weights, local_train, seed_everything, set_weights

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    used = torch.get_num_threads()
    try:
        seed_everything(cfg["seed"])
        ds = dataset_for(cfg)
        recipe = Recipe.from_mapping(cfg["train"])
        model, eval_model = model_for(cfg), model_for(cfg)
        global_w = get_weights(model)
        n = cfg["federation"]["num_clients"]
        data = [client_data(cfg, pid) for pid in range(n)]
        rows = []
        for rnd in range(1, cfg["federation"]["rounds"] + 1):
            t0 = time.perf_counter()
            replies, compute = [], 0.0
            for pid, (x, y) in enumerate(data):
                set_weights(model, global_w)
                res = local_train(model, x, y, recipe, seed=cfg["seed"], round=rnd, client=pid)
                replies.append((res.weights, res.num_examples))
                compute += res.metrics["train_seconds"]
            total = sum(k for _, k in replies)
            global_w = [sum(w[j].astype(np.float64) * (k / total) for w, k in replies).astype(global_w[j].dtype)
                        for j in range(len(global_w))]
            set_weights(eval_model, global_w)
            _, acc = evaluate(eval_model, ds.x_test, ds.y_test)
            rows.append({"round": rnd, "seconds": time.perf_counter() - t0, "compute": compute, "accuracy": acc})
        return {"rows": rows, "threads": used}
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------- fedsim runs
def compute_observer():
    """An observer summing the clients' own train_seconds per round (what the ClientApp measured)."""
    from fedsim.observers import Observer

    class ComputeObserver(Observer):
        def __init__(self):
            self.compute: dict[int, float] = {}

        def observe(self, update):
            self.compute[update.round] = self.compute.get(update.round, 0.0) + float(
                update.metrics.get("train_seconds", 0.0))

    return ComputeObserver()


def fedsim_run(cfg: dict, out: Path, pull_interval: float | None = None, fast_dispatch: bool = False) -> dict:
    import fedsim.app.server as server
    from fedsim.app.runner import run_experiment
    from fedsim.reports import read_jsonl

    original = server.run_server
    patched_vce = None

    def run_server(grid, *a, **kw):
        if pull_interval is not None and hasattr(grid, "pull_interval"):
            grid.pull_interval = pull_interval
        return original(grid, *a, **kw)

    if fast_dispatch:
        patched_vce = _patch_vce_dispatch(0.005)
    server.run_server = run_server
    obs = compute_observer()
    t0 = time.perf_counter()
    try:
        run_dir = run_experiment(cfg, out=out, observers=[obs], progress=False)
    finally:
        server.run_server = original
        if patched_vce is not None:
            patched_vce()
    wall = time.perf_counter() - t0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    out_rows = [{"round": r["round"], "seconds": r["seconds"], "accuracy": r["accuracy"],
                 "compute": obs.compute.get(r["round"], 0.0)} for r in rows if r["round"] >= 1]
    return {"rows": out_rows, "wall": wall, "startup": rows[0]["seconds"]}


def _patch_vce_dispatch(interval: float):
    """Make Flower's simulation-engine dispatcher (vce_api.add_messages_to_queue) poll every ``interval``."""
    from flwr.server.superlink.fleet.vce import vce_api

    original = vce_api.add_messages_to_queue

    def add_messages_to_queue(state, queue, nodes_mapping, f_stop):
        while not f_stop.is_set():
            for node_id in nodes_mapping.keys():
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            f_stop.wait(interval)

    vce_api.add_messages_to_queue = add_messages_to_queue

    def restore():
        vce_api.add_messages_to_queue = original

    return restore


def ray_actor_threads() -> str:
    """torch threads and OMP_NUM_THREADS inside a 1-CPU Ray task (what each client actor gets)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        @ray.remote(num_cpus=1)
        def probe():
            import os

            import torch

            return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")

        t, omp = ray.get(probe.remote())
        return f"{t} (OMP_NUM_THREADS={omp})"
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------------------- report
def summarise(rows: list[dict], first: int) -> tuple[float, float, float]:
    m = [r for r in rows if r["round"] >= first] or rows
    secs = [r["seconds"] for r in m]
    return statistics.mean(secs), min(secs), statistics.mean(r["compute"] for r in m)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measure-from", type=int, default=2, help="first measured round (default 2)")
    p.add_argument("--pull-intervals", default="0.1,0.01",
                   help="ServerApp grid pull_interval values for the Ray runs (Flower's default: 0.1)")
    p.add_argument("--fast-dispatch", action="store_true",
                   help="also run Ray with the pull interval 0.01 and Flower's dispatcher polling every 5 ms")
    p.add_argument("--inprocess-threads", type=int, default=None,
                   help="torch threads for the in-process run (default 1: on a shared 2-core machine two "
                        "OpenMP threads stall for seconds at a time; see the module docstring)")
    p.add_argument("--skip-ray", action="store_true")
    p.add_argument("--no-probe", action="store_true", help="do not probe the thread count inside Ray actors")
    args = p.parse_args(argv)
    if args.rounds < args.measure_from:
        p.error("--rounds must be >= --measure-from")
    _quiet()
    import torch

    results: list[tuple[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="fedsim-bench-") as tmp:
        tmp = Path(tmp)
        os.environ.setdefault("RAY_TMPDIR", str(tmp))
        cfg = make_cfg(args, tmp, "inprocess")
        default_threads = torch.get_num_threads()
        print(f"fedsim sim_overhead: {args.clients} clients, {args.rounds} rounds, LeNet/{cfg['model']['activation']} "
              f"on {cfg['data']['dataset']}, lr {cfg['train']['lr']}, batch {cfg['train']['batch_size']}, "
              f"{cfg['train']['local_epochs']} local epochs; measuring rounds >= {args.measure_from}",
              flush=True)
        print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f} (start)", flush=True)

        plain_default = plain_loop(cfg, None)
        results.append((f"plain torch loop ({plain_default['threads']} threads)", plain_default))
        plain_1 = plain_loop(cfg, 1)
        results.append(("plain torch loop (1 thread)", plain_1))

        threads = 1 if args.inprocess_threads is None else args.inprocess_threads
        torch.set_num_threads(threads)
        results.append((f"fedsim in-process ({threads} thread{'s' if threads > 1 else ''})",
                        fedsim_run(cfg, tmp / "inproc")))
        torch.set_num_threads(default_threads)

        actors = None
        if not args.skip_ray:
            rcfg = make_cfg(args, tmp, "ray")
            actors = max(1, min(args.clients, (os.cpu_count() or 1) // rcfg["simulation"]["num_cpus"]))
            for pi in [float(x) for x in args.pull_intervals.split(",") if x.strip()]:
                res = fedsim_run(rcfg, tmp / f"ray-{pi}", pi)
                results.append((f"fedsim Ray, pull_interval {pi:g}", dict(res, parallel=actors)))
            if args.fast_dispatch:
                res = fedsim_run(rcfg, tmp / "ray-fast", 0.01, fast_dispatch=True)
                results.append(("fedsim Ray, pull 0.01 + dispatch 5 ms", dict(res, parallel=actors)))
        probe = None
        if not args.skip_ray and not args.no_probe:
            probe = ray_actor_threads()

    base = results[0][1]
    b_mean = summarise(base["rows"], args.measure_from)[0]
    b1_mean = summarise(plain_1["rows"], args.measure_from)[0]
    print()
    print(f"| {'run':<38} | round s mean | round s min | client compute s | framework s | vs plain "
          f"{plain_default['threads']}T | vs plain 1T | start-up s |")
    print("|" + "---|" * 8)
    for name, res in results:
        mean, mn, comp = summarise(res["rows"], args.measure_from)
        par = res.get("parallel", 1)
        start = f"{res['startup']:.2f}" if "startup" in res else "-"
        print(f"| {name:<38} | {mean:12.3f} | {mn:11.3f} | {comp:16.3f} | {mean - comp / par:11.3f} | "
              f"{mean / b_mean:10.2f}x | {mean / b1_mean:10.2f}x | {start:>10} |")
    print()
    print(f"threads: plain loop default {plain_default['threads']} (torch default on {os.cpu_count()} cpus); "
          f"Ray actors: {actors} actors x 1 CPU" + (f", torch threads per actor {probe}" if probe else ""))
    if actors:
        p1 = summarise(plain_1["rows"], args.measure_from)[0]
        print(f"ideal {actors}-way parallel plain loop (1 thread each): {p1 / actors:.3f} s/round")
    accs = {name: round(res["rows"][-1]["accuracy"], 4) for name, res in results}
    print(f"final accuracy per run: {accs}")
    print(f"load average {os.getloadavg()[0]:.2f} (end); other processes on this machine inflate every row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
