"""The server's round engine and the typed record of what happened in a round.

:class:`RoundEngine` runs one federated round on a Flower ``Grid`` by composing the three seams of
:mod:`fedsim.seams` (aggregation rule, channel, server transforms):

1. the global model goes through the transforms' ``before_send`` and the channel's ``outgoing``;
2. the sampled clients (partitions drawn from (seed, round)) get a ``train`` message each;
3. every reply is checked before it is used (:class:`fedsim.replies.ReplyChecker`: the example count, the
   channel's payload check, the rule's and transforms' checks, the update norm bound); error replies and
   replies that fail a check become recorded failures (not fatal); every valid reply is shown to the
   observers (the interception point, before aggregation) through the channel's view;
4. the rule aggregates (through the channel), the transforms' ``after_aggregate`` run in reverse; a
   non-finite global model stops the run (:class:`NonFiniteModel`);
5. the channel's ``after_round`` (e.g. the Paillier channel sends the new aggregate ahead to the next
   round's clients).

It returns the new global state and a :class:`RoundRecord`; evaluating, notifying observers of the
round's end, writing metrics and printing progress is the server loop's round-end step
(``fedsim.app.server``). The engine also discovers the nodes: it waits until every configured
client is registered and maps node ids to partition ids, so sampling can reach every partition.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedsim.models.weights import get_weights
from fedsim.observers import ClientUpdate, Observer
from fedsim.privacy import PrivacyLedger
from fedsim.protocol import (
    CONFIG,
    ERROR,
    ERROR_REASON,
    EVAL_ACCURACY,
    EVAL_LOSS,
    EVAL_SOURCE_ACCURACY,
    EVALUATE,
    EXTRAS,
    HOSTED_PARTITIONS,
    METRICS,
    NUM_EXAMPLES,
    PARTITION_ID,
    PARTITIONS,
    QUERY,
    decode_arrays,
    for_partition,
    num_nodes,
    recipe_of,
    train_config,
)
from fedsim.replies import InvalidReply, ModelSpec, Reply, ReplyCheck, ReplyChecker
from fedsim.seams import AggregationRule, RoundContext, RoundRecord, ServerChannel, ServerTransform
from fedsim.seeding import derive_seed

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


def mean_metrics(replies: Sequence[Reply]) -> dict[str, Any]:
    """The replies' metrics, example-weighted (Flower's ``aggregate_metricrecords``). Flower sums
    ``value * (n_i / N)``, which turns a value every client reports alike into a neighbour (1 step into
    0.9999999999999999): a metric equal in every reply is that value, its type (an integer) kept."""
    out = dict(aggregate_metricrecords([RecordDict({METRICS: r.record(METRICS)}) for r in replies], NUM_EXAMPLES))
    for k in out:
        values = [r.metrics.get(k) for r in replies]
        if all(type(v) is type(values[0]) and v == values[0] for v in values) and not isinstance(values[0], list):
            out[k] = values[0]
    return out


class NonFiniteModel(RuntimeError):
    """The aggregated global model holds NaN or infinite values: the run stops (it never completes on it)."""


class RoundEngine:
    """Runs rounds of one federation (see the module docstring).

    Every reply is checked before it is used (``self.checks``, a :class:`fedsim.replies.ReplyChecker`: one
    mechanism for every channel); a reply that fails is its client's recorded failure. An aggregated global
    model that is not finite stops the run (:class:`NonFiniteModel`)."""

    def __init__(self, cfg: Mapping[str, Any], param_names: Sequence[str], rule: AggregationRule,
                 channel: ServerChannel, transforms: Sequence[ServerTransform] = (),
                 observers: Sequence[Observer] = (), timeout: float | None = 3600.0,
                 fixed_partitions: Sequence[int] | None = None, model: ModelSpec | None = None,
                 privacy: PrivacyLedger | None = None):
        self.cfg = cfg
        self.param_names = list(param_names)
        from fedsim.factories import dataset_for, model_for

        self.model = model if model is not None else ModelSpec.of(self.param_names, get_weights(model_for(cfg)))
        ds = dataset_for(cfg)
        # a client cannot hold more examples than the training set (unless the user says otherwise)
        max_examples = int(cfg["federation"].get("max_examples") or len(ds.y_train))
        self.checks = ReplyChecker(cfg, self.model, [channel, rule, *transforms], max_examples,
                                   max(max_examples, len(ds.y_test)))  # evaluation on the common test split
        self.rule, self.channel, self.transforms = rule, channel, list(transforms)
        self.observers = list(observers)
        self.privacy = privacy if privacy is not None else PrivacyLedger()
        self.timeout = timeout
        self.fixed_partitions = list(fixed_partitions) if fixed_partitions is not None else None
        self.clients_per_node = int(cfg.get("simulation", {}).get("clients_per_node", 1) or 1)
        self.virtual = self.clients_per_node > 1
        self.node_partitions: dict[int, list[int]] = {}
        self.partition_node: dict[int, int] = {}
        self.failures: list[dict[str, Any]] = []
        for c in (channel, rule, *self.transforms, *self.observers):
            setup = getattr(c, "setup", None)  # (an observer need not be a Component)
            if setup is not None:
                setup(self.param_names, cfg)

    # ---- discovery ---------------------------------------------------------------------------------
    WARMUP_QUERIES = 8  # discovery asks this many nodes before the others (see discover)

    def discover(self, grid: Grid, wait: float | None = None, poll: float = 0.05) -> dict[int, int]:
        """Wait until every node the federation needs is registered (at most ``wait`` seconds, default
        ``simulation.discovery_timeout``), then ask each which partitions it serves; every partition must
        be served. Raises :class:`DiscoveryError` naming what is missing. Returns the partition -> node map."""
        if wait is None:
            wait = float(self.cfg.get("simulation", {}).get("discovery_timeout", 120.0))
        clients = int(self.cfg["federation"]["num_clients"])
        expected = num_nodes(clients, self.clients_per_node)
        deadline = time.monotonic() + wait
        nodes = list(grid.get_node_ids())
        while len(nodes) < expected and time.monotonic() < deadline:
            time.sleep(poll)
            nodes = list(grid.get_node_ids())
        if len(nodes) < expected:
            raise DiscoveryError(f"only {len(nodes)} of the {expected} client nodes the federation needs "
                                 f"(federation.num_clients = {clients}, simulation.clients_per_node = "
                                 f"{self.clients_per_node}) registered within {wait:g} s "
                                 "(simulation.discovery_timeout)")
        content = RecordDict({CONFIG: train_config(self.cfg, 0)})
        record = RoundRecord(0)
        # A few nodes first, then the rest: the first messages wait while the engine starts its client
        # workers (Ray, the actors' imports), and Flower's simulation engine rescans every pending
        # message once per node while they wait (nodes x messages per pass, holding the interpreter).
        # Measured with 1,000 one-client nodes under load: 65 s for all at once, 12 s once warm.
        for batch in (nodes[:self.WARMUP_QUERIES], nodes[self.WARMUP_QUERIES:]):
            msgs = [Message(content, dst_node_id=n, message_type=QUERY) for n in batch]
            for reply in self._send(grid, msgs, "query", 0, record, {}) if msgs else ():
                m = reply.content[METRICS]
                hosted = [int(p) for p in m[HOSTED_PARTITIONS]] if HOSTED_PARTITIONS in m else [int(m[PARTITION_ID])]
                self.node_partitions[reply.metadata.src_node_id] = hosted
                for p in hosted:
                    self.partition_node[p] = reply.metadata.src_node_id
        missing = sorted(set(range(clients)) - set(self.partition_node))
        if missing:
            first = record.failures[0]["reason"].splitlines()[-1] if record.failures else "no failure recorded"
            raise DiscoveryError(f"{len(missing)} of {clients} partitions have no reachable node "
                                 f"(e.g. {missing[:5]}); first failure: {first}")
        return dict(self.partition_node)

    # ---- sampling and exchanges --------------------------------------------------------------------
    def sample(self, server_round: int) -> list[int]:
        if self.fixed_partitions is not None:
            return list(self.fixed_partitions)
        return sample_partitions(self.cfg["seed"], server_round, list(self.partition_node),
                                 int(self.cfg["federation"]["clients_per_round"]))

    def _send(self, grid: Grid, messages: list[Message], stage: str, server_round: int,
              record: RoundRecord, by_node: Mapping[int, list[int]]) -> list[Message]:
        """send_and_receive; error replies recorded as failures (of every partition the node was asked
        for), and so is every message not answered within ``federation.round_timeout`` (a node that
        died or lost its connection): the round goes on with the replies it has."""
        replies = list(grid.send_and_receive(messages, timeout=self.timeout))
        # a reply answers one message; error replies the SuperLink makes for a node it lost (deployment
        # engine: "Node Unavailable") carry the SuperLink's id as their source, so map by the message id
        dst = {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}
        if len(dst) < len(messages):  # a grid that does not id the messages it sends: sources only
            dst = {}
        answered = {dst.get(r.metadata.reply_to_message_id, r.metadata.src_node_id) for r in replies}
        for m in messages:
            node = m.metadata.dst_node_id
            if node in answered:
                continue
            for p in by_node.get(node) or [None]:
                self.record_failure(record, server_round, node, stage,
                                    f"no reply within federation.round_timeout = {self.timeout:g} s "
                                    "(the node stopped or lost its connection)", partition=p)
        valid = []
        for r in replies:
            if r.has_error():
                node = dst.get(r.metadata.reply_to_message_id, r.metadata.src_node_id)
                for p in by_node.get(node) or [None]:
                    self.record_failure(record, server_round, node, stage, r.error.reason if r.error else "unknown",
                                        partition=p)
            else:
                valid.append(r)
        return valid

    def send(self, grid: Grid, partitions: Sequence[int], message_type: str, shared: RecordDict,
             per_partition: Mapping[int, Mapping[str, Any]] | None, stage: str, server_round: int,
             record: RoundRecord, check: ReplyCheck | None = None) -> list[Reply]:
        """One message per node serving some of ``partitions``: the ``shared`` records, plus each
        partition's own records (suffixed ``@<partition>`` and listed under ``PARTITIONS`` when a node
        serves several). Returns the valid replies, one per partition, sorted by partition (replies
        arrive in completion order; sorting keeps float sums, and runs, reproducible): not an error, and
        passing ``check`` (a reply it raises :class:`InvalidReply` for is recorded as failed)."""
        per_partition = per_partition or {}
        by_node: dict[int, list[int]] = {}
        for p in sorted(partitions):
            by_node.setdefault(self.partition_node[p], []).append(p)
        messages = []
        for node, parts in by_node.items():
            if not self.virtual:
                own = per_partition.get(parts[0], {})
                content = shared if not own else RecordDict({**dict(shared.items()), **own})
            else:
                content = RecordDict()
                for k, v in shared.items():
                    content[k] = ConfigRecord({**dict(v), PARTITIONS: parts}) if k == CONFIG else v
                for p in parts:
                    for k, v in per_partition.get(p, {}).items():
                        content[for_partition(k, p)] = v
            messages.append(Message(content=content, dst_node_id=node, message_type=message_type))
        out = []
        for m in self._send(grid, messages, stage, server_round, record, by_node):
            parts = by_node[m.metadata.src_node_id]
            if not self.virtual:
                out.append(Reply(m, parts[0]))
                continue
            for p in parts:
                err = for_partition(ERROR, p)
                if err in m.content:
                    self.record_failure(record, server_round, m.metadata.src_node_id, stage,
                                        m.content[err][ERROR_REASON], partition=p)
                else:
                    out.append(Reply(m, p, "@" + str(p)))
        out = sorted(out, key=lambda r: r.partition)
        return out if check is None else self.accept(out, check, stage, server_round, record)

    # ---- checking replies ------------------------------------------------------------------------------
    def accept(self, replies: Sequence[Reply], check: ReplyCheck, stage: str, server_round: int,
               record: RoundRecord) -> list[Reply]:
        """The replies ``check`` passes; each one it raises :class:`InvalidReply` for is a recorded failure
        (of every client a reply stands for)."""
        out = []
        for r in replies:
            try:
                check(r)
            except InvalidReply as exc:
                for p in r.contributors or [r.partition]:
                    self.record_failure(record, server_round, r.node_id, stage, f"invalid reply: {exc}",
                                        partition=p)
                continue
            out.append(r)
        return out

    def check_global(self, server_round: int, state: Any) -> None:
        """Raise :class:`NonFiniteModel` if the new global model (when the server can read it) is not finite."""
        arrays = self.channel.plaintext(state)
        for name, a in zip(self.param_names, arrays or ()):
            a = np.asarray(a)
            if a.dtype.kind in "fc" and not np.isfinite(a).all():
                raise NonFiniteModel(f"round {server_round}: the aggregated global model holds non-finite values "
                                     f"in {name!r} (rule {self.rule.name!r}); the run stops with the model of the "
                                     "last completed round")

    def record_failure(self, record: RoundRecord, server_round: int, node: int, stage: str, reason: Any,
                       partition: int | None = None) -> None:
        f = {"round": server_round, "stage": stage, "node": node, "client": partition,
             "reason": str(reason)[-2000:]}
        record.failures.append(f)
        self.failures.append(f)
        log.warning("client %s failed in %s round %d: %s", partition if partition is not None else f"node {node}",
                    stage, server_round, str(reason).splitlines()[-1] if reason else "")

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
                if k in content and isinstance(v, ArrayRecord) and isinstance(content[k], ArrayRecord):
                    clash = set(v.keys()) & set(content[k].keys())
                    if clash:
                        raise RuntimeError(f"transforms send the same extra array twice: {sorted(clash)[:3]}")
                    v = ArrayRecord({**dict(content[k].items()), **dict(v.items())})
                content[k] = v
        record.sampled = self.sample(server_round)
        ctx = RoundContext(self, grid, server_round, self.channel, config, sent, record)
        replies = self.accept(self.channel.train_exchange(ctx, record.sampled, content),
                              lambda r: self.checks.check_reply(r, sent), "train", server_round, record)
        ctx.replies = replies
        self._notify(server_round, replies, sent, config)
        record.contributors = [p for r in replies for p in (r.contributors or [r.partition])]
        if not replies:
            record.privacy = self.privacy.row() if self.privacy else {}
            return state, record
        record.train_metrics = mean_metrics(replies)
        new_state = self.rule.aggregate(ctx, replies)
        record.rule_metrics = dict(self.rule.metrics())
        if self.transforms:
            arrays = self.channel.plaintext(new_state)
            for t in reversed(self.transforms):
                arrays = t.after_aggregate(ctx, arrays)
                record.transform_metrics[t.name] = dict(t.metrics())
            new_state = self.channel.initial(arrays)
        self.check_global(server_round, new_state)
        self.channel.after_round(ctx, new_state)
        record.channel_metrics = dict(self.channel.metrics())
        if self.privacy:  # after the rule: a central-DP rule has recorded this round's release
            record.privacy = self.privacy.after_round(server_round, record.contributors, config)
        return new_state, record

    def _notify(self, server_round: int, replies: list[Reply], sent: list[np.ndarray] | None,
                config: ConfigRecord) -> None:
        if not self.observers:
            return
        recipe = recipe_of(config)
        for r in replies:
            view = self.channel.client_view(r)
            extras = (lambda r=r: dict(zip(r.record(EXTRAS).keys(), decode_arrays(r.record(EXTRAS), False)))) \
                if r.has(EXTRAS) else None
            upd = ClientUpdate(round=server_round, client_id=r.partition, node_id=r.node_id,
                               global_weights=sent if sent is not None else (), num_examples=r.num_examples,
                               recipe=recipe, metrics=r.metrics, param_names=self.param_names, extras=extras,
                               **view)
            for obs in self.observers:
                obs.observe(upd)

    # ---- evaluation by a client (when the server cannot read the model) ------------------------------
    def evaluate_remote(self, grid: Grid, server_round: int, state: Any, record: RoundRecord,
                        partitions: Sequence[int]) -> tuple[float, float, int, list[float]] | None:
        """Ask the first of ``partitions`` that answers to evaluate the global state on the common test
        split; returns (loss, accuracy, partition, accuracy per test source - empty when the reply has
        none) or None if none could."""
        config = train_config(self.cfg, server_round)
        content = RecordDict({CONFIG: config, **self.channel.outgoing(state)})
        for p in partitions:
            replies = self.send(grid, [p], EVALUATE, content, None, "evaluate", server_round, record,
                                self.checks.check_evaluation)
            if replies:
                m = replies[0].metrics
                per = m.get(EVAL_SOURCE_ACCURACY) or []  # checked by check_evaluation
                return float(m[EVAL_LOSS]), float(m[EVAL_ACCURACY]), p, [float(a) for a in per]
        return None
