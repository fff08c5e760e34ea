"""Flower's central differential privacy around any aggregation rule (``strategy.name = "flwr-dp-..."``).

Flower 1.42's ``flwr.serverapp.strategy`` wraps a strategy with central DP: it clips each client's
update (on the server, or on the client with a mod) and adds Gaussian noise of standard deviation
``noise_multiplier * clipping_norm / num_sampled_clients`` to the wrapped strategy's aggregate (McMahan
et al. 2018, "Learning differentially private recurrent language models"; adaptive clipping: Andrew et
al. 2021). fedsim runs Flower's four classes themselves; this module is the adapter that lets them wrap
any fedsim rule (``[strategy.rule]``), not only Flower's strategies:

* ``flwr-dp-server-fixed``: ``DifferentialPrivacyServerSideFixedClipping`` (noise_multiplier, clipping_norm);
* ``flwr-dp-client-fixed``: ``DifferentialPrivacyClientSideFixedClipping`` (the same);
* ``flwr-dp-server-adaptive``: ``DifferentialPrivacyServerSideAdaptiveClipping`` (noise_multiplier,
  initial_clipping_norm, target_clipped_quantile, clip_norm_lr, clipped_count_stddev);
* ``flwr-dp-client-adaptive``: ``DifferentialPrivacyClientSideAdaptiveClipping`` (the same);

each also with fedsim's ``rule`` (the wrapped rule), ``delta`` and ``sampling_amplification``.

Config::

    [strategy]
    name = "flwr-dp-server-fixed"
    noise_multiplier = 1.0
    clipping_norm = 0.5
    delta = 1e-5                   # the delta fedsim reports epsilon at (fedsim.privacy)
    sampling_amplification = false # true: account with the client sampling rate (Poisson approximation)
    [strategy.rule]                # the wrapped rule (default fedavg), with its own parameters
    name = "flwr-fedprox"
    proximal_mu = 0.01

The client-side wrappers need Flower's mod on every client: ``[[client.flower_mods]] name =
"fixed-clipping"`` (``fixedclipping_mod``) or ``"adaptive-clipping"`` (``adaptiveclipping_mod``); both
are checked when the config is loaded. ``num_sampled_clients`` is ``federation.clients_per_round`` (all
clients when 0); Flower's own accountant hook is not used (it accepts only fixed clipping around
FedAvg with equal weights): the run's :class:`fedsim.privacy.PrivacyLedger` accounts every variant.

How the adapter drives Flower's wrapper (the pattern of :mod:`strategies.flower`):

* ``configure_train`` runs the wrapped rule's, then the wrapper's ``configure_train`` and copies the keys
  it adds (the client-side wrappers' ``clipping_norm``) into the round's train config;
* ``aggregate`` calls the wrapper's ``configure_train`` with the model the clients received (the
  server-side wrappers clip relative to it), rebuilds one Flower ``Message`` per reply (model arrays,
  metrics) and calls the wrapper's ``aggregate_train``. The wrapper clips what it clips and hands the
  messages to :class:`RuleStrategy`, a Flower ``Strategy`` whose ``aggregate_train`` runs the wrapped
  fedsim rule on them (through the round's channel); the wrapper adds its noise to that aggregate.
  NumPy's global generator, which Flower draws the noise from, is seeded from (seed, round) around the
  call and restored afterwards, so runs are reproducible.

What the combination needs from the channel: the aggregate in plaintext (the noise is added to it) and
whatever the wrapped rule needs; the server-side wrappers also each client's model in plaintext (they
clip individual updates), and the client-side adaptive wrapper too (it counts each reply's
``norm_bit``). So client-side fixed clipping composes with SecAgg+ (the server sees only the clipped
clients' sum and adds the noise), the others need the plain channel, and none runs under Paillier (the
server never holds the aggregate in plaintext).

**What it guarantees** (client level, against whoever sees the global models, *not* the server, which
sees the updates before it adds the noise): the noise is calibrated to the example-weighted mean of the
clipped updates, whose sensitivity to one client is its weight ``n_i / sum n`` times the clipping norm
(fixed-denominator convention: a client without data sends the zero update). fedsim accounts each
round's release with the effective noise multiplier ``std / (clipping norm x largest weight)`` of the
clients in it - Flower's ``noise_multiplier`` when the clients have equal data - and, for the adaptive
wrappers, the clipped-count release composed with it (``clipped_count_stddev``, sensitivity 1). Flower
1.42's adaptive wrappers draw the noise with the clipping norm already updated for the next round; the
effective multiplier uses the norm the updates were clipped with, so the accounting stays exact. A
wrapped rule that is not an example-weighted mean (Krum, FedMedian, FedAdam, FedBoosting, ...) gets
the noise but no formal guarantee.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
from typing import Annotated, Any, ClassVar, Iterable, Iterator, Mapping, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from fedsim.components import STRATEGIES, ConfigError, declared_params
from fedsim.params import Range
from fedsim.privacy import AGAINST_RELEASE, Mechanism
from fedsim.protocol import ARRAYS, METRICS, arrays_record, decode_array
from fedsim.replies import ModelSpec, Reply
from fedsim.seams import INDIVIDUAL, PLAINTEXT_AGGREGATE, AggregationRule, RoundContext
from fedsim.seeding import derive_seed

from .flower import _Nodes, constrained

log = logging.getLogger("fedsim")

# parameters fedsim sets itself: the wrapped strategy, the sample size, Flower's own accountant hook
FIXED = frozenset({"strategy", "num_sampled_clients", "accountant"})
RANGES: dict[str, Range] = {  # limits of the wrappers' parameters (constraints of their annotations)
    "noise_multiplier": Range(0.0, math.inf),
    "clipping_norm": Range(0.0, math.inf, open_low=True),
    "initial_clipping_norm": Range(0.0, math.inf, open_low=True),
    "target_clipped_quantile": Range(0.0, 1.0),
    "clip_norm_lr": Range(0.0, math.inf, open_low=True),
    "clipped_count_stddev": Range(0.0, math.inf),
}
# the client mod (FLOWER_MODS name, clients/flower_mods.py) each client-side wrapper needs
CLIENT_MODS = {"flwr-dp-client-fixed": "fixed-clipping", "flwr-dp-client-adaptive": "adaptive-clipping"}


@contextlib.contextmanager
def seeded_numpy(seed: int) -> Iterator[None]:
    """NumPy's global generator seeded for the block (Flower draws DP noise from it), then put back."""
    saved = np.random.get_state()
    np.random.seed(seed % (2 ** 32))
    try:
        yield
    finally:
        np.random.set_state(saved)


class _View(Reply):
    """A reply as the wrapped rule sees it after Flower's wrapper: the (possibly clipped) arrays of the
    rebuilt message, everything else from the original reply."""

    def __init__(self, message: Message, original: Reply):
        self.message, self.original = message, original
        self.node_id, self.partition, self.suffix = original.node_id, original.partition, ""
        self.metrics, self.num_examples = original.metrics, original.num_examples
        self.extra, self.contributors = original.extra, original.contributors
        self._arrays = None

    def has(self, name: str) -> bool:
        return name in self.message.content or self.original.has(name)

    def record(self, name: str) -> Any:
        return self.message.content[name] if name in self.message.content else self.original.record(name)


class RuleStrategy(Strategy):
    """A fedsim :class:`AggregationRule` as the Flower ``Strategy`` that Flower's DP wrappers wrap.

    Only ``aggregate_train`` does work: it maps the messages back to the round's replies and runs the
    rule through the round's context (channel, exchanges); sampling and evaluation stay with fedsim."""

    def __init__(self, rule: AggregationRule):
        super().__init__()
        self.rule = rule
        self.ctx: RoundContext | None = None
        self.originals: dict[int, Reply] = {}
        self.names: list[str] = []

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Any) -> Iterable[Message]:
        return []

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        assert self.ctx is not None
        views = [_View(m, self.originals[id(m)]) for m in replies]
        state = self.rule.aggregate(self.ctx, views)
        arrays = self.ctx.channel.plaintext(state)
        if arrays is None:  # pragma: no cover - the compatibility check admits plaintext aggregates only
            raise RuntimeError("central DP needs the aggregate in plaintext")
        return arrays_record(self.names, arrays), MetricRecord()

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Any) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        pass


class CentralDP(AggregationRule):
    """Base of the four adapters (see the module docstring)."""

    flower_class: ClassVar[type] = DifferentialPrivacyServerSideFixedClipping
    server_clipping: ClassVar[bool] = True  # the wrapper clips individual updates on the server
    adaptive: ClassVar[bool] = False

    def __init__(self, *, rule: dict | None = None,
                 delta: Annotated[float, Range(0, 1, open_low=True, open_high=True)] = 1e-5,
                 sampling_amplification: bool = False, **params: Any):
        entry = {"name": "fedavg"} if rule is None else rule
        if not isinstance(entry, Mapping):
            raise ConfigError('strategy.rule must be a table with a name (e.g. rule = { name = "fedavg" })')
        inner_cls = STRATEGIES.lookup(entry.get("name"), "strategy.rule.name")
        if issubclass(inner_cls, CentralDP):
            raise ConfigError(f"strategy.rule: {entry.get('name')!r} is a central-DP wrapper itself; wrap a rule")
        try:
            self.inner: AggregationRule = STRATEGIES.build(entry, "strategy.rule")
        except ConfigError as exc:  # the wrapped rule's own range checks name strategy.<key>
            msg = str(exc)
            raise ConfigError(msg if msg.startswith("strategy.rule") else msg.replace("strategy.", "strategy.rule.", 1)) \
                from None
        self.params, self.delta, self.amplify = dict(params), float(delta), bool(sampling_amplification)
        needs = {PLAINTEXT_AGGREGATE} | ({INDIVIDUAL} if self.server_clipping or self.adaptive else set())
        self.requires = frozenset(self.inner.requires | needs)  # type: ignore[misc]
        self.strategy = RuleStrategy(self.inner)
        self.wrapper: Any = None
        self.names: list[str] = []
        self.sizes: list[int] = []
        self.m = self.population = 1
        self.seed = 0
        self.releases: list[tuple[float, float, int]] = []
        self._metrics: dict[str, float] = {}

    # ---- the wrapper ---------------------------------------------------------------------------------------
    def _sampled(self, cfg: Mapping[str, Any]) -> tuple[int, int]:
        fed = cfg["federation"]
        n = int(fed["num_clients"])
        return int(fed["clients_per_round"] or n), n

    def _build(self, m: int) -> Any:
        flwr_log = logging.getLogger("flwr")
        level = flwr_log.level
        flwr_log.setLevel(logging.ERROR)  # e.g. the adaptive wrappers' warning about large noise
        try:
            return self.flower_class(strategy=self.strategy, num_sampled_clients=m, **self.params)
        finally:
            flwr_log.setLevel(level)

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        try:
            self.inner.validate_config(cfg)
        except ValueError as exc:
            raise ValueError(f"rule ({self.inner.name}): {exc}") from exc
        self._build(self._sampled(cfg)[0])  # Flower's own checks (e.g. the adaptive noise split needs m)
        names = [m.get("name") if isinstance(m, Mapping) else m for m in cfg["client"]["flower_mods"]]
        need = CLIENT_MODS.get(self.name)
        if need and need not in names:
            raise ValueError(f"{self.name} clips on the clients: add Flower's mod to every client with "
                             f'[[client.flower_mods]] name = "{need}"')
        wrong = [n for n in set(CLIENT_MODS.values()) - {need} if n in names]
        if wrong:
            raise ValueError(f"client.flower_mods {wrong} belongs to another central-DP strategy "
                             f"({[k for k, v in CLIENT_MODS.items() if v in wrong]})")

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        from fedsim.factories import partitions_for

        self.names = list(param_names)
        self.strategy.names = self.names
        self.m, self.population = self._sampled(cfg)
        self.seed = int(cfg["seed"])
        self.sizes = [len(p) for p in partitions_for(cfg)]
        self.wrapper = self._build(self.m)
        self.inner.setup(param_names, cfg)

    # ---- a round ------------------------------------------------------------------------------------------
    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        self.inner.check_reply(reply, model)  # what the wrapped rule reads; the wrapper reads the checked model

    def configure_train(self, server_round: int, config: dict[str, Any]) -> None:
        self.inner.configure_train(server_round, config)
        probe = ConfigRecord()
        list(self.wrapper.configure_train(server_round, ArrayRecord(), probe, _Nodes()))
        for k, v in probe.items():  # the client-side wrappers' clipping norm
            config[k] = v

    def aggregate(self, ctx: RoundContext, replies: list[Reply]) -> Any:
        sent = ctx.sent
        if sent is None:  # pragma: no cover - the compatibility check admits plaintext channels only
            raise RuntimeError(f"{self.name} needs the plaintext model the clients received")
        list(self.wrapper.configure_train(ctx.round, arrays_record(self.names, sent), ConfigRecord(), _Nodes()))
        messages = [Message(RecordDict({ARRAYS: arrays_record(self.names, r.arrays),
                                        METRICS: MetricRecord(_metric_items(r.metrics))}),
                            dst_node_id=r.node_id, message_type=MessageType.TRAIN) for r in replies]
        self.strategy.ctx, self.strategy.originals = ctx, {id(m): r for m, r in zip(messages, replies)}
        clip = float(self.wrapper.clipping_norm)  # the bound the updates are clipped to this round
        try:
            with seeded_numpy(derive_seed(self.seed, ctx.round, 0xD9)):
                arrays, _ = self.wrapper.aggregate_train(ctx.round, messages)
        finally:
            self.strategy.ctx, self.strategy.originals = None, {}
        if arrays is None:
            log.warning("%s: Flower skipped aggregation in round %d; the global model is unchanged", self.name, ctx.round)
            self._metrics = {"skipped": 1.0}
            return ctx.channel.initial([np.array(a, copy=True) for a in sent])
        noise_std = float(self.wrapper.noise_multiplier) * float(self.wrapper.clipping_norm) / self.m
        z = self.effective_noise_multiplier(replies, clip, noise_std)
        self.releases.append((z, self.sample_rate(), 1))
        self._metrics = {"skipped": 0.0, "clipping_norm": clip, "noise_std": noise_std,
                         "effective_noise_multiplier": z,
                         **{f"rule.{k}": v for k, v in self.inner.metrics().items()}}
        out = []
        for name, ref in zip(self.names, sent):
            a = decode_array(arrays[name])
            if np.issubdtype(ref.dtype, np.integer):
                a = np.rint(a)
            out.append(np.asarray(a, dtype=ref.dtype).reshape(ref.shape))
        return ctx.channel.initial(out)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    # ---- accounting ---------------------------------------------------------------------------------------
    def sample_rate(self) -> float:
        return self.m / self.population if self.amplify else 1.0

    def effective_noise_multiplier(self, replies: Sequence[Reply], clip: float, noise_std: float) -> float:
        """The round's release as a Gaussian mechanism: noise std over the sensitivity of the example-weighted
        mean to one client (its largest weight times the clipping norm), composed for the adaptive wrappers
        with the noisy clipped count (std ``clipped_count_stddev``, sensitivity 1)."""
        clients = [c for r in replies for c in (r.contributors or [r.partition])]
        n = np.array([self.sizes[c] for c in clients], dtype=np.float64)
        z = noise_std / (clip * float(n.max() / n.sum())) if len(n) and clip > 0 else 0.0
        if self.adaptive:  # the noisy clipped count is released too; no noise on either: no guarantee
            count_std = float(getattr(self.wrapper, "clipped_count_stddev", 0.0) or 0.0)
            z = (z ** -2 + count_std ** -2) ** -0.5 if z > 0 and count_std > 0 else 0.0
        return float(z)

    def privacy(self, cfg: Mapping[str, Any]) -> list[Mechanism]:
        m, n = self._sampled(cfg)
        p = self.params
        clip = (f"clipping norm {p['clipping_norm']:g}" if "clipping_norm" in p else
                f"adaptive clipping from {p.get('initial_clipping_norm', 0.1):g} to the "
                f"{p.get('target_clipped_quantile', 0.5):g} quantile")
        where = "on the server" if self.server_clipping else "on the clients (Flower's mod)"
        desc = (f"{self.flower_class.__name__} around {self.inner.name}: {clip} {where}, noise multiplier "
                f"{p.get('noise_multiplier', 0):g}, {m} of {n} clients per round")
        notes = [f"sampling: {'amplified with q = %g (Poisson approximation of fixed-size sampling)' % (m / n) if self.amplify and m < n else 'no amplification by client sampling (q = 1)'}"]
        if not type(self.inner).example_weighted_mean:
            return [Mechanism("strategy", desc, "client", AGAINST_RELEASE, reason=(
                f"the wrapped rule {self.inner.name!r} is not the example-weighted mean of the client models; the "
                "noise is calibrated to that mean's sensitivity"))]
        return [Mechanism("strategy", desc, "client", AGAINST_RELEASE, self.delta,
                          per_round=lambda: list(self.releases), notes=notes)]

    # ---- checkpoints --------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"inner": self.inner.state(), "releases": [list(e) for e in self.releases],
                "clipping_norm": float(self.wrapper.clipping_norm) if self.wrapper is not None else None}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state(state.get("inner", {}))
        self.releases = [(float(z), float(q), int(s)) for z, q, s in state.get("releases", [])]
        if state.get("clipping_norm") is not None and self.adaptive:
            self.wrapper.clipping_norm = float(state["clipping_norm"])


def _metric_items(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The reply's metrics a Flower MetricRecord can hold (numbers and lists of numbers)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
        elif isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            out[k] = list(v)
    return out


def wrapper_parameters(flower_class: type) -> list[inspect.Parameter]:
    """The Flower wrapper's constructor parameters a config may set."""
    return constrained([p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in declared_params(flower_class).values()
                        if p.name not in FIXED], RANGES)


def dp_adapter(name: str, flower_class: type, server_clipping: bool, adaptive: bool) -> type[CentralDP]:
    params = wrapper_parameters(flower_class)
    own = [p for p in inspect.signature(CentralDP.__init__).parameters.values()
           if p.kind is inspect.Parameter.KEYWORD_ONLY]

    def __init__(self, **kwargs: Any) -> None:
        CentralDP.__init__(self, **kwargs)

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *own, *params])
    __init__.__annotations__ = {p.name: p.annotation for p in (*own, *params)
                                if p.annotation is not inspect.Parameter.empty}
    doc = (f"Flower's ``{flower_class.__qualname__}`` around the rule in ``[strategy.rule]`` (parameters: "
           f"{', '.join(p.name for p in params)}; fedsim's: rule, delta, sampling_amplification).")
    cls = type(f"Flower{flower_class.__name__}", (CentralDP,),
               {"name": name, "flower_class": flower_class, "server_clipping": server_clipping, "adaptive": adaptive,
                "__init__": __init__, "__doc__": doc, "__module__": __name__})
    return STRATEGIES.register(cls)


WRAPPERS = {
    "flwr-dp-server-fixed": (DifferentialPrivacyServerSideFixedClipping, True, False),
    "flwr-dp-client-fixed": (DifferentialPrivacyClientSideFixedClipping, False, False),
    "flwr-dp-server-adaptive": (DifferentialPrivacyServerSideAdaptiveClipping, True, True),
    "flwr-dp-client-adaptive": (DifferentialPrivacyClientSideAdaptiveClipping, False, True),
}
ADAPTERS = {name: dp_adapter(name, cls, server, adaptive) for name, (cls, server, adaptive) in WRAPPERS.items()}
