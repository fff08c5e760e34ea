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

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
from flwr.app import Context, Message, RecordDict

from fedsim.components import CHANNELS, CLIENT_CHANNELS, STRATEGIES, TRANSFORMS, ConfigError
from fedsim.protocol import ARRAYS, TRAIN, arrays_record, decode_array, decode_arrays

if TYPE_CHECKING:  # pragma: no cover
    from fedsim.rounds import Reply, RoundContext

# ---- what a channel gives the server
INDIVIDUAL = "each client's model in plaintext"
WEIGHTED_SUM = "weighted sums of client models"
EXAMPLE_WEIGHTED_MEAN = "the example-weighted mean of the client models"  # implied by WEIGHTED_SUM
PLAINTEXT_AGGREGATE = "the aggregate in plaintext"


def capabilities(provides: frozenset[str]) -> frozenset[str]:
    """What a channel gives, with what it implies: weighted sums with any weights include the
    example-weighted mean (a channel such as SecAgg+ gives only the latter)."""
    return provides | {EXAMPLE_WEIGHTED_MEAN} if WEIGHTED_SUM in provides else provides

Arrays = list[np.ndarray]
Handler = Callable[[Message, Context], Message]


class InvalidReply(RuntimeError):
    """A client's reply is unusable (a bad example count, a model of the wrong names, shapes or dtypes,
    non-finite values, a payload the channel cannot use): that client's recorded failure, never the
    server's crash. Raised by the ``check_reply`` hooks (:meth:`ServerChannel.check_reply`)."""


class ChannelError(InvalidReply):
    """A client's channel payload is unusable (corrupted, wrong key, wrong size): that client's failure."""


class ModelSpec:
    """The global model's entries as the server knows them: names, shapes and dtypes, in state-dict order.
    What every reply's model is checked against (:meth:`check_arrays`). Shapes are the ones the entries
    travel in: a 0-d entry (e.g. BatchNorm's ``num_batches_tracked``) travels as shape (1,)
    (``fedsim.protocol.encode_array``)."""

    def __init__(self, names: Sequence[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype]):
        self.names = list(names)
        self.shapes = [tuple(int(d) for d in s) or (1,) for s in shapes]
        self.dtypes = [np.dtype(d) for d in dtypes]

    @classmethod
    def of(cls, names: Sequence[str], arrays: Sequence[np.ndarray]) -> "ModelSpec":
        arrays = [np.asarray(a) for a in arrays]
        return cls(names, [a.shape for a in arrays], [a.dtype for a in arrays])

    def check_names(self, got: Sequence[str], what: str = "the reply's model") -> None:
        got = list(got)
        if got == self.names:
            return
        missing = [n for n in self.names if n not in got]
        extra = [n for n in got if n not in self.names]
        if missing or extra:
            parts = ([f"lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}"] if missing else []) + \
                    ([f"has unknown entries {extra[:4]}{' ...' if len(extra) > 4 else ''}"] if extra else [])
            raise InvalidReply(f"{what} {' and '.join(parts)}")
        raise InvalidReply(f"{what} has the model's entries in another order")

    def check_arrays(self, record: Any, what: str = "the reply's model") -> Arrays:
        """The arrays of an ``ArrayRecord`` that must hold exactly this model (same names in the same
        order, shapes, dtypes, finite values), decoded; raises :class:`InvalidReply` naming the entry."""
        from flwr.app import ArrayRecord

        if not isinstance(record, ArrayRecord):
            raise InvalidReply(f"{what} is a {type(record).__name__}, not an ArrayRecord")
        self.check_names(list(record.keys()), what)
        out = []
        for name, arr, shape, dtype in zip(self.names, record.values(), self.shapes, self.dtypes):
            try:
                ok_meta = np.dtype(arr.dtype) == dtype and tuple(arr.shape) == shape
            except (TypeError, ValueError):
                ok_meta = False
            if not ok_meta:
                raise InvalidReply(f"{what}: {name!r} is {arr.dtype} {list(arr.shape)}, the model's is "
                                   f"{dtype} {list(shape)}")
            try:
                a = decode_array(arr, writable=False)
            except Exception as exc:  # noqa: BLE001 - a damaged payload: name the entry
                raise InvalidReply(f"{what}: {name!r} cannot be decoded ({type(exc).__name__}: {exc})") from None
            if a.dtype != dtype or a.shape != shape:
                raise InvalidReply(f"{what}: {name!r} decodes to {a.dtype} {list(a.shape)}, the model's is "
                                   f"{dtype} {list(shape)}")
            if a.dtype.kind in "fc" and not np.isfinite(a).all():
                bad = a[~np.isfinite(a)]
                raise InvalidReply(f"{what}: {name!r} holds {bad.size} non-finite values (e.g. {bad.flat[0]})")
            out.append(a)
        return out


# ============================================================================= aggregation rules
class AggregationRule:
    """How the round's client contributions become the next global model."""

    name: ClassVar[str] = ""
    #: what the rule needs from the channel
    requires: ClassVar[frozenset[str]] = frozenset({INDIVIDUAL, PLAINTEXT_AGGREGATE})
    #: whether the aggregate is the example-weighted mean of the client models (FedAvg's arithmetic): then one
    #: client moves it by at most its weight times its update's norm, the sensitivity central DP calibrates
    #: its noise to (strategies/dp.py); other rules get no formal guarantee from it
    example_weighted_mean: ClassVar[bool] = False

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        """Checks against the rest of the config (raise ValueError); called when the config is loaded."""

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        """Called once before round 1."""

    def configure_train(self, server_round: int, config: dict[str, Any]) -> None:
        """Add rule-specific keys to the round's train config (e.g. FedProx's proximal term)."""

    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        """Check what this rule reads from one client's train reply before anything uses it; raise
        :class:`InvalidReply` (the client's recorded failure) if it is unusable. The round engine calls it
        for every reply (``RoundEngine.check_reply``), after its own checks (the example count) and the
        channel's, before observers, the rule and the transforms see the reply. Default: nothing to check."""

    def aggregate(self, ctx: RoundContext, replies: list[Reply]) -> Any:
        """The next global state (in the channel's representation) from the round's valid replies."""
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """What the rule did this round (logged in metrics.jsonl under ``strategy.<key>``)."""
        return {}

    def privacy(self, cfg: Mapping[str, Any]) -> list[Any]:
        """The differential privacy the rule gives, as :class:`fedsim.privacy.Mechanism` entries (central DP:
        ``strategies/dp.py``). Default: none."""
        return []

    def state(self) -> dict[str, Any]:
        """What this component carries from one round to the next, for checkpoints: a dict of arrays,
        numbers, strings, lists and dicts. Default: nothing (stateless). A component whose behaviour in
        round t+1 depends on what it saw in round t must return it here, or resumed runs differ."""
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned (resuming a run after ``setup``)."""


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
class ServerTransform:
    """Wrapped around the aggregation rule: ``before_send`` in config order, ``after_aggregate`` in
    reverse order (the first transform is the outermost)."""

    name: ClassVar[str] = ""
    requires: ClassVar[frozenset[str]] = frozenset({PLAINTEXT_AGGREGATE})

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        """Checks against the rest of the config (raise ValueError); called when the config is loaded."""

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        """Called once before round 1."""

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
        for every reply (``RoundEngine.check_reply``), after its own checks (the example count) and the
        channel's, before observers, the rule and the transforms see the reply. Default: nothing to check."""

    def client_defenses(self) -> list[dict[str, Any]]:
        """``[[defenses]]`` entries every client must run first for this transform to work (e.g. the
        client half of a perturbation scheme). Default: none."""
        return []

    def after_aggregate(self, ctx: RoundContext, aggregate: Arrays) -> Arrays:
        """The next global model from the rule's aggregate (default: unchanged)."""
        return aggregate

    def metrics(self) -> dict[str, float]:
        """What the transform did this round (logged as ``<name>.<key>``)."""
        return {}

    def state(self) -> dict[str, Any]:
        """What this component carries from one round to the next, for checkpoints: a dict of arrays,
        numbers, strings, lists and dicts. Default: nothing (stateless). A component whose behaviour in
        round t+1 depends on what it saw in round t must return it here, or resumed runs differ."""
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned (resuming a run after ``setup``)."""


# ============================================================================= channels
class ServerChannel:
    """The server half of a channel. The global *state* is whatever the channel holds between rounds:
    plaintext arrays for the plain channel, a ciphertext for an encrypted one."""

    name: ClassVar[str] = ""
    provides: ClassVar[frozenset[str]] = frozenset()
    #: what the server does after a round in which no client's model reached the aggregate (every
    #: sampled client failed, or a secure-aggregation protocol halted): ``"stop"`` the run with an
    #: error, or ``"continue"`` with the global model unchanged (the round is recorded as failed)
    on_round_failure: str = "stop"

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        """Checks against the rest of the config (raise ValueError); called when the config is loaded."""

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        """Called once before the first exchange."""

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
        the decoded arrays). The round engine calls it once per train reply (``RoundEngine.check_reply``),
        after checking the example count; a reply standing for several clients (``Reply.contributors``)
        is checked as one. Default: no payload check (a channel with a payload must override it)."""

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

    def metrics(self) -> dict[str, float]:
        return {}

    def state(self) -> dict[str, Any]:
        """What this component carries from one round to the next, for checkpoints: a dict of arrays,
        numbers, strings, lists and dicts. Default: nothing (stateless). A component whose behaviour in
        round t+1 depends on what it saw in round t must return it here, or resumed runs differ."""
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned (resuming a run after ``setup``; the handshake is not repeated:
        a channel with a setup exchange must restore its outcome here, or resuming is refused)."""


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


@CLIENT_CHANNELS.register
class PlainClientChannel(ClientChannel):
    name = "plain"

    def decode(self, content: RecordDict, context: Context, template: Mapping[str, np.ndarray]) -> Arrays:
        return decode_arrays(content[ARRAYS])

    def encode(self, arrays: Arrays, param_names: Sequence[str], context: Context) -> dict[str, Any]:
        return {ARRAYS: arrays_record(param_names, arrays)}


# import references in [strategy], [channel], [[transforms]] must name these base classes
STRATEGIES.base, CHANNELS.base, TRANSFORMS.base = AggregationRule, ServerChannel, ServerTransform
CLIENT_CHANNELS.base = ClientChannel


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
