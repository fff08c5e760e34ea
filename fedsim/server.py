"""The fedsim ServerApp logic: one run of federated training with central evaluation.

Data flow of one round (see docs/architecture.md):
strategy.configure_train (prepare_arrays, sampling) -> grid.send_and_receive -> ClientApp.train
(local SGD + defense pipeline) -> strategy.aggregate_train (observers see every reply, then
aggregate, then finalize_arrays) -> central evaluation on the test set -> metrics.jsonl + progress.
"""
from __future__ import annotations

import io
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from fedsim.client_app import CONFIG_KEY, dataset_for, model_for
from fedsim.observers import Observer
from fedsim.reports import atomic_write_bytes, plot_accuracy, write_json, write_jsonl, write_report
from fedsim.training import evaluate, get_weights, resolve_device, seed_everything, set_weights
from strategies import build_strategy
from strategies.base import to_record

log = logging.getLogger("fedsim")
CLIENT_ID_KEYS = ("partition-id", "num-examples")  # per-client bookkeeping, meaningless when averaged


def train_config(cfg: dict[str, Any]) -> ConfigRecord:
    """What every train message carries: the recipe the server configures, and the resolved config."""
    t = cfg["train"]
    rec: dict[str, Any] = {"lr": float(t["lr"]), "batch_size": int(t["batch_size"]),
                           CONFIG_KEY: json.dumps(cfg, sort_keys=True)}
    if t.get("local_steps"):
        rec["local_steps"] = int(t["local_steps"])
    else:
        rec["local_epochs"] = int(t["local_epochs"])
    return ConfigRecord(rec)


def run_server(grid: Grid, cfg: dict[str, Any], out: Path | None, observers: Sequence[Observer] = (),
               progress: bool = True) -> dict[str, Any]:
    """Run ``federation.rounds`` rounds on ``grid``; write metrics, plot, summary and report to ``out``."""
    t_start = time.perf_counter()
    seed_everything(cfg["seed"])
    ds = dataset_for(cfg)
    model = model_for(cfg)  # initial weights fixed by the seed
    names = list(model.state_dict().keys())
    device = resolve_device(cfg["device"])
    strategy = build_strategy(cfg, param_names=names, observers=observers)
    for obs in observers:
        obs.on_start(out)
    rows: list[dict[str, Any]] = []
    eval_model = model_for(cfg)
    clock = {"t": time.perf_counter()}
    rounds = cfg["federation"]["rounds"]

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        set_weights(eval_model, arrays.to_numpy_ndarrays())
        loss, acc = evaluate(eval_model, ds.x_test, ds.y_test, device)
        now = time.perf_counter()
        info = strategy.round_info.get(server_round, {})
        row: dict[str, Any] = {"round": server_round, "accuracy": acc, "loss": loss, "seconds": now - clock["t"],
                               "replies": info.get("replies", 0), "failures": info.get("failures", 0)}
        # the clients' metrics (example-weighted means): training loss, what each defense did, ...
        row.update({k: v for k, v in info.get("train_metrics", {}).items() if k not in CLIENT_ID_KEYS})
        row.update({f"compensation.{k}": v for k, v in info.get("compensation", {}).items()})
        if server_round > 0 and row["replies"] == 0 and row["failures"] > 0:
            first = next((f for f in strategy.failures if f["round"] == server_round), {})
            raise RuntimeError(f"round {server_round}: all {row['failures']} sampled clients failed; the first "
                               f"error (client {first.get('client')}): {first.get('reason', '?')}")
        for obs in observers:  # e.g. the curious server's attacks: timed apart from the round
            obs.on_round_end(server_round, row)
        row["observer_seconds"] = time.perf_counter() - now
        clock["t"] = time.perf_counter()
        rows.append(row)
        if out is not None:
            write_jsonl(out / "metrics.jsonl", rows)
        if progress:
            print(f"[fedsim] round {server_round:>3}/{rounds}  accuracy {acc:.4f}  loss {loss:.4f}  "
                  f"clients {row['replies']}{'/' + str(row['replies'] + row['failures']) if row['failures'] else ''}"
                  f"  {row['seconds']:.2f}s", file=sys.stderr, flush=True)
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy.discover(grid)
    result = strategy.start(grid, to_record(names, get_weights(model)), num_rounds=rounds,
                            train_config=train_config(cfg), evaluate_fn=evaluate_fn)
    final = rows[-1] if rows else {}
    summary: dict[str, Any] = {
        "name": cfg["name"], "rounds": rounds, "final_accuracy": final.get("accuracy"),
        "final_loss": final.get("loss"), "best_accuracy": max((r["accuracy"] for r in rows), default=None),
        "initial_accuracy": rows[0]["accuracy"] if rows else None,
        "seconds": time.perf_counter() - t_start, "client_failures": len(strategy.failures),
        "failures": strategy.failures, "clients": len(strategy.node_partition),
    }
    for obs in observers:
        summary.update(obs.on_finish())
    if out is not None:
        if result.arrays is not None:
            buf = io.BytesIO()
            torch.save({n: torch.as_tensor(a) for n, a in zip(names, result.arrays.to_numpy_ndarrays())}, buf)
            atomic_write_bytes(out / "model.pt", buf.getvalue())
        plot_accuracy(rows, out / "accuracy.png", title=cfg["name"])
        write_json(out / "summary.json", summary)
        write_report(out, cfg, rows, summary, [obs.report_markdown() for obs in observers])
    return summary
