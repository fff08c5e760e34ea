"""What fedsim adds to a federated round, against a plain torch loop and a minimal plain-Flower app
doing the same work, measured interleaved.

Workload: the default experiment (experiments/default.toml: LeNet/ReLU on fmnist-small, IID, SGD lr 0.1,
batch 16, 4 local epochs) with ``--clients`` clients and ``--rounds`` rounds, rounds >= 2 measured.
Each repeat runs every variant once, in the same order (interleaved: slow phases of a shared machine
hit every variant alike); the table gives the median and the range over all measured rounds of all
repeats.

Variants:

* ``plain torch loop (1 thread)``: the clients trained one after the other with
  ``fedsim.training.local.local_train`` on the same partitions, the example-weighted mean, the central
  evaluation - the work of a round without any framework;
* ``fedsim in-process``: ``run_experiment`` on the in-process grid (the real ClientApp, engine,
  channel; no transport), 1 torch thread, no observers (``output.observers = []``);
* ``fedsim in-process, update-norms``: the same with the default observers (``output.observers =
  ["update-norms"]``: every reply's update norm computed and appended to ``updates.jsonl``);
* ``plain Flower on Ray``: a minimal Flower Message-API app (Flower's own ``FedAvg.start`` and
  ``run_simulation``; a ClientApp that calls the same ``local_train``) - what Flower + Ray cost with
  no fedsim in between;
* ``fedsim on Ray``: ``run_experiment`` with Flower's simulation engine (two 1-CPU actors).

Columns: ``round s`` median and range; ``compute s``: the clients' own training time per round
(``train_seconds`` measured inside ``local_train``); ``framework s`` = round - compute / parallel
clients; ``start-up s``: from the variant's start to the end of round 1, minus one median round (Ray
and actor start-up plus round 1's first-backward warm-up). ``per-message ms`` (in-process only) =
(fedsim in-process round - plain loop round) / clients: fedsim's own cost per client message, printed
without observers and with the default observers.

    python benchmarks/sim_overhead.py [--rounds 5] [--clients 10] [--repeats 3] [--skip-ray]
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


def quiet() -> None:
    """Ray and Flower without their own logs (shared by the benchmarks that start Ray)."""
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import logging

    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.ERROR)


def make_cfg(args, out_dir: Path, backend: str, observers: str = "[]") -> dict:
    from fedsim.app import load_config

    return load_config(ROOT / "experiments" / "default.toml", [
        f"federation.rounds={args.rounds}", f"federation.num_clients={args.clients}",
        f"output.observers={observers}",
        f'output.dir="{out_dir}"', f'simulation.backend="{backend}"', 'device="cpu"', f"seed={args.seed}"])


# -------------------------------------------------------------------------------- plain torch loop
def plain_loop(cfg: dict) -> dict:
    """The same rounds without any framework: sequential local_train, weighted mean, evaluation."""
    import numpy as np

    from fedsim.factories import client_data, dataset_for, model_for
    from fedsim.models.weights import get_weights, set_weights
    from fedsim.seeding import seed_everything
    from fedsim.training.evaluation import evaluate
    from fedsim.training.local import local_train
    from fedsim.training.recipe import Recipe

    t_start = time.perf_counter()
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
        rows.append({"round": rnd, "seconds": time.perf_counter() - t0, "compute": compute, "accuracy": acc,
                     "end": time.perf_counter() - t_start})
    return {"rows": rows, "parallel": 1}


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


def fedsim_run(cfg: dict, out: Path, parallel: int) -> dict:
    """A fedsim run with the observers its config names (``output.observers``) plus the compute one."""
    from fedsim.app.runner import build_observers, run_experiment
    from fedsim.reports import read_jsonl

    obs = compute_observer()
    t0 = time.perf_counter()
    run_dir = run_experiment(cfg, out=out, observers=[*build_observers(cfg), obs], progress=False)
    wall = time.perf_counter() - t0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    ends, acc = [], 0.0
    for r in rows:
        acc += r["seconds"] + r.get("observer_seconds", 0.0)
        ends.append(acc)
    out_rows = [{"round": r["round"], "seconds": r["seconds"], "accuracy": r["accuracy"],
                 "compute": obs.compute.get(r["round"], 0.0)} for r in rows if r["round"] >= 1]
    # round 1 ends this long after the start of the variant (the startup is wall - all rounds)
    startup_to_round1 = wall - sum(r["seconds"] + r.get("observer_seconds", 0.0) for r in rows if r["round"] >= 2)
    return {"rows": out_rows, "wall": wall, "round1_end": startup_to_round1, "parallel": parallel}


# --------------------------------------------------------------------------------- plain Flower app
def plain_flower(cfg: dict, parallel: int) -> dict:
    """Flower's own FedAvg.start + run_simulation, the ClientApp calling fedsim's local_train."""
    import numpy as np
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from fedsim.factories import client_data, dataset_for, model_for
    from fedsim.models.weights import get_weights, set_weights
    from fedsim.seeding import seed_everything
    from fedsim.training.evaluation import evaluate
    from fedsim.training.local import local_train
    from fedsim.training.recipe import Recipe

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        pid = int(context.node_config["partition-id"])
        model = model_for(cfg)
        set_weights(model, msg.content["arrays"].to_numpy_ndarrays())
        x, y = client_data(cfg, pid)
        rnd = int(msg.content["config"]["server-round"])
        res = local_train(model, x, y, Recipe.from_mapping(cfg["train"]), seed=cfg["seed"], round=rnd, client=pid)
        arrays = ArrayRecord([np.ascontiguousarray(w) for w in res.weights])
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(
            {"num-examples": res.num_examples, "train_seconds": res.metrics["train_seconds"]})}), reply_to=msg)

    server = ServerApp()
    rows: list[dict] = []
    t_start = time.perf_counter()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        grid.pull_interval = 0.01
        seed_everything(cfg["seed"])
        model = model_for(cfg)
        ds = dataset_for(cfg)
        clock = {"t": time.perf_counter()}

        def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            set_weights(model, arrays.to_numpy_ndarrays())
            _, acc = evaluate(model, ds.x_test, ds.y_test)
            now = time.perf_counter()
            if rnd > 0:
                rows.append({"round": rnd, "seconds": now - clock["t"], "accuracy": acc, "compute": 0.0,
                             "end": now - t_start})
            clock["t"] = now
            return MetricRecord({"accuracy": acc})

        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=cfg["federation"]["num_clients"])
        strategy.start(grid=grid, initial_arrays=ArrayRecord([np.ascontiguousarray(w) for w in get_weights(model)]),
                       num_rounds=cfg["federation"]["rounds"], train_config=ConfigRecord({}), evaluate_fn=evaluate_fn)

    torch.set_num_threads(1)
    run_simulation(server_app=server, client_app=client, num_supernodes=cfg["federation"]["num_clients"],
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"logging_level": "ERROR", "log_to_driver": False,
                                                 "include_dashboard": False}})
    wall = time.perf_counter() - t_start
    return {"rows": rows, "wall": wall, "round1_end": wall - sum(r["seconds"] for r in rows if r["round"] >= 2),
            "parallel": parallel}


# ----------------------------------------------------------------------------------------- report
def measured(results: list[dict], first: int) -> list[dict]:
    return [r for res in results for r in res["rows"] if r["round"] >= first]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measure-from", type=int, default=2, help="first measured round (default 2)")
    p.add_argument("--skip-ray", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < args.measure_from:
        p.error("--rounds must be >= --measure-from")
    quiet()
    import torch

    torch.set_num_threads(1)
    actors = max(1, min(args.clients, os.cpu_count() or 1))
    variants = ["plain torch loop (1 thread)", "fedsim in-process (1 thread)",
                "fedsim in-process, update-norms (1 thread)"]
    if not args.skip_ray:
        variants += ["plain Flower on Ray", "fedsim on Ray"]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="fedsim-bench-") as tmp:
        tmp = Path(tmp)
        os.environ.setdefault("RAY_TMPDIR", str(tmp))
        cfg = make_cfg(args, tmp, "inprocess")
        cfg_norms = make_cfg(args, tmp, "inprocess", '["update-norms"]')
        print(f"fedsim sim_overhead: {args.clients} clients, {args.rounds} rounds x {args.repeats} repeats, "
              f"LeNet/{cfg['model']['activation']} on {cfg['data']['dataset']}, lr {cfg['train']['lr']}, "
              f"batch {cfg['train']['batch_size']}, {cfg['train']['local_epochs']} local epochs; rounds >= "
              f"{args.measure_from} measured; load average {os.getloadavg()[0]:.2f} (start)", flush=True)
        for rep in range(args.repeats):
            for v in variants:
                if v.startswith("plain torch"):
                    res = plain_loop(cfg)
                    res["round1_end"] = res["rows"][0]["end"]
                elif v.startswith("fedsim in-process, update-norms"):
                    res = fedsim_run(cfg_norms, tmp / f"inproc-norms-{rep}", 1)
                elif v.startswith("fedsim in-process"):
                    res = fedsim_run(cfg, tmp / f"inproc-{rep}", 1)
                elif v.startswith("plain Flower"):
                    res = plain_flower(cfg, actors)
                else:
                    res = fedsim_run(make_cfg(args, tmp, "ray"), tmp / f"ray-{rep}", actors)
                results[v].append(res)
                print(f"  repeat {rep + 1}: {v}: median round "
                      f"{statistics.median(r['seconds'] for r in measured([res], args.measure_from)):.3f} s",
                      flush=True)
    table = {}
    for v, res in results.items():
        rows = measured(res, args.measure_from)
        secs = [r["seconds"] for r in rows]
        med = statistics.median(secs)
        comp = statistics.median(r["compute"] for r in rows) if any(r["compute"] for r in rows) else None
        par = res[0]["parallel"]
        startup = statistics.median(x["round1_end"] for x in res) - med
        table[v] = {"median": med, "min": min(secs), "max": max(secs), "compute": comp, "parallel": par,
                    "startup": startup, "acc": res[-1]["rows"][-1]["accuracy"]}
    base = table["plain torch loop (1 thread)"]["median"]
    print()
    print("| run | round s median | range | compute s | framework s | vs plain loop | start-up s | final acc |")
    print("|---|---|---|---|---|---|---|---|")
    for v, t in table.items():
        comp = "-" if t["compute"] is None else f"{t['compute']:.3f}"
        frame = "-" if t["compute"] is None else f"{t['median'] - t['compute'] / t['parallel']:.3f}"
        print(f"| {v} | {t['median']:.3f} | {t['min']:.3f}-{t['max']:.3f} | {comp} | {frame} | "
              f"{t['median'] / base:.2f}x | {t['startup']:.2f} | {t['acc']:.4f} |")
    inproc = table["fedsim in-process (1 thread)"]["median"]
    norms = table["fedsim in-process, update-norms (1 thread)"]["median"]
    print(f"\nfedsim per-message overhead (in-process - plain loop) / clients: "
          f"{(inproc - base) / args.clients * 1e3:.2f} ms without observers, "
          f"{(norms - base) / args.clients * 1e3:.2f} ms with the default observers (update-norms)")
    if "fedsim on Ray" in table:
        print(f"fedsim on Ray / plain Flower on Ray: {table['fedsim on Ray']['median'] / table['plain Flower on Ray']['median']:.2f}x")
        print(f"ideal {actors}-way parallel plain loop: {base / actors:.3f} s/round")
    print(f"load average {os.getloadavg()[0]:.2f} (end); other processes on this machine inflate every row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
