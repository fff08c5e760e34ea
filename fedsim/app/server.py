"""The fedsim ServerApp loop: rounds of the round engine, each followed by an explicit round-end step.

``run_server`` builds the run's components from the config (aggregation rule, channel, transforms,
observers), lets the engine discover the clients and run the channel's setup exchange, then for
every round:

1. ``engine.run_round`` - send, collect, intercept (observers see every reply), aggregate; returns the
   new global state and a :class:`fedsim.rounds.RoundRecord`;
2. ``round_end`` - evaluate the global model (centrally when the server can read it, else by a client
   on the common test split), stop if no client's model reached the aggregate (or, when the channel
   says ``on_round_failure = "continue"``, record the round as failed and keep the global model), let
   observers act on the round
   (the curious server attacks here, timed apart), append the row to ``metrics.jsonl``, print progress.

At the end it writes ``model.pt`` (when the server can read the model), ``accuracy.png``,
``summary.json`` and ``report.md``; ``metrics.csv`` mirrors ``metrics.jsonl`` after every round.

Progress (``fedsim.progress``, on stderr): start-up (waiting for the client nodes, discovery, the
channel's setup), one line per round as soon as it is evaluated (before the observers' attacks,
which report their own progress) with an ETA, and how long the observers took. Start-up is timed
apart from the rounds: round 0's ``seconds`` is the initial evaluation only, and ``summary.json``
has ``startup_seconds``, ``round_seconds`` and ``observer_seconds`` beside the total ``seconds``.
"""
from __future__ import annotations

import io
import logging
import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from flwr.app import RecordDict
from flwr.serverapp import Grid

from fedsim import progress
from fedsim.app import build_components
from fedsim.export import write_csv
from fedsim.factories import dataset_for, model_for
from fedsim.observers import Observer
from fedsim.protocol import CONFIG, EVAL_ACCURACY, EVAL_DATA, EVAL_EXAMPLES, EVAL_LOSS, EVALUATE, train_config
from fedsim.reports import append_jsonl, atomic_write_bytes, plot_accuracy, write_json, write_report
from fedsim.rounds import RoundContext, RoundEngine, RoundRecord, sample_partitions
from fedsim.training import derive_seed, evaluate, get_weights, resolve_device, seed_everything, set_weights

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
        self.startup_seconds: float | None = None

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

    def client_evaluate(self, grid: Grid, state: Any, record: RoundRecord) -> dict[str, Any]:
        """Client-side evaluation (``evaluate.client_fraction``): clients drawn from (seed, round)
        evaluate the global model on their own data; example-weighted mean, worst and best."""
        frac = float(self.cfg.get("evaluate", {}).get("client_fraction", 0.0) or 0.0)
        if frac <= 0 or record.round < 1:
            return {}
        parts = sorted(self.engine.partition_node)
        k = max(1, math.ceil(frac * len(parts)))
        chosen = sample_partitions(derive_seed(self.cfg["seed"], 0xE7A1), record.round, parts, k)
        config = train_config(self.cfg, record.round)
        config[EVAL_DATA] = "local"
        content = RecordDict({CONFIG: config, **self.engine.channel.outgoing(state)})
        replies = self.engine.send(grid, chosen, EVALUATE, content, None, "client-evaluate", record.round, record)
        if not replies:
            return {"client_evaluators": 0}
        accs = [float(r.metrics[EVAL_ACCURACY]) for r in replies]
        n = [float(r.metrics[EVAL_EXAMPLES]) for r in replies]
        return {"client_accuracy": sum(a * w for a, w in zip(accs, n)) / sum(n),
                "client_loss": sum(float(r.metrics[EVAL_LOSS]) * w for r, w in zip(replies, n)) / sum(n),
                "client_accuracy_min": min(accs), "client_accuracy_max": max(accs),
                "client_evaluators": len(replies)}

    def round_end(self, grid: Grid, state: Any, record: RoundRecord, t_start: float) -> dict[str, Any]:
        evaluation = self.evaluate(grid, state, record)
        evaluation.update(self.client_evaluate(grid, state, record))
        row = {**record.row(), **evaluation}
        row["seconds"] = time.perf_counter() - t_start
        rnd = record.round
        if rnd == 0 and self.startup_seconds is not None:
            row["startup_seconds"] = self.startup_seconds  # Ray, discovery, the channel's setup
        if rnd > 0 and record.replies == 0 and record.failures:
            first = record.failures[0]
            what = (f"round {rnd}: all {len(record.failures)} sampled clients failed; the first error "
                    f"(client {first.get('client')}): {first.get('reason', '?')}")
            if self.engine.channel.on_round_failure != "continue":
                raise RuntimeError(what)
            row["round_failed"] = True  # the global model stays as it was (the channel says: continue)
            log.warning("%s; continuing with the global model unchanged", what.splitlines()[0])
        self.say_round(row, record)  # before the observers: attacks report their own progress
        t_obs = time.perf_counter()
        arrays = self.engine.channel.plaintext(state) if self.observers else None
        for obs in self.observers:  # observers that evaluate the global model add columns to the row
            row.update(obs.on_global_model(rnd, arrays))
        for obs in self.observers:  # e.g. the curious server's attacks: timed apart from the round
            obs.on_round_end(rnd, row)
        row["observer_seconds"] = time.perf_counter() - t_obs
        if row["observer_seconds"] >= 1.0:
            progress.say(f"round {rnd:>3}: observers (attacks) took {progress.duration(row['observer_seconds'])}")
        self.rows.append(row)
        if self.out is not None:
            append_jsonl(self.out / "metrics.jsonl", [row])
            write_csv(self.out / "metrics.csv", self.rows)
        return row

    def say_round(self, row: dict[str, Any], record: RoundRecord) -> None:
        """``round   3/20  accuracy 0.6500  loss 1.4562  clients 10  1.14s  ETA 20s``."""
        rnd, rounds = record.round, self.cfg["federation"]["rounds"]
        acc = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
        loss = "-" if row["loss"] is None else f"{row['loss']:.4f}"
        total = record.replies + len(record.failures)
        line = (f"round {rnd:>3}/{rounds}  accuracy {acc}  loss {loss}  "
                f"clients {record.replies}{'/' + str(total) if record.failures else ''}  {row['seconds']:.2f}s")
        if "client_accuracy" in row:
            line += f"  client acc {row['client_accuracy']:.4f} (min {row['client_accuracy_min']:.4f})"
        done = [r for r in self.rows if r["round"] >= 1]
        if rnd >= 1 and rnd < rounds:  # rounds so far (with their observers) and this one
            per = (sum(r["seconds"] + r.get("observer_seconds", 0.0) for r in done) + row["seconds"]) / (len(done) + 1)
            line += f"  ETA {progress.duration(per * (rounds - rnd))}"
        progress.say(line)

    # ---- the whole run ----------------------------------------------------------------------------------
    def run(self, grid: Grid, started_at: float | None = None) -> dict[str, Any]:
        """All rounds on ``grid``. ``started_at`` (a ``time.perf_counter()`` value) is when the run was
        launched - before Ray started, say - so start-up counts from there (default: now)."""
        with progress.suppressed(not self.progress):
            return self._run(grid, started_at)

    def _run(self, grid: Grid, started_at: float | None) -> dict[str, Any]:
        t_start = time.perf_counter() if started_at is None else started_at
        cfg, engine = self.cfg, self.engine
        for obs in self.observers:
            obs.on_start(self.out)
        n = cfg["federation"]["num_clients"]
        progress.say(f"waiting for {n} clients to register and answer (the simulation engine starts the client "
                     "nodes and their actors now)")
        with progress.heartbeat(f"still starting: waiting for {n} clients"):
            engine.discover(grid)
        state = engine.channel.initial(self.initial)
        handshake = RoundRecord(0)
        with progress.heartbeat(f"channel {engine.channel.name!r}: setup exchange"):
            engine.channel.handshake(RoundContext(engine, grid, 0, engine.channel, None, None, handshake))
        self.startup_seconds = time.perf_counter() - t_start
        progress.say(f"{len(engine.partition_node)} clients on {len(engine.node_partitions)} nodes ready; start-up "
                     f"took {progress.duration(self.startup_seconds)}")
        self.round_end(grid, state, handshake, time.perf_counter())
        for rnd in range(1, cfg["federation"]["rounds"] + 1):
            t0 = time.perf_counter()
            with progress.heartbeat(f"round {rnd}/{cfg['federation']['rounds']}: clients training"):
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
            "startup_seconds": self.startup_seconds,
            "round_seconds": sum(r["seconds"] for r in rows if r["round"] >= 1),
            "observer_seconds": sum(r.get("observer_seconds", 0.0) for r in rows),
            "client_failures": len(self.engine.failures), "failures": self.engine.failures,
            "rounds_failed": sum(1 for r in rows if r.get("round_failed")),
            "clients": len(self.engine.partition_node), "nodes": len(self.engine.node_partitions),
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
               progress: bool = True, started_at: float | None = None) -> dict[str, Any]:
    """Run ``federation.rounds`` rounds on ``grid``; write metrics, plot, summary and report to ``out``.
    ``started_at``: when the run was launched (``time.perf_counter()``), for the start-up time."""
    return Server(cfg, out, observers, progress).run(grid, started_at)
