"""Flower's own Message-API strategies as fedsim aggregation rules, through one adapter.

``[strategy] name = "flwr-<strategy>"`` runs the aggregation of Flower's strategy object
(``flwr.serverapp.strategy``) on the round's replies; fedsim keeps doing everything else (sampling
from the seed, discovery, the channel, transforms, observers, evaluation, failures):

====================== ===================================== ==============================================
name                   Flower class                          parameters (from Flower's constructor)
====================== ===================================== ==============================================
``flwr-fedavg``        ``FedAvg``                            none
``flwr-fedprox``       ``FedProx`` (+ the clients' proximal) ``proximal_mu``
``flwr-fedavgm``       ``FedAvgM``                           ``server_learning_rate``, ``server_momentum``
``flwr-fedadam``       ``FedAdam``                           ``eta``, ``beta_1``, ``beta_2``, ``tau``
``flwr-fedyogi``       ``FedYogi``                           ``eta``, ``beta_1``, ``beta_2``, ``tau``
``flwr-fedadagrad``    ``FedAdagrad``                        ``eta``, ``tau``
``flwr-fedmedian``     ``FedMedian``                         none
``flwr-fedtrimmedavg`` ``FedTrimmedAvg``                     ``beta`` (share cut from each tail)
``flwr-krum``          ``Krum``                              ``num_malicious_nodes``
``flwr-multikrum``     ``MultiKrum``                         ``num_malicious_nodes``, ``num_nodes_to_select``
``flwr-bulyan``        ``Bulyan``                            ``num_malicious_nodes``
====================== ===================================== ==============================================

Each adapter's parameters are read from the Flower class's own ``__init__`` signature (names,
defaults, annotations), so fedsim's one validation mechanism (:mod:`fedsim.components`) checks them;
left out are what fedsim does itself (sampling: ``fraction_*``, ``min_*_nodes``), the record keys and
callables (fixed by the adapter), and FedOpt's ``eta_l`` (the clients' learning rate is ``train.lr``;
Flower only stores it). Ranges Flower does not check are checked here (``eta > 0``, ``beta_1`` in
[0, 1), ...), and ``validate_config`` refuses a federation too small for the rule (Krum:
``n >= 2f + 3`` clients per round, MultiKrum: ``num_nodes_to_select <= n``, Bulyan: ``n >= 4f + 3``).

Per round the adapter

1. adds the strategy's train-config keys: Flower's ``configure_train`` runs on a stateless probe
   instance and every key it puts in the ConfigRecord goes into the round's train config (FedProx's
   ``proximal-mu``, which fedsim's clients apply in local training);
2. calls the real strategy's ``configure_train`` with the model the clients received this round, so
   server-side state is relative to it (FedOpt's ``current_arrays``, FedAvgM's; FedAvgM's own copy is
   reset first so that server transforms that change the global model are respected);
3. rebuilds one Flower ``Message`` per valid reply (its model arrays, ``num-examples``) and calls
   ``aggregate_train``; the result becomes the next global model, cast back to each entry's dtype.
   When Flower skips aggregation (Bulyan with too few replies) the model stays as it was sent and
   ``strategy.skipped`` is 1.

These rules read each client's model, so they need the plain channel (the compatibility check
refuses them under an encrypted channel or secure aggregation). Flower's ``configure_train`` samples
with the global ``random`` module; the adapter restores its state, so fedsim's runs stay
deterministic.
"""
from __future__ import annotations

import inspect
import logging
import math
import random
from typing import Annotated, Any, ClassVar, Mapping, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import strategy as flwr_strategy

from fedsim.components import STRATEGIES, declared_params
from fedsim.params import Range
from fedsim.protocol import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, SERVER_ROUND, arrays_record, decode_array
from fedsim.replies import Reply
from fedsim.seams import AggregationRule, RoundContext

log = logging.getLogger("fedsim")

# Flower constructor parameters fedsim sets or does itself
SAMPLING = ("fraction_train", "fraction_evaluate", "min_train_nodes", "min_evaluate_nodes", "min_available_nodes")
WIRING = ("weighted_by_key", "arrayrecord_key", "configrecord_key", "train_metrics_aggr_fn",
          "evaluate_metrics_aggr_fn", "selection_rule")
NOT_FORWARDED = ("eta_l",)  # FedOpt's client learning rate: fedsim's clients use train.lr
EXCLUDED = frozenset(SAMPLING + WIRING + NOT_FORWARDED)

# limits Flower does not check, added to the declared parameters (the registry checks them, naming the key)
INF = math.inf
RANGES: dict[str, Range] = {
    "proximal_mu": Range(0.0, INF),
    "eta": Range(0.0, INF, open_low=True),
    "tau": Range(0.0, INF, open_low=True),
    "beta_1": Range(0.0, 1.0, open_high=True),
    "beta_2": Range(0.0, 1.0, open_high=True),
    "server_learning_rate": Range(0.0, INF, open_low=True),
    "server_momentum": Range(0.0, 1.0, open_high=True),
    "num_malicious_nodes": Range(0, INF),
    "num_nodes_to_select": Range(1, INF),
    "beta": Range(0.0, 0.5, open_high=True),  # FedTrimmedAvg (Flower checks it too, without naming the key)
}


def constrained(params: list[inspect.Parameter], ranges: Mapping[str, Range]) -> list[inspect.Parameter]:
    """Flower's parameters with fedsim's limits as constraints of their annotations (``Annotated``)."""
    out = []
    for p in params:
        if p.name in ranges:
            base = Any if p.annotation is inspect.Parameter.empty else p.annotation
            p = p.replace(annotation=Annotated[base, ranges[p.name]])
        out.append(p)
    return out


class _Nodes:
    """The smallest grid Flower's ``configure_train`` accepts (it samples node ids; fedsim ignores them)."""

    def get_node_ids(self) -> list[int]:
        return [1, 2]


class FlowerRule(AggregationRule):
    """Base of the adapters: a Flower Message-API strategy as an :class:`AggregationRule`."""

    flower_class: ClassVar[type] = flwr_strategy.FedAvg

    def __init__(self, **params: Any):
        wiring = {"weighted_by_key": NUM_EXAMPLES, "arrayrecord_key": ARRAYS, "configrecord_key": CONFIG}
        self.params = dict(params)
        flwr_log = logging.getLogger("flwr")
        level = flwr_log.level
        flwr_log.setLevel(logging.ERROR)  # e.g. FedProx warns at every construction when proximal_mu = 0
        try:
            self.strategy = self.flower_class(**wiring, **params)
            self._probe = self.flower_class(**wiring, **params)  # stateless copy for the config keys
        finally:
            flwr_log.setLevel(level)
        self.names: list[str] = []
        self._metrics: dict[str, float] = {}

    # ---- the seam ----------------------------------------------------------------------------------
    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        fed = cfg["federation"]
        n = int(fed["clients_per_round"] or fed["num_clients"])
        f = int(self.params.get("num_malicious_nodes", 0))
        if self.name in ("flwr-krum", "flwr-multikrum") and n < 2 * f + 3:
            raise ValueError(f"Krum with num_malicious_nodes = {f} needs at least 2f + 3 = {2 * f + 3} clients per "
                             f"round, the federation samples {n}")
        if self.name == "flwr-multikrum" and int(self.params.get("num_nodes_to_select", 1)) > n:
            raise ValueError(f"num_nodes_to_select = {self.params['num_nodes_to_select']} exceeds the {n} clients "
                             "sampled per round")
        if self.name == "flwr-bulyan" and n < 4 * f + 3:
            raise ValueError(f"Bulyan with num_malicious_nodes = {f} needs at least 4f + 3 = {4 * f + 3} clients "
                             f"per round, the federation samples {n}")

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        self.names = list(param_names)

    # ---- checkpoints: the Flower strategy's server-side state (FedOpt's moments, FedAvgM's momentum) ----
    def state(self) -> dict[str, Any]:
        """Every attribute of the wrapped strategy that holds arrays (``m_t``, ``v_t``, ``momentum_vector``,
        ``current_arrays``, ...); scalars and settings come back from the config."""
        attrs: dict[str, Any] = {}
        for k, v in vars(self.strategy).items():
            if isinstance(v, ArrayRecord):
                attrs[k] = {"array_record": {n: a.numpy() for n, a in v.items()}}
            elif isinstance(v, np.ndarray):
                attrs[k] = {"array": v}
            elif isinstance(v, dict) and v and all(isinstance(x, np.ndarray) for x in v.values()):
                attrs[k] = {"dict": dict(v)}
            elif isinstance(v, list) and v and all(isinstance(x, np.ndarray) for x in v):
                attrs[k] = {"list": list(v)}
        return {"attrs": attrs}

    def load_state(self, state: Mapping[str, Any]) -> None:
        for k, v in state.get("attrs", {}).items():
            if "array_record" in v:
                setattr(self.strategy, k, arrays_record(list(v["array_record"]), list(v["array_record"].values())))
            elif "array" in v:
                setattr(self.strategy, k, np.asarray(v["array"]))
            elif "dict" in v:
                setattr(self.strategy, k, {n: np.asarray(a) for n, a in v["dict"].items()})
            elif "list" in v:
                setattr(self.strategy, k, [np.asarray(a) for a in v["list"]])

    def configure_train(self, server_round: int, config: dict[str, Any]) -> None:
        """Every key Flower's ``configure_train`` adds to the ConfigRecord (e.g. ``proximal-mu``)."""
        probe_config = ConfigRecord()
        messages = _keep_random(lambda: list(self._probe.configure_train(
            server_round, ArrayRecord(), probe_config, _Nodes())))
        added = dict(messages[0].content[CONFIG]) if messages else dict(probe_config)
        for k, v in added.items():
            if k != SERVER_ROUND:
                config[k] = v

    def aggregate(self, ctx: RoundContext, replies: list[Reply]) -> Any:
        sent = ctx.sent
        if sent is None:  # pragma: no cover - the compatibility check admits plaintext channels only
            raise RuntimeError(f"{self.name} needs the plaintext model the clients received")
        if hasattr(self.strategy, "current_arrays"):
            self.strategy.current_arrays = None  # FedAvgM keeps its own copy; start from what was sent
        _keep_random(lambda: list(self.strategy.configure_train(
            ctx.round, arrays_record(self.names, sent), ConfigRecord(), _Nodes())))
        messages = [Message(RecordDict({ARRAYS: ArrayRecord(dict(r.record(ARRAYS).items())),
                                        METRICS: MetricRecord({NUM_EXAMPLES: int(r.num_examples)})}),
                            dst_node_id=r.node_id, message_type=MessageType.TRAIN) for r in replies]
        arrays, _ = self.strategy.aggregate_train(ctx.round, messages)
        if arrays is None:
            log.warning("%s: Flower skipped aggregation in round %d (%d replies); the global model is unchanged",
                        self.name, ctx.round, len(replies))
            self._metrics = {"skipped": 1.0}
            return [np.array(a, copy=True) for a in sent]
        self._metrics = {"skipped": 0.0}
        out = []
        for name, ref in zip(self.names, sent):
            a = decode_array(arrays[name])
            if np.issubdtype(ref.dtype, np.integer):
                a = np.rint(a)
            out.append(np.asarray(a, dtype=ref.dtype).reshape(ref.shape))
        return out

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)


def _keep_random(fn):
    """Run Flower's ``configure_train`` (``fn``) leaving the global ``random`` state as it was (Flower
    samples nodes with it) and without its log line about sampling the adapter's stand-in nodes."""
    state = random.getstate()
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(max(level, logging.WARNING))
    try:
        return fn()
    finally:
        flwr_log.setLevel(level)
        random.setstate(state)


def flower_parameters(flower_class: type) -> list[inspect.Parameter]:
    """The Flower constructor parameters a config may set (see the module docstring)."""
    return constrained([p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in declared_params(flower_class).values()
                        if p.name not in EXCLUDED], RANGES)


def adapter(name: str, flower_class: type) -> type[FlowerRule]:
    """A registered :class:`FlowerRule` subclass for ``flower_class`` whose declared parameters are the
    Flower constructor's (so ``strategy.<key>`` is validated like every other component's)."""
    params = flower_parameters(flower_class)

    def __init__(self, **kwargs: Any) -> None:
        FlowerRule.__init__(self, **kwargs)

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params])
    __init__.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not inspect.Parameter.empty}
    doc = (f"Flower's ``{flower_class.__module__}.{flower_class.__qualname__}`` as a fedsim aggregation rule "
           f"(parameters: {', '.join(p.name for p in params) or 'none'}).")
    cls = type(f"Flower{flower_class.__name__}", (FlowerRule,),
               {"name": name, "flower_class": flower_class, "__init__": __init__, "__doc__": doc,
                "__module__": __name__,
                # FedAvg's arithmetic (FedAvg, FedProx): what central DP's noise is calibrated to (strategies/dp.py)
                "example_weighted_mean": flower_class.aggregate_train is flwr_strategy.FedAvg.aggregate_train})
    return STRATEGIES.register(cls)


FLOWER_STRATEGIES = {
    "flwr-fedavg": flwr_strategy.FedAvg,
    "flwr-fedprox": flwr_strategy.FedProx,
    "flwr-fedavgm": flwr_strategy.FedAvgM,
    "flwr-fedadam": flwr_strategy.FedAdam,
    "flwr-fedyogi": flwr_strategy.FedYogi,
    "flwr-fedadagrad": flwr_strategy.FedAdagrad,
    "flwr-fedmedian": flwr_strategy.FedMedian,
    "flwr-fedtrimmedavg": flwr_strategy.FedTrimmedAvg,
    "flwr-krum": flwr_strategy.Krum,
    "flwr-multikrum": flwr_strategy.MultiKrum,
    "flwr-bulyan": flwr_strategy.Bulyan,
}
ADAPTERS = {name: adapter(name, cls) for name, cls in FLOWER_STRATEGIES.items()}
