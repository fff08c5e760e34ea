"""Flower's SecAgg+ as a channel, client half (see channels/secagg/server.py for the protocol wiring).

``wrap_train`` puts Flower's ``secaggplus_mod`` around the ClientApp's train handler. The mod answers
the protocol's stages itself (key generation, key sharing, unmasking) and, in the
``collect_masked_vectors`` stage, calls the handler with a legacy ``FitIns`` message and masks the
``FitRes`` it gets back. Between the two sits :func:`legacy_fit`, which turns the ``FitIns`` into the
message fedsim's own training code expects (``CONFIG`` from the FitIns config, the global arrays under
``ARRAYS``, the transforms' ``EXTRAS``) and the reply back into a ``FitRes`` (the trained arrays, the
example count, the scalar metrics). Defenses and ``[[client.flower_mods]]`` run inside, on the model
before it is masked, as under every other channel.

The settings the client needs (clipping range, quantization range, max weight, and the model's
parameter names, which legacy ``Parameters`` do not carry) come from the server's
``collect_masked_vectors`` message (``CODEC``), declared once on the server half. Flower's mod rounds
stochastically with NumPy's global generator; it is seeded from (seed, round, client) between training
and the rounding (and restored afterwards) so that a run is reproducible. The masks come from
``os.urandom``.
"""
from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat

from fedsim.protocol import (
    ARRAYS,
    CHANNEL,
    CLIPPED,
    CODEC,
    CONFIG,
    EXTRAS,
    FEDSIM_CONFIG,
    METRICS,
    NODE_PARTITION_ID,
    NUM_EXAMPLES,
    SERVER_ROUND,
    arrays_record,
    decode_arrays,
)
from fedsim.seams import Handler, PlainClientChannel
from fedsim.seeding import derive_seed


@contextmanager
def restored_numpy() -> Iterator[None]:
    """NumPy's global generator state is put back after the block."""
    saved = np.random.get_state()
    try:
        yield
    finally:
        np.random.set_state(saved)


def clipped_count(arrays: list[np.ndarray], num_examples: int, settings: dict[str, Any]) -> int:
    """Values Flower's quantizer will clip: it scales the model by round(n / max_weight * T) / T and
    clips to [-clipping_range, clipping_range]."""
    T = int(settings["quantization_range"])
    ratio = round(num_examples / float(settings["max_weight"]) * T) / T
    c = float(settings["clipping_range"])
    return int(sum(np.count_nonzero(np.abs(np.asarray(a, dtype=np.float64) * ratio) > c) for a in arrays))


def legacy_fit(handler: Handler) -> Handler:
    """``handler`` (fedsim's train handler) as a legacy FitIns -> FitRes handler for ``secaggplus_mod``.

    On return it seeds NumPy's global generator from (seed, round, client): the mod's stochastic rounding,
    which comes next, is then reproducible (the caller restores the generator afterwards)."""

    def fit(msg: Message, context: Context) -> Message:
        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        settings = json.loads(str(msg.content[CHANNEL][CODEC]))
        arrays = parameters_to_ndarrays(fitins.parameters)
        if len(arrays) != len(settings["names"]):
            raise ValueError(f"channel secagg+: {len(arrays)} arrays for a model of {len(settings['names'])}")
        content = RecordDict({CONFIG: ConfigRecord(dict(fitins.config)),
                              ARRAYS: arrays_record(settings["names"], arrays)})
        if EXTRAS in msg.content:
            content[EXTRAS] = msg.content[EXTRAS]
        reply = handler(Message(content=content, metadata=copy.copy(msg.metadata)), context)
        if reply.has_error():
            raise RuntimeError(reply.error.reason if reply.error else "training failed")
        if EXTRAS in reply.content:
            raise ValueError("channel secagg+: the defenses' extra reply arrays cannot travel under SecAgg+ "
                             "(the server would see one client's arrays); use a channel that gives the server "
                             "each client's reply")
        trained = decode_arrays(reply.content[ARRAYS])
        metrics = dict(reply.content[METRICS])
        n = int(metrics[NUM_EXAMPLES])
        if n > float(settings["max_weight"]):
            raise ValueError(f"channel.max_weight ({settings['max_weight']:g}) is below this client's example count "
                             f"({n}): SecAgg+ would clip its weighted model; raise channel.max_weight")
        metrics[CLIPPED] = clipped_count(trained, n, settings)
        scalars = {k: v for k, v in metrics.items()
                   if isinstance(v, (int, float, str, bytes)) and not isinstance(v, bool)}
        fitres = FitRes(Status(Code.OK, "OK"), ndarrays_to_parameters(trained), n, scalars)
        conf = msg.content[CONFIG]
        seed = json.loads(str(conf[FEDSIM_CONFIG]))["seed"]
        np.random.seed(derive_seed(seed, int(conf[SERVER_ROUND]), int(context.node_config[NODE_PARTITION_ID]),
                                   0x5EC) % 2 ** 32)
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)

    return fit


class SecAggPlusClientChannel(PlainClientChannel):
    """Inside training the model travels as plain arrays (``decode``/``encode`` of the plain channel):
    it leaves the client only through ``secaggplus_mod``, quantized and masked."""

    name = "secagg+"

    def wrap_train(self, handler: Handler) -> Handler:
        fit = legacy_fit(handler)

        def run(msg: Message, context: Context) -> Message:
            if RECORD_KEY_CONFIGS not in msg.content:
                raise ValueError("channel secagg+: a train message outside the SecAgg+ protocol (no stage)")
            if msg.content[RECORD_KEY_CONFIGS].get(Key.STAGE) != Stage.COLLECT_MASKED_VECTORS:
                return secaggplus_mod(msg, context, fit)
            with restored_numpy():  # fit seeds it for the rounding that follows training
                return secaggplus_mod(msg, context, fit)

        return run
