"""The Paillier channel's server half (seed 003 §4.2.2, Alg. 2-3, eq. 4.4): ``[channel] name = "paillier"``.

Clients quantize what they send, pack many values per Paillier plaintext and encrypt (``fedsim.crypto``);
the server checks each payload against the channel's settings with the public key alone
(:meth:`PaillierChannel.check_reply`), combines the payloads homomorphically with integer weights
``w_i = round(p_i * precision)`` (``p_i``: the aggregation rule's weights) and never decrypts.

What is encrypted (``encrypt``):

* ``"update"`` (default, as the thesis: Alg. 3 lines 10 and 17-18): each client's update
  ``x_i - x_{r-1}``. The server holds the global model as the public initial model plus the chain of
  encrypted aggregate updates; a client adds the decrypted updates to the model it last trained on
  (it keeps it in its state, as the thesis' clients keep ``omega_{r-1}``), so each train message carries
  only the updates that client has not seen (all of them, and the initial model, to a client that never
  trained). With ``clip`` unset the round's clipping range follows the updates' range: clients reply to
  ``train`` with ``e_i`` (``max|update| <= 2**e_i``) and keep the update; the server sends the common
  ``clip = 2**max(e_i)`` (``CHANNEL_SETUP`` stage ``encrypt``) and they encrypt at it, so nothing is
  clipped and the rounding error is ``0.5 * clip / (2**(bits-1) - 1)`` (``channel.quantization_bound``).
* ``"model"``: each client's whole trained model over a fixed ``clip`` (default 4.0).

Keys never reach the server (``fedsim.keydelivery``). Threat model and what each check catches:
docs/paillier.md.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Annotated, Any, Mapping, Sequence

import numpy as np
from flwr.app import RecordDict

from channels.initial_model import InitialModel
from fedsim.components import CHANNELS
from fedsim.crypto.errors import IntegrityError
from fedsim.crypto.packing import MAX_TOTAL_WEIGHT, packing_layout
from fedsim.crypto.paillier import (
    DEFAULT_KEY_BITS,
    MAX_KEY_BITS,
    MIN_KEY_BITS,
    MODE_PACKED,
    MODE_PER_ELEMENT,
    combine_read,
    key_fingerprint,
    public_key_from_bytes,
    public_key_to_bytes,
    read_ciphertexts,
)
from fedsim.crypto.quantize import MAX_RANGE_EXPONENT, MIN_RANGE_EXPONENT, Quantizer, exact_integer_weights
from fedsim.keydelivery import SealedKeyServer
from fedsim.params import OneOf, Range, Satisfies
from fedsim.protocol import (
    ARRAYS,
    BASE,
    CHANNEL,
    CHANNEL_SETUP,
    CLIP,
    CLIPPED,
    CONFIG,
    DECRYPT_SECONDS,
    ENCRYPT_SECONDS,
    HELD_ROUND,
    INLINE_OBFUSCATORS,
    PAYLOAD,
    PAYLOADS,
    PUBLIC_KEY,
    RANGE_EXPONENT,
    ROUND_WEIGHT,
    ROUNDS,
    TRAIN,
    arrays_record,
)
from fedsim.replies import ChannelError, InvalidReply, ModelSpec, Reply
from fedsim.seams import WEIGHTED_SUM, RoundContext, ServerChannel

from .client import PaillierClientChannel
from .model import EncryptedModel, EncryptedModelCheckpoints

log = logging.getLogger("fedsim")
KEY_BITS = Satisfies(lambda b: b % 2 == 0 and MIN_KEY_BITS <= b <= MAX_KEY_BITS,
                     f"an even integer in [{MIN_KEY_BITS}, {MAX_KEY_BITS}]")
ENCRYPT = ("update", "model")
BITS = {"update": 12, "model": 16}  # channel.bits when unset (docs/paillier.md: "Quantization and its error bound")

_READ = "paillier.read"  # Reply.extra: the payload's header and ciphertexts, as check_reply read them


@CHANNELS.register
class PaillierChannel(InitialModel, EncryptedModelCheckpoints, SealedKeyServer, ServerChannel):
    """Paillier-encrypted weighted sums (parameters: ``key_bits``, ``encrypt`` = update | model, ``bits`` and
    ``clip`` of the quantizer (``bits`` unset: 12 for updates, 16 for models; ``clip`` unset: the updates'
    range every round, or 4.0 for models), ``overflow`` = clip | raise, ``precision`` = P of the integer
    weights, ``packed``, ``slots``, ``advance`` (send each round's aggregate ahead to the next round's
    clients, :meth:`after_round`), ``round_layout`` (pack at the round's total weight when the clip exchange
    makes it known, :meth:`round_total_weight`); see docs/paillier.md for the error bound and the overflow rule)."""

    name = "paillier"
    client = PaillierClientChannel
    provides = frozenset({WEIGHTED_SUM})
    key_name = "the Paillier key pair"

    def __init__(self, key_bits: Annotated[int, KEY_BITS] = DEFAULT_KEY_BITS, encrypt: Annotated[str, OneOf(*ENCRYPT)] = "update",
                 bits: int | None = None, clip: float | None = None, overflow: str = "clip",
                 precision: Annotated[int, Range(1)] = 4096, packed: bool = True, slots: int | None = None,
                 advance: bool = True, round_layout: bool = True):
        self.encrypt = encrypt
        self.auto_clip = clip is None and encrypt == "update"
        fixed = 4.0 if clip is None else clip  # the auto clip changes every round: 4.0 only fills the layout
        if bits is None:  # updates at their own range: 12 bits; whole models over a fixed clip: 16
            bits = BITS[encrypt]
        self.quantizer = Quantizer(bits=bits, clip=fixed, overflow=overflow)  # ValueErrors name channel.*
        self.key_bits, self.precision, self.packed, self.slots = int(key_bits), int(precision), bool(packed), slots
        self.advance = bool(advance)
        self.round_layout = bool(round_layout)
        self.public_key = None
        self.x0: list[np.ndarray] | None = None
        self.holder: dict[int, int] = {}  # partition -> the round whose global model it holds (update encryption)
        self._metrics: dict[str, float] = {}
        self._round = 0
        self._chain: tuple[tuple[int, bytes], ...] = ()
        self._clip = self.quantizer.clip
        self._mtw = 0  # the round's largest total weight (set in setup, then per round: round_total_weight)

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
        self.names = list(param_names)
        self.mtw = self.max_total_weight(cfg)
        self.setup_delivery(cfg, {"bits": self.quantizer.bits, "clip": None if self.auto_clip else self.quantizer.clip,
                                  "overflow": self.quantizer.overflow, "key_bits": self.key_bits,
                                  "max_total_weight": self.mtw, "packed": self.packed, "slots": self.slots,
                                  "encrypt": self.encrypt})
        self._mtw = self.mtw

    @property
    def expected(self) -> dict[str, Any]:
        """The header fields of a client's payload this round (the layout follows the round's total weight)."""
        layout = packing_layout(self.key_bits, self.quantizer.bits, self._mtw, slots=self.slots) if self.packed else None
        return {"mode": MODE_PACKED if self.packed else MODE_PER_ELEMENT, "bits": self.quantizer.bits,
                "slot_bits": layout.slot_bits if layout else 0, "slots": layout.slots if layout else 1,
                "key_bits": self.key_bits, "max_total_weight": self._mtw, "total_weight": 1}

    def round_total_weight(self, ctx: RoundContext, replies: Sequence[Reply]) -> int:
        """The largest total weight this round's combinations can carry, known once the clients replied to
        ``train``: under a rule that weights by example counts (``example_weighted_mean``, FedAvg), the
        counts divided by their gcd when they sum to at most ``precision`` (:func:`exact_integer_weights`: any
        subset of these replies - clients that fail later - has a smaller reduced sum, since a subset's gcd
        is a multiple of the whole set's); otherwise ``precision`` plus the clients per round, as at
        setup. Equal counts give ``len(replies)``: 16-bit slots instead of 25 at the defaults, 126 values
        per 2048-bit plaintext instead of 80."""
        if not (self.packed and self.round_layout) or not getattr(type(ctx.engine.rule), "example_weighted_mean", False):
            return self.mtw
        counts = [int(r.num_examples) for r in replies]
        if not counts or min(counts) < 1:
            return self.mtw
        total = sum(counts) // math.gcd(*counts)
        return total if total <= self.precision else self.mtw

    # ---- key delivery -------------------------------------------------------------------------------------
    def accept_public_key(self, public: bytes) -> bytes:
        self.public_key = public_key_from_bytes(public)
        if self.public_key.n.bit_length() != self.key_bits:
            raise RuntimeError(f"Paillier channel: the key holder made a {self.public_key.n.bit_length()}-bit key, "
                               f"channel.key_bits = {self.key_bits}")
        return key_fingerprint(self.public_key)

    def handshake(self, ctx: RoundContext) -> None:
        self._metrics = {"key_bits": float(self.key_bits), **SealedKeyServer.handshake(self, ctx)}

    # ---- what travels to the clients ------------------------------------------------------------------------
    def outgoing_to_trained(self, state: Any) -> dict[str, Any]:
        return self.outgoing(state, recipients_trained=True)

    def outgoing(self, state: Any, recipients_trained: bool = False) -> dict[str, Any]:
        public = {PUBLIC_KEY: public_key_to_bytes(self.public_key)}
        if not isinstance(state, EncryptedModel):  # the initial model is public: it travels in plaintext
            return {ARRAYS: arrays_record(self.names, state), CHANNEL: self.channel_record(**public)}
        if state.kind == "model":
            return {CHANNEL: self.channel_record(**public, **{PAYLOADS: [state.head], ROUNDS: [state.round],
                                                              BASE: -1})}
        if recipients_trained:  # they hold the global model of round - 1: its update on top is enough
            return {CHANNEL: self.channel_record(**public, **{PAYLOADS: [state.head], ROUNDS: [state.round],
                                                              BASE: state.round - 1})}
        chain = [*state.chain, (state.round, state.head)]
        return {ARRAYS: arrays_record(self.names, self.x0),
                CHANNEL: self.channel_record(**public, **{PAYLOADS: [p for _, p in chain],
                                                          ROUNDS: [r for r, _ in chain], BASE: 0})}

    def train_exchange(self, ctx: RoundContext, partitions: list[int], content: RecordDict) -> list[Reply]:
        """Each client gets the aggregate updates it has not seen; with the automatic clip, a second
        exchange (``CHANNEL_SETUP`` stage ``encrypt``) announces the round's common clip and collects the
        ciphertexts."""
        self._round = ctx.round
        ch = content[CHANNEL]
        self._chain = tuple(zip([int(r) for r in ch[ROUNDS]], [bytes(p) for p in ch[PAYLOADS]])) \
            if self.encrypt == "update" and PAYLOADS in ch else ()
        self._clip = self.quantizer.clip
        self._mtw = self.mtw
        shared, own = content, None
        if self.encrypt == "update" and self._chain:
            shared = RecordDict({k: v for k, v in content.items() if k not in (ARRAYS, CHANNEL)})
            own = {p: self._train_records(p) for p in partitions}
        replies = ctx.send(partitions, TRAIN, shared, own, "train")
        answered = {r.partition for r in replies}
        for p in partitions:  # it may not hold what we think (a lost state): send it everything next time
            if p not in answered:
                self.holder.pop(p, None)
        if not self.auto_clip:
            return replies
        ready, exps = [], []
        for r in replies:
            rec = r.record(CHANNEL) if r.has(CHANNEL) else {}
            e = rec.get(RANGE_EXPONENT) if hasattr(rec, "get") else None
            if isinstance(e, bool) or not isinstance(e, int) or not MIN_RANGE_EXPONENT <= e <= MAX_RANGE_EXPONENT:
                ctx.engine.record_failure(ctx.record, ctx.round, r.node_id, "train",
                                          f"invalid reply: the reply carries no valid {RANGE_EXPONENT} (an integer "
                                          f"in [{MIN_RANGE_EXPONENT}, {MAX_RANGE_EXPONENT}]): {str(e)[:80]}",
                                          partition=r.partition)
                continue
            ready.append(r)
            exps.append(e)
        if not ready:
            return []
        self._clip = math.ldexp(1.0, max(exps))
        self._mtw = self.round_total_weight(ctx, ready)
        config = self.stage_config("encrypt", ctx.round)
        msg = RecordDict({CONFIG: config, CHANNEL: self.channel_record(**{CLIP: self._clip, ROUND_WEIGHT: self._mtw})})
        done = {r.partition: r for r in ctx.send([r.partition for r in ready], CHANNEL_SETUP, msg, None,
                                                 "train encrypt")}
        out = []
        for r in ready:
            if r.partition in done:  # the train reply (metrics) with the ciphertexts of the second exchange
                r.message.content[CHANNEL + r.suffix] = done[r.partition].record(CHANNEL)
                out.append(r)
        return out

    def _train_records(self, partition: int, chain: tuple[tuple[int, bytes], ...] | None = None) -> dict[str, Any]:
        """What ``partition`` needs to rebuild the newest model of ``chain`` (default: this round's): the
        updates after the round whose model it holds (none when it holds the newest), or the initial model
        and every update."""
        chain = self._chain if chain is None else chain
        held = self.holder.get(partition, 0)
        rounds = [r for r, _ in chain]
        if held >= 1 and held in rounds:
            later = [(r, p) for r, p in chain if r > held]
            return {CHANNEL: self.channel_record(**{PUBLIC_KEY: public_key_to_bytes(self.public_key),
                                                    PAYLOADS: [p for _, p in later], ROUNDS: [r for r, _ in later],
                                                    BASE: held})}
        return {ARRAYS: arrays_record(self.names, self.x0),
                CHANNEL: self.channel_record(**{PUBLIC_KEY: public_key_to_bytes(self.public_key),
                                                PAYLOADS: [p for _, p in chain], ROUNDS: rounds, BASE: 0})}

    def after_round(self, ctx: RoundContext, state: Any) -> None:
        """Send the new aggregate update ahead (``CHANNEL_SETUP`` stage ``advance``, update encryption, every
        round but the last): the next round's clients, and the first client of this round (the server's
        evaluator), decrypt it now, all at once, and keep the new global model, so that neither the
        evaluation nor the next round's training waits for a decryption (on a simulation's actors, or in a
        deployment, where every client decrypts in parallel, a round holds one decryption instead of two:
        the evaluator's, then the next round's clients'). A client that does not answer gets the update
        with its next train message, as before."""
        if self.encrypt != "update" or not self.advance or not isinstance(state, EncryptedModel):
            return
        if ctx.round >= int(ctx.engine.cfg["federation"]["rounds"]):
            return
        t0 = time.perf_counter()
        targets = set(ctx.engine.sample(ctx.round + 1)) | set(ctx.record.contributors[:1])
        chain = (*state.chain, (state.round, state.head))
        own = {p: self._train_records(p, chain) for p in targets}
        msg = RecordDict({CONFIG: self.stage_config("advance", ctx.round)})
        decrypt: list[float] = []

        def check(reply: Reply) -> None:
            rec = reply.record(CHANNEL) if reply.has(CHANNEL) else {}
            held = rec.get(HELD_ROUND) if hasattr(rec, "get") else None
            if held != state.round or isinstance(held, bool):
                raise InvalidReply(f"the reply says it holds the global model of round {str(held)[:40]}, "
                                   f"not of round {state.round}")
            sec = rec.get(DECRYPT_SECONDS)
            if isinstance(sec, (int, float)) and not isinstance(sec, bool) and math.isfinite(sec) and sec >= 0:
                decrypt.append(float(sec))

        for r in ctx.send(sorted(targets), CHANNEL_SETUP, msg, own, "advance", check=check):
            self.holder[r.partition] = state.round
        self._metrics["advance_seconds"] = time.perf_counter() - t0
        if decrypt:
            self._metrics["decrypt_seconds_max"] = max(decrypt)

    # ---- what comes back --------------------------------------------------------------------------------------
    def check_payload(self, payload: bytes) -> tuple[Any, list[int]]:
        """A client's payload against the channel's settings, with the public key alone: ``verify`` (size,
        magic, version, key fingerprint and width, layout, count, digest, every ciphertext in range), then
        every header field against what this channel expects of a client's payload this round (mode, value
        and slot bits, slots, key bits, the round's clip, ``max_total_weight``, ``total_weight = 1``, the
        model's value count). Returns the header and the ciphertexts; raises :class:`ChannelError` naming the
        field."""
        try:
            h, ciphertexts = read_ciphertexts(self.public_key, payload, num_values=self.num_values)
        except IntegrityError as exc:
            raise ChannelError(f"payload rejected ({exc.field}): {exc}") from None
        for name, want in {**self.expected, "clip": self._clip}.items():
            got = getattr(h, name)
            if got != want:
                raise ChannelError(f"payload rejected ({name}): the payload has {name} = {got!r}, the channel "
                                   f"expects {want!r} this round")
        return h, ciphertexts

    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        """The per-reply check (``fedsim.replies.ReplyChecker.check_reply`` calls it for every train reply; see
        :meth:`check_payload`): a bad payload is this client's recorded failure, never a crash of the
        combination. Keeps the payload in ``reply.extra`` and notes which global model the client holds."""
        if not reply.has(CHANNEL) or PAYLOAD not in reply.record(CHANNEL):
            raise ChannelError("the reply carries no ciphertexts")
        rec = reply.record(CHANNEL)
        payload = rec[PAYLOAD]
        if not isinstance(payload, bytes):
            raise ChannelError(f"payload rejected (type): {type(payload).__name__}, not bytes")
        reply.extra[_READ] = self.check_payload(payload)  # checked once here, combined as often as the rule asks
        reply.extra[PAYLOAD] = payload
        for k in (ENCRYPT_SECONDS, CLIPPED, INLINE_OBFUSCATORS):
            v = rec.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
                reply.extra[k] = float(v)
        if self.encrypt == "update":
            self.holder[reply.partition] = self._round - 1

    def weighted_mean(self, replies: list[Reply], weights: Sequence[float]) -> EncryptedModel:
        t0 = time.perf_counter()
        w = self.integer_weights(weights)
        if sum(w) > self._mtw:  # the layout announced this round has no headroom for it (a rule's weights that
            # are not its example counts although it says so): refused before combining, never decoded wrong
            raise RuntimeError(f"Paillier channel: the rule's integer weights total {sum(w)}, above the round's "
                               f"largest total weight {self._mtw} (a rule that declares example_weighted_mean must "
                               "weight by the example counts)")
        payload = combine_read(self.public_key, [r.extra[_READ] for r in replies], w)
        enc = [r.extra.get(ENCRYPT_SECONDS) for r in replies if ENCRYPT_SECONDS in r.extra]
        total = float(sum(weights))
        p = [float(x) / total for x in weights]
        weight_term = sum(abs(wi / sum(w) - pi) for wi, pi in zip(w, p))
        step = self.quantizer.max_int
        self._metrics = {"combine_seconds": time.perf_counter() - t0, "total_weight": float(sum(w)),
                         "encrypt_seconds_max": float(max(enc)) if enc else float("nan"),
                         "encrypt_seconds_mean": float(np.mean(enc)) if enc else float("nan"),
                         "clipped": float(sum(r.extra.get(CLIPPED, 0.0) for r in replies)),
                         "inline_obfuscators": float(sum(r.extra.get(INLINE_OBFUSCATORS, 0.0) for r in replies)),
                         "payload_bytes": float(len(payload)), "clip": self._clip,
                         "reply_bytes": float(np.mean([len(r.extra[PAYLOAD]) for r in replies])),
                         "values_per_ciphertext": float(self.expected["slots"]),
                         # |decoded - sum_i p_i x_i| per value (docs/paillier.md): rounding, plus the
                         # integer weights' deviation from the rule's weights times the largest |value|
                         "quantization_bound": 0.5 * self._clip / step,
                         "error_bound": 0.5 * self._clip / step + self._clip * weight_term}
        return EncryptedModel(self.encrypt, payload, self._round, self._chain if self.encrypt == "update" else ())

    def integer_weights(self, weights: Sequence[float]) -> list[int]:
        return exact_integer_weights(weights, self.precision)

    def plaintext(self, state: Any) -> list[np.ndarray] | None:
        return None if isinstance(state, EncryptedModel) else state

    def client_view(self, reply: Reply) -> dict[str, Any]:
        return {"kind": "ciphertext", "payload": reply.extra.get(PAYLOAD)}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)
