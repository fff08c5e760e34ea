"""A client's reply as the server holds it, and the checks every reply passes before anything uses it.

* :class:`Reply` - one client's reply (arrays decoded once, on first use; the records of one virtual client
  of a node read through its suffix);
* :class:`ModelSpec` - the global model's names, shapes and dtypes, what every reply's model is checked
  against;
* :class:`ReplyChecker` - one mechanism for every channel: the example count, the defenses' extra arrays,
  then the hooks of the channel, the rule and the transforms (``check_reply``), then the update's norm
  bound; and the checks of an ``evaluate`` reply;
* :class:`InvalidReply` (and :class:`ChannelError`) - a reply that fails is its client's recorded failure,
  never the server's crash.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord

from fedsim.protocol import (
    ARRAYS,
    EVAL_ACCURACY,
    EVAL_EXAMPLES,
    EVAL_LOSS,
    EVAL_SOURCE_ACCURACY,
    EXTRAS,
    METRICS,
    NUM_EXAMPLES,
    decode_array,
    decode_arrays,
)

Arrays = list[np.ndarray]

#: a check of one reply: raises :class:`InvalidReply` when the reply cannot be used
ReplyCheck = Callable[["Reply"], None]


def _is_finite_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


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


class Reply:
    """One valid client reply as the server holds it; arrays are decoded once, on first use.

    A node serving several partitions (virtual clients) answers for all of them in one message; each
    partition's records carry the suffix ``@<partition>`` and :meth:`record` reads through it."""

    def __init__(self, message: Message, partition: int, suffix: str = ""):
        self.message = message
        self.node_id = message.metadata.src_node_id
        self.partition = partition
        self.suffix = suffix
        self.metrics: dict[str, Any] = dict(self.record(METRICS)) if self.has(METRICS) else {}
        # as the client reported it; RoundEngine.check_reply replaces it by the checked count
        n = self.metrics.get(NUM_EXAMPLES, 0)
        self.num_examples = int(n) if isinstance(n, int) else 0
        self._arrays: list[np.ndarray] | None = None
        self.extra: dict[str, Any] = {}  # what the channel parsed from the payload
        self.contributors: list[int] = []  # for a reply that stands for several clients (secure aggregation)

    def has(self, name: str) -> bool:
        return name + self.suffix in self.message.content

    def record(self, name: str) -> Any:
        """This client's record ``name`` (one of fedsim.protocol's record names)."""
        return self.message.content[name + self.suffix]

    @property
    def arrays(self) -> list[np.ndarray]:
        if self._arrays is None:
            self._arrays = decode_arrays(self.record(ARRAYS), writable=False)
        return self._arrays

    @arrays.setter
    def arrays(self, arrays: list[np.ndarray]) -> None:
        """The decoded model (a channel's ``check_reply`` sets it once it has checked it)."""
        self._arrays = list(arrays)


class ReplyHook(Protocol):
    """A component that checks what it reads from a train reply (the channel, the rule, each transform)."""

    def check_reply(self, reply: Reply, model: ModelSpec) -> None: ...


class ReplyChecker:
    """Everything a reply must satisfy before anything uses it (one mechanism for every channel): the example
    count (a positive integer up to ``federation.max_examples``, or the training set's size when unset), the
    defenses' extra arrays (decodable, finite), then the ``check_reply`` hooks in order - the channel's payload
    check (``ServerChannel.check_reply``: for the plain channel the model's names, shapes, dtypes and finite
    values), the rule's and the transforms' own checks of what they read - and the update's norm
    (``federation.max_update_norm``). ``evaluate`` replies: :meth:`check_evaluation`."""

    def __init__(self, cfg: Mapping[str, Any], model: ModelSpec, hooks: Sequence[ReplyHook], max_examples: int,
                 max_eval_examples: int):
        self.cfg, self.model, self.hooks = cfg, model, list(hooks)
        self.max_examples, self.max_eval_examples = max_examples, max_eval_examples
        self.max_update_norm = cfg["federation"].get("max_update_norm")

    def check_count(self, value: Any, key: str = NUM_EXAMPLES, contributors: int = 1,
                    bound: int | None = None) -> int:
        """An example count a client reported: a positive integer up to ``federation.max_examples`` (per
        client a reply stands for). Returns it as an int; raises :class:`InvalidReply`."""
        if not _is_finite_number(value) or value != int(value):
            raise InvalidReply(f"{key} must be a positive integer, got {value!r}")
        n, most = int(value), (bound or self.max_examples) * max(1, contributors)
        if n < 1:
            raise InvalidReply(f"{key} = {n}: a client's count of examples must be at least 1")
        if n > most:
            where = "federation.max_examples" if self.cfg["federation"].get("max_examples") else \
                "the training set's size (federation.max_examples unset)"
            if bound is not None and bound != self.max_examples:  # an evaluation: the test split may be larger
                where = f"the larger of {where} and the test split's size"
            raise InvalidReply(f"{key} = {n} is above {where} = {bound or self.max_examples}"
                               + (f" x {contributors} contributors" if contributors > 1 else ""))
        return n

    @staticmethod
    def check_metrics(reply: Reply, *keys: str) -> dict[str, Any]:
        """The reply's metrics: a MetricRecord holding ``keys``; raises :class:`InvalidReply`."""
        if not reply.has(METRICS):
            raise InvalidReply("the reply carries no metrics record")
        if not isinstance(reply.record(METRICS), MetricRecord):
            raise InvalidReply(f"the reply's metrics are a {type(reply.record(METRICS)).__name__}, not a MetricRecord")
        missing = [k for k in keys if k not in reply.metrics]
        if missing:
            raise InvalidReply(f"the reply's metrics lack {', '.join(missing)}")
        return reply.metrics

    def check_reply(self, reply: Reply, sent: Sequence[np.ndarray] | None) -> None:
        """Everything a train reply must satisfy before anything uses it (see the class docstring); raises
        :class:`InvalidReply`. ``sent``: the plaintext model the clients received (for the norm bound)."""
        self.check_metrics(reply, NUM_EXAMPLES)
        reply.num_examples = self.check_count(reply.metrics[NUM_EXAMPLES], contributors=len(reply.contributors))
        if reply.has(EXTRAS):  # the defenses' extra arrays: observers and transforms decode them
            extras = reply.record(EXTRAS)
            if not isinstance(extras, ArrayRecord):
                raise InvalidReply(f"the reply's {EXTRAS} record is a {type(extras).__name__}, not an ArrayRecord")
            for name, arr in extras.items():
                try:
                    a = decode_array(arr, writable=False)
                except Exception as exc:  # noqa: BLE001 - a damaged payload: name the entry
                    raise InvalidReply(f"extra array {name!r} cannot be decoded ({type(exc).__name__})") from None
                if a.dtype.kind in "fc" and not np.isfinite(a).all():
                    raise InvalidReply(f"extra array {name!r} holds non-finite values")
        for hook in self.hooks:  # the channel's, the rule's, the transforms'
            hook.check_reply(reply, self.model)
        if self.max_update_norm is not None and sent is not None:
            sq = sum(float(np.sum((np.asarray(a, dtype=np.float64) - np.asarray(s, dtype=np.float64)) ** 2))
                     for a, s, dt in zip(reply.arrays, sent, self.model.dtypes) if dt.kind == "f")
            if not math.sqrt(sq) <= self.max_update_norm:
                raise InvalidReply(f"the update's L2 norm {math.sqrt(sq):.4g} is above federation.max_update_norm "
                                   f"= {self.max_update_norm:g}")

    def check_evaluation(self, reply: Reply) -> None:
        """An ``evaluate`` reply: a metrics record with a finite loss >= 0 (the evaluation's cross-entropy
        never is negative), an accuracy in [0, 1], a positive example count (at most the larger of
        ``federation.max_examples`` and the test split) and (when it sends them) accuracies per test source
        in [0, 1]."""
        m = self.check_metrics(reply, EVAL_LOSS, EVAL_ACCURACY, EVAL_EXAMPLES)
        loss, acc = m[EVAL_LOSS], m[EVAL_ACCURACY]
        if not _is_finite_number(loss) or loss < 0:
            raise InvalidReply(f"{EVAL_LOSS} must be a finite number >= 0, got {loss!r}")
        if not _is_finite_number(acc):
            raise InvalidReply(f"{EVAL_ACCURACY} must be a finite number, got {acc!r}")
        if not 0 <= acc <= 1:
            raise InvalidReply(f"{EVAL_ACCURACY} must be in [0, 1], got {acc!r}")
        self.check_count(m[EVAL_EXAMPLES], EVAL_EXAMPLES, bound=self.max_eval_examples)
        per = m.get(EVAL_SOURCE_ACCURACY)
        if per is not None and not (isinstance(per, list) and len(per) <= 64 and all(
                _is_finite_number(a) and 0 <= a <= 1 for a in per)):
            raise InvalidReply(f"{EVAL_SOURCE_ACCURACY} must be a list of accuracies in [0, 1], got {str(per)[:100]}")
