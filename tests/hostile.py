"""Hostile clients and components for the tests (tests/test_hostile.py): referenced from configs by file path.

:class:`Tamper` is a Flower mod a client puts around its own training (``[[client.flower_mods]]``): the
ClientApp trains as usual, then the mod changes the reply before it leaves the client - the realistic
threat (a buggy or malicious client controls everything it sends). :class:`NaNRule` is an aggregation
rule whose aggregate is not finite (what a broken plugin rule could produce).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord

from fedsim.protocol import ARRAYS, METRICS, NODE_PARTITION_ID, NUM_EXAMPLES, decode_arrays, encode_array
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


class NaNRule(WeightedSumRule):
    """FedAvg's weights, then a NaN in the aggregate."""

    name = "nan-rule"

    def weights(self, ctx: Any, replies: list[Any]) -> list[float]:
        return [float(r.num_examples) for r in replies]

    def aggregate(self, ctx: Any, replies: list[Any]) -> Any:
        out = [np.array(a) for a in super().aggregate(ctx, replies)]
        out[0].flat[0] = np.nan
        return out
