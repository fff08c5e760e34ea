"""Flower's SecAgg+ as a channel, server half: ``[channel] name = "secagg+"``.

The round's training exchange is Flower's own protocol (``flwr.server.workflow.SecAggPlusWorkflow``,
Bell et al. 2020's SecAgg+ as implemented in Flower 1.41; nothing here masks or unmasks anything):

* ``train_exchange`` builds a ``flwr.server.LegacyContext`` around the round (the global model under
  ``parameters``, the round under ``config``) with a legacy ``Strategy`` adapter whose
  ``configure_fit`` targets exactly the engine's sampled partitions (the ``FitIns`` carry fedsim's train
  ``ConfigRecord`` and the global arrays) and whose ``aggregate_fit`` captures the unmasked aggregate,
  the contributors, their example counts and metrics;
* the workflow runs its four stages on a view of the round's grid (``ProtocolGrid``; the workflow's pieces
  are in ``channels/secagg/workflow.py``) that adds fedsim's ``CONFIG`` record to every message (the ClientApp needs the config to know the channel),
  the channel's settings and the transforms' extras to the ``collect_masked_vectors`` message (the one
  that trains), records each client's failures and simulates the configured dropouts;
* the clients' half (``channels/secagg/client.py``) runs Flower's ``secaggplus_mod`` around fedsim's own local
  training; each client uploads ``[w, w * params]`` quantized and masked, with ``w`` its example count
  over ``max_weight``: the unmasked result is FedAvg's example-weighted mean (up to the quantization).

The server sees one aggregate per round: ``train_exchange`` returns a single :class:`fedsim.replies.Reply`
standing for every contributor (``Reply.contributors``; its ``partition`` is ``AGGREGATE`` = -1), and
observers get it as a ``ClientUpdate`` of kind ``"aggregate"``. What the server still learns: the
aggregate, who contributed, each contributor's example count and training metrics (Flower's FitRes
metrics travel in the clear), and who dropped out when (docs/secagg.md).

Dropouts (``dropout_fraction`` / ``dropout_clients`` at ``dropout_stage``, in ``dropout_rounds``): a
dropped client gets no message from that stage on, exactly as if it had vanished. Flower recovers the
masks of clients that drop after sharing their keys from the survivors' Shamir shares; with fewer than
``reconstruction_threshold`` survivors in a neighbourhood the protocol halts, every sampled client is
recorded as failed and the server stops or goes on with the global model unchanged (``on_failure``).
"""
from __future__ import annotations

import json
import random
import time
from typing import Annotated, Any, Mapping, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import Stage
from flwr.server import LegacyContext
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from fedsim.components import CHANNELS
from fedsim.params import CountOrFraction, OneOf, Range, Satisfies
from fedsim.protocol import (
    ARRAYS,
    CLIPPED,
    CONFIG,
    METRICS,
    TRAIN,
    arrays_record,
)
from fedsim.replies import ChannelError, ModelSpec, Reply
from fedsim.seams import EXAMPLE_WEIGHTED_MEAN, PLAINTEXT_AGGREGATE, RoundContext, ServerChannel
from fedsim.seeding import derive_seed

from .client import SecAggPlusClientChannel
from .workflow import (
    STAGES,
    ProtocolGrid,
    RoundStrategy,
    Workflow,
    aggregate_metrics,
    as_model,
    fmt,
)

AGGREGATE = -1  # the partition id of a reply that stands for several clients

NUM_SHARES = CountOrFraction(3, of="the round's clients", odd=True, why=(
    "with an even number Flower 1.41's SecAgg+ builds neighbourhoods one larger than the shares it makes, "
    "every client fails with an IndexError and the run still exits 0"))
THRESHOLD = CountOrFraction(2, of="num_shares", why="one share must not reveal a secret")


def _power_of_two(v: int) -> bool:
    return 4 <= v <= 2 ** 32 and not v & (v - 1)


def _ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v)


def _rounds(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in v)


@CHANNELS.register
class SecAggPlusChannel(ServerChannel):
    """Flower's SecAgg+ (parameters as Flower's ``SecAggPlusWorkflow``, plus dropouts and the failure
    policy; docs/secagg.md):

    * ``num_shares``: an odd integer >= 3 (each client's secrets are split among itself and
      ``num_shares - 1`` neighbours), or a fraction in (0, 1] of the round's clients;
    * ``reconstruction_threshold``: an integer >= 2 below ``num_shares`` (shares needed to recover a
      secret), or a fraction in (0, 1] of ``num_shares``;
    * ``clipping_range``, ``quantization_range``, ``modulus_range``: each client's weighted model is
      clipped to [-c, c] and quantized to ``quantization_range`` levels, masks live modulo
      ``modulus_range``;
    * ``max_weight``: the largest example count a client may have (its weight is count / max_weight);
    * ``timeout``: seconds to wait for each stage's replies (unset: the engine's timeout);
    * ``on_failure``: ``"stop"`` or ``"continue"`` after a round that produced no aggregate;
    * ``dropout_fraction`` / ``dropout_clients`` / ``dropout_stage`` / ``dropout_rounds``: simulated
      dropouts (a share of the round's clients drawn from (seed, round), and/or these partition ids;
      at one of Flower's stages ``setup``, ``share_keys``, ``collect_masked_vectors``, ``unmask``; in
      these rounds, unset: every round).
    """

    name = "secagg+"
    client = SecAggPlusClientChannel
    stateless = True  # every round runs the whole protocol afresh
    provides = frozenset({EXAMPLE_WEIGHTED_MEAN, PLAINTEXT_AGGREGATE})

    def __init__(self, num_shares: Annotated[int | float, NUM_SHARES] = 3,
                 reconstruction_threshold: Annotated[int | float, THRESHOLD] = 2,
                 clipping_range: Annotated[float, Range(0, open_low=True)] = 8.0,
                 quantization_range: Annotated[int, Range(2, 2 ** 31, open_high=True, why="Flower quantizes to int32")] = 2 ** 22,
                 modulus_range: Annotated[int, Satisfies(_power_of_two, "a power of 2 in [4, 2^32]")] = 2 ** 32,
                 max_weight: Annotated[float, Range(0, open_low=True)] = 1000.0,
                 timeout: Annotated[float | None, Range(0, open_low=True)] = None,
                 on_failure: Annotated[str, OneOf("stop", "continue")] = "stop",
                 dropout_fraction: Annotated[float, Range(0, 1, open_high=True)] = 0.0,
                 dropout_clients: Annotated[list[int] | None, Satisfies(_ids, "a list of partition ids")] = None,
                 dropout_stage: Annotated[str, OneOf(*STAGES)] = Stage.COLLECT_MASKED_VECTORS,
                 dropout_rounds: Annotated[list[int] | None, Satisfies(_rounds, "a list of round numbers >= 1 "
                                                                                 "(unset: every round)")] = None):
        # (the limits between parameters are checked in validate_config)
        clients = [] if dropout_clients is None else dropout_clients
        rounds = dropout_rounds
        self.num_shares, self.threshold = num_shares, reconstruction_threshold
        self.clipping_range, self.quantization_range = float(clipping_range), int(quantization_range)
        self.modulus_range, self.max_weight = int(modulus_range), float(max_weight)
        self.timeout, self.on_round_failure = timeout, on_failure
        self.dropout_fraction, self.dropout_clients = float(dropout_fraction), sorted(set(clients))
        self.dropout_stage, self.dropout_rounds = dropout_stage, rounds
        self._metrics: dict[str, float] = {}

    # ---- configuration --------------------------------------------------------------------------------
    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        if isinstance(self.threshold, int) and isinstance(self.num_shares, int) and self.threshold >= self.num_shares:
            raise ValueError(f"channel.reconstruction_threshold ({self.threshold}) must be below "
                             f"channel.num_shares ({self.num_shares})")
        if self.modulus_range <= self.quantization_range:
            raise ValueError(f"channel.modulus_range must be a power of 2 above quantization_range and at most "
                             f"2^32, got {self.modulus_range}")
        per_node = int(cfg.get("simulation", {}).get("clients_per_node", 1) or 1)
        if per_node > 1:
            raise ValueError(f"simulation.clients_per_node = {per_node} is not supported: Flower's SecAgg+ "
                             "addresses nodes, and virtual clients share one (use clients_per_node = 1)")
        fed = cfg["federation"]
        n = int(fed["clients_per_round"] or fed["num_clients"])
        if n < 2:
            raise ValueError(f"SecAgg+ needs at least 2 clients per round (federation.clients_per_round / "
                             f"num_clients give {n}): the sum of one client is that client's model")
        if isinstance(self.threshold, int):
            neighbours = min(self.num_shares, n) if isinstance(self.num_shares, int) else n
            if self.threshold > neighbours:
                raise ValueError(f"channel.reconstruction_threshold ({self.threshold}) exceeds the {neighbours} "
                                 f"clients that can hold a share in a round of {n}: every round would fail")
        if n * self.quantization_range >= self.modulus_range:
            raise ValueError(f"channel.quantization_range ({self.quantization_range}) x {n} clients per round "
                             f"must stay below channel.modulus_range ({self.modulus_range}): the sum would wrap")
        bad = [c for c in self.dropout_clients if c >= int(fed["num_clients"])]
        if bad:
            raise ValueError(f"channel.dropout_clients {bad} are not partition ids (0..{fed['num_clients'] - 1})")
        largest = self._largest_partition(cfg)
        if largest is not None and largest > self.max_weight:
            raise ValueError(f"channel.max_weight ({fmt(self.max_weight)}) is below the largest client's example "
                             f"count ({largest}): its weight would exceed 1 and its model be clipped")

    @staticmethod
    def _largest_partition(cfg: Mapping[str, Any]) -> int | None:
        from fedsim.factories import partitions_for

        try:
            return max(len(p) for p in partitions_for(cfg))
        except Exception:  # noqa: BLE001 - the dataset is not loadable here: each client checks at run time
            return None

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.names = list(param_names)
        # what the client half needs: the quantizer's settings, and the names legacy Parameters lack
        self.codec = json.dumps({"clipping_range": self.clipping_range, "quantization_range": self.quantization_range,
                                 "max_weight": self.max_weight, "names": self.names}, sort_keys=True)

    def dropouts(self, server_round: int, partitions: Sequence[int]) -> dict[int, str]:
        """Partition -> stage for this round's simulated dropouts (a pure function of seed and round)."""
        if self.dropout_rounds is not None and server_round not in self.dropout_rounds:
            return {}
        chosen = {p for p in self.dropout_clients if p in partitions}
        k = int(round(self.dropout_fraction * len(partitions)))
        if k:
            rng = np.random.default_rng(derive_seed(self.cfg["seed"], server_round, 0xD5))
            chosen |= {int(p) for p in rng.choice(sorted(partitions), size=k, replace=False)}
        return {p: self.dropout_stage for p in sorted(chosen)}

    # ---- the round --------------------------------------------------------------------------------------
    def outgoing(self, state: list[np.ndarray]) -> dict[str, Any]:
        return {ARRAYS: arrays_record(self.names, state)}

    def train_exchange(self, ctx: RoundContext, partitions: list[int], content: RecordDict) -> list[Reply]:
        t0 = time.perf_counter()
        engine = ctx.engine
        node_partition = {engine.partition_node[p]: p for p in sorted(partitions)}
        dropped = self.dropouts(ctx.round, partitions)
        grid = ProtocolGrid(ctx, node_partition, content, dropped, codec=self.codec, max_weight=self.max_weight,
                            modulus_range=self.modulus_range)
        run_id = getattr(getattr(ctx.grid, "run", None), "run_id", 0) or 0
        proxies = [GridClientProxy(n, grid, run_id) for n in node_partition]  # sorted by partition
        strategy = RoundStrategy(proxies, content[CONFIG])
        state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: int(ctx.round)}),
                            MAIN_PARAMS_RECORD: ArrayRecord(dict(content[ARRAYS].items()))})
        legacy = LegacyContext(Context(run_id=run_id, node_id=0, node_config={}, state=state, run_config={}),
                               strategy=strategy)
        workflow = Workflow(self.num_shares, self.threshold, max_weight=self.max_weight,
                             clipping_range=self.clipping_range, quantization_range=self.quantization_range,
                             modulus_range=self.modulus_range,
                             timeout=self.timeout if self.timeout is not None else engine.timeout)
        saved = random.getstate()  # the workflow shuffles the nodes into neighbourhoods with `random`
        random.seed(derive_seed(self.cfg["seed"], ctx.round, 0x5EC))
        broke = None
        try:
            workflow(grid, legacy)
        except Exception as exc:  # noqa: BLE001 - a client's reply Flower's protocol could not use
            broke = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            strategy.parameters = None
        finally:
            random.setstate(saved)
        seconds = time.perf_counter() - t0
        if strategy.parameters is None or not strategy.results:
            self._halted(ctx, grid, workflow, partitions, broke)
            return []
        contributors = sorted(node_partition[proxy.node_id] for proxy, _ in strategy.results)
        arrays = as_model(parameters_to_ndarrays(strategy.parameters), ctx.sent)
        metrics = aggregate_metrics([res for _, res in strategy.results])
        reply = Reply(Message(RecordDict({ARRAYS: arrays_record(self.names, arrays),
                                          METRICS: MetricRecord(metrics)}),
                              dst_node_id=0, message_type=TRAIN), AGGREGATE)
        reply.node_id = 0
        reply.contributors = contributors
        self._metrics = {"contributors": float(len(contributors)), "dropped": float(len(grid.failed)),
                         "messages": float(grid.messages), "protocol_seconds": seconds,
                         "clipped": float(metrics.get(CLIPPED, 0.0)),
                         **{f"{s}_seconds": v for s, v in grid.stage_seconds.items()}}
        return [reply]

    def _halted(self, ctx: RoundContext, grid: ProtocolGrid, workflow: Workflow, partitions: Sequence[int],
                broke: str | None = None) -> None:
        """No aggregate: every sampled client that has not failed already is recorded as not aggregated."""
        if broke is not None:  # e.g. shares that do not combine: the protocol cannot tell whose they were
            why = f"SecAgg+ protocol error in Flower's workflow ({broke})"
        elif workflow.last_check is not None:
            stage, fewest, t = workflow.last_check
            why = (f"SecAgg+ halted after the {stage} stage: a client has only {fewest} active neighbours and "
                   f"recovering its secrets needs reconstruction_threshold = {t}")
        else:
            why = "SecAgg+ halted before its first stage (fewer than 2 clients)"
        if grid.replied.get(Stage.UNMASK) is not None and broke is None:
            why = "SecAgg+ could not unmask the sum: fewer than reconstruction_threshold shares of some secret"
        survivors = [p for p in sorted(partitions) if p not in grid.failed]
        why += f" ({len(survivors)} of {len(partitions)} sampled clients left)"
        for p in survivors:
            grid._fail(p, ctx.engine.partition_node[p], "aggregate", f"not aggregated: {why}")
        self._metrics = {}

    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        """The unmasked aggregate (each client's masked vector was checked in the protocol, ProtocolGrid)."""
        if not reply.contributors:
            raise ChannelError("SecAgg+ gives the server only aggregates: a reply without contributors")
        reply.arrays = model.check_arrays(reply.record(ARRAYS), "the unmasked aggregate")

    def weighted_mean(self, replies: list[Reply], weights: Sequence[float]) -> list[np.ndarray]:
        """The unmasked aggregate: already the example-weighted mean of the contributors (the protocol
        weighted each by its example count). There is only ever one reply to 'combine'."""
        if len(replies) != 1 or not replies[0].contributors:
            raise RuntimeError(f"SecAgg+ gives one aggregate per round, got {len(replies)} replies")
        return [np.array(a) for a in replies[0].arrays]

    def plaintext(self, state: list[np.ndarray]) -> list[np.ndarray]:
        return state

    def client_view(self, reply: Reply) -> dict[str, Any]:
        return {"kind": "aggregate", "weights": lambda: reply.arrays, "contributors": list(reply.contributors)}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)
