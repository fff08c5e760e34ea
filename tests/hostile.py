"""Hostile clients and components for the tests (tests/test_hostile.py): referenced from configs by file path.

:class:`Tamper` is a Flower mod a client puts around its own training (``[[client.flower_mods]]``): the
ClientApp trains as usual, then the mod changes the reply before it leaves the client - the realistic
threat (a buggy or malicious client controls everything it sends). :class:`TamperedEvaluation` does the
same to the replies to the server's ``evaluate`` messages (the config's Flower mods wrap training only),
as a ClientApp around the real one. :class:`NaNRule` is an aggregation rule whose aggregate is not
finite (what a broken plugin rule could produce).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedsim.protocol import (
    ARRAYS,
    CONFIG,
    EVALUATE,
    METRICS,
    NODE_PARTITION_ID,
    NUM_EXAMPLES,
    SERVER_ROUND,
    decode_arrays,
    encode_array,
)
from fedsim.seams import WeightedSumRule

WHAT = ("raise", "fill", "examples", "shape", "dtype", "drop", "extra")


class Tamper:
    """Clients ``clients`` (partition ids) change their train reply: ``what`` =

    * ``raise``: fail honestly (the reference: what a rejected reply must be equivalent to);
    * ``fill``: every float entry of the model set to ``value`` (``"nan"``, ``"inf"``, ``"1e30"``);
    * ``examples``: report ``value`` as num-examples;
    * ``shape``: entry ``entry`` (index) one row longer; ``dtype``: entry ``entry`` as float64;
    * ``drop``: entry ``entry`` left out; ``extra``: an unknown entry added."""

    def __init__(self, clients: list[int], what: str, value: str = "0", entry: int = 0):
        if what not in WHAT:
            raise ValueError(f"what must be one of {WHAT}, got {what!r}")
        self.clients, self.what, self.value, self.entry = set(clients), what, value, entry

    def __call__(self, msg: Message, context: Context, call_next: Any) -> Message:
        if int(context.node_config[NODE_PARTITION_ID]) not in self.clients:
            return call_next(msg, context)
        if self.what == "raise":
            raise RuntimeError("this client fails")
        reply = call_next(msg, context)
        content = reply.content
        if self.what == "examples":
            metrics = dict(content[METRICS])
            metrics[NUM_EXAMPLES] = int(float(self.value))
            content[METRICS] = MetricRecord(metrics)
            return reply
        names = list(content[ARRAYS].keys())
        arrays = decode_arrays(content[ARRAYS])
        k = self.entry
        if self.what == "fill":
            arrays = [np.full_like(a, float(self.value)) if a.dtype.kind == "f" else a for a in arrays]
        elif self.what == "shape":
            arrays[k] = np.concatenate([arrays[k], arrays[k][:1]])
        elif self.what == "dtype":
            arrays[k] = arrays[k].astype(np.float64)
        elif self.what == "drop":
            del names[k], arrays[k]
        elif self.what == "extra":
            names.append("evil.weight")
            arrays.append(np.zeros(3, dtype=np.float32))
        content[ARRAYS] = ArrayRecord(OrderedDict((n, encode_array(a)) for n, a in zip(names, arrays)))
        return reply


class TamperedEvaluation:
    """The ClientApp ``app``, except that clients change their reply to an ``evaluate`` message -
    client-side evaluation (``evaluate.client_fraction``) and the evaluation a client does for the server
    when the server cannot read the model - after ``app`` answered: ``cases`` maps (round, partition id)
    to ``(what, key, value)``; every other reply is honest.

    * ``raise``: fail honestly (the reference);
    * ``set``: metric ``key`` set to ``value`` (any MetricRecord value: NaN, a list, ...);
    * ``drop``: metric ``key`` left out; ``no-metrics``: no metrics record at all;
    * ``as-text``: the metrics sent as a ConfigRecord of strings."""

    def __init__(self, app: Any, cases: dict[tuple[int, int], tuple[str, str, Any]]):
        self.app, self.cases = app, dict(cases)

    def __call__(self, msg: Message, context: Context) -> Message:
        rnd = int(msg.content[CONFIG][SERVER_ROUND]) if CONFIG in msg.content else -1
        case = self.cases.get((rnd, int(context.node_config[NODE_PARTITION_ID])))
        if msg.metadata.message_type != EVALUATE or case is None:
            return self.app(msg, context)
        what, key, value = case
        if what == "raise":
            raise RuntimeError("this client fails")
        reply = self.app(msg, context)
        metrics = dict(reply.content[METRICS])
        if what == "set":
            metrics[key] = value
        elif what == "drop":
            del metrics[key]
        content = RecordDict()
        if what == "as-text":
            content[METRICS] = ConfigRecord({k: str(v) for k, v in metrics.items()})
        elif what != "no-metrics":
            content[METRICS] = MetricRecord(metrics)
        return Message(content, reply_to=msg)


class NaNRule(WeightedSumRule):
    """FedAvg's weights, then a NaN in the aggregate."""

    name = "nan-rule"
    stateless = True

    def weights(self, ctx: Any, replies: list[Any]) -> list[float]:
        return [float(r.num_examples) for r in replies]

    def aggregate(self, ctx: Any, replies: list[Any]) -> Any:
        out = [np.array(a) for a in super().aggregate(ctx, replies)]
        out[0].flat[0] = np.nan
        return out
