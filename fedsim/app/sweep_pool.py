"""``--jobs N``: a sweep's in-process runs on N worker processes at once.

Each run is independent (its own seed, folder and checkpoint), so a sweep of many runs on a machine with
many cores finishes about N times sooner. The workers are fresh (``spawn``) Python processes; each runs
one job at a time with the run's own ``simulation.threads`` torch threads (default 1), so a run computes
exactly what it computes in a sequential sweep: the same metrics, bit for bit (tested). Runs on Ray are
not given to the pool: Ray already spreads a run's clients over the cores, so the sweep runs them one
after another in its own process, after the pooled ones.

Progress: one line per finished run (``sweep k/N done: label (seed s) in 1m20s [...]``) with an ETA from
the wall time so far; the runs' own progress lines are off (N interleaved streams would be unreadable).

Stopping: the first SIGINT or SIGTERM to the sweep is passed on to the workers, whose runs stop at their
next safe point and write their checkpoints (as a single run does, :mod:`fedsim.interrupt`); a run still
starting up stops as a sequential sweep's does on Ctrl-C. No run starts after the stop, not even one a
worker had already taken from the pool's queue (a shared event, checked before each run). Re-running the
same command continues: complete runs are skipped, stopped ones resume. An idle worker ignores the signal
(a terminal's Ctrl-C reaches the whole process group).
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from fedsim import progress as prog
from fedsim.interrupt import SIGNALS as _SIGNALS
from fedsim.interrupt import RunInterrupted

#: (variant index, label, config, seed, run folder): one job of :func:`fedsim.app.sweep._jobs`
Job = tuple[int, str, dict, "int | None", Path]


def failed_row(label: str, seed: int | None, job_dir: Path, error: str, failed: list[str]) -> dict[str, Any]:
    """The table row of a run that failed (``error``: its first line is kept), noted in ``failed`` and said."""
    failed.append(label if seed is None else f"{label} (seed {seed})")
    row = {"variant": label, "status": "failed", "accuracy": None, "loss": None, "round_seconds": None,
           "run": job_dir.name, "error": error.splitlines()[0][:300] if error else ""}
    prog.say(f"sweep run {failed[-1]!r} failed: {row['error']}")
    return row


_stopped: Any = None  # in a worker: the pool's stop event (set by the sweep when it was asked to stop)


def _worker_init(stopped: Any) -> None:
    """Between runs a worker ignores SIGINT/SIGTERM (the run's own handler takes them while it runs)."""
    global _stopped
    _stopped = stopped
    for s in _SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    prog.log_to_stderr()


def _work(run_job: Callable[..., dict[str, Any]], label: str, cfg: dict, seed: int | None, job_dir: Path,
          resume_hint: tuple) -> tuple[dict[str, Any], list[str], list[Path]] | None:
    """One job in a worker: the row, the failures and the run folder, as the sequential sweep records them
    (``run_job``: :func:`fedsim.app.sweep._run_job`, passed by reference); None, without starting it, once
    the sweep was asked to stop (a job already handed to the worker's queue cannot be cancelled)."""
    if _stopped is not None and _stopped.is_set():
        return None
    # until the run installs its own handler (fedsim.interrupt), a stop ends its start-up as a Ctrl-C ends a
    # sequential sweep's: once (the signal may come twice, from the terminal and from the sweep)
    for s in _SIGNALS:
        signal.signal(s, _interrupt)
    try:
        failed: list[str] = []
        dirs: list[Path] = []
        row = run_job(label, cfg, seed, job_dir, False, resume_hint, failed, dirs)
        return row, failed, dirs
    finally:
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def _interrupt(signum: int, frame: Any) -> None:
    for s in _SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise RunInterrupted(signal.Signals(signum).name)


def run_pooled(jobs: Sequence[Job], todo: Sequence[int], workers: int,
               record: Callable[[int, dict[str, Any], list[Path]], None], failed: list[str],
               resume_hint: tuple, run_job: Callable[..., dict[str, Any]]) -> str | None:
    """Run ``jobs[k]`` for every ``k`` in ``todo`` on ``workers`` processes, each with
    ``run_job(label, cfg, seed, folder, progress, resume_hint, failed, run_dirs)`` (a module-level function:
    the workers import it); ``record(k, row, run_dirs)`` for each as it finishes (in this process, in completion order). Returns the name of the signal that stopped
    the pool (its running runs wrote their checkpoints), or None when every job ran."""
    if not todo:
        return None
    ctx = multiprocessing.get_context("spawn")
    stop: dict[str, Any] = {"signame": None}
    stopped = ctx.Event()
    pool = cf.ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx, initializer=_worker_init,
                                  initargs=(stopped,))

    def handle(signum: int, frame: Any) -> None:
        if stop["signame"] is not None:
            return
        stopped.set()  # before the workers hear of it: a job they pick up from now on does not start
        stop["signame"] = signal.Signals(signum).name
        prog.say(f"{stop['signame']}: stopping the running runs at their next safe point; no new run starts")
        for pid in list(getattr(pool, "_processes", {}) or {}):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, handle) for s in _SIGNALS} if main else {}
    t0 = time.perf_counter()
    done = 0
    try:
        futures = {pool.submit(_work, run_job, *jobs[k][1:], resume_hint): k for k in todo}
        prog.say(f"sweep: {len(todo)} run{'s' if len(todo) != 1 else ''} on {min(workers, len(todo))} worker "
                 "processes")
        pending = set(futures)
        while pending:
            finished, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            if stop["signame"] is not None:
                for f in pending:
                    f.cancel()
            for f in finished:
                k = futures[f]
                if f.cancelled():
                    continue
                _, label, _, seed, _ = jobs[k]
                try:
                    result = f.result()
                except KeyboardInterrupt as exc:  # the run was stopped (RunInterrupted): its checkpoint is
                    if stop["signame"] is None:  # written; a worker stopped on its own stops the sweep too
                        stopped.set()
                        stop["signame"] = getattr(exc, "signame", "SIGINT")
                        for other in pending:
                            other.cancel()
                    continue
                except Exception as exc:  # noqa: BLE001 - the worker died (killed, out of memory): this run failed
                    fails = []
                    result = (failed_row(label, seed, jobs[k][4], f"worker process failed: {type(exc).__name__}: "
                                         f"{exc}", fails), fails, [])
                if result is None:  # handed to a worker before the stop, not started
                    continue
                row, fails, dirs = result
                failed.extend(fails)
                record(k, row, dirs)
                done += 1
                elapsed = time.perf_counter() - t0
                left = len(todo) - done
                eta = f", ETA {prog.duration(prog.eta(done, len(todo), elapsed))}" if left and stop["signame"] is None else ""
                prog.say(f"sweep {done}/{len(todo)} done: {label}" + (f" (seed {seed})" if seed is not None else "")
                         + (f"  ({row.get('status')})" if row.get("status") == "failed" else "")
                         + f"  [{prog.duration(elapsed)}{eta}]")
            pending = {f for f in pending if not f.cancelled()}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for s, prev in previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
    return stop["signame"]
