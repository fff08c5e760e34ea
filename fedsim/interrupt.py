"""Clean interruption of a run: the first Ctrl-C (SIGINT) or SIGTERM stops it at the next safe point.

:class:`StopSignal` is what the runner installs as the handler of SIGINT and SIGTERM while a run is in
progress. The first signal *requests* a stop:

* when the server loop runs in the main thread (the in-process backend), the handler raises
  :class:`RunInterrupted` right there - in the middle of a client's local training if need be - unless
  the server is inside a :meth:`StopSignal.shielded` section (the round-end step that appends the
  metrics row and writes the checkpoint), in which case it is raised when the section ends;
* when the server loop runs in another thread (the ServerApp thread of Flower's simulation engine on
  Ray), the handler only sets the flag; the server loop raises :class:`RunInterrupted` itself at the
  next safe point (:meth:`StopSignal.check`: while it waits for client replies, between rounds,
  between observers).

Long loops that run in the server's thread - the curious server's attacks, which run between two
rounds and can take minutes - are safe points too: :func:`poll` raises :class:`RunInterrupted` when the
stop watched by the current thread (:meth:`StopSignal.watching`, which the server loop opens) was
requested. :func:`fedsim.progress.tick` calls it, so every loop that reports progress stops within one
iteration of a Ctrl-C, also on Ray, without the loop knowing the run.

Either way the server then writes ``summary.json`` with ``status = "interrupted"`` and the last
completed round, and the runner shuts the federation down. A second signal aborts at once
(``os._exit``), without a summary - unless it comes within :data:`REPEAT_WINDOW` seconds of the first:
that is the same stop delivered twice (GNU ``timeout`` signals its child, then the child's whole
process group; batch schedulers and a terminal's Ctrl-C signal process groups too), and counts as one.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: seconds after the first stop signal during which another one is the same stop delivered again
#: (to the process, then to its process group), not a request to abort
REPEAT_WINDOW = 1.0
_watched: contextvars.ContextVar["StopSignal | None"] = contextvars.ContextVar("fedsim_stop", default=None)


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by SIGINT or SIGTERM (a ``KeyboardInterrupt``, so ``except Exception`` in
    client or Flower code does not swallow it)."""

    def __init__(self, signame: str = "SIGINT", completed_round: int | None = None, *,
                 before_first_round: bool = False):
        super().__init__(signame)
        self.signame = signame
        self.completed_round = completed_round
        #: a run stopped before its first round (round 0, the initial evaluation) was recorded: during
        #: start-up (Ray, discovery, the channel's setup); its folder holds no round to continue from
        self.before_first_round = before_first_round and completed_round is None

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + int(getattr(signal, self.signame, signal.SIGINT))

    def __str__(self) -> str:
        done = f" after round {self.completed_round}" if self.completed_round is not None else (
            " before any round completed" if self.before_first_round else "")
        return f"interrupted by {self.signame}{done}"


class StopSignal:
    """A stop request shared by the signal handler, the server loop and the runner."""

    clock = staticmethod(time.monotonic)  # when a signal arrives (tests replace it)

    def __init__(self, notice: str = "stopping after the last completed round") -> None:
        self.notice = notice  # what the first signal's line says is happening
        self.signame: str | None = None
        self.server_thread: int | None = None
        self._shield = 0
        self._pending = False
        self._previous: dict[int, Any] = {}
        self._first_at = 0.0  # clock() of the first signal

    # ---- state -------------------------------------------------------------------------------------
    @property
    def requested(self) -> bool:
        return self.signame is not None

    def request(self, signame: str = "SIGINT") -> None:
        """Request a stop (what the first signal does; tests call it directly)."""
        if self.signame is None:
            self.signame = signame

    def bind_current_thread(self) -> None:
        """The server loop runs in this thread (the handler raises in it only if it is the main thread)."""
        self.server_thread = threading.get_ident()

    def check(self) -> None:
        """A safe point: raise :class:`RunInterrupted` if a stop was requested (and not shielded)."""
        if self.signame is not None and self._shield == 0:
            raise RunInterrupted(self.signame)

    @contextlib.contextmanager
    def watching(self) -> Iterator["StopSignal"]:
        """While the block runs, :func:`poll` in this thread checks this stop (loops deep inside the
        server's work - attacks - stop at their next iteration without a reference to the run)."""
        token = _watched.set(self)
        try:
            yield self
        finally:
            _watched.reset(token)

    @contextlib.contextmanager
    def shielded(self, raise_pending: bool = True) -> Iterator[None]:
        """A section the first signal does not break into; a stop requested inside is raised at its end
        (``raise_pending``), or only recorded (the run's last step: it completes)."""
        self._shield += 1
        try:
            yield
        finally:
            self._shield -= 1
        if self._pending and self._shield == 0:
            self._pending = False
            if raise_pending:
                raise RunInterrupted(self.signame or "SIGINT")

    # ---- the handler ---------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signame is not None:
            if self.clock() - self._first_at < REPEAT_WINDOW:
                return  # the first stop again (delivered to the process group too): one stop
            print(f"\nfedsim: {name} again: aborting without a summary", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signame, self._first_at = name, self.clock()
        print(f"\nfedsim: {name}: {self.notice} (again to abort)",
              file=sys.stderr, flush=True)
        in_server = self.server_thread == threading.get_ident()
        if in_server:
            if self._shield:
                self._pending = True
            else:
                raise RunInterrupted(name)

    def install(self) -> None:
        """Install the handler for SIGINT and SIGTERM (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            prev = signal.signal(s, self._handle)
            self._previous.setdefault(s, prev)

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()


def poll() -> None:
    """A safe point for any long loop: raise :class:`RunInterrupted` if the stop this thread watches
    (:meth:`StopSignal.watching`) was requested and is not shielded; a no-op when none is watched."""
    stop = _watched.get()
    if stop is not None:
        stop.check()


@contextlib.contextmanager
def handle_signals(stop: StopSignal) -> Iterator[StopSignal]:
    """SIGINT and SIGTERM request ``stop`` while the block runs; the previous handlers come back after."""
    stop.install()
    try:
        yield stop
    finally:
        stop.restore()
