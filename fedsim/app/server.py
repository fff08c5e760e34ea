"""The fedsim ServerApp loop: rounds of the round engine, each followed by an explicit round-end step.

``run_server`` builds the run's components from the config (aggregation rule, channel, transforms,
observers), lets the engine discover the clients and run the channel's setup exchange, then for
every round:

1. ``engine.run_round`` - send, collect, intercept (observers see every reply), aggregate; returns the
   new global state and a :class:`fedsim.rounds.RoundRecord`;
2. ``round_end`` - evaluate the global model (centrally when the server can read it, else by a client
   on the common test split), stop if every sampled client failed, let observers act on the round
   (the curious server attacks here, timed apart), append the row to ``metrics.jsonl``, print progress.

At the end it writes ``model.pt`` (when the server can read the model), ``accuracy.png``,
``summary.json`` and ``report.md``.
"""
from __future__ import annotations

import io
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from flwr.serverapp import Grid

from fedsim.app import build_components
from fedsim.factories import dataset_for, model_for
from fedsim.observers import Observer
from fedsim.reports import append_jsonl, atomic_write_bytes, plot_accuracy, write_json, write_report
from fedsim.rounds import RoundContext, RoundEngine, RoundRecord
from fedsim.training import evaluate, get_weights, resolve_device, seed_everything, set_weights

log = logging.getLogger("fedsim")


class Server:
    """One run: the engine plus the round-end step (evaluation, observers, metrics, progress)."""

    def __init__(self, cfg: dict[str, Any], out: Path | None, observers: Sequence[Observer] | None = None,
                 progress: bool = True, fixed_partitions: Sequence[int] | None = None):
        self.cfg, self.out, self.progress = cfg, out, progress
        seed_everything(cfg["seed"])
        self.ds = dataset_for(cfg)
        model = model_for(cfg)  # initial weights fixed by the seed
        self.names = list(model.state_dict().keys())
        self.initial = get_weights(model)
        self.device = resolve_device(cfg["device"])
        parts = build_components(cfg)
        self.observers = list(parts["observers"] if observers is None else observers)
        self.engine = RoundEngine(cfg, self.names, parts["rule"], parts["channel"], parts["transforms"],
                                  self.observers, fixed_partitions=fixed_partitions)
        self.eval_model = model_for(cfg)
        self.rows: list[dict[str, Any]] = []

    # ---- the round-end step ----------------------------------------------------------------------------
    def evaluate(self, grid: Grid, state: Any, record: RoundRecord) -> dict[str, Any]:
        arrays = self.engine.channel.plaintext(state)
        if arrays is not None:
            set_weights(self.eval_model, arrays)
            loss, acc = evaluate(self.eval_model, self.ds.x_test, self.ds.y_test, self.device)
            return {"accuracy": acc, "loss": loss, "evaluated_by": "server"}
        order = record.contributors or record.sampled or sorted(self.engine.partition_node)
        res = self.engine.evaluate_remote(grid, record.round, state, record, order)
        if res is None:
            return {"accuracy": None, "loss": None, "evaluated_by": "nobody (every evaluator failed)"}
        loss, acc, p = res
        return {"accuracy": acc, "loss": loss, "evaluated_by": f"client {p}"}

    def round_end(self, grid: Grid, state: Any, record: RoundRecord, t_start: float) -> dict[str, Any]:
        row = {**record.row(), **self.evaluate(grid, state, record)}
        row["seconds"] = time.perf_counter() - t_start
        rnd = record.round
        if rnd > 0 and record.replies == 0 and record.failures:
            first = record.failures[0]
            raise RuntimeError(f"round {rnd}: all {len(record.failures)} sampled clients failed; the first error "
                               f"(client {first.get('client')}): {first.get('reason', '?')}")
        t_obs = time.perf_counter()
        arrays = self.engine.channel.plaintext(state) if self.observers else None
        for obs in self.observers:  # observers that evaluate the global model add columns to the row
            row.update(obs.on_global_model(rnd, arrays))
        for obs in self.observers:  # e.g. the curious server's attacks: timed apart from the round
            obs.on_round_end(rnd, row)
        row["observer_seconds"] = time.perf_counter() - t_obs
        self.rows.append(row)
        if self.out is not None:
            append_jsonl(self.out / "metrics.jsonl", [row])
        if self.progress:
            acc = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
            loss = "-" if row["loss"] is None else f"{row['loss']:.4f}"
            total = record.replies + len(record.failures)
            print(f"[fedsim] round {rnd:>3}/{self.cfg['federation']['rounds']}  accuracy {acc}  loss {loss}  "
                  f"clients {record.replies}{'/' + str(total) if record.failures else ''}  {row['seconds']:.2f}s",
                  file=sys.stderr, flush=True)
        return row

    # ---- the whole run ----------------------------------------------------------------------------------
    def run(self, grid: Grid) -> dict[str, Any]:
        t_start = time.perf_counter()
        cfg, engine = self.cfg, self.engine
        for obs in self.observers:
            obs.on_start(self.out)
        engine.discover(grid)
        state = engine.channel.initial(self.initial)
        handshake = RoundRecord(0)
        engine.channel.handshake(RoundContext(engine, grid, 0, engine.channel, None, None, handshake))
        self.round_end(grid, state, handshake, t_start)
        for rnd in range(1, cfg["federation"]["rounds"] + 1):
            t0 = time.perf_counter()
            state, record = engine.run_round(grid, rnd, state)
            self.round_end(grid, state, record, t0)
        return self.finish(state, time.perf_counter() - t_start)

    def finish(self, state: Any, seconds: float) -> dict[str, Any]:
        rows = self.rows
        final = rows[-1] if rows else {}
        accs = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
        summary: dict[str, Any] = {
            "name": self.cfg["name"], "rounds": self.cfg["federation"]["rounds"],
            "final_accuracy": final.get("accuracy"), "final_loss": final.get("loss"),
            "best_accuracy": max(accs, default=None), "initial_accuracy": rows[0]["accuracy"] if rows else None,
            "evaluated_by": final.get("evaluated_by"), "seconds": seconds,
            "client_failures": len(self.engine.failures), "failures": self.engine.failures,
            "clients": len(self.engine.node_partition),
            "clients_configured": self.cfg["federation"]["num_clients"],
        }
        for obs in self.observers:
            summary.update(obs.on_finish())
        if self.out is not None:
            arrays = self.engine.channel.plaintext(state)
            if arrays is not None:
                buf = io.BytesIO()
                torch.save({n: torch.as_tensor(a) for n, a in zip(self.names, arrays)}, buf)
                atomic_write_bytes(self.out / "model.pt", buf.getvalue())
            plot_accuracy(rows, self.out / "accuracy.png", title=self.cfg["name"])
            write_json(self.out / "summary.json", summary)
            write_report(self.out, self.cfg, rows, summary, [obs.report_markdown() for obs in self.observers])
        return summary


def run_server(grid: Grid, cfg: dict[str, Any], out: Path | None, observers: Sequence[Observer] | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Run ``federation.rounds`` rounds on ``grid``; write metrics, plot, summary and report to ``out``."""
    return Server(cfg, out, observers, progress).run(grid)
