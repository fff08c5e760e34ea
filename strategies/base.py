"""fedsim's strategy base: Flower's Message-API FedAvg plus the seams the papers need.

* **Deterministic sampling** by partition id: ``clients_per_round`` partitions drawn from
  (seed, round); the node-id -> partition-id map is learnt once by a ``query`` exchange.
* **Interception point**: every valid reply becomes a read-only ``ClientUpdate`` handed to the
  observers *before* aggregation. Observers get copies; they cannot change aggregation.
* **Server-side transforms**: ``prepare_arrays`` (the model before it is sent, e.g. accuracy-lossless
  perturbation) and ``finalize_arrays`` (the aggregate after it is received, e.g. random-matrix
  compensation). Subclasses override ``aggregate`` for a different aggregation rule.
* **Failures are recorded, not fatal**: error replies are logged to ``self.failures`` and the round
  aggregates what arrived.

Strategies never import ``attacks``; the curious server is just another observer.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fedsim.observers import ClientUpdate, Observer

log = logging.getLogger("fedsim")

PARTITION_KEY = "partition-id"
NUM_EXAMPLES_KEY = "num-examples"


def to_record(names: Sequence[str], arrays: Sequence[np.ndarray]) -> ArrayRecord:
    return ArrayRecord(OrderedDict((n, Array(np.ascontiguousarray(a))) for n, a in zip(names, arrays)))


def from_record(record: ArrayRecord) -> list[np.ndarray]:
    return record.to_numpy_ndarrays()


def sample_partitions(seed: int, round: int, partitions: Sequence[int], k: int) -> list[int]:
    """``k`` partitions (all when k <= 0), drawn from (seed, round) only."""
    from fedsim.training import derive_seed

    parts = sorted(partitions)
    if k <= 0 or k >= len(parts):
        return parts
    rng = np.random.default_rng(derive_seed(seed, round, 0x5A3))
    return sorted(rng.choice(parts, size=k, replace=False).tolist())


class FedsimStrategy(FlowerFedAvg):
    """Base of every fedsim strategy (a Flower ``Strategy``; runs under ``Strategy.start``)."""

    name = "fedavg"

    def __init__(self, *, param_names: Sequence[str], seed: int = 0, clients_per_round: int = 0,
                 observers: Sequence[Observer] = (), **_: Any) -> None:
        super().__init__(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=1, min_evaluate_nodes=0,
                         min_available_nodes=1, weighted_by_key=NUM_EXAMPLES_KEY)
        self.fraction_evaluate = 0.0  # the server evaluates centrally (set here: Flower warns in __init__)
        self.param_names = list(param_names)
        self.seed = seed
        self.clients_per_round = clients_per_round
        self.observers = list(observers)
        self.node_partition: dict[int, int] = {}
        self.failures: list[dict[str, Any]] = []
        self.round_info: dict[int, dict[str, Any]] = {}
        self._sent: dict[int, list[np.ndarray]] = {}
        self._recipe: dict[str, Any] = {}

    # ---- hooks for subclasses -------------------------------------------------------------
    def prepare_arrays(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """Transform the global model before it is sent (default: unchanged)."""
        return arrays

    def finalize_arrays(self, server_round: int, arrays: ArrayRecord, replies: list[Message]) -> ArrayRecord:
        """Transform the aggregate after it is received (default: unchanged)."""
        return arrays

    def aggregate(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregation rule (default: Flower's example-weighted FedAvg)."""
        return FlowerFedAvg.aggregate_train(self, server_round, replies)

    # ---- node discovery and sampling ------------------------------------------------------
    def discover(self, grid: Grid, timeout: float = 600) -> dict[int, int]:
        """Ask every node for its partition id (one ``query`` exchange)."""
        node_ids = list(grid.get_node_ids())
        msgs = [Message(RecordDict({"config": ConfigRecord({"what": PARTITION_KEY})}), dst_node_id=n,
                        message_type=MessageType.QUERY) for n in node_ids]
        mapping: dict[int, int] = {}
        for reply in grid.send_and_receive(msgs, timeout=timeout):
            if reply.has_error():
                self._record_failure(0, reply, "query")
                continue
            mapping[reply.metadata.src_node_id] = int(reply.content["metrics"][PARTITION_KEY])
        self.node_partition = mapping
        return mapping

    def sample_nodes(self, server_round: int) -> list[int]:
        by_part = {p: n for n, p in self.node_partition.items()}
        chosen = sample_partitions(self.seed, server_round, list(by_part), self.clients_per_round)
        return [by_part[p] for p in chosen]

    # ---- Flower Strategy API ----------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if not self.node_partition:
            self.discover(grid)
        arrays = self.prepare_arrays(server_round, arrays)
        node_ids = self.sample_nodes(server_round)
        config["server-round"] = server_round
        self._recipe = {k: config[k] for k in ("lr", "batch_size", "local_steps", "local_epochs") if k in config}
        sent = from_record(arrays)
        self._sent = {n: sent for n in node_ids}
        self.round_info[server_round] = {"sampled": [self.node_partition[n] for n in node_ids]}
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, node_ids, MessageType.TRAIN)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        # replies arrive in completion order; sort by partition so float sums (and runs) are reproducible
        replies = sorted(replies, key=lambda m: self.node_partition.get(m.metadata.src_node_id, -1))
        valid, errors = self._check_and_log_replies(replies, is_train=True)
        for e in errors:
            self._record_failure(server_round, e, "train")
        info = self.round_info.setdefault(server_round, {})
        info.update(replies=len(valid), failures=len(errors))
        for msg in valid:
            self._notify(server_round, msg)
        if not valid:
            return None, None
        arrays, metrics = self.aggregate(server_round, valid)
        if metrics is not None:
            info["train_metrics"] = dict(metrics)
        if arrays is not None:
            arrays = self.finalize_arrays(server_round, arrays, valid)
        return arrays, metrics

    # ---- internals ---------------------------------------------------------------------------
    def _notify(self, server_round: int, msg: Message) -> None:
        if not self.observers:
            return
        node = msg.metadata.src_node_id
        metrics = dict(msg.content["metrics"])
        upd = ClientUpdate.create(
            round=server_round, client_id=int(metrics.get(PARTITION_KEY, self.node_partition.get(node, -1))),
            node_id=node, global_weights=self._sent.get(node, []),
            weights=from_record(msg.content[self.arrayrecord_key]),
            num_examples=int(metrics[NUM_EXAMPLES_KEY]), recipe=self._recipe, metrics=metrics,
            param_names=self.param_names)
        for obs in self.observers:
            obs.observe(upd)

    def _record_failure(self, server_round: int, msg: Message, stage: str) -> None:
        node = msg.metadata.src_node_id
        reason = msg.error.reason if msg.error else "unknown"
        self.failures.append({"round": server_round, "stage": stage, "node": node,
                              "client": self.node_partition.get(node), "reason": str(reason)[-2000:]})
        log.warning("client %s failed in %s round %d: %s", self.node_partition.get(node, node), stage,
                    server_round, str(reason).splitlines()[-1] if reason else "")


def strategy_params(cls: type) -> dict[str, Any]:
    import inspect

    out = {}
    for klass in cls.__mro__:
        if klass is FedsimStrategy or not issubclass(klass, FedsimStrategy):
            continue
        for n, p in inspect.signature(klass.__init__).parameters.items():
            if p.kind == p.KEYWORD_ONLY and n not in ("param_names", "seed", "clients_per_round", "observers"):
                out.setdefault(n, p.default)
    return out


def check_params(cls: type, given: Mapping[str, Any]) -> None:
    allowed = strategy_params(cls)
    for k in given:
        if k not in allowed:
            raise ValueError(f"strategy.{k} is not a parameter of strategy {cls.name!r}; "
                             f"allowed: {sorted(allowed) or 'none'}")
