"""Decrypted aggregates shared by the clients of one process (client processes only; never the server).

In the thesis' protocol every client holds the same secret key (Paillier or CKKS) and decrypts the same
aggregate ciphertexts every round. On a simulation's actor (or the in-process grid) one process runs
several clients one after another; each would decrypt the same payload again and get the same values.
:class:`DecodedCache` keeps the decoded values of the payloads a process decrypted lately, keyed by the
key's fingerprint, a SHA-256 digest of the payload and the decoding settings, and hands the same
read-only array to the next client of that process. In a deployment each client decrypts once per round
on its own machine, all in parallel, so one decryption is the round's critical path; the cache makes a
process that hosts several clients charge one decryption too, not one per client (docs/paillier.md).

Decryption is deterministic (the same ciphertexts and key give the same values), so a hit returns exactly
what the client would have computed. The cache never leaves the process: nothing in it is put in a reply
or a checkpoint, and a process that holds no key never fills it.
"""
from __future__ import annotations

import collections
import hashlib
import threading
from typing import Callable

import numpy as np


class DecodedCache:
    """The ``size`` most recently used decoded payloads of this process."""

    def __init__(self, size: int = 32) -> None:
        self.items: collections.OrderedDict[tuple[bytes, bytes, str], np.ndarray] = collections.OrderedDict()
        self.size = int(size)
        self.lock = threading.Lock()
        self.hits = 0

    def get(self, key: bytes, payload: bytes, settings: str, decode: Callable[[], np.ndarray]) -> np.ndarray:
        """The decoded values of ``payload`` (decrypted under the key whose fingerprint is ``key``, with
        ``settings``): from the cache, or ``decode()`` once and kept. The array is read-only."""
        k = (bytes(key), hashlib.sha256(payload).digest(), str(settings))
        with self.lock:
            if k in self.items:
                self.items.move_to_end(k)
                self.hits += 1
                return self.items[k]
        values = np.asarray(decode())
        values.setflags(write=False)
        with self.lock:
            self.items[k] = values
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return values


DECODED = DecodedCache()  # this process's
