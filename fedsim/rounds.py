"""The server's round engine and the typed record of what happened in a round.

:class:`RoundEngine` runs one federated round on a Flower ``Grid`` by composing the three seams of
:mod:`fedsim.seams` (aggregation rule, channel, server transforms):

1. the global model goes through the transforms' ``before_send`` and the channel's ``outgoing``;
2. the sampled clients (partitions drawn from (seed, round)) get a ``train`` message each;
3. error replies and unusable payloads become recorded failures (not fatal); every valid reply is
   shown to the observers (the interception point, before aggregation) through the channel's view;
4. the rule aggregates (through the channel), the transforms' ``after_aggregate`` run in reverse.

It returns the new global state and a :class:`RoundRecord`; evaluating, notifying observers of the
round's end, writing metrics and printing progress is the server loop's round-end step
(``fedsim.app.server``). The engine also discovers the nodes: it waits until every configured
client is registered and maps node ids to partition ids, so sampling can reach every partition.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedsim.observers import ClientUpdate, Observer
from fedsim.protocol import (
    ARRAYS,
    CLIENT_ID_KEYS,
    CONFIG,
    EVAL_ACCURACY,
    EVAL_LOSS,
    EVALUATE,
    EXTRAS,
    METRICS,
    NUM_EXAMPLES,
    PARTITION_ID,
    QUERY,
    TRAIN,
    recipe_of,
    train_config,
)
from fedsim.seams import AggregationRule, ChannelError, ServerChannel, ServerTransform
from fedsim.training import derive_seed

log = logging.getLogger("fedsim")


class DiscoveryError(RuntimeError):
    """Not every configured client could be reached."""


def sample_partitions(seed: int, round: int, partitions: Sequence[int], k: int) -> list[int]:
    """``k`` partitions (all when k <= 0), drawn from (seed, round) only."""
    parts = sorted(partitions)
    if k <= 0 or k >= len(parts):
        return parts
    rng = np.random.default_rng(derive_seed(seed, round, 0x5A3))
    return sorted(rng.choice(parts, size=k, replace=False).tolist())


class Reply:
    """One valid client reply as the server holds it; arrays are decoded once, on first use."""

    def __init__(self, message: Message, partition: int):
        self.message = message
        self.node_id = message.metadata.src_node_id
        self.partition = partition
        self.metrics: dict[str, Any] = dict(message.content[METRICS]) if METRICS in message.content else {}
        self.num_examples = int(self.metrics.get(NUM_EXAMPLES, 0))
        self._arrays: list[np.ndarray] | None = None
        self.extra: dict[str, Any] = {}  # what the channel parsed from the payload

    @property
    def arrays(self) -> list[np.ndarray]:
        if self._arrays is None:
            self._arrays = self.message.content[ARRAYS].to_numpy_ndarrays()
        return self._arrays


@dataclass
class RoundRecord:
    """What happened in one round (the strategy's account; the round-end step adds the evaluation)."""

    round: int
    sampled: list[int] = field(default_factory=list)  # partition ids sent a train message
    contributors: list[int] = field(default_factory=list)  # partition ids whose reply was aggregated
    failures: list[dict[str, Any]] = field(default_factory=list)  # this round's recorded failures
    train_metrics: dict[str, float] = field(default_factory=dict)  # example-weighted mean of the replies
    rule_metrics: dict[str, float] = field(default_factory=dict)
    transform_metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # by transform name
    channel_metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0  # training exchange + aggregation (+ evaluation, set by the round-end step)

    @property
    def replies(self) -> int:
        return len(self.contributors)

    def row(self) -> dict[str, Any]:
        """The round's items of a ``metrics.jsonl`` row."""
        out: dict[str, Any] = {"round": self.round, "replies": self.replies, "failures": len(self.failures)}
        out.update({k: v for k, v in self.train_metrics.items() if k not in CLIENT_ID_KEYS})
        out.update({f"strategy.{k}": v for k, v in self.rule_metrics.items()})
        out.update({f"channel.{k}": v for k, v in self.channel_metrics.items()})
        for name, m in self.transform_metrics.items():
            out.update({f"{name}.{k}": v for k, v in m.items()})
        return out


@dataclass
class RoundContext:
    """Handed to rules and transforms during a round: the grid, the channel, what was sent."""

    engine: "RoundEngine"
    grid: Grid
    round: int
    channel: ServerChannel
    config: ConfigRecord
    sent: list[np.ndarray] | None  # the plaintext model the clients received (None if encrypted)
    record: RoundRecord
    replies: list[Reply] = field(default_factory=list)  # the round's valid replies (what was aggregated)
    weights: list[float] | None = None  # the weights a weighted-sum rule used

    def exchange(self, messages: list[Message], stage: str) -> list[Reply]:
        """Send messages, return the valid replies (sorted by partition); failures are recorded."""
        return self.engine.exchange(self.grid, messages, stage, self.round, self.record)


class RoundEngine:
    """Runs rounds of one federation (see the module docstring)."""

    def __init__(self, cfg: Mapping[str, Any], param_names: Sequence[str], rule: AggregationRule,
                 channel: ServerChannel, transforms: Sequence[ServerTransform] = (),
                 observers: Sequence[Observer] = (), timeout: float | None = 3600.0,
                 fixed_partitions: Sequence[int] | None = None):
        self.cfg = cfg
        self.param_names = list(param_names)
        self.rule, self.channel, self.transforms = rule, channel, list(transforms)
        self.observers = list(observers)
        self.timeout = timeout
        self.fixed_partitions = list(fixed_partitions) if fixed_partitions is not None else None
        self.node_partition: dict[int, int] = {}
        self.partition_node: dict[int, int] = {}
        self.failures: list[dict[str, Any]] = []
        for c in (channel, rule, *self.transforms):
            c.setup(self.param_names, cfg)

    # ---- discovery ---------------------------------------------------------------------------------
    def discover(self, grid: Grid, wait: float = 120.0, poll: float = 0.05) -> dict[int, int]:
        """Wait until all ``federation.num_clients`` nodes are registered, then ask each for its
        partition id. Raises :class:`DiscoveryError` naming how many were found."""
        expected = int(self.cfg["federation"]["num_clients"])
        deadline = time.monotonic() + wait
        nodes = list(grid.get_node_ids())
        while len(nodes) < expected and time.monotonic() < deadline:
            time.sleep(poll)
            nodes = list(grid.get_node_ids())
        if len(nodes) < expected:
            raise DiscoveryError(f"only {len(nodes)} of federation.num_clients = {expected} client nodes registered "
                                 f"within {wait:.0f} s")
        msgs = [Message(RecordDict({CONFIG: ConfigRecord({"what": PARTITION_ID})}), dst_node_id=n,
                        message_type=QUERY) for n in nodes]
        mapping: dict[int, int] = {}
        record = RoundRecord(0)
        for reply in self._send(grid, msgs, "query", 0, record):
            mapping[reply.metadata.src_node_id] = int(reply.content[METRICS][PARTITION_ID])
        self.node_partition = mapping
        self.partition_node = {p: n for n, p in mapping.items()}
        missing = sorted(set(range(expected)) - set(self.partition_node))
        if missing:
            first = record.failures[0]["reason"].splitlines()[-1] if record.failures else "no failure recorded"
            raise DiscoveryError(f"{len(missing)} of {expected} partitions have no reachable node "
                                 f"(e.g. {missing[:5]}); first failure: {first}")
        return mapping

    # ---- sampling and exchanges --------------------------------------------------------------------
    def sample(self, server_round: int) -> list[int]:
        if self.fixed_partitions is not None:
            return list(self.fixed_partitions)
        return sample_partitions(self.cfg["seed"], server_round, list(self.partition_node),
                                 int(self.cfg["federation"]["clients_per_round"]))

    def _send(self, grid: Grid, messages: list[Message], stage: str, server_round: int,
              record: RoundRecord) -> list[Message]:
        """send_and_receive; error replies recorded as failures; every message must be answered."""
        replies = list(grid.send_and_receive(messages, timeout=self.timeout))
        if len(replies) < len(messages):
            got = {r.metadata.src_node_id for r in replies}
            lost = [self.node_partition.get(m.metadata.dst_node_id, m.metadata.dst_node_id)
                    for m in messages if m.metadata.dst_node_id not in got]
            raise RuntimeError(f"round {server_round} ({stage}): {len(messages)} messages sent, "
                               f"{len(replies)} replies received; no reply from clients {lost[:10]}")
        valid = []
        for r in replies:
            if r.has_error():
                self.record_failure(record, server_round, r.metadata.src_node_id, stage,
                                    r.error.reason if r.error else "unknown")
            else:
                valid.append(r)
        return valid

    def exchange(self, grid: Grid, messages: list[Message], stage: str, server_round: int,
                 record: RoundRecord) -> list[Reply]:
        valid = self._send(grid, messages, stage, server_round, record)
        # replies arrive in completion order; sort by partition so float sums (and runs) are reproducible
        out = sorted((Reply(m, self.node_partition.get(m.metadata.src_node_id, -1)) for m in valid),
                     key=lambda r: r.partition)
        return out

    def record_failure(self, record: RoundRecord, server_round: int, node: int, stage: str, reason: Any) -> None:
        f = {"round": server_round, "stage": stage, "node": node, "client": self.node_partition.get(node),
             "reason": str(reason)[-2000:]}
        record.failures.append(f)
        self.failures.append(f)
        log.warning("client %s failed in %s round %d: %s", self.node_partition.get(node, node), stage,
                    server_round, str(reason).splitlines()[-1] if reason else "")

    def messages(self, nodes: Iterable[int], content: RecordDict, message_type: str) -> list[Message]:
        return [Message(content=content, dst_node_id=n, message_type=message_type) for n in nodes]

    # ---- one round -----------------------------------------------------------------------------------
    def run_round(self, grid: Grid, server_round: int, state: Any) -> tuple[Any, RoundRecord]:
        record = RoundRecord(server_round)
        sent = self.channel.plaintext(state)
        if sent is not None and self.transforms:
            for t in self.transforms:
                sent = t.before_send(server_round, sent)
            state_out = self.channel.initial(sent)
        else:
            state_out = state
        config = train_config(self.cfg, server_round)
        self.rule.configure_train(server_round, config)
        content = RecordDict({CONFIG: config, **self.channel.outgoing(state_out)})
        for t in self.transforms:
            for k, v in t.message_extras(server_round).items():
                content[k] = v
        record.sampled = self.sample(server_round)
        nodes = [self.partition_node[p] for p in record.sampled]
        ctx = RoundContext(self, grid, server_round, self.channel, config, sent, record)
        replies = []
        for r in ctx.exchange(self.messages(nodes, content, TRAIN), "train"):
            try:
                self.channel.accept(r)
            except ChannelError as exc:
                self.record_failure(record, server_round, r.node_id, "train", f"ChannelError: {exc}")
                continue
            replies.append(r)
        ctx.replies = replies
        self._notify(server_round, replies, sent, config)
        record.contributors = [r.partition for r in replies]
        if not replies:
            return state, record
        record.train_metrics = dict(aggregate_metricrecords(
            [RecordDict({METRICS: r.message.content[METRICS]}) for r in replies], NUM_EXAMPLES))
        new_state = self.rule.aggregate(ctx, replies)
        record.rule_metrics = dict(self.rule.metrics())
        if self.transforms:
            arrays = self.channel.plaintext(new_state)
            for t in reversed(self.transforms):
                arrays = t.after_aggregate(ctx, arrays)
                record.transform_metrics[t.name] = dict(t.metrics())
            new_state = self.channel.initial(arrays)
        record.channel_metrics = dict(self.channel.metrics())
        return new_state, record

    def _notify(self, server_round: int, replies: list[Reply], sent: list[np.ndarray] | None,
                config: ConfigRecord) -> None:
        if not self.observers:
            return
        recipe = recipe_of(config)
        for r in replies:
            view = self.channel.client_view(r)
            extras = (lambda m=r.message: {k: a.numpy() for k, a in m.content[EXTRAS].items()}) \
                if EXTRAS in r.message.content else None
            upd = ClientUpdate(round=server_round, client_id=r.partition, node_id=r.node_id,
                               global_weights=sent if sent is not None else (), num_examples=r.num_examples,
                               recipe=recipe, metrics=r.metrics, param_names=self.param_names, extras=extras,
                               **view)
            for obs in self.observers:
                obs.observe(upd)

    # ---- evaluation by a client (when the server cannot read the model) ------------------------------
    def evaluate_remote(self, grid: Grid, server_round: int, state: Any, record: RoundRecord,
                        partitions: Sequence[int]) -> tuple[float, float, int] | None:
        """Ask the first of ``partitions`` that answers to evaluate the global state on the common test
        split; returns (loss, accuracy, partition) or None if none could."""
        config = train_config(self.cfg, server_round)
        content = RecordDict({CONFIG: config, **self.channel.outgoing(state)})
        for p in partitions:
            replies = self.exchange(grid, self.messages([self.partition_node[p]], content, EVALUATE), "evaluate",
                                    server_round, record)
            if replies:
                m = replies[0].metrics
                return float(m[EVAL_LOSS]), float(m[EVAL_ACCURACY]), p
        return None
