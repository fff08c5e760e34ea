"""The CKKS channel, both halves: ``[channel] name = "ckks"`` (TenSEAL; the peer of the Paillier channel).

Clients encrypt their whole trained model (floating entries) as CKKS vectors, 8192 values per ciphertext
(``fedsim.crypto.ckks``); the server checks each payload with the public context alone
(:meth:`CkksChannel.check_reply`), forms ``sum_i w_i x_i`` homomorphically with the rule's weights as integers
(``fedsim.crypto.quantize.exact_integer_weights``: FedAvg's example counts over their gcd, exact; other
weights ``round(p_i P)``, ``P = precision``, eq. 4.4 as the Paillier channel) and never decrypts: the
global model it holds after round 1 is a ciphertext of total weight ``W``, which the clients decrypt and
divide by ``W`` at the start of the next round and a client evaluates. Why the model and not the update (as
the Paillier channel): CKKS's error is absolute, about 1e-9 per value whatever the values' range
(:func:`fedsim.crypto.ckks.error_bound`), so a model costs no precision and needs no state on the clients;
the values must stay within ``[-X, X]``, ``X = floor(CAPACITY / (sqrt(2) (P + clients per round)))`` (90 at
the defaults for up to 23 clients per round, 80 up to 538; a client with a larger value fails with a message
naming ``channel.precision``).

The secret key never reaches the server: one client makes the key pair and seals the private context for
the others (``fedsim.keydelivery``, as the Paillier channel's key). Every client keeps its X25519 private
key and, once delivered, the CKKS private context in Flower's ``Context.state``; neither is ever put in a
reply. The clients encrypt with that secret key (secret-key encryption, seeded ciphertexts; the public
context the server holds carries the parameters and a key id, no key) and a process decrypts a global model
once for all the clients it runs (``fedsim.crypto.decoded``). Integer buffers (``num_batches_tracked``)
travel in no form and restart at zero. Parameters (fixed, 128-bit security): N = 8192, coefficient moduli
60/60 bits (one data prime: no level is spent), scale 2**40 (docs/paillier.md, "The CKKS channel").
"""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, Mapping, Sequence

import numpy as np
from flwr.app import ConfigRecord, Context, RecordDict

from channels.initial_model import InitialModel
from fedsim.components import CHANNELS
from fedsim.crypto import ckks
from fedsim.crypto.decoded import DECODED
from fedsim.crypto.errors import IntegrityError
from fedsim.crypto.quantize import exact_integer_weights
from fedsim.keydelivery import SealedKeyClient, SealedKeyServer
from fedsim.params import Range
from fedsim.protocol import ARRAYS, CHANNEL, CODEC, ENCRYPT_SECONDS, PAYLOAD, arrays_record, decode_arrays
from fedsim.replies import ChannelError, ModelSpec, Reply
from fedsim.seams import WEIGHTED_SUM, ClientChannel, RoundContext, ServerChannel

_STATE_MAGIC = b"FSCS1"
_READ = "ckks.read"  # Reply.extra: the payload's ciphertexts, as check_reply read them


class CkksModel:
    """The global model as the server holds it after round 1: a combined CKKS payload."""

    def __init__(self, payload: bytes):
        self.payload = payload


class CkksClientChannel(SealedKeyClient, ClientChannel):
    name = "ckks"
    secret_field, public_field = "ckks-private", "ckks-public"

    def make_keys(self, settings: Mapping[str, Any]) -> tuple[bytes, bytes]:
        return ckks.make_keys()

    def check_keys(self, public: bytes, secret: bytes) -> None:
        ckks.check_keys(public, secret)

    def fingerprint(self, public: bytes) -> bytes:
        return ckks.fingerprint(public)

    def _key(self, context: Context, field: str) -> bytes:
        state = self.channel_state(context)
        if field not in state:
            raise RuntimeError("CKKS channel: this client holds no key (key delivery failed)")
        return state[field]

    def decode(self, content: RecordDict, context: Context, template: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        ch = content[CHANNEL]
        self._max_abs = float(json.loads(str(ch[CODEC]))["max_abs"])  # the values' bound encode() keeps to
        if PAYLOAD not in ch:  # round 1: the public initial model
            return decode_arrays(content[ARRAYS])
        floating = [k for k, v in template.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]
        num = sum(int(np.asarray(template[k]).size) for k in floating)
        private, payload = self._key(context, self.secret_field), bytes(ch[PAYLOAD])
        # one decryption per process for all the clients it runs (they hold the same key: fedsim.crypto.decoded)
        flat = DECODED.get(ckks.fingerprint(self._key(context, self.public_field)), payload, str(num),
                           lambda: ckks.decode(private, payload, num, self._max_abs))
        out, i = [], 0
        for k, v in template.items():
            v = np.asarray(v)
            if k in floating:
                out.append(flat[i:i + v.size].reshape(v.shape).astype(v.dtype))
                i += v.size
            else:
                out.append(np.zeros_like(v))
        return out

    def encode(self, arrays: Sequence[np.ndarray], param_names: Sequence[str], context: Context) -> dict[str, Any]:
        floating = [np.asarray(a, dtype=np.float64).ravel() for a in arrays
                    if np.issubdtype(np.asarray(a).dtype, np.floating)]
        t0 = time.perf_counter()
        # with the secret key every client holds (secret-key encryption; fedsim.crypto.ckks.make_keys)
        payload = ckks.encode(self._key(context, self.secret_field), np.concatenate(floating),
                              self._key(context, self.public_field), self._max_abs)
        return {CHANNEL: ConfigRecord({PAYLOAD: payload, ENCRYPT_SECONDS: time.perf_counter() - t0})}


@CHANNELS.register
class CkksChannel(InitialModel, SealedKeyServer, ServerChannel):
    """CKKS-encrypted weighted means (parameter: ``precision`` = P of the integer weights, as the Paillier
    channel's; the CKKS parameters are fixed at 128-bit security)."""

    name = "ckks"
    client = CkksClientChannel
    provides = frozenset({WEIGHTED_SUM})
    key_name = "the CKKS key pair"

    def __init__(self, precision: Annotated[int, Range(1)] = 4096):
        self.precision = int(precision)
        self.public_bytes: bytes | None = None
        self.x0: list[np.ndarray] | None = None
        self._metrics: dict[str, float] = {}

    def max_total_weight(self, cfg: Mapping[str, Any]) -> int:
        """Integer weights round ``p_i * P`` to the nearest integer: their sum is at most ``P + N/2``."""
        fed = cfg["federation"]
        return self.precision + (fed["clients_per_round"] or fed["num_clients"])

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        try:
            ckks.max_abs(self.max_total_weight(cfg))
        except ValueError as exc:
            raise ValueError(f"channel.precision = {self.precision}: {exc}") from None

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        self.names = list(param_names)
        self.mtw = self.max_total_weight(cfg)
        self.max_abs = ckks.max_abs(self.mtw)
        self.setup_delivery(cfg, {"poly_modulus_degree": ckks.POLY_MODULUS_DEGREE,
                                  "coeff_mod_bit_sizes": list(ckks.COEFF_MOD_BIT_SIZES),
                                  "scale_bits": ckks.SCALE_BITS, "max_total_weight": self.mtw,
                                  "max_abs": self.max_abs})

    # ---- key delivery ---------------------------------------------------------------------------------
    def accept_public_key(self, public: bytes) -> bytes:
        try:
            ctx = ckks.load_context(public)
        except ValueError as exc:
            raise RuntimeError(f"CKKS channel: the key holder's public context is unusable: {exc}") from None
        if ctx.has_secret_key():
            raise RuntimeError("CKKS channel: the key holder sent a context holding the secret key; refused")
        self.public_bytes = bytes(public)
        return ckks.fingerprint(public)

    def handshake(self, ctx: RoundContext) -> None:
        self._metrics = SealedKeyServer.handshake(self, ctx)

    # ---- rounds -----------------------------------------------------------------------------------------
    def outgoing(self, state: Any) -> dict[str, Any]:
        if isinstance(state, CkksModel):
            return {CHANNEL: self.channel_record(**{PAYLOAD: state.payload})}
        return {ARRAYS: arrays_record(self.names, state), CHANNEL: self.channel_record()}

    def check_payload(self, payload: bytes) -> list[Any]:
        """A client's payload against the channel: the key fingerprint, the model's value count, total weight
        1, one ciphertext (2 polynomials at the data prime, scale 2**40) per 8192 values, each readable with
        the public context. Raises :class:`ChannelError` naming the field."""
        try:
            return ckks.verify(self.public_bytes, payload, self.num_values)
        except IntegrityError as exc:
            raise ChannelError(f"payload rejected ({exc.field}): {exc}") from None

    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        """The per-reply check (``fedsim.replies.ReplyChecker.check_reply``; see :meth:`check_payload`)."""
        if not reply.has(CHANNEL) or PAYLOAD not in reply.record(CHANNEL):
            raise ChannelError("the reply carries no ciphertexts")
        rec = reply.record(CHANNEL)
        payload = rec[PAYLOAD]
        if not isinstance(payload, bytes):
            raise ChannelError(f"payload rejected (type): {type(payload).__name__}, not bytes")
        reply.extra[_READ] = self.check_payload(payload)  # read once here, combined as often as the rule asks
        reply.extra[PAYLOAD] = payload
        v = rec.get(ENCRYPT_SECONDS)
        if isinstance(v, float) and np.isfinite(v) and v >= 0:
            reply.extra[ENCRYPT_SECONDS] = v

    def weighted_mean(self, replies: list[Reply], weights: Sequence[float]) -> CkksModel:
        t0 = time.perf_counter()
        w = exact_integer_weights(weights, self.precision)
        if sum(w) > self.mtw:  # cannot happen with round(p_i P) (<= P + N/2); refused rather than overflowed
            raise RuntimeError(f"CKKS channel: integer weights total {sum(w)}, above {self.mtw}")
        payload = ckks.combine_read(self.public_bytes, [r.extra[_READ] for r in replies], w, self.num_values)
        enc = [r.extra[ENCRYPT_SECONDS] for r in replies if ENCRYPT_SECONDS in r.extra]
        total = float(sum(weights))
        weight_term = sum(abs(wi / sum(w) - float(x) / total) for wi, x in zip(w, weights))
        self._metrics = {"combine_seconds": time.perf_counter() - t0, "payload_bytes": float(len(payload)),
                         "reply_bytes": float(np.mean([len(r.extra[PAYLOAD]) for r in replies])),
                         "encrypt_seconds_mean": float(np.mean(enc)) if enc else float("nan"),
                         "total_weight": float(sum(w)),
                         # |decoded - sum_i p_i x_i| per value: CKKS's error, plus the integer weights'
                         # deviation from the rule's weights times the values' bound
                         "error_bound": ckks.error_bound(self.max_abs) + self.max_abs * weight_term}
        return CkksModel(payload)

    def plaintext(self, state: Any) -> list[np.ndarray] | None:
        return None if isinstance(state, CkksModel) else state

    def client_view(self, reply: Reply) -> dict[str, Any]:
        return {"kind": "ciphertext", "payload": reply.extra.get(PAYLOAD)}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"run_tag": getattr(self, "run_tag", ""), "x0": list(self.x0 or []),
                "public_key": np.frombuffer(self.public_bytes or b"", dtype=np.uint8)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        if len(state.get("public_key", ())) == 0:
            raise ValueError("the checkpoint holds no CKKS public context (the key delivery never finished)")
        self.run_tag = str(state["run_tag"])
        self.accept_public_key(np.asarray(state["public_key"], dtype=np.uint8).tobytes())
        self.x0 = [np.asarray(a) for a in state["x0"]]

    def checkpoint_arrays(self, state: Any) -> list[np.ndarray]:
        if isinstance(state, CkksModel):
            return [np.frombuffer(_STATE_MAGIC + state.payload, dtype=np.uint8).copy()]
        return list(state)

    def from_checkpoint_arrays(self, arrays: list[np.ndarray]) -> Any:
        if len(arrays) == 1 and arrays[0].dtype == np.uint8 and arrays[0][:len(_STATE_MAGIC)].tobytes() == _STATE_MAGIC:
            return CkksModel(arrays[0].tobytes()[len(_STATE_MAGIC):])
        return self.initial(arrays)
