"""The CKKS channel, client half (see strategies/ckks.py and fedsim/crypto/ckks.py).

Every client keeps its X25519 private key and, once delivered, the CKKS private context (with the secret
key) in Flower's ``Context.state`` (``fedsim.keydelivery``); neither is ever put in a reply. A client
encrypts its trained model's floating entries (integer buffers such as ``num_batches_tracked`` travel in no
form and restart at zero) and decrypts the global model the server combined.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np
from flwr.app import ConfigRecord, Context, RecordDict

from fedsim.components import CLIENT_CHANNELS
from fedsim.crypto import ckks
from fedsim.keydelivery import SealedKeyClient
from fedsim.protocol import ARRAYS, CHANNEL, ENCRYPT_SECONDS, PAYLOAD, decode_arrays
from fedsim.seams import ClientChannel


@CLIENT_CHANNELS.register
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
        if PAYLOAD not in ch:  # round 1: the public initial model
            return decode_arrays(content[ARRAYS])
        floating = [k for k, v in template.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]
        num = sum(int(np.asarray(template[k]).size) for k in floating)
        flat = ckks.decode(self._key(context, self.secret_field), bytes(ch[PAYLOAD]), num)
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
        payload = ckks.encode(self._key(context, self.public_field), np.concatenate(floating))
        return {CHANNEL: ConfigRecord({PAYLOAD: payload, ENCRYPT_SECONDS: time.perf_counter() - t0})}
