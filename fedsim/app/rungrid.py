"""The grid the server loop talks to: the engine's grid plus what a run needs around it."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable

from flwr.app import ConfigRecord, Message
from flwr.serverapp import Grid

from fedsim.inprocess import DelegatingGrid
from fedsim.interrupt import StopSignal
from fedsim.protocol import CHANNEL_SETUP, CONFIG, RESUMED_AT, STATE_MIRROR, TRAIN


class RunGrid(DelegatingGrid):
    """The grid the server loop talks to: the engine's grid plus what the run needs around it.

    * Waiting for replies polls the stop signal (a stop requested by SIGINT/SIGTERM while clients train
      raises :class:`~fedsim.interrupt.RunInterrupted` within one poll interval).
    * Train and channel-setup messages name the client-state mirror folder (runs that checkpoint) and,
      in a resumed run, the checkpointed round (:mod:`fedsim.checkpoint`).
    """

    def __init__(self, inner: Grid, stop: StopSignal, mirror: Path | None = None, resumed_at: int | None = None):
        self.inner, self.stop = inner, stop
        self.extra: dict[str, Any] = {}
        if mirror is not None:
            self.extra[STATE_MIRROR] = str(mirror)
            if resumed_at is not None:
                self.extra[RESUMED_AT] = int(resumed_at)

    def __getattr__(self, name: str) -> Any:  # pull_interval, contexts, messages_sent, ...
        return getattr(self.inner, name)

    def get_node_ids(self) -> Iterable[int]:
        self.stop.check()
        return self.inner.get_node_ids()

    def _augment(self, msg: Message) -> None:
        if self.extra and msg.metadata.message_type in (TRAIN, CHANNEL_SETUP) and CONFIG in msg.content:
            conf = msg.content[CONFIG]
            if any(k not in conf for k in self.extra):
                msg.content[CONFIG] = ConfigRecord({**dict(conf), **self.extra})

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self.stop.check()
        messages = list(messages)
        for m in messages:
            self._augment(m)
        return self.inner.push_messages(messages)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Flower's push-then-poll loop, with the stop signal checked between polls (grids that poll at a
        ``pull_interval``: the simulation engine's; others, such as the in-process grid that answers at
        once or a deployment's, send and receive as they do, and the stop is checked before sending)."""
        if not hasattr(self.inner, "pull_interval"):
            messages = list(messages)
            self.stop.check()
            for m in messages:
                self._augment(m)
            return self.inner.send_and_receive(messages, timeout=timeout)
        ids = set(self.push_messages(messages))
        end = time.monotonic() + (timeout if timeout is not None else 0.0)
        interval = float(self.inner.pull_interval)
        out: list[Message] = []
        while timeout is None or time.monotonic() < end:
            got = list(self.inner.pull_messages(ids))
            out.extend(got)
            ids.difference_update(m.metadata.reply_to_message_id for m in got)
            if not ids:
                break
            self.stop.check()
            time.sleep(interval)
        return out
