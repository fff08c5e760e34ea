"""Scale: seconds per round, start-up, clients discovered and process-tree memory for large federations,
against the compute floor of the same clients' training.

Workload (issue 19's): FedSGD (one step, batch 8), ReLU LeNet, full Fashion-MNIST (60k images; install
Debian's ``dataset-fashion-mnist`` or pass ``--data-dir``), IID, the Ray backend, no observers. Each
configuration ``CLIENTSxPER_ROUND[:K]`` runs as its own ``fedsim run`` subprocess (a fresh Ray), with
``simulation.clients_per_node`` = ``K``, else ``--clients-per-node`` (``auto``: 20 nodes - few enough
that Flower's dispatch, which scans every pending message for every node, stays cheap; enough to keep
two actors busy). ``--discovery-rows 10000`` adds ``10000x100:1`` rows: one client per node, where
discovery has to find every one of 10,000 registering nodes (slow: Flower's dispatch costs about
nodes x pending messages per pass).

Columns:

* ``round s``: median over rounds >= 2 of the round's wall time (training exchange, aggregation, central
  evaluation); ``range``: min-max over those rounds;
* ``round 1 s``: round 1 alone (the actors' first backward and other warm-up);
* ``start-up s``: from the command's start to the end of round 1 (Python and Ray start-up, actor start,
  discovery, round 1 with its warm-up); ``ready s``: from Ray's launch inside the command until every
  client was discovered (summary.json ``startup_seconds``: Ray, actors, discovery, the channel's setup);
* ``discovered``: partitions the engine mapped to a node (summary.json ``clients``) / configured; a run
  that fails (e.g. discovery timing out) prints its error instead of a row;
* ``PSS GiB``: the largest proportional set size of the whole process tree (the command, Ray and its
  workers), sampled every 0.5 s from /proc;
* ``floor s``: the same number of clients' training (the sampled clients of one round, same data, same
  recipe) in a plain loop over two worker processes (``multiprocessing``, 1 torch thread each): the
  compute a round cannot go below on 2 cores; ``x floor`` = round s / floor s (target <= 3 for
  10,000 clients with 1,000 per round).

    python benchmarks/scale.py [--configs 1000x100,10000x1000] [--rounds 4] [--clients-per-node auto]
                               [--discovery-rows 10000] [--dataset fmnist --model lenet] [--no-floor]
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FEDSIM = [sys.executable, "-m", "fedsim"]
RECIPE = ["train.local_steps=1", "train.batch_size=8", "train.lr=0.05", 'model.activation="relu"',
          'data.partition="iid"', "output.observers=[]"]
AUTO_NODES = 20


def tree_pss(pid: int) -> int:
    """Proportional set size (bytes) of ``pid`` and all its descendants."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = (task / "children").read_text().split()
                todo.extend(int(k) for k in kids)
        except (OSError, ValueError):
            continue
    return total


def run_fedsim(clients: int, per_round: int, rounds: int, k: int, data: list[str], out: Path) -> dict:
    """One ``fedsim run`` subprocess; its timings, discovery and peak process-tree memory (or its error)."""
    sets = [f"federation.num_clients={clients}", f"federation.clients_per_round={per_round}",
            f"federation.rounds={rounds}", f"simulation.clients_per_node={k}", *RECIPE, *data]
    base = out.parent / "scale.toml"
    base.write_text('name = "scale"\n')
    cmd = [*FEDSIM, "run", str(base), "--out", str(out), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]
    round1_end: list[float] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], tree_pss(proc.pid))
            stop.wait(0.5)

    def watch_round1():  # the moment round 1's row is appended to metrics.jsonl
        path = out / "metrics.jsonl"
        while not stop.is_set():
            try:
                if any(json.loads(x).get("round") == 1 for x in path.read_text().splitlines() if x.strip()):
                    round1_end.append(time.perf_counter() - t0)
                    return
            except (OSError, ValueError):
                pass
            stop.wait(0.05)

    threads = [threading.Thread(target=f, daemon=True) for f in (sample, watch_round1)]
    for th in threads:
        th.start()
    output, _ = proc.communicate()
    stop.set()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = [x for x in output.splitlines() if x.strip()]
        return {"error": f"exit {proc.returncode}: " + (lines[-1] if lines else "no output"), "pss": peak[0] / 2**30}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((out / "summary.json").read_text())
    timed = [r["seconds"] for r in rows if r["round"] >= 2] or [r["seconds"] for r in rows if r["round"] >= 1]
    round1 = next(r["seconds"] for r in rows if r["round"] == 1)
    if not round1_end:  # missed by the watcher: the whole command less rounds >= 2 (includes the exit)
        round1_end.append(wall - sum(r["seconds"] + r.get("observer_seconds", 0.0) for r in rows if r["round"] >= 2))
    return {"round": statistics.median(timed), "min": min(timed), "max": max(timed), "round1": round1,
            "startup": round1_end[0], "ready": summary.get("startup_seconds"), "discovered": summary["clients"],
            "configured": summary.get("clients_configured", clients), "nodes": summary.get("nodes"),
            "pss": peak[0] / 2**30, "failures": summary["client_failures"]}


# ------------------------------------------------------------------------------------- compute floor
_CFG: dict = {}


def _init(cfg_json: str) -> None:
    import torch

    torch.set_num_threads(1)
    _CFG["cfg"] = json.loads(cfg_json)


def _train_chunk(pids: list[int]) -> float:
    from fedsim.factories import client_data, model_for
    from fedsim.training.local import local_train
    from fedsim.training.recipe import Recipe

    cfg = _CFG["cfg"]
    model = model_for(cfg)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = Recipe.from_mapping(cfg["train"])
    t0 = time.perf_counter()
    for pid in pids:
        model.load_state_dict(state)
        x, y = client_data(cfg, pid)
        local_train(model, x, y, recipe, seed=cfg["seed"], round=1, client=pid)
    return time.perf_counter() - t0


def compute_floor(clients: int, per_round: int, data: list[str], repeats: int = 3) -> float:
    """Wall time of one round's training of ``per_round`` clients in two worker processes (best of
    ``repeats``, after a warm-up)."""
    from fedsim.app import load_config
    from fedsim.rounds import sample_partitions

    cfg = load_config(None,
                      [f"federation.num_clients={clients}", f"federation.clients_per_round={per_round}", *RECIPE,
                       *data])
    parts = sample_partitions(cfg["seed"], 1, range(clients), per_round)
    chunks = [parts[0::2], parts[1::2]]
    ctx = mp.get_context("spawn")
    with ctx.Pool(2, initializer=_init, initargs=(json.dumps(cfg),)) as pool:
        pool.map(_train_chunk, [c[:20] for c in chunks])  # warm-up: imports, data, first backward
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            pool.map(_train_chunk, chunks)
            best = min(best, time.perf_counter() - t0)
    return best


def parse_spec(spec: str, default_k: str) -> tuple[int, int, int]:
    """``CLIENTSxPER_ROUND[:K]`` -> (clients, per round, clients per node)."""
    body, _, k = spec.strip().lower().partition(":")
    clients, per_round = (int(v) for v in body.split("x"))
    k = k or default_k
    return clients, per_round, max(1, math.ceil(clients / AUTO_NODES)) if k == "auto" else int(k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="1000x100,1000x1000,10000x100,10000x1000,50000x100,50000x1000",
                    help="comma-separated CLIENTSxPER_ROUND[:CLIENTS_PER_NODE]")
    ap.add_argument("--discovery-rows", default="",
                    help="comma-separated client counts run with one client per node and 100 per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clients-per-node", default="auto")
    ap.add_argument("--dataset", default="fmnist", help="data.dataset (fmnist: the issue's workload)")
    ap.add_argument("--model", default="lenet", help="model.name")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--no-floor", action="store_true", help="skip the 2-process compute floor")
    args = ap.parse_args()
    data = [f'data.dataset="{args.dataset}"', f'model.name="{args.model}"'] + (
        [f'data.data_dir="{args.data_dir}"'] if args.data_dir else [])
    specs = [parse_spec(s, args.clients_per_node) for s in args.configs.split(",") if s.strip()]
    specs += [(int(n), 100, 1) for n in args.discovery_rows.split(",") if n.strip()]
    floors: dict[tuple[int, int], float] = {}
    print(f"{'clients':>8} {'per round':>9} {'k':>5} {'nodes':>6} {'round s':>8} {'range':>13} {'round 1 s':>9} "
          f"{'start-up s':>10} {'ready s':>8} {'discovered':>13} {'PSS GiB':>8} {'floor s':>8} {'x floor':>8}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (clients, per_round, k) in enumerate(specs):
            r = run_fedsim(clients, per_round, args.rounds, k, data, Path(tmp) / f"run{i}")
            if "error" in r:
                print(f"{clients:>8} {per_round:>9} {k:>5}  {r['error']}", flush=True)
                continue
            key = (clients, per_round)
            if key not in floors and not args.no_floor:
                floors[key] = compute_floor(clients, per_round, data)
            f = floors.get(key)
            floor = f"{f:>8.2f} {r['round'] / f:>8.2f}" if f else f"{'-':>8} {'-':>8}"
            ready = f"{r['ready']:>8.1f}" if r["ready"] is not None else f"{'-':>8}"
            print(f"{clients:>8} {per_round:>9} {k:>5} {r['nodes']:>6} {r['round']:>8.2f} "
                  f"{r['min']:>6.2f}-{r['max']:<6.2f} {r['round1']:>9.2f} {r['startup']:>10.1f} {ready} "
                  f"{str(r['discovered']) + '/' + str(r['configured']):>13} {r['pss']:>8.2f} {floor}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    main()
