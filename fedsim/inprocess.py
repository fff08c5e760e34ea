"""A small in-process Grid that calls the real ClientApp directly (tests and quick studies).

Each node has a persistent Flower ``Context`` (node_config ``partition-id``/``num-partitions`` as
in Flower's simulation engine), so client state across rounds, mods and message handling are the
real ones; only the transport and Ray are left out. Exceptions inside the ClientApp become error
replies, as in Flower's engine.
"""
from __future__ import annotations

import secrets
import traceback
import uuid
from typing import Any, Iterable

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedsim.protocol import NODE_NUM_PARTITIONS, NODE_PARTITION_ID


def delivered_copy(content: RecordDict) -> RecordDict:
    """What a transport would deliver: new records (a client cannot change the server's), sharing only
    the immutable serialised arrays (``Array.data`` is ``bytes``) instead of deep-copying them."""
    out = RecordDict()
    for key, rec in content.items():
        if isinstance(rec, ArrayRecord):
            out[key] = ArrayRecord(dict(rec.items()))
        elif isinstance(rec, (ConfigRecord, MetricRecord)):
            out[key] = type(rec)({k: list(v) if isinstance(v, list) else v for k, v in rec.items()})
        else:  # pragma: no cover - every record type is handled above
            raise TypeError(f"cannot deliver a {type(rec).__name__}")
    return out


class InProcessGrid(Grid):
    def __init__(self, client_app: ClientApp, num_nodes: int, run_id: int = 1):
        self.client_app = client_app
        # messages created in this process need a task identity, as run_simulation sets one
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
        ids = set()
        while len(ids) < num_nodes:  # random node ids, like the simulation engine
            ids.add(secrets.randbits(62) + 1)
        self.nodes = {nid: pid for pid, nid in enumerate(sorted(ids, key=lambda _: secrets.randbits(32)))}
        self.contexts = {nid: Context(run_id=run_id, node_id=nid,
                                      node_config={NODE_PARTITION_ID: pid, NODE_NUM_PARTITIONS: num_nodes},
                                      state=RecordDict(), run_config={}) for nid, pid in self.nodes.items()}
        self._replies: dict[str, Message] = {}
        self._run = None
        self.messages_sent: list[Message] = []  # every message pushed (tests inspect what was sent)
        self.replies_seen: list[Message] = []  # every reply produced (tests inspect what left the clients)

    def set_run(self, run) -> None:  # noqa: D401 - Grid API
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            # a copy, as a real transport would deliver: the server's records are never shared with a client
            msg = Message(delivered_copy(msg.content), dst_node_id=msg.metadata.dst_node_id,
                          message_type=msg.metadata.message_type, group_id=msg.metadata.group_id)
            msg.metadata.__dict__["_message_id"] = mid
            self.messages_sent.append(msg)
            ctx = self.contexts[msg.metadata.dst_node_id]
            try:
                reply = self.client_app(msg, ctx)
            except Exception as exc:  # noqa: BLE001 - mirrored as an error reply
                reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"),
                                reply_to=msg)
            self.replies_seen.append(reply)
            self._replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(m) for m in message_ids if m in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


class DelegatingGrid(Grid):
    """A Grid that forwards every call to ``self.inner``: wrappers (the run's stop-aware grid, a
    channel's protocol grid) subclass it and override only what they change."""

    inner: Grid

    def set_run(self, run: Any) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Any:
        return self.inner.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.inner.send_and_receive(messages, timeout=timeout)
