"""The Paillier channel, client half (see strategies/paillier.py for the protocol).

Every client keeps its X25519 private key and, once delivered, the Paillier private key in Flower's
``Context.state`` (record ``fedsim.protocol.STATE_CHANNEL``); neither is ever put in a reply. The
encoding settings come from the server's messages (``CODEC``), so they are declared once, on the
server half.

Encryption uses obfuscators precomputed off the critical path: each client process keeps one
:class:`fedsim.crypto.paillier.ObfuscatorPool` per public key, refilled in a background thread after
each encryption (and started as soon as the key arrives), so the online cost of an encryption is one
multiplication mod n^2 per ciphertext. The reply reports the online time, the values the quantizer
clipped and the obfuscators that had to be computed inline.
"""
from __future__ import annotations

import json
import threading
import time
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedsim.components import CLIENT_CHANNELS
from fedsim.crypto.keyexchange import open_secret, seal_secret, x25519_keypair
from fedsim.crypto.paillier import (
    ObfuscatorPool,
    PaillierCodec,
    generate_keypair,
    key_fingerprint,
    private_key_from_bytes,
    private_key_to_bytes,
    public_key_from_bytes,
    public_key_to_bytes,
)
from fedsim.crypto.quantize import Quantizer
from fedsim.factories import model_for
from fedsim.protocol import (
    ARRAYS,
    CHANNEL,
    CLIPPED,
    CODEC,
    CONFIG,
    ENCRYPT_SECONDS,
    FINGERPRINT,
    HOLDER,
    HOLDER_KEY,
    INLINE_OBFUSCATORS,
    NODE_PARTITION_ID,
    PAYLOAD,
    PEER_KEYS,
    PEERS,
    PUBLIC_KEY,
    RUN_TAG,
    SEALED,
    STAGE,
    STATE_CHANNEL,
    X25519_PUBLIC,
    decode_arrays,
)
from fedsim.seams import ClientChannel

_X25519 = "x25519-private"
_PAILLIER = "paillier-private"
_PUBLIC = "paillier-public"


def _who(partition: int) -> str:
    return f"client-{int(partition)}"


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


@CLIENT_CHANNELS.register
class PaillierClientChannel(ClientChannel):
    name = "paillier"

    # ---- state ---------------------------------------------------------------------------------------
    @staticmethod
    def _state(context: Context) -> dict[str, bytes]:
        return {k: bytes(v) for k, v in context.state[STATE_CHANNEL].items()} if STATE_CHANNEL in context.state else {}

    @staticmethod
    def _save(context: Context, **items: bytes) -> None:
        rec = context.state[STATE_CHANNEL] if STATE_CHANNEL in context.state else ConfigRecord()
        for k, v in items.items():
            rec[k] = v
        context.state[STATE_CHANNEL] = rec

    def _codec(self, channel: Mapping[str, Any], context: Context, need_private: bool) -> PaillierCodec:
        s = _settings(str(channel[CODEC]))
        public = public_key_from_bytes(bytes(channel[PUBLIC_KEY]))
        state = self._state(context)
        private = private_key_from_bytes(state[_PAILLIER], public) if _PAILLIER in state else None
        if need_private and private is None:
            raise RuntimeError("Paillier channel: this client holds no private key (key delivery failed)")
        return PaillierCodec(public, Quantizer(bits=s["bits"], clip=s["clip"], overflow=s["overflow"]),
                             s["max_total_weight"], private_key=private, packed=s["packed"], slots=s["slots"],
                             pool=POOLS.get(public, private) if private is not None else None)

    # ---- setup exchange ------------------------------------------------------------------------------------
    def handshake(self, msg: Message, context: Context) -> RecordDict:
        stage = str(msg.content[CONFIG][STAGE])
        ch = msg.content[CHANNEL]
        me = int(context.node_config[NODE_PARTITION_ID])
        run = str(ch[RUN_TAG])
        if stage == "hello":
            private, public = x25519_keypair()
            raw = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
            self._save(context, **{_X25519: raw})
            return RecordDict({CHANNEL: ConfigRecord({X25519_PUBLIC: public})})
        own = X25519PrivateKey.from_private_bytes(self._state(context)[_X25519])
        if stage == "keygen":
            s = _settings(str(ch[CODEC]))
            public, private = generate_keypair(int(s["key_bits"]), warn=False)  # the config's check warned
            secret = private_key_to_bytes(private)
            sealed = [seal_secret(secret, own, bytes(k), run_id=run, sender=_who(me), recipient=_who(p))
                      for p, k in zip(ch[PEERS], ch[PEER_KEYS])]
            self._save(context, **{_PAILLIER: secret, _PUBLIC: public_key_to_bytes(public)})
            self._prefill(public, private, s)
            return RecordDict({CHANNEL: ConfigRecord({PUBLIC_KEY: public_key_to_bytes(public), SEALED: sealed})})
        if stage == "deliver":
            holder = int(ch[HOLDER])
            secret = open_secret(bytes(ch[SEALED]), own, bytes(ch[HOLDER_KEY]), run_id=run, sender=_who(holder),
                                 recipient=_who(me))
            public = public_key_from_bytes(bytes(ch[PUBLIC_KEY]))
            private = private_key_from_bytes(secret, public)  # checks that it belongs to the public key
            self._save(context, **{_PAILLIER: secret, _PUBLIC: public_key_to_bytes(public)})
            self._prefill(public, private, _settings(str(ch[CODEC])))
            return RecordDict({CHANNEL: ConfigRecord({FINGERPRINT: key_fingerprint(public)})})
        raise ValueError(f"Paillier channel: unknown setup stage {stage!r}")

    def _prefill(self, public: Any, private: Any, settings: Mapping[str, Any]) -> None:
        """Start precomputing the first round's obfuscators as soon as the key is known."""
        values = sum(int(v.numel()) for v in model_for(self.cfg).state_dict().values() if v.is_floating_point())
        codec = PaillierCodec(public, Quantizer(bits=settings["bits"], clip=settings["clip"]),
                              settings["max_total_weight"], packed=settings["packed"], slots=settings["slots"])
        POOLS.refill(POOLS.get(public, private), codec.num_ciphertexts(values))

    # ---- rounds ----------------------------------------------------------------------------------------------
    def decode(self, content: RecordDict, context: Context, template: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        ch = content[CHANNEL]
        self._codec_text = str(ch[CODEC])  # the settings encode() will use for the reply
        if PAYLOAD not in ch:  # round 1: the public initial model
            return decode_arrays(content[ARRAYS])
        floating = [k for k, v in template.items() if np.issubdtype(v.dtype, np.floating)]
        values = self._codec(ch, context, need_private=True).decode(bytes(ch[PAYLOAD]),
                                                                    [template[k].shape for k in floating])
        dec = dict(zip(floating, values))
        # integer buffers (BatchNorm's num_batches_tracked) are not encrypted: they restart at zero
        return [dec[k].astype(v.dtype) if k in dec else np.zeros_like(v) for k, v in template.items()]

    def encode(self, arrays: Sequence[np.ndarray], param_names: Sequence[str], context: Context) -> dict[str, Any]:
        state = self._state(context)
        if _PUBLIC not in state:
            raise RuntimeError("Paillier channel: this client holds no key (key delivery failed)")
        channel = {CODEC: self._codec_text, PUBLIC_KEY: state[_PUBLIC]}
        codec = self._codec(channel, context, need_private=False)
        floating = [a for a in arrays if np.issubdtype(np.asarray(a).dtype, np.floating)]
        inline0 = codec.pool.inline if codec.pool is not None else 0
        t0 = time.perf_counter()
        payload = codec.encode(floating)
        seconds = time.perf_counter() - t0
        inline = (codec.pool.inline - inline0) if codec.pool is not None else codec.num_ciphertexts(
            sum(int(np.asarray(a).size) for a in floating))
        if codec.pool is not None:
            POOLS.refill(codec.pool, codec.num_ciphertexts(sum(int(np.asarray(a).size) for a in floating)))
        return {CHANNEL: ConfigRecord({PAYLOAD: payload, ENCRYPT_SECONDS: seconds, CLIPPED: codec.last_clipped,
                                       INLINE_OBFUSCATORS: inline})}
