"""The server side's three seams, and the plain channel.

A round on the server is composed of three separately configured concerns (docs/architecture.md):

* the **aggregation rule** (``[strategy]``, :class:`AggregationRule`): how client contributions become
  the next global model (FedAvg's example-weighted mean; FedBoosting's cross-validated weights; ...);
* the **channel** (``[channel]``, :class:`ServerChannel` + :class:`ClientChannel`): how models travel -
  encoded on the client, combined on the server, decoded where the key lives (plain arrays; Paillier
  ciphertexts; Flower's SecAgg+ masked sums);
* **server transforms** (``[[transforms]]``, :class:`ServerTransform`): wrapped around the rule -
  before the global model is sent and after the aggregate is formed (seed 000's update
  compensation; seed 002's lossless perturbation).

Each component says what it needs from the channel (``requires``) and each channel what it gives the
server (``provides``); :func:`check_compatible` refuses, at config time, a combination that cannot
work (e.g. a transform that needs the plaintext aggregate under an encrypted channel).

Plugins implement these classes and register them in :mod:`fedsim.components`; this module imports
no plugin.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid

from fedsim.components import CHANNELS, STRATEGIES, TRANSFORMS, ConfigError
from fedsim.lifecycle import Component
from fedsim.protocol import ARRAYS, CLIENT_ID_KEYS, TRAIN, arrays_record, decode_arrays
from fedsim.replies import Arrays, ChannelError, ModelSpec, Reply, ReplyCheck, ReplyChecker

# ---- what a channel gives the server
INDIVIDUAL = "each client's model in plaintext"
WEIGHTED_SUM = "weighted sums of client models"
EXAMPLE_WEIGHTED_MEAN = "the example-weighted mean of the client models"  # implied by WEIGHTED_SUM
PLAINTEXT_AGGREGATE = "the aggregate in plaintext"


def capabilities(provides: frozenset[str]) -> frozenset[str]:
    """What a channel gives, with what it implies: weighted sums with any weights include the
    example-weighted mean (a channel such as SecAgg+ gives only the latter)."""
    return provides | {EXAMPLE_WEIGHTED_MEAN} if WEIGHTED_SUM in provides else provides

Handler = Callable[[Message, Context], Message]


# ============================================================================= what a round hands the seams
class Engine(Protocol):
    """What a round's context offers of the engine that runs the round (``fedsim.rounds.RoundEngine``)."""

    model: ModelSpec  # the global model's names, shapes and dtypes
    checks: ReplyChecker  # example counts and the other reply checks
    partition_node: dict[int, int]  # partition id -> the node serving it (found at discovery)
    timeout: float | None  # how long to wait for replies (federation.round_timeout)

    def send(self, grid: Grid, partitions: Sequence[int], message_type: str, shared: RecordDict,
             per_partition: Mapping[int, Mapping[str, Any]] | None, stage: str, server_round: int,
             record: RoundRecord, check: ReplyCheck | None = None) -> list[Reply]: ...

    def record_failure(self, record: RoundRecord, server_round: int, node: int, stage: str, reason: Any,
                       partition: int | None = None) -> None: ...


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
    privacy: dict[str, Any] = field(default_factory=dict)  # privacy.<mechanism>.epsilon/.delta (fedsim.privacy)
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
        out.update(self.privacy)
        return out


@dataclass
class RoundContext:
    """Handed to rules and transforms during a round: the grid, the channel, what was sent."""

    engine: Engine
    grid: Grid
    round: int
    channel: ServerChannel
    config: ConfigRecord
    sent: list[np.ndarray] | None  # the plaintext model the clients received (None if encrypted)
    record: RoundRecord
    replies: list[Reply] = field(default_factory=list)  # the round's valid replies (what was aggregated)
    weights: list[float] | None = None  # the weights a weighted-sum rule used

    def send(self, partitions: Sequence[int], message_type: str, shared: RecordDict,
             per_partition: Mapping[int, Mapping[str, Any]] | None = None, stage: str = "train",
             check: ReplyCheck | None = None) -> list[Reply]:
        """Send to clients (partition ids); the valid replies, sorted by partition. Failures are recorded;
        ``check`` (raising :class:`InvalidReply`) decides which replies are valid (see ``RoundEngine.send``)."""
        return self.engine.send(self.grid, partitions, message_type, shared, per_partition, stage, self.round,
                                self.record, check)


# ============================================================================= aggregation rules
class AggregationRule(Component):
    """How the round's client contributions become the next global model."""

    name: ClassVar[str] = ""
    #: what the rule needs from the channel
    requires: ClassVar[frozenset[str]] = frozenset({INDIVIDUAL, PLAINTEXT_AGGREGATE})
    #: whether the aggregate is the example-weighted mean of the client models (FedAvg's arithmetic): then one
    #: client moves it by at most its weight times its update's norm, the sensitivity central DP calibrates
    #: its noise to (strategies/dp.py); other rules get no formal guarantee from it
    example_weighted_mean: ClassVar[bool] = False

    def configure_train(self, server_round: int, config: dict[str, Any]) -> None:
        """Add rule-specific keys to the round's train config (e.g. FedProx's proximal term)."""

    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        """Check what this rule reads from one client's train reply before anything uses it; raise
        :class:`InvalidReply` (the client's recorded failure) if it is unusable. The round engine calls it
        for every reply (``fedsim.replies.ReplyChecker.check_reply``), after its own checks (the example count) and the
        channel's, before observers, the rule and the transforms see the reply. Default: nothing to check."""

    def aggregate(self, ctx: RoundContext, replies: list[Reply]) -> Any:
        """The next global state (in the channel's representation) from the round's valid replies."""
        raise NotImplementedError

    def privacy(self, cfg: Mapping[str, Any]) -> list[Any]:
        """The differential privacy the rule gives, as :class:`fedsim.privacy.Mechanism` entries (central DP:
        ``strategies/dp.py``). Default: none."""
        return []



class WeightedSumRule(AggregationRule):
    """A rule whose aggregate is a weighted mean of the client models: works under every channel."""

    requires = frozenset({WEIGHTED_SUM})

    def weights(self, ctx: RoundContext, replies: list[Reply]) -> list[float]:
        raise NotImplementedError

    def aggregate(self, ctx: RoundContext, replies: list[Reply]) -> Any:
        w = self.weights(ctx, replies)
        ctx.weights = list(w)
        return ctx.channel.weighted_mean(replies, w)


# ============================================================================= server transforms
class ServerTransform(Component):
    """Wrapped around the aggregation rule: ``before_send`` in config order, ``after_aggregate`` in
    reverse order (the first transform is the outermost)."""

    name: ClassVar[str] = ""
    requires: ClassVar[frozenset[str]] = frozenset({PLAINTEXT_AGGREGATE})

    def before_send(self, server_round: int, arrays: Arrays) -> Arrays:
        """The model the clients receive this round (default: unchanged)."""
        return arrays

    def message_extras(self, server_round: int) -> dict[str, Any]:
        """Extra records for this round's train messages (default: none). Arrays for the clients'
        defenses go in an ArrayRecord under ``fedsim.protocol.EXTRAS``."""
        return {}

    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        """Check what this transform reads from one client's train reply before anything uses it; raise
        :class:`InvalidReply` (the client's recorded failure) if it is unusable. The round engine calls it
        for every reply (``fedsim.replies.ReplyChecker.check_reply``), after its own checks (the example count) and the
        channel's, before observers, the rule and the transforms see the reply. Default: nothing to check."""

    def client_defenses(self) -> list[dict[str, Any]]:
        """``[[defenses]]`` entries every client must run first for this transform to work (e.g. the
        client half of a perturbation scheme). Default: none."""
        return []

    def after_aggregate(self, ctx: RoundContext, aggregate: Arrays) -> Arrays:
        """The next global model from the rule's aggregate (default: unchanged)."""
        return aggregate



# ============================================================================= channels
class ServerChannel(Component):
    """The server half of a channel. The global *state* is whatever the channel holds between rounds:
    plaintext arrays for the plain channel, a ciphertext for an encrypted one. A channel is one plugin:
    its server half names its client half (``client``), which the ClientApp builds from the same
    ``channel.name`` (a registered name or an import reference to this class)."""

    name: ClassVar[str] = ""
    provides: ClassVar[frozenset[str]] = frozenset()
    client: ClassVar[type[ClientChannel]]  # the client half (runs inside the ClientApp)
    #: what the server does after a round in which no client's model reached the aggregate (every
    #: sampled client failed, or a secure-aggregation protocol halted): ``"stop"`` the run with an
    #: error, or ``"continue"`` with the global model unchanged (the round is recorded as failed)
    on_round_failure: str = "stop"

    def handshake(self, ctx: RoundContext) -> None:
        """Exchanges before round 1 (key agreement, key delivery). Default: none."""

    def train_exchange(self, ctx: RoundContext, partitions: list[int], content: RecordDict) -> list[Reply]:
        """The round's training exchange: by default one ``TRAIN`` message per sampled client and one
        reply each. A channel whose protocol has several stages (secure aggregation) runs them here and
        may return a single reply standing for several clients (``Reply.contributors``)."""
        return ctx.send(partitions, TRAIN, content, None, "train")

    def after_round(self, ctx: RoundContext, state: Any) -> None:
        """After the round's global state is formed and checked (before the server evaluates it): a channel
        may exchange more with the clients here (the Paillier channel sends the new aggregate ahead to the
        next round's clients, who decrypt it now, all at once, instead of one after another later).
        Default: nothing."""

    def initial(self, arrays: Arrays) -> Any:
        """The state for the (public) initial model."""
        return arrays

    def outgoing(self, state: Any) -> dict[str, Any]:
        """Records that carry the global state to a client (train and evaluate messages)."""
        raise NotImplementedError

    def outgoing_to_trained(self, state: Any) -> dict[str, Any]:
        """Records that carry ``state`` (a weighted mean of this round's replies) to clients that trained on
        this round's global model (FedBoosting's validators): a channel may leave out what they already
        hold. Default: :meth:`outgoing`."""
        return self.outgoing(state)

    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        """Check one reply's payload against the model and this channel's settings before anything uses
        it; raise :class:`ChannelError` (an :class:`InvalidReply`) naming what is wrong if it is unusable:
        the reply becomes that client's recorded failure. May keep what it parsed in ``reply.extra`` (or
        the decoded arrays). The round engine calls it once per train reply
        (``fedsim.replies.ReplyChecker.check_reply``), after checking the example count; a reply standing
        for several clients (``Reply.contributors``) is checked as one. Default: no payload check (a channel with a payload must override it)."""

    def weighted_mean(self, replies: list[Reply], weights: Sequence[float]) -> Any:
        """The weighted mean of the replies' models, as a state."""
        raise NotImplementedError

    def plaintext(self, state: Any) -> Arrays | None:
        """The state as plaintext arrays, or None when the server cannot read it."""
        return None

    def checkpoint_arrays(self, state: Any) -> Arrays | None:
        """The global state as arrays for a checkpoint (default: its plaintext; None: it cannot be saved).
        An encrypted channel returns its ciphertexts (with :meth:`state` holding no secret)."""
        return self.plaintext(state)

    def from_checkpoint_arrays(self, arrays: Arrays) -> Any:
        """The global state from :meth:`checkpoint_arrays`' arrays (after :meth:`load_state`)."""
        return self.initial(arrays)

    def client_view(self, reply: Reply) -> dict[str, Any]:
        """What an observer may see of one reply: ``weights`` (lazy) or ``payload`` + ``kind``."""
        raise NotImplementedError

    # load_state (Component): on resume the handshake is not repeated, so a channel with a setup
    # exchange must restore its outcome there, or resuming is refused (fedsim.checkpoint.resume_blocker)


class ClientChannel:
    """The client half of a channel (runs inside the ClientApp)."""

    name: ClassVar[str] = ""

    def __init__(self, cfg: Mapping[str, Any]):
        self.cfg = cfg

    def handshake(self, msg: Message, context: Context) -> RecordDict:
        """Answer one of the channel's setup exchanges (content of the reply)."""
        raise ValueError(f"channel {self.name!r} has no setup exchange")

    def decode(self, content: RecordDict, context: Context, template: Mapping[str, np.ndarray]) -> Arrays:
        """The global model (plaintext, in ``template``'s order) from a server message. ``template`` is the
        client's model state (names, shapes and dtypes; its values are not the global model's)."""
        raise NotImplementedError

    def encode(self, arrays: Arrays, param_names: Sequence[str], context: Context) -> dict[str, Any]:
        """Records carrying this client's model to the server."""
        raise NotImplementedError

    def wrap_train(self, handler: Handler) -> Handler:
        """The ClientApp's train handler as this channel runs it (default: unchanged). A channel whose
        protocol has several message stages (Flower's SecAgg+ mod) wraps the handler that trains."""
        return handler


# ---- the plain channel ---------------------------------------------------------------------------
@CHANNELS.register
class PlainChannel(ServerChannel):
    """Models travel as plaintext ArrayRecords; the server reads everything."""

    name = "plain"
    provides = frozenset({INDIVIDUAL, WEIGHTED_SUM, PLAINTEXT_AGGREGATE})
    stateless = True

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        self.names = list(param_names)

    def outgoing(self, state: Arrays) -> dict[str, Any]:
        return {ARRAYS: arrays_record(self.names, state)}

    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        if not reply.has(ARRAYS):
            raise ChannelError("the reply carries no model arrays")
        reply.arrays = model.check_arrays(reply.record(ARRAYS))  # decoded once, checked

    def weighted_mean(self, replies: list[Reply], weights: Sequence[float]) -> Arrays:
        """``sum_i (w_i / W) x_i``, accumulated in reply order in the arrays' dtype - the same arithmetic
        as Flower's ``aggregate_arrayrecords`` (tested bit for bit), on the already decoded arrays."""
        total = float(sum(weights))
        out: Arrays | None = None
        for r, w in zip(replies, weights):
            f = float(w) / total
            if out is None:
                out = [a * f for a in r.arrays]
            else:
                for acc, a in zip(out, r.arrays):
                    acc += a * f
        return [np.asarray(a) for a in out or []]

    def plaintext(self, state: Arrays) -> Arrays:
        return state

    def client_view(self, reply: Reply) -> dict[str, Any]:
        return {"kind": "individual", "weights": lambda: reply.arrays}


class PlainClientChannel(ClientChannel):
    name = "plain"

    def decode(self, content: RecordDict, context: Context, template: Mapping[str, np.ndarray]) -> Arrays:
        return decode_arrays(content[ARRAYS])

    def encode(self, arrays: Arrays, param_names: Sequence[str], context: Context) -> dict[str, Any]:
        return {ARRAYS: arrays_record(param_names, arrays)}


PlainChannel.client = PlainClientChannel  # defined after it: the server half names its client half


# import references in [strategy], [channel], [[transforms]] must name these base classes
STRATEGIES.base, CHANNELS.base, TRANSFORMS.base = AggregationRule, ServerChannel, ServerTransform


# ============================================================================= compatibility
def check_compatible(channel: type[ServerChannel], rule: type[AggregationRule] | AggregationRule,
                     transforms: Sequence[tuple[str, type[ServerTransform]]]) -> None:
    """Refuse a rule or transform that needs something the channel does not give the server. ``rule`` may be
    an instance: a rule that wraps another (central DP) needs what the wrapped rule needs, and more."""
    gives = capabilities(channel.provides)
    compatible = lambda need: sorted(n for n, c in CHANNELS.items() if need <= capabilities(c.provides))  # noqa: E731
    missing = rule.requires - gives
    if missing:
        raise ConfigError(f"strategy.name = {rule.name!r} needs {', '.join(sorted(missing))}, which channel "
                          f"{channel.name!r} does not give the server; channels it works with: "
                          f"{compatible(rule.requires)}")
    for where, t in transforms:
        missing = t.requires - gives
        if missing:
            raise ConfigError(f"{where} ({t.name}) needs {', '.join(sorted(missing))}, which channel "
                              f"{channel.name!r} does not give the server; channels it works with: "
                              f"{compatible(t.requires)}")
