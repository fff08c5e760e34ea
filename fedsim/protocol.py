"""The message protocol: every key and message type that crosses the wire between server and clients.

Client and server code use these names and nothing else; ``tests/test_architecture.py`` checks that
no package spells one of these keys as a string literal of its own.

A message's content is a Flower ``RecordDict`` with these records:

=================  ===============  =========================================================================
record             type             what
=================  ===============  =========================================================================
``ARRAYS``         ArrayRecord      model weights (plain channel): the global model sent, a client's model back
``CONFIG``         ConfigRecord     server -> client: the round, the recipe, the resolved fedsim config (JSON)
``METRICS``        MetricRecord     client -> server: example count, partition id, training/defense metrics
``CHANNEL``        ConfigRecord     channel payloads (ciphertexts, public keys, sealed keys), see each channel
``EXTRAS``         ArrayRecord      extra per-client arrays a server transform asks for (noise terms, ...)
=================  ===============  =========================================================================

Message types follow Flower's ``<category>[.<action>]`` form (actions are Python identifiers).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType

# ---- records of a message's RecordDict
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
CHANNEL = "channel"
EXTRAS = "extras"

# ---- ConfigRecord keys (server -> client)
SERVER_ROUND = "server-round"
FEDSIM_CONFIG = "fedsim-config"  # the resolved config as JSON: the client needs nothing else
LR = "lr"
BATCH_SIZE = "batch_size"
LOCAL_STEPS = "local_steps"
LOCAL_EPOCHS = "local_epochs"
RECIPE_KEYS = (LR, BATCH_SIZE, LOCAL_STEPS, LOCAL_EPOCHS)
STAGE = "stage"  # a channel's setup stage (e.g. key agreement)

# ---- MetricRecord keys (client -> server)
PARTITION_ID = "partition-id"
NUM_EXAMPLES = "num-examples"
NOISE_VARIANCE = "noise_variance"  # per-entry variance of the noise the client's defenses declare
TRAIN_LOSS = "train_loss"
TRAIN_ACCURACY = "train_accuracy"
EVAL_LOSS = "eval_loss"
EVAL_ACCURACY = "eval_accuracy"
EVAL_EXAMPLES = "eval_examples"
CLIENT_ID_KEYS = (PARTITION_ID, NUM_EXAMPLES)  # per-client bookkeeping, meaningless when averaged

# ---- EXTRAS array names of seed 002's lossless perturbation (strategies/lossless.py <-> clients/lossless.py)
LOSSLESS_MODEL = "lossless.model."  # + state-dict name: the perturbed model W^ in float64 (server -> client)
LOSSLESS_R_A = "lossless.r_a"  # public additive noise r^(a), float64 (server -> client)
LOSSLESS_GROUPS = "lossless.groups"  # public output partition I_1..I_m, int64 (server -> client)
LOSSLESS_TERMS = "lossless.terms"  # fedsim.lossless.ClientTerms.to_arrays() flattened into one float64 array (client -> server)

# ---- node config keys (set by Flower's simulation engine and by the in-process grid)
NODE_PARTITION_ID = "partition-id"
NODE_NUM_PARTITIONS = "num-partitions"

# ---- client state (Flower's per-node Context.state; never sent)
STATE_DEFENSES = "fedsim.defense-state"
STATE_CHANNEL = "fedsim.channel-state"

# ---- message types
TRAIN = MessageType.TRAIN  # local training; reply: the client's model (through the channel)
EVALUATE = MessageType.EVALUATE  # evaluate the global model on the common test split (encrypted channels)
QUERY = MessageType.QUERY  # discovery: reply with the node's partition id
CHANNEL_SETUP = f"{MessageType.QUERY}.channel"  # a channel's setup exchange (key agreement, key delivery)


# ---- helpers both sides use ------------------------------------------------------------------------
def arrays_record(names: Sequence[str], arrays: Sequence[np.ndarray]) -> ArrayRecord:
    """Arrays in ``names`` order as an ArrayRecord (contiguous copies where needed)."""
    return ArrayRecord(OrderedDict((n, Array(np.ascontiguousarray(a))) for n, a in zip(names, arrays)))


def train_config(cfg: Mapping[str, Any], server_round: int | None = None) -> ConfigRecord:
    """What every server -> client message carries: the recipe and the resolved config."""
    t = cfg["train"]
    rec: dict[str, Any] = {LR: float(t["lr"]), BATCH_SIZE: int(t["batch_size"]),
                           FEDSIM_CONFIG: json.dumps(cfg, sort_keys=True)}
    if t.get("local_steps"):
        rec[LOCAL_STEPS] = int(t["local_steps"])
    else:
        rec[LOCAL_EPOCHS] = int(t["local_epochs"])
    if server_round is not None:
        rec[SERVER_ROUND] = int(server_round)
    return ConfigRecord(rec)


def config_text(cfg: Mapping[str, Any]) -> str:
    """The exact config text a message carries (the key of the clients' per-process caches)."""
    return json.dumps(cfg, sort_keys=True)


def recipe_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The local-training recipe keys of a train ConfigRecord."""
    return {k: config[k] for k in RECIPE_KEYS if k in config}
