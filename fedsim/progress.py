"""Progress you can see: one-line messages and throttled progress of long loops, on stderr.

Every long path reports through this module: Ray and actor start-up, client discovery, rounds (with
an ETA), each attack (victim, iteration, current gradient distance), sweep variants (done/total,
ETA). Lines start with ``[fedsim]`` and end with a newline, so they show up in logs, pipes and
subprocesses as they happen (no carriage-return redraws).

Levels: :data:`QUIET` (nothing), :data:`NORMAL` (the default), :data:`VERBOSE` (also lets Flower's
and Ray's own logs through; the runner reads :func:`level`). The CLI's ``--quiet`` / ``--verbose``
set the process-wide level; :func:`suppressed` silences one thread's work (a run started with
``progress=False``).

Loops report with :func:`tick`, which goes to the innermost :func:`task` of the current thread (a
no-op when none is open), so an attack's iteration loop needs no reporter argument::

    with progress.task("idlg: client 3, round 1", total=300, unit="it"):
        for it in range(300):
            ...
            progress.tick(it + 1, distance=float(dist))

A task prints its first update, then at most one line every ``interval`` seconds
(``FEDSIM_PROGRESS_INTERVAL``, default 2 s), and a final line when it closes.

Every :func:`tick` is also a safe point for stopping: it calls :func:`fedsim.interrupt.poll`, which
raises :class:`~fedsim.interrupt.RunInterrupted` when the run this thread works for was asked to stop
(Ctrl-C, SIGTERM), whether or not a task is open or output is on.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
from typing import Any, Iterator, TextIO

from fedsim import interrupt

QUIET, NORMAL, VERBOSE = 0, 1, 2
PREFIX = "[fedsim]"

_level = NORMAL
_suppressed: contextvars.ContextVar[bool] = contextvars.ContextVar("fedsim_progress_suppressed", default=False)
_task: contextvars.ContextVar["Task | None"] = contextvars.ContextVar("fedsim_progress_task", default=None)


def set_level(level: int) -> None:
    """The process-wide level: QUIET (0), NORMAL (1) or VERBOSE (2)."""
    global _level
    if level not in (QUIET, NORMAL, VERBOSE):
        raise ValueError(f"progress level must be 0 (quiet), 1 (normal) or 2 (verbose), got {level!r}")
    _level = level


def level() -> int:
    return _level


def enabled() -> bool:
    """Whether progress lines are printed in this thread."""
    return _level > QUIET and not _suppressed.get()


def verbose() -> bool:
    """Whether Flower's and Ray's own logs should be let through."""
    return _level >= VERBOSE


@contextlib.contextmanager
def suppressed(on: bool = True) -> Iterator[None]:
    """No progress lines from this thread inside the block (when ``on``)."""
    token = _suppressed.set(True) if on else None
    try:
        yield
    finally:
        if token is not None:
            _suppressed.reset(token)


def _stream() -> TextIO:
    return sys.stderr


def say(message: str) -> None:
    """One progress line (``[fedsim] message``) on stderr, flushed."""
    if enabled():
        print(f"{PREFIX} {message}", file=_stream(), flush=True)


class OnceToStderr(logging.Handler):
    """fedsim's log records at WARNING and above as ``[fedsim] warning: ...`` lines on stderr, each distinct
    message once per process (a check that runs at config load, in the runner and in the server warns
    once), at every level: ``--quiet`` silences progress, not warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message in self.seen:
            return
        self.seen.add(message)
        print(f"{PREFIX} {record.levelname.lower()}: {message}", file=_stream(), flush=True)


def log_to_stderr(logger: str = "fedsim") -> None:
    """Send ``logger``'s warnings through :class:`OnceToStderr` (the CLI calls this; idempotent)."""
    log = logging.getLogger(logger)
    if not any(isinstance(h, OnceToStderr) for h in log.handlers):
        log.addHandler(OnceToStderr())


def interval() -> float:
    """Seconds between two lines of one task (``FEDSIM_PROGRESS_INTERVAL``, default 2)."""
    try:
        return max(0.0, float(os.environ.get("FEDSIM_PROGRESS_INTERVAL", "2")))
    except ValueError:
        return 2.0


def duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def eta(done: float, total: float, elapsed: float) -> float | None:
    """Remaining seconds at the mean rate so far (None before anything is done)."""
    if done <= 0 or total <= 0:
        return None
    return elapsed / done * max(total - done, 0)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Task:
    """Throttled progress of one loop (see the module docstring)."""

    def __init__(self, label: str, total: int | None = None, unit: str = "it", every: float | None = None):
        self.label, self.total, self.unit = label, total, unit
        self.every = interval() if every is None else every
        self.t0 = time.perf_counter()
        self._last: float | None = None
        self._first: tuple[float, int] | None = None  # (time, count) of the first update: the rate excludes warm-up
        self.done = 0
        self.info: dict[str, Any] = {}
        self.lines = 0

    def line(self, final: bool = False, stopped: bool = False) -> str:
        elapsed = time.perf_counter() - self.t0
        count = f"{self.unit} {self.done}" + (f"/{self.total}" if self.total else "")
        parts = [self.label, count]
        parts += [f"{k} {_fmt(v)}" for k, v in self.info.items()]
        if final:
            parts.append(f"{'stopped after' if stopped else 'done in'} {duration(elapsed)}")
        else:
            parts.append(duration(elapsed))
            if self.total and self._first is not None and self.done > self._first[1]:
                t1, d1 = self._first
                left = eta(self.done - d1, self.total - d1, time.perf_counter() - t1)
                parts.append(f"ETA {duration(left)}")
        return "  ".join(parts)

    def update(self, done: int, **info: Any) -> None:
        self.done = int(done)
        self.info = dict(info)  # what the latest update says (one loop may follow another in a task)
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, self.done)
        if self._last is None or now - self._last >= self.every:
            self._last = now
            self.lines += 1
            say(self.line())

    def close(self, stopped: bool = False) -> None:
        if self.lines:  # a loop that printed something says when it ended (or that it was stopped)
            say(self.line(final=True, stopped=stopped))


@contextlib.contextmanager
def task(label: str, total: int | None = None, unit: str = "it", every: float | None = None) -> Iterator[Task]:
    """Open a task for this thread; :func:`tick` inside the block updates it."""
    t = Task(label, total, unit, every)
    token = _task.set(t)
    stopped = False
    try:
        yield t
    except BaseException:
        stopped = True
        raise
    finally:
        _task.reset(token)
        t.close(stopped)


def tick(done: int, total: int | None = None, **info: Any) -> None:
    """Progress of the innermost open task of this thread (no-op when none is open or output is off).

    Loops that nest (an attack's restarts) pass their own ``total``; the task keeps the first one it
    was opened with unless it has none. Raises :class:`~fedsim.interrupt.RunInterrupted` when a stop
    was requested (:func:`fedsim.interrupt.poll`)."""
    interrupt.poll()
    t = _task.get()
    if t is None or not enabled():
        return
    if total is not None and not t.total:
        t.total = int(total)
    t.update(done, **info)


@contextlib.contextmanager
def heartbeat(message: str, every: float | None = None) -> Iterator[None]:
    """While the block runs (a blocking call with no progress of its own: Ray and actor start-up), print
    ``message (12s)`` every ``every`` seconds (default: 2.5 x :func:`interval`, at least 1 s)."""
    if not enabled():
        yield
        return
    period = max(1.0, 2.5 * interval()) if every is None else every
    stop = threading.Event()
    t0 = time.perf_counter()

    def beat() -> None:
        while not stop.wait(period):
            print(f"{PREFIX} {message} ({duration(time.perf_counter() - t0)})", file=_stream(), flush=True)

    thread = threading.Thread(target=beat, name="fedsim-progress-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
