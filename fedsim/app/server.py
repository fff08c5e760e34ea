"""The fedsim ServerApp loop: rounds of the round engine, each followed by an explicit round-end step.

``run_server`` builds the run's components from the config (aggregation rule, channel, transforms,
observers), lets the engine discover the clients and run the channel's setup exchange, then for
every round:

1. ``engine.run_round`` - send, collect, intercept (observers see every reply), aggregate; returns the
   new global state and a :class:`fedsim.seams.RoundRecord`;
2. ``round_end`` - evaluate the global model (:mod:`fedsim.app.evaluation`: centrally when the server
   can read it, else by a client on the common test split), stop if no client's model reached the
   aggregate (or, when the channel says ``on_round_failure = "continue"``, record the round as failed
   and keep the global model), let observers act on the round (the curious server attacks here, timed apart), append the row to
   ``metrics.jsonl``, print progress.

After every round's row is appended, the server checkpoints the run (``checkpoint.npz``,
:mod:`fedsim.checkpoint`) when it can: the global model, the state of the rule, channel, transforms
and observers, the RNG positions. A run resumed from a checkpoint continues with the next round and
ends exactly as the uninterrupted run would.

The server talks to the clients through :class:`fedsim.app.rungrid.RunGrid` (the stop signal, the
client-state mirror). At the end it writes ``model.pt`` (when the server can read the model),
``accuracy.png``, ``summary.json`` (``status``: ``completed``, ``interrupted`` or ``failed``, with the last completed
round) and ``report.md`` - also when the run is interrupted (SIGINT/SIGTERM, :mod:`fedsim.interrupt`)
or fails: then the files describe the last completed round. ``metrics.csv`` mirrors ``metrics.jsonl``.

Progress (``fedsim.progress``, on stderr): start-up (waiting for the client nodes, discovery, the
channel's setup), one line per round as soon as it is evaluated (before the observers' attacks,
which report their own progress) with an ETA, and how long the observers took. Start-up is timed
apart from the rounds: round 0's ``seconds`` is the initial evaluation only, and ``summary.json``
has ``startup_seconds``, ``round_seconds`` and ``observer_seconds`` beside the total ``seconds``.
"""
from __future__ import annotations

import io
import json
import logging
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

import torch
from flwr.serverapp import Grid

from fedsim import progress
from fedsim.app import build_components
from fedsim.app.evaluation import Evaluator
from fedsim.app.rungrid import RunGrid
from fedsim.checkpoint import (
    CHECKPOINT,
    CLIENT_STATE,
    Checkpoint,
    CheckpointError,
    client_state_digests,
    config_identity,
    keep_client_states,
    metrics_prefix,
    resume_blocker,
    rng_state,
    set_rng_state,
    verify_resume,
    write_checkpoint,
)
from fedsim.components import ConfigError
from fedsim.device import resolve_device
from fedsim.export import CsvLog
from fedsim.factories import model_for
from fedsim.interrupt import RunInterrupted, StopSignal
from fedsim.models.weights import get_weights
from fedsim.observers import Observer
from fedsim.replies import ModelSpec
from fedsim.reports import (
    append_jsonl,
    atomic_write_bytes,
    plot_accuracy,
    write_json,
    write_report,
)
from fedsim.rounds import RoundEngine
from fedsim.runfolder import read_summary
from fedsim.seams import RoundContext, RoundRecord
from fedsim.seeding import seed_everything

log = logging.getLogger("fedsim")


class Server:
    """One run: the engine plus the round-end step (evaluation, observers, metrics, progress)."""

    def __init__(self, cfg: dict[str, Any], out: Path | None, observers: Sequence[Observer] | None = None,
                 progress: bool = True, fixed_partitions: Sequence[int] | None = None, *,
                 stop: StopSignal | None = None, resume: Checkpoint | None = None, checkpoint: bool | None = None):
        self.cfg, self.out, self.progress = cfg, out, progress
        self.stop = stop if stop is not None else StopSignal()
        self.resume = resume
        seed_everything(cfg["seed"])
        model = model_for(cfg)  # initial weights fixed by the seed
        self.names = list(model.state_dict().keys())
        self.initial = get_weights(model)
        self.device = resolve_device(cfg["device"])
        parts = build_components(cfg)
        self.observers = list(parts["observers"] if observers is None else observers)
        self.engine = RoundEngine(cfg, self.names, parts["rule"], parts["channel"], parts["transforms"],
                                  self.observers, timeout=float(cfg["federation"].get("round_timeout", 3600.0)),
                                  fixed_partitions=fixed_partitions, model=ModelSpec.of(self.names, self.initial),
                                  privacy=parts["privacy"])
        self.evaluator = Evaluator(cfg, self.engine, self.device)
        self.rows: list[dict[str, Any]] = []
        self.csv = CsvLog(out / "metrics.csv") if out is not None else None
        self.startup_seconds: float | None = None
        # checkpoints: only when every piece of the run can report its state (fedsim.checkpoint)
        self.blocker = resume_blocker(self.engine.channel, self.engine.rule, self.engine.transforms, self.observers)
        wanted = cfg["output"].get("checkpoint", True) if checkpoint is None else checkpoint
        self.checkpointing = out is not None and bool(wanted) and self.blocker is None
        if resume is not None and not self.checkpointing:
            raise ConfigError(f"cannot resume this run: {self.blocker or 'checkpoints are off'}")
        self.identity = config_identity(cfg)
        self.completed: int | None = None  # the last round whose row and checkpoint were written
        self.committed: Any = None  # the global state after that round
        self._committed_observers: list[Any] | None = None
        self.prior_seconds = resume.seconds if resume is not None else 0.0
        self.resumed = [*resume.resumed, resume.round] if resume is not None else []
        self.client_state_dropped = list(resume.client_state_dropped) if resume is not None else []
        self._t_start = time.perf_counter()

    # ---- the round-end step ----------------------------------------------------------------------------
    def round_end(self, grid: Grid, state: Any, record: RoundRecord, t_start: float) -> dict[str, Any]:
        evaluation = self.evaluator.evaluate(grid, state, record)
        evaluation.update(self.evaluator.client_evaluate(grid, state, record))
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
        say_round(row, record, self.cfg["federation"]["rounds"], self.rows)  # before the observers: attacks report their own progress
        t_obs = time.perf_counter()
        arrays = self.engine.channel.plaintext(state) if self.observers else None
        for obs in self.observers:  # observers that evaluate the global model add columns to the row
            row.update(obs.on_global_model(rnd, arrays))
        for obs in self.observers:  # e.g. the curious server's attacks: timed apart from the round
            self.stop.check()
            obs.on_round_end(rnd, row)
        row["observer_seconds"] = time.perf_counter() - t_obs
        if row["observer_seconds"] >= 1.0:
            progress.say(f"round {rnd:>3}: observers (attacks) took {progress.duration(row['observer_seconds'])}")
        with self.stop.shielded():  # the row and the checkpoint: both or neither
            self.rows.append(row)
            if self.out is not None:
                append_jsonl(self.out / "metrics.jsonl", [row])
                self.csv.append(self.rows)
            self.commit(state, rnd)
        return row

    # ---- checkpoints ------------------------------------------------------------------------------------
    def commit(self, state: Any, rnd: int) -> None:
        """Round ``rnd`` is complete: remember its state and write the checkpoint (fedsim.checkpoint)."""
        self.completed, self.committed = rnd, state
        if not self.checkpointing:
            return
        engine = self.engine
        observers = [obs.state() for obs in self.observers]
        self._committed_observers = observers
        components = {"strategy": engine.rule.state(), "channel": engine.channel.state(),
                      "transforms": [t.state() for t in engine.transforms], "observers": observers,
                      "privacy": engine.privacy.state()}
        mirror = self.out / CLIENT_STATE
        size, digest = metrics_prefix(self.out)
        ckpt = Checkpoint(round=rnd, identity=self.identity, arrays=list(engine.channel.checkpoint_arrays(state)),
                          components=components, rng=rng_state(), failures=list(engine.failures),
                          seconds=self.elapsed(), resumed=self.resumed, metrics_bytes=size, metrics_digest=digest,
                          client_state=client_state_digests(mirror, rnd),  # (the clients' digests)
                          client_state_dropped=self.client_state_dropped)
        write_checkpoint(self.out / CHECKPOINT, ckpt)
        keep_client_states(mirror, ckpt.client_state)  # superseded files (and any a late client wrote) go

    def restore(self, ckpt: Checkpoint) -> Any:
        """Bring the run back to the end of round ``ckpt.round``; returns the global state. A checkpoint
        that does not fit the run raises :class:`CheckpointError` (the folder's summary is left alone)."""
        engine = self.engine
        comps = ckpt.components
        where = self.out / CHECKPOINT
        if len(comps.get("transforms", [])) != len(engine.transforms) or \
                len(comps.get("observers", [])) != len(self.observers):
            raise CheckpointError(f"{where} does not match this run's transforms/observers; use --overwrite "
                                  "to start the run again")
        verify_resume(self.out, ckpt, without_client_state=True)  # (the run folder checked the client state)
        metrics = self.out / "metrics.jsonl"
        kept = metrics.read_bytes()[:ckpt.metrics_bytes]
        try:
            rows = [json.loads(line) for line in kept.decode().splitlines() if line.strip()]
        except ValueError as exc:
            raise CheckpointError(f"{metrics} cannot be read ({exc}); use --overwrite to start the run again") from None
        if [r.get("round") for r in rows] != list(range(ckpt.round + 1)):
            raise CheckpointError(f"{metrics} does not hold rounds 0..{ckpt.round} of the "
                                  "checkpoint; use --overwrite to start the run again")
        pieces = [(f"strategy {engine.rule.name!r}", engine.rule, comps.get("strategy", {})),
                  (f"channel {engine.channel.name!r}", engine.channel, comps.get("channel", {})),
                  *((f"transform {t.name!r}", t, st) for t, st in zip(engine.transforms, comps["transforms"]))]
        atomic_write_bytes(metrics, kept)  # drop the row of an interrupted round (the same bytes as before)
        self.csv.write(rows)
        self.rows = rows
        pieces += [(f"observer {o.name!r}", o, st) for o, st in zip(self.observers, comps["observers"])]
        pieces.append(("the privacy ledger", engine.privacy, comps.get("privacy", {})))
        for what, comp, st in pieces:
            try:
                comp.load_state(st)
            except (ValueError, KeyError, TypeError, OSError) as exc:
                raise CheckpointError(f"{where}: {what} cannot take its state back ({type(exc).__name__}: {exc}); "
                                      "use --overwrite to start the run again") from exc
        self._committed_observers = comps["observers"]
        engine.failures[:] = list(ckpt.failures)
        keep_client_states(self.out / CLIENT_STATE, ckpt.client_state)  # files of the interrupted round go
        if ckpt.client_state_dropped and ckpt.client_state_dropped[-1] == ckpt.round and not ckpt.client_state:
            progress.say(f"resuming after round {ckpt.round} without the clients' state "
                         "(--resume-without-client-state): the run is no longer exact")
        set_rng_state(ckpt.rng)
        state = engine.channel.from_checkpoint_arrays([a.copy() for a in ckpt.arrays])
        self.completed, self.committed = ckpt.round, state
        return state

    def drop_checkpoint(self) -> None:
        """A complete run needs no checkpoint (``model.pt`` is the final model): remove it and the mirror."""
        if self.out is None:
            return
        (self.out / CHECKPOINT).unlink(missing_ok=True)
        shutil.rmtree(self.out / CLIENT_STATE, ignore_errors=True)

    def elapsed(self) -> float:
        return self.prior_seconds + time.perf_counter() - self._t_start

    # ---- the whole run ----------------------------------------------------------------------------------
    def run(self, grid: Grid, started_at: float | None = None) -> dict[str, Any]:
        """All rounds on ``grid``. ``started_at`` (a ``time.perf_counter()`` value) is when the run was
        launched - before Ray started, say - so start-up counts from there (default: now)."""
        with progress.suppressed(not self.progress), self.stop.watching():  # attack loops poll the stop
            return self._run(grid, started_at)

    def _run(self, grid: Grid, started_at: float | None) -> dict[str, Any]:
        self._t_start = time.perf_counter() if started_at is None else started_at
        cfg, engine, stop = self.cfg, self.engine, self.stop
        mirror = self.out / CLIENT_STATE if self.checkpointing else None
        grid = RunGrid(grid, stop, mirror, self.resume.round if self.resume is not None else None)
        try:
            stop.bind_current_thread()  # (in the main thread the handler raises from here on: inside the try)
            stop.check()  # a signal during start-up (Ray starting, the ServerApp thread not yet running)
            for obs in self.observers:
                obs.on_start(self.out)
            n = cfg["federation"]["num_clients"]
            progress.say(f"waiting for {n} clients to register and answer (the simulation engine starts the "
                         "client nodes and their actors now)")
            with progress.heartbeat(f"still starting: waiting for {n} clients"):
                engine.discover(grid)
            if self.resume is not None:
                state = self.restore(self.resume)
                first = self.resume.round + 1
                self.startup_seconds = time.perf_counter() - self._t_start
            else:
                state = engine.channel.initial(self.initial)
                handshake = RoundRecord(0)
                with progress.heartbeat(f"channel {engine.channel.name!r}: setup exchange"):
                    engine.channel.handshake(RoundContext(engine, grid, 0, engine.channel, None, None, handshake))
                self.startup_seconds = time.perf_counter() - self._t_start
                progress.say(f"{len(engine.partition_node)} clients on {len(engine.node_partitions)} nodes ready; "
                             f"start-up took {progress.duration(self.startup_seconds)}")
                self.round_end(grid, state, handshake, time.perf_counter())
                first = 1
            for rnd in range(first, cfg["federation"]["rounds"] + 1):
                stop.check()
                t0 = time.perf_counter()
                with progress.heartbeat(f"round {rnd}/{cfg['federation']['rounds']}: clients training"):
                    state, record = engine.run_round(grid, rnd, state)
                self.round_end(grid, state, record, t0)
            with stop.shielded(raise_pending=False):  # the run is complete: a late signal changes nothing
                summary = self.finish(state, self.elapsed())
                self.drop_checkpoint()
            return summary
        except KeyboardInterrupt as exc:
            signame = exc.signame if isinstance(exc, RunInterrupted) else "SIGINT"
            self._stopped("interrupted" if signame.startswith("SIG") else "failed", signame=signame)
            raise self._interrupted(signame) from None
        except CheckpointError:
            raise  # the checkpoint does not fit: the folder stays as the interrupted run left it
        except Exception as exc:
            if stop.requested:  # e.g. Ray's processes died of the terminal's SIGINT before the server saw it
                signame = stop.signame or "SIGINT"
                self._stopped("interrupted" if signame.startswith("SIG") else "failed", signame=signame)
                raise self._interrupted(signame) from None
            self._stopped("failed", error=f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                          trace=traceback.format_exc())
            raise
        finally:
            stop.server_thread = None  # the loop is over: a signal from now on only records the stop

    def last_round(self) -> int | None:
        """The last completed round the run folder holds: a resumed run's checkpoint round until the
        checkpoint is restored (after discovery), then the rounds this run completed; None if none."""
        if self.completed is None and self.resume is not None:
            return self.resume.round
        return self.completed

    def _interrupted(self, signame: str) -> RunInterrupted:
        last = self.last_round()
        return RunInterrupted(signame, last, before_first_round=last is None)

    def _stopped(self, status: str, signame: str | None = None, error: str | None = None,
                 trace: str | None = None) -> None:
        """Write the files of a run that stopped early, describing its last completed round (none: a run
        stopped during start-up says so, ``completed_round`` null). A late first signal changes nothing
        here (it is only recorded: the run already stops). A resumed run stopped before it restored its
        checkpoint leaves the folder as the previous stop left it, describing the checkpoint's round,
        and records only this stop's status in ``summary.json``."""
        if self.out is None:
            return
        with self.stop.shielded(raise_pending=False):
            self._write_stopped(status, signame, error, trace)

    def _write_stopped(self, status: str, signame: str | None, error: str | None, trace: str | None) -> None:
        extra = {k: v for k, v in (("stopped_by", signame), ("error", error), ("traceback", trace)) if v}
        try:
            if self.resume is not None and self.completed is None:  # the checkpoint was not restored yet
                previous = read_summary(self.out)
                if previous is not None:
                    for key in ("stopped_by", "error", "traceback"):
                        previous.pop(key, None)
                    write_json(self.out / "summary.json", {**previous, "status": status, **extra})
                return
            if self._committed_observers is not None:  # observers back to the last completed round
                for obs, st in zip(self.observers, self._committed_observers):
                    obs.load_state(st)
            self.finish(self.committed, self.elapsed(), status=status, extra=extra)
        except Exception as exc:  # noqa: BLE001 - the original error matters more
            if self.completed:  # without a completed round the folder is discarded: nothing to say
                log.error("could not write the summary of the %s run: %s", status, exc)

    def finish(self, state: Any, seconds: float, status: str = "completed",
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
        rows = self.rows
        final = rows[-1] if rows else {}
        accs = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
        summary: dict[str, Any] = {
            "name": self.cfg["name"], "status": status, "rounds": self.cfg["federation"]["rounds"],
            "completed_round": self.completed,
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
            "checkpoint": "after every round" if self.checkpointing else (
                self.blocker or "off (output.checkpoint = false)" if self.out is not None else "off"),
            "resumable": bool(self.checkpointing and status != "completed" and self.completed is not None),
            "resumed_from": self.resumed,
        }
        if self.client_state_dropped:
            summary["resumed_without_client_state"] = self.client_state_dropped
        summary.update(extra or {})
        if self.engine.privacy:
            summary["privacy"] = self.engine.privacy.describe()
        for obs in self.observers:
            summary.update(obs.on_finish())
        if self.out is not None:
            arrays = self.engine.channel.plaintext(state) if state is not None else None
            if arrays is not None:
                buf = io.BytesIO()
                torch.save({n: torch.as_tensor(a) for n, a in zip(self.names, arrays)}, buf)
                atomic_write_bytes(self.out / "model.pt", buf.getvalue())
            if rows:
                plot_accuracy(rows, self.out / "accuracy.png", title=self.cfg["name"])
            write_json(self.out / "summary.json", summary)
            write_report(self.out, self.cfg, rows, summary,
                         [self.engine.privacy.report_markdown(rows), *(obs.report_markdown() for obs in self.observers)])
        return summary


def say_round(row: dict[str, Any], record: RoundRecord, rounds: int, rows: Sequence[dict[str, Any]]) -> None:
    """``round   3/20  accuracy 0.6500  loss 1.4562  clients 10  1.14s  ETA 20s`` (``rows``: the rows so far)."""
    rnd = record.round
    acc = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
    loss = "-" if row["loss"] is None else f"{row['loss']:.4f}"
    total = record.replies + len(record.failures)
    line = (f"round {rnd:>3}/{rounds}  accuracy {acc}  loss {loss}  "
            f"clients {record.replies}{'/' + str(total) if record.failures else ''}  {row['seconds']:.2f}s")
    if "client_accuracy" in row:
        line += f"  client acc {row['client_accuracy']:.4f} (min {row['client_accuracy_min']:.4f})"
    done = [r for r in rows if r["round"] >= 1]
    if rnd >= 1 and rnd < rounds:  # rounds so far (with their observers) and this one
        per = (sum(r["seconds"] + r.get("observer_seconds", 0.0) for r in done) + row["seconds"]) / (len(done) + 1)
        line += f"  ETA {progress.duration(per * (rounds - rnd))}"
    progress.say(line)


def run_server(grid: Grid, cfg: dict[str, Any], out: Path | None, observers: Sequence[Observer] | None = None,
               progress: bool = True, *, stop: StopSignal | None = None,
               resume: Checkpoint | None = None, started_at: float | None = None) -> dict[str, Any]:
    """Run ``federation.rounds`` rounds on ``grid`` (after ``resume.round`` when resuming); write metrics,
    checkpoints, plot, summary and report to ``out``. ``started_at``: when the run was launched
    (``time.perf_counter()``), for the start-up time."""
    return Server(cfg, out, observers, progress, stop=stop, resume=resume).run(grid, started_at)
