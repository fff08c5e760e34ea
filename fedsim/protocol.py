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

import io
import json
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType

from fedsim.training.schedule import scheduled_lr

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
MOMENTUM = "momentum"  # local SGD momentum (sent only when set)
WEIGHT_DECAY = "weight_decay"  # local weight decay (sent only when set)
PROXIMAL_MU = "proximal-mu"  # FedProx's proximal term (Flower's FedProx.configure_train sets this key)
RECIPE_KEYS = (LR, BATCH_SIZE, LOCAL_STEPS, LOCAL_EPOCHS, MOMENTUM, WEIGHT_DECAY, PROXIMAL_MU)
EVAL_DATA = "eval-data"  # evaluate message: "test" (the common test split, default) or "local" (the client's data)
STAGE = "stage"  # a channel's setup stage (e.g. key agreement)
REPORT_TRAIN_LOSS = "report-train-loss"  # train: also report the trained model's loss on the training split
CROSSVAL_MODELS = "crossval-models"  # cross-validation: how many models the message carries (see for_model)
PARTITIONS = "partitions"  # the virtual clients (partition ids) a message to a node addresses
STATE_MIRROR = "fedsim.state-mirror"  # folder a client mirrors its Context.state to (runs that checkpoint)
RESUMED_AT = "fedsim.resumed-at"  # in a resumed run: the checkpointed round the run continues after

# ---- MetricRecord keys (client -> server)
PARTITION_ID = "partition-id"
NUM_EXAMPLES = "num-examples"
NOISE_VARIANCE = "noise_variance"  # per-entry variance of the noise the client's defenses declare
TRAIN_LOSS = "train_loss"
TRAIN_ACCURACY = "train_accuracy"
EVAL_LOSS = "eval_loss"
EVAL_ACCURACY = "eval_accuracy"
EVAL_EXAMPLES = "eval_examples"
EVAL_SOURCE_ACCURACY = "eval_source_accuracy"  # evaluate reply: accuracy on each test source, in order
HOSTED_PARTITIONS = "hosted-partitions"  # query reply: the partitions a node serves
FINAL_TRAIN_LOSS = "final_train_loss"  # train reply (if asked): loss of the trained model on the training split
CROSSVAL_LOSSES = "crossval-losses"  # cross-validation reply: each model's loss on the validation split
VAL_EXAMPLES = "val-examples"  # cross-validation reply: size of the client's validation split
CLIENT_ID_KEYS = (PARTITION_ID, NUM_EXAMPLES)  # per-client bookkeeping, meaningless when averaged

# ---- a virtual client's failure inside a multi-client message (ConfigRecord record, see for_partition)
ERROR = "error"
ERROR_REASON = "reason"

# ---- CHANNEL record keys (encrypted channels; see channels/paillier/ and channels/ckks.py)
PAYLOAD = "payload"  # ciphertexts: a client's encrypted model, or the encrypted global model
CODEC = "codec"  # the channel's encoding settings (JSON), declared once on the server half
RUN_TAG = "run-tag"  # binds sealed keys to this run
X25519_PUBLIC = "x25519-public"  # a client's key-agreement public key
PEERS = "peers"  # partition ids the key holder seals the private key for
PEER_KEYS = "peer-keys"  # their X25519 public keys, same order
HOLDER = "holder"  # the key-holding client's partition id
HOLDER_KEY = "holder-key"  # its X25519 public key
PUBLIC_KEY = "public-key"  # the Paillier public key
SEALED = "sealed"  # the Paillier private key sealed for one client (or, from the holder, for each peer)
FINGERPRINT = "fingerprint"  # a client's confirmation of the public key it holds the private key of
ENCRYPT_SECONDS = "encrypt-seconds"  # online (critical-path) encryption time of one reply
CLIPPED = "clipped"  # values the quantizer clipped in one reply
INLINE_OBFUSCATORS = "inline-obfuscators"  # obfuscators computed on the critical path for one reply
PAYLOADS = "payloads"  # server -> client: the ciphertexts that, decrypted in order, give the global model
ROUNDS = "rounds"  # the round each of PAYLOADS is the aggregate update of (update encryption)
BASE = "base"  # the round whose global model PAYLOADS' updates start from (0: the initial model, in ARRAYS)
RANGE_EXPONENT = "range-exponent"  # train reply (update encryption): e with max|update| <= 2**e; no payload yet
CLIP = "clip"  # channel setup "encrypt": the round's common clipping range 2**max(e) the clients encrypt at
ROUND_WEIGHT = "round-weight"  # channel setup "encrypt": the round's largest total weight (fixes the packing layout)
HELD_ROUND = "held-round"  # channel setup "advance" reply: the round whose global model the client now holds
DECRYPT_SECONDS = "decrypt-seconds"  # channel setup "advance" reply: the client's time to decode what it got

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
STATE_CHANNEL_MODEL = "fedsim.channel-model"  # the global model this client last trained on (update encryption)
STATE_CHANNEL_PENDING = "fedsim.channel-pending"  # a trained update waiting for the round's common clip
STATE_MIRROR_MARK = "fedsim.mirror-mark"  # the client's state was mirrored/restored in this session

# ---- message types
TRAIN = MessageType.TRAIN  # local training; reply: the client's model (through the channel)
EVALUATE = MessageType.EVALUATE  # evaluate the global model on the common test split (encrypted channels)
QUERY = MessageType.QUERY  # discovery: reply with the node's partition id
CHANNEL_SETUP_ACTION = "channel"
CHANNEL_SETUP = f"{MessageType.QUERY}.{CHANNEL_SETUP_ACTION}"  # a channel's setup exchange (key agreement, key delivery)
CROSS_VALIDATE_ACTION = "crossval"
# evaluate several models on the client's validation split (FedBoosting, strategies/fedboosting.py)
CROSS_VALIDATE = f"{MessageType.EVALUATE}.{CROSS_VALIDATE_ACTION}"


# ---- virtual clients: one node serving several partitions -------------------------------------------
# A message to a node that serves several partitions lists them under PARTITIONS in its CONFIG; records
# meant for one partition only carry the suffix ``@<partition>`` (for_partition), records without a
# suffix are shared. The reply carries each partition's records with the same suffix.
def for_partition(record: str, partition: int) -> str:
    return f"{record}@{int(partition)}"


def split_partition(record: str) -> tuple[str, int | None]:
    base, sep, tail = record.rpartition("@")
    return (base, int(tail)) if sep and tail.isdigit() else (record, None)


def hosted_partitions(node_index: int, clients_per_node: int, num_clients: int) -> list[int]:
    """The partitions node ``node_index`` serves when each node serves ``clients_per_node`` of them."""
    k = max(1, int(clients_per_node))
    return list(range(node_index * k, min(int(num_clients), (node_index + 1) * k)))


def num_nodes(num_clients: int, clients_per_node: int) -> int:
    k = max(1, int(clients_per_node))
    return -(-int(num_clients) // k)


# ---- several models in one message: each model's records carry the suffix ``#<k>`` (k = 0, 1, ...);
# CROSSVAL_MODELS in the CONFIG record says how many. The suffix goes before a partition suffix.
def for_model(record: str, k: int) -> str:
    return f"{record}#{int(k)}"


def split_model(record: str) -> tuple[str, int | None]:
    base, sep, tail = record.rpartition("#")
    return (base, int(tail)) if sep and tail.isdigit() else (record, None)


# ---- helpers both sides use ------------------------------------------------------------------------
def arrays_record(names: Sequence[str], arrays: Sequence[np.ndarray]) -> ArrayRecord:
    """Arrays in ``names`` order as an ArrayRecord (contiguous copies where needed)."""
    return ArrayRecord(OrderedDict((n, encode_array(a)) for n, a in zip(names, arrays)))


_NPY_HEADERS: dict[tuple[str, tuple[int, ...]], bytes] = {}


def encode_array(a: np.ndarray) -> Array:
    """An array as Flower's ``Array``, the same bytes as ``Array(ndarray)`` (``np.save``'s .npy format)
    without ``np.save`` per array: the header of a (dtype, shape) is made once and reused, the data is
    the C-ordered buffer. Structured and object dtypes go through Flower's own path."""
    a = np.ascontiguousarray(a)
    if a.dtype.fields is not None or a.dtype.hasobject:
        return Array(a)
    shape = tuple(int(d) for d in a.shape)
    key = (a.dtype.str, shape)
    header = _NPY_HEADERS.get(key)
    if header is None:
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(a))
        header = _NPY_HEADERS.setdefault(key, buf.getvalue()) if len(_NPY_HEADERS) < 4096 else buf.getvalue()
    return Array(dtype=str(a.dtype), shape=shape, stype="numpy.ndarray", data=header + a.tobytes())


def decode_array(arr: Array, writable: bool = True) -> np.ndarray:
    """An ``Array`` as NumPy without re-parsing the npy header (Flower's ``Array.numpy`` runs
    ``np.load``, whose header parser costs ~40 us per array). Falls back to ``Array.numpy`` for anything
    but a C-ordered numpy payload whose size matches its dtype and shape."""
    if arr.stype == "numpy.ndarray":
        dtype = np.dtype(arr.dtype)
        count = int(np.prod(arr.shape, dtype=np.int64))
        offset = len(arr.data) - count * dtype.itemsize
        header = arr.data[:offset]
        if offset > 0 and b"'fortran_order': False" in header and dtype.str.encode() in header:
            out = np.frombuffer(arr.data, dtype=dtype, count=count, offset=offset).reshape(arr.shape)
            return out.copy() if writable else out
    return arr.numpy()


def decode_arrays(record: ArrayRecord, writable: bool = True) -> list[np.ndarray]:
    """Every array of a record, in order (see :func:`decode_array`)."""
    return [decode_array(a, writable) for a in record.values()]


def train_config(cfg: Mapping[str, Any], server_round: int | None = None) -> ConfigRecord:
    """What every server -> client message carries: the recipe and the resolved config."""
    t = cfg["train"]
    lr = scheduled_lr(t, server_round or 1, int(cfg["federation"]["rounds"])) if server_round else float(t["lr"])
    rec: dict[str, Any] = {LR: float(lr), BATCH_SIZE: int(t["batch_size"]),
                           FEDSIM_CONFIG: json.dumps(cfg, sort_keys=True)}
    if t.get("local_steps"):
        rec[LOCAL_STEPS] = int(t["local_steps"])
    else:
        rec[LOCAL_EPOCHS] = int(t["local_epochs"])
    for key in (MOMENTUM, WEIGHT_DECAY):
        if t.get(key):
            rec[key] = float(t[key])
    if server_round is not None:
        rec[SERVER_ROUND] = int(server_round)
    return ConfigRecord(rec)


def config_text(cfg: Mapping[str, Any]) -> str:
    """The exact config text a message carries (the key of the clients' per-process caches)."""
    return json.dumps(cfg, sort_keys=True)


def recipe_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The local-training recipe keys of a train ConfigRecord."""
    return {k: config[k] for k in RECIPE_KEYS if k in config}
