"""The Paillier channel, server half (seed 003 §4.2.2, Alg. 2, eq. 4.4): ``[channel] name = "paillier"``.

Clients quantize their model, pack many values per Paillier plaintext and encrypt (``fedsim.crypto``);
the server verifies each payload with the public key alone, combines the payloads homomorphically
with integer weights ``w_i = round(p_i * precision)`` (``p_i``: the aggregation rule's weights, e.g.
FedAvg's example shares) and never decrypts: the global model it holds after round 1 is a ciphertext.
Clients decrypt it at the start of the next round; the global model's accuracy is measured by a client
(an ``evaluate`` message) on the common test split.

Keys never reach the server. Before round 1 (``handshake``):

1. ``hello``: every client makes an X25519 key pair and sends its public key;
2. ``keygen``: the key holder (the lowest partition id that answered: the thesis' "client 1") makes
   the Paillier key pair and seals the private key for every other client under their pairwise X25519
   secret (HKDF + AES-GCM, bound to the run, sender and recipient); it returns the public key and the
   sealed boxes;
3. ``deliver``: the server relays each client its box; the client opens it, checks the private key
   against the public key and confirms the public key's fingerprint.

The server only ever holds public keys, sealed boxes and ciphertexts. Threat model (thesis §4.4):
an honest-but-curious server that colludes with no client. docs/paillier.md says what breaks if a
client colludes or the server is malicious.
"""
from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any, Mapping, Sequence

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from fedsim.components import CHANNELS
from fedsim.crypto.errors import IntegrityError
from fedsim.crypto.packing import MAX_TOTAL_WEIGHT, packing_layout
from fedsim.crypto.paillier import (
    DEFAULT_KEY_BITS,
    MIN_KEY_BITS,
    combine,
    key_fingerprint,
    public_key_from_bytes,
    public_key_to_bytes,
    verify,
)
from fedsim.crypto.quantize import Quantizer, integer_weights
from fedsim.protocol import (
    ARRAYS,
    CHANNEL,
    CHANNEL_SETUP,
    CLIPPED,
    CODEC,
    CONFIG,
    ENCRYPT_SECONDS,
    FINGERPRINT,
    HOLDER,
    HOLDER_KEY,
    INLINE_OBFUSCATORS,
    PAYLOAD,
    PEER_KEYS,
    PEERS,
    PUBLIC_KEY,
    RUN_TAG,
    SEALED,
    STAGE,
    X25519_PUBLIC,
    arrays_record,
    train_config,
)
from fedsim.rounds import Reply, RoundContext
from fedsim.seams import WEIGHTED_SUM, ChannelError, ModelSpec, ServerChannel

log = logging.getLogger("fedsim")


class EncryptedModel:
    """The global model as the server holds it after round 1: a combined Paillier payload."""

    def __init__(self, payload: bytes):
        self.payload = payload


@CHANNELS.register
class PaillierChannel(ServerChannel):
    """Paillier-encrypted weighted sums (parameters: ``key_bits``, ``bits`` and ``clip`` of the
    quantizer, ``overflow`` = clip | raise, ``precision`` = P of the integer weights, ``packed``,
    ``slots``; see docs/paillier.md for the error bound and the overflow rule)."""

    name = "paillier"
    provides = frozenset({WEIGHTED_SUM})

    def __init__(self, key_bits: int = DEFAULT_KEY_BITS, bits: int = 16, clip: float = 4.0, overflow: str = "clip",
                 precision: int = 4096, packed: bool = True, slots: int | None = None):
        if key_bits < MIN_KEY_BITS:
            raise ValueError(f"channel.key_bits must be >= {MIN_KEY_BITS}, got {key_bits}")
        if precision < 1:
            raise ValueError(f"channel.precision must be an integer >= 1, got {precision}")
        self.quantizer = Quantizer(bits=bits, clip=clip, overflow=overflow)  # ValueErrors name channel.*
        self.key_bits, self.precision, self.packed, self.slots = int(key_bits), int(precision), bool(packed), slots
        self.public_key = None
        self._metrics: dict[str, float] = {}

    # ---- configuration ------------------------------------------------------------------------------
    def max_total_weight(self, cfg: Mapping[str, Any]) -> int:
        """Integer weights round ``p_i * P`` to the nearest integer: their sum is at most ``P + N/2``."""
        fed = cfg["federation"]
        n = fed["clients_per_round"] or fed["num_clients"]
        return self.precision + n

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        total = self.max_total_weight(cfg)
        if total > MAX_TOTAL_WEIGHT:
            raise ValueError(f"channel.precision = {self.precision} (+ {total - self.precision} clients per round) "
                             f"exceeds the largest total weight a slot supports ({MAX_TOTAL_WEIGHT})")
        if self.packed:  # refuses a layout that could overflow a slot or the plaintext (names the key)
            packing_layout(self.key_bits, self.quantizer.bits, total, slots=self.slots)
        elif self.slots not in (None, 1):
            raise ValueError(f"channel.slots must be 1 (or unset) without packing, got {self.slots}")
        if self.key_bits < DEFAULT_KEY_BITS:
            log.warning("channel.key_bits = %d is below %d: fine for experiments, not for protecting anything",
                        self.key_bits, DEFAULT_KEY_BITS)

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.names = list(param_names)
        self.codec = json.dumps({"bits": self.quantizer.bits, "clip": self.quantizer.clip,
                                 "overflow": self.quantizer.overflow, "key_bits": self.key_bits,
                                 "max_total_weight": self.max_total_weight(cfg), "packed": self.packed,
                                 "slots": self.slots}, sort_keys=True)
        self.run_tag = secrets.token_hex(16)

    def _stage(self, stage: str) -> ConfigRecord:
        rec = train_config(self.cfg, 0)
        rec[STAGE] = stage
        return rec

    def _channel_record(self, **items: Any) -> ConfigRecord:
        return ConfigRecord({RUN_TAG: self.run_tag, CODEC: self.codec, **items})

    # ---- key agreement and delivery --------------------------------------------------------------------
    def handshake(self, ctx: RoundContext) -> None:
        parts = sorted(ctx.engine.partition_node)
        hello = ctx.send(parts, CHANNEL_SETUP, RecordDict({CONFIG: self._stage("hello"),
                                                           CHANNEL: self._channel_record()}), stage="channel hello")
        keys = {r.partition: bytes(r.record(CHANNEL)[X25519_PUBLIC]) for r in hello}
        if not keys:
            raise RuntimeError("Paillier channel: no client answered the key-agreement hello")
        holder, peers = min(keys), [p for p in sorted(keys) if p != min(keys)]
        own = {holder: {CHANNEL: self._channel_record(**{PEERS: peers, PEER_KEYS: [keys[p] for p in peers]})}}
        made = ctx.send([holder], CHANNEL_SETUP, RecordDict({CONFIG: self._stage("keygen")}), own,
                        stage="channel keygen")
        if not made:
            raise RuntimeError(f"Paillier channel: the key holder (client {holder}) failed to make the key pair")
        rec = made[0].record(CHANNEL)
        public = bytes(rec[PUBLIC_KEY])
        self.public_key = public_key_from_bytes(public)
        fingerprint = key_fingerprint(self.public_key)
        sealed = dict(zip(peers, [bytes(b) for b in rec[SEALED]]))
        boxes = {p: {CHANNEL: self._channel_record(**{HOLDER: holder, HOLDER_KEY: keys[holder], SEALED: sealed[p],
                                                      PUBLIC_KEY: public})} for p in peers}
        for r in ctx.send(peers, CHANNEL_SETUP, RecordDict({CONFIG: self._stage("deliver")}), boxes,
                          stage="channel deliver"):
            if bytes(r.record(CHANNEL)[FINGERPRINT]) != fingerprint:
                ctx.engine.record_failure(ctx.record, 0, r.node_id, "channel deliver",
                                          "the client confirmed another public key", partition=r.partition)
        self._metrics = {"key_bits": float(self.key_bits), "clients_with_key": float(1 + len(peers))}

    # ---- rounds ---------------------------------------------------------------------------------------------
    def outgoing(self, state: Any) -> dict[str, Any]:
        if isinstance(state, EncryptedModel):
            return {CHANNEL: self._channel_record(**{PAYLOAD: state.payload,
                                                     PUBLIC_KEY: public_key_to_bytes(self.public_key)})}
        # the initial model is public: it travels in plaintext
        return {ARRAYS: arrays_record(self.names, state),
                CHANNEL: self._channel_record(**{PUBLIC_KEY: public_key_to_bytes(self.public_key)})}

    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        if not reply.has(CHANNEL) or PAYLOAD not in reply.record(CHANNEL):
            raise ChannelError("the reply carries no ciphertexts")
        rec = reply.record(CHANNEL)
        payload = bytes(rec[PAYLOAD])
        try:
            header = verify(self.public_key, payload)
        except IntegrityError as exc:
            raise ChannelError(f"payload rejected ({exc.field}): {exc}") from None
        if getattr(self, "_num_values", None) is None:
            self._num_values = header.num_values
        elif header.num_values != self._num_values:
            raise ChannelError(f"payload has {header.num_values} values, the others {self._num_values}")
        reply.extra[PAYLOAD] = payload
        for k in (ENCRYPT_SECONDS, CLIPPED, INLINE_OBFUSCATORS):
            if k in rec:
                reply.extra[k] = float(rec[k])

    def weighted_mean(self, replies: list[Reply], weights: Sequence[float]) -> EncryptedModel:
        t0 = time.perf_counter()
        w = self.integer_weights(weights)
        payload = combine(self.public_key, [r.extra[PAYLOAD] for r in replies], w)
        enc = [r.extra.get(ENCRYPT_SECONDS) for r in replies if ENCRYPT_SECONDS in r.extra]
        self._metrics = {"combine_seconds": time.perf_counter() - t0, "total_weight": float(sum(w)),
                         "encrypt_seconds_max": float(max(enc)) if enc else float("nan"),
                         "encrypt_seconds_mean": float(np.mean(enc)) if enc else float("nan"),
                         "clipped": float(sum(r.extra.get(CLIPPED, 0.0) for r in replies)),
                         "inline_obfuscators": float(sum(r.extra.get(INLINE_OBFUSCATORS, 0.0) for r in replies)),
                         "payload_bytes": float(len(payload))}
        return EncryptedModel(payload)

    def integer_weights(self, weights: Sequence[float]) -> list[int]:
        """The rule's weights as integers: as they are when they already are integers summing to at most
        ``precision`` (example counts usually are: no rounding error), else ``round(p_i * precision)``
        (eq. 4.4)."""
        if all(float(x).is_integer() and x >= 0 for x in weights) and 0 < sum(weights) <= self.precision:
            return [int(x) for x in weights]
        total = float(sum(weights))
        return integer_weights([float(x) / total for x in weights], self.precision)

    def plaintext(self, state: Any) -> list[np.ndarray] | None:
        return None if isinstance(state, EncryptedModel) else state

    def client_view(self, reply: Reply) -> dict[str, Any]:
        return {"kind": "ciphertext", "payload": reply.extra.get(PAYLOAD)}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)
