"""The Paillier channel's client half (see channels/paillier/server.py for the protocol).

Every client keeps its X25519 private key and, once delivered, the Paillier private key in Flower's
``Context.state`` (record ``fedsim.protocol.STATE_CHANNEL``, ``fedsim.keydelivery``); neither is ever put
in a reply. The encoding settings come from the server's messages (``CODEC``), so they are declared once,
on the server half.

Update encryption (the default): the client adds the decrypted aggregate updates to the global model it
last trained on (``STATE_CHANNEL_MODEL``, as the thesis' clients keep ``omega_{r-1}``; Alg. 3 line 10),
trains, and encrypts ``trained - global``. With the automatic clip it first replies with the update's
range exponent and keeps the update (``STATE_CHANNEL_PENDING``) until the server announces the round's
common clip (setup stage ``encrypt``).

Costs: obfuscators come from a per-process :class:`fedsim.crypto.paillier.ObfuscatorPool` per public key
(short-exponent, CRT), refilled in a background thread; decryption runs ``phe``'s CRT decryption in as
many threads as torch may use, and a process decrypts a given aggregate once: the clients it serves hold
the same key and would compute the same integers, so they share the result (in a deployment every client
decrypts once per round, in parallel; a simulation that ran N clients' decryptions one after another would
charge the round N times that).
"""
from __future__ import annotations

import collections
import json
import threading
import time
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedsim.crypto.decoded import DECODED
from fedsim.crypto.paillier import (
    ObfuscatorPool,
    PaillierCodec,
    generate_keypair,
    key_fingerprint,
    parse_header,
    private_key_from_bytes,
    private_key_to_bytes,
    public_key_from_bytes,
    public_key_to_bytes,
)
from fedsim.crypto.quantize import Quantizer, range_exponent
from fedsim.factories import model_for
from fedsim.keydelivery import SealedKeyClient
from fedsim.protocol import (
    ARRAYS,
    BASE,
    CHANNEL,
    CLIP,
    CLIPPED,
    CODEC,
    DECRYPT_SECONDS,
    ENCRYPT_SECONDS,
    HELD_ROUND,
    INLINE_OBFUSCATORS,
    PAYLOAD,
    PAYLOADS,
    RANGE_EXPONENT,
    ROUND_WEIGHT,
    ROUNDS,
    STATE_CHANNEL_MODEL,
    STATE_CHANNEL_PENDING,
    decode_arrays,
)
from fedsim.seams import ClientChannel

_PAILLIER = "paillier-private"
_PUBLIC = "paillier-public"
_ROUND = "__round__"  # the round of the global model kept in STATE_CHANNEL_MODEL
_UPDATE = "update"


class _Pools:
    """One obfuscator pool per public key in this process, refilled in the background."""

    def __init__(self) -> None:
        self.pools: dict[bytes, ObfuscatorPool] = {}
        self.pending: dict[bytes, int] = {}
        self.lock = threading.Lock()

    def get(self, public_key: Any, private_key: Any) -> ObfuscatorPool:
        fp = key_fingerprint(public_key)
        with self.lock:
            if fp not in self.pools:
                self.pools[fp] = ObfuscatorPool(public_key, private_key)
            return self.pools[fp]

    def refill(self, pool: ObfuscatorPool, count: int) -> None:
        """Queue ``count`` more obfuscators; one background fill runs at a time (the next one starts
        when it is asked for again)."""
        fp = key_fingerprint(pool.public_key)
        with self.lock:
            self.pending[fp] = self.pending.get(fp, 0) + int(count)
            thread = getattr(pool, "_thread", None)
            if thread is not None and thread.is_alive():
                return
            pool.wait()
            todo, self.pending[fp] = self.pending[fp], 0
        if todo:
            pool.fill_async(todo)


POOLS = _Pools()




@lru_cache(maxsize=8)
def _settings(codec: str) -> dict[str, Any]:
    return json.loads(codec)


@lru_cache(maxsize=4)
def _load_keys(public: bytes, private: bytes | None) -> tuple[Any, Any]:
    """The key objects of a client's key bytes, made once per process (``phe``'s private key precomputes its
    CRT constants: ~10 ms a time, three times per client and round); client processes only, like
    :data:`POOLS`, which holds the same private key."""
    pk = public_key_from_bytes(public)
    return pk, (private_key_from_bytes(private, pk) if private is not None else None)


def _floating(template: Mapping[str, np.ndarray]) -> list[str]:
    return [k for k, v in template.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]


class PaillierClientChannel(SealedKeyClient, ClientChannel):
    name = "paillier"
    secret_field, public_field = _PAILLIER, _PUBLIC

    # ---- keys (fedsim.keydelivery) ---------------------------------------------------------------------
    def make_keys(self, settings: Mapping[str, Any]) -> tuple[bytes, bytes]:
        public, private = generate_keypair(int(settings["key_bits"]), warn=False)  # the config check warned once
        return public_key_to_bytes(public), private_key_to_bytes(private)

    def check_keys(self, public: bytes, secret: bytes) -> None:
        private_key_from_bytes(secret, public_key_from_bytes(public))  # checks p * q = n

    def fingerprint(self, public: bytes) -> bytes:
        return key_fingerprint(public_key_from_bytes(public))

    def keys_made(self, public: bytes, secret: bytes, settings: Mapping[str, Any]) -> None:
        """Start precomputing the first round's obfuscators as soon as the key is known."""
        pk = public_key_from_bytes(public)
        sk = private_key_from_bytes(secret, pk)
        values = sum(int(v.numel()) for v in model_for(self.cfg).state_dict().values() if v.is_floating_point())
        POOLS.refill(POOLS.get(pk, sk), self._codec(settings, pk, None, 1.0).num_ciphertexts(values))

    def _keys(self, context: Context, need_private: bool) -> tuple[Any, Any]:
        state = self.channel_state(context)
        if _PUBLIC not in state or (need_private and _PAILLIER not in state):
            raise RuntimeError("Paillier channel: this client holds no key (key delivery failed)")
        return _load_keys(bytes(state[_PUBLIC]), bytes(state[_PAILLIER]) if _PAILLIER in state else None)

    @staticmethod
    def _codec(s: Mapping[str, Any], public: Any, private: Any, clip: float) -> PaillierCodec:
        return PaillierCodec(public, Quantizer(bits=s["bits"], clip=clip, overflow=s["overflow"]),
                             s["max_total_weight"], private_key=private, packed=s["packed"], slots=s["slots"],
                             pool=POOLS.get(public, private) if private is not None else None,
                             decrypt_threads=max(1, torch.get_num_threads()))

    # ---- the global model --------------------------------------------------------------------------------
    def decode(self, content: RecordDict, context: Context, template: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        ch = content[CHANNEL]
        self._codec_text = str(ch[CODEC])  # the settings encode() will use for the reply
        s = _settings(self._codec_text)
        floating = _floating(template)
        if PAYLOADS not in ch:  # round 1: the public initial model
            model = dict(zip(template, decode_arrays(content[ARRAYS])))
            self._decoded = (0, model)
            return list(model.values())
        payloads, rounds, base = [bytes(p) for p in ch[PAYLOADS]], [int(r) for r in ch[ROUNDS]], int(ch[BASE])
        public, private = self._keys(context, need_private=True)
        num = sum(int(np.asarray(template[k]).size) for k in floating)

        def mean(payload: bytes) -> np.ndarray:
            h = parse_header(payload)  # the layout follows its round's total weight, never above the channel's
            if not 1 <= h.max_total_weight <= s["max_total_weight"]:
                raise RuntimeError(f"Paillier channel: an aggregate with max_total_weight {h.max_total_weight}, "
                                   f"outside [1, {s['max_total_weight']}]")
            codec = self._codec({**s, "max_total_weight": h.max_total_weight}, public, private, h.clip)
            return DECODED.get(key_fingerprint(public), payload, f"{self._codec_text}|{num}",
                               lambda: codec.decode(payload, [(num,)])[0])

        start = base
        if base < 0:  # the whole model was encrypted
            model = self._split(mean(payloads[0]), template, floating, None)
        else:
            model, start = self._start(content, context, template, base, rounds)
            for r, p in zip(rounds, payloads):
                if r > start:  # the updates this client has not added yet, in order
                    model = self._split(mean(p), template, floating, model)
        self._decoded = (max(rounds, default=start), model)
        return [model[k] for k in template]

    def _start(self, content: RecordDict, context: Context, template: Mapping[str, np.ndarray], base: int,
               rounds: list[int]) -> tuple[dict[str, np.ndarray], int]:
        """The model the updates go on: the one this client kept (if the message's updates continue it),
        else the initial model the message carries."""
        if STATE_CHANNEL_MODEL in context.state:
            kept = {k: np.array(v.numpy()) for k, v in context.state[STATE_CHANNEL_MODEL].items()}
            held = int(kept.pop(_ROUND)[0])
            if (held == base or held in rounds) and list(kept) == list(template):
                return kept, held
        if base == 0 and ARRAYS in content:
            return dict(zip(template, decode_arrays(content[ARRAYS]))), 0
        raise RuntimeError(f"Paillier channel: the message continues the global model of round {base}, which "
                           "this client does not hold (its state was lost?)")

    @staticmethod
    def _split(flat: np.ndarray, template: Mapping[str, np.ndarray], floating: list[str],
               onto: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """Flat decoded values as the template's floating entries, added to ``onto`` (in the entries' dtype,
        one rounding per round, as every client does) or as they are; integer buffers restart at zero."""
        out, i = {}, 0
        for k, v in template.items():
            v = np.asarray(v)
            if k not in floating:
                out[k] = np.zeros_like(v) if onto is None else onto[k]
                continue
            part = flat[i:i + v.size].reshape(v.shape)
            i += v.size
            out[k] = (part if onto is None else onto[k].astype(np.float64) + part).astype(v.dtype)
        return out

    # ---- the client's contribution ----------------------------------------------------------------------
    def encode(self, arrays: Sequence[np.ndarray], param_names: Sequence[str], context: Context) -> dict[str, Any]:
        s = _settings(self._codec_text)
        arrays = [np.asarray(a) for a in arrays]
        floating = [i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.floating)]
        if s.get("encrypt", "model") == "model":
            return self._encrypt(context, s, [arrays[i] for i in floating], float(s["clip"]))
        self._keep(context)  # the global model this client trained on (Alg. 3 line 10)
        held, model = self._decoded
        names = list(model)
        update = np.concatenate([arrays[i].astype(np.float64).ravel() - model[names[i]].astype(np.float64).ravel()
                                 for i in floating]) if floating else np.zeros(0)
        if s["clip"] is not None:
            return self._encrypt(context, s, [update], float(s["clip"]))
        context.state[STATE_CHANNEL_PENDING] = ArrayRecord({_UPDATE: Array(update)})
        return {CHANNEL: ConfigRecord({RANGE_EXPONENT: range_exponent(update)})}

    def _keep(self, context: Context) -> None:
        """Keep the global model :meth:`decode` rebuilt (and its round) in the client's state."""
        held, model = self._decoded
        context.state[STATE_CHANNEL_MODEL] = ArrayRecord(collections.OrderedDict(
            [(k, Array(np.ascontiguousarray(v))) for k, v in model.items()] +
            [(_ROUND, Array(np.array([held], dtype=np.int64)))]))

    def other_stage(self, stage: str, msg: Message, context: Context) -> RecordDict:
        """``advance``: the round's aggregate update, sent ahead; decode it and keep the new global model.
        ``encrypt``: the round's common clip is known; encrypt the update kept since training."""
        if stage == "advance":
            return self._advance(msg, context)
        if stage != "encrypt":
            return super().other_stage(stage, msg, context)
        if STATE_CHANNEL_PENDING not in context.state:
            raise RuntimeError("Paillier channel: asked to encrypt, but this client keeps no trained update")
        update = context.state[STATE_CHANNEL_PENDING][_UPDATE].numpy()
        del context.state[STATE_CHANNEL_PENDING]
        ch = msg.content[CHANNEL]
        s = _settings(str(ch[CODEC]))
        if ROUND_WEIGHT in ch:  # the round's total weight, known to the server once the clients replied
            weight = ch[ROUND_WEIGHT]
            if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= s["max_total_weight"]:
                raise RuntimeError(f"Paillier channel: {ROUND_WEIGHT} {str(weight)[:40]} outside "
                                   f"[1, {s['max_total_weight']}]")
            s = {**s, "max_total_weight": weight}
        return RecordDict(self._encrypt(context, s, [update], float(ch[CLIP])))

    def _advance(self, msg: Message, context: Context) -> RecordDict:
        if STATE_CHANNEL_MODEL in context.state:  # names, shapes and dtypes: the model this client holds ...
            template = {k: np.asarray(v.numpy()) for k, v in context.state[STATE_CHANNEL_MODEL].items() if k != _ROUND}
        elif ARRAYS in msg.content:  # ... or the initial model the message carries
            template = dict(zip(msg.content[ARRAYS].keys(), decode_arrays(msg.content[ARRAYS])))
        else:
            raise RuntimeError("Paillier channel: the message continues a global model this client does not hold")
        t0 = time.perf_counter()
        self.decode(msg.content, context, template)
        seconds = time.perf_counter() - t0
        self._keep(context)
        return RecordDict({CHANNEL: ConfigRecord({HELD_ROUND: int(self._decoded[0]), DECRYPT_SECONDS: seconds})})

    def _encrypt(self, context: Context, s: Mapping[str, Any], arrays: Sequence[np.ndarray],
                 clip: float) -> dict[str, Any]:
        public, private = self._keys(context, need_private=False)
        codec = self._codec(s, public, private, clip)
        num = sum(int(np.asarray(a).size) for a in arrays)
        inline0 = codec.pool.inline if codec.pool is not None else 0
        t0 = time.perf_counter()
        payload = codec.encode(arrays)
        seconds = time.perf_counter() - t0
        inline = (codec.pool.inline - inline0) if codec.pool is not None else codec.num_ciphertexts(num)
        if codec.pool is not None:
            POOLS.refill(codec.pool, codec.num_ciphertexts(num))
        return {CHANNEL: ConfigRecord({PAYLOAD: payload, ENCRYPT_SECONDS: seconds, CLIPPED: codec.last_clipped,
                                       INLINE_OBFUSCATORS: inline})}
