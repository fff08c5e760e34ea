"""Paillier keys (``phe`` with ``gmpy2``), their serialisation and fingerprint, and the raw operations:
encryption with a given obfuscator, decryption, the homomorphic weighted sum, threaded decryption."""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import struct
import warnings
from typing import Sequence

import gmpy2
import numpy as np
from phe import paillier as phe_paillier

DEFAULT_KEY_BITS = 2048
MIN_KEY_BITS = 512
MAX_KEY_BITS = 8192  # the payload header stores key_bits in 16 bits; larger keys take minutes to generate
PublicKey = phe_paillier.PaillierPublicKey
PrivateKey = phe_paillier.PaillierPrivateKey
_PK_MAGIC, _SK_MAGIC, _KEY_VERSION = b"FSPK", b"FSSK", 1


class WeakKeyWarning(UserWarning):
    """A Paillier key shorter than 2048 bits (fine for tests, not for protecting data)."""



# ------------------------------------------------------------------------------------------- keys
def generate_keypair(key_bits: int = DEFAULT_KEY_BITS, warn: bool = True) -> tuple[PublicKey, PrivateKey]:
    """A fresh Paillier key pair with an ``n`` of exactly ``key_bits`` bits (even, >= 512).

    Keys below 2048 bits emit :class:`WeakKeyWarning` (unless ``warn`` is false: the channel's client
    half, whose server half warned once when the config was validated).
    """
    check_key_bits(key_bits)
    if key_bits < DEFAULT_KEY_BITS and warn:
        warnings.warn(f"Paillier key of {key_bits} bits: below {DEFAULT_KEY_BITS} bits, use only for tests",
                      WeakKeyWarning, stacklevel=2)
    return phe_paillier.generate_paillier_keypair(n_length=int(key_bits))


def check_key_bits(key_bits: object) -> int:
    """``key_bits`` as an int, or ``ValueError`` naming ``channel.key_bits`` and its bounds."""
    if isinstance(key_bits, bool) or not isinstance(key_bits, (int, np.integer)) or key_bits % 2 \
            or not MIN_KEY_BITS <= key_bits <= MAX_KEY_BITS:
        raise ValueError(f"channel.key_bits must be an even integer in [{MIN_KEY_BITS}, {MAX_KEY_BITS}], "
                         f"got {key_bits!r}")
    return int(key_bits)


def security_bits(key_bits: int) -> int:
    """``kappa``, the security level of a Paillier/RSA modulus (NIST SP 800-57): 112 bits below 3072-bit
    keys, 128 from 3072 bits (and 80 below 2048 bits, for test keys)."""
    return 80 if key_bits < 2048 else 112 if key_bits < 3072 else 128


def public_key_to_bytes(public_key: PublicKey) -> bytes:
    """``"FSPK" | version u8 | len u16 | n`` (big-endian)."""
    n = int(public_key.n)
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return _PK_MAGIC + struct.pack(">BH", _KEY_VERSION, len(body)) + body


def public_key_from_bytes(data: bytes) -> PublicKey:
    """Inverse of :func:`public_key_to_bytes`; ``ValueError`` on malformed bytes."""
    data = bytes(data)
    if len(data) < 7 or data[:4] != _PK_MAGIC or data[4] != _KEY_VERSION:
        raise ValueError("public key bytes: bad magic or version")
    (length,) = struct.unpack(">H", data[5:7])
    if len(data) != 7 + length:
        raise ValueError(f"public key bytes: {len(data) - 7} bytes of n, header says {length}")
    n = int.from_bytes(data[7:], "big")
    if n.bit_length() < MIN_KEY_BITS or n % 2 == 0:
        raise ValueError(f"public key bytes: n of {n.bit_length()} bits is not a valid modulus")
    return PublicKey(n)


def private_key_to_bytes(private_key: PrivateKey) -> bytes:
    """``"FSSK" | version u8 | len(p) u16 | len(q) u16 | p | q`` (big-endian). Secret: seal it
    (:func:`fedsim.crypto.keyexchange.seal_secret`) before it leaves the client."""
    p, q = int(private_key.p), int(private_key.q)
    bp = p.to_bytes((p.bit_length() + 7) // 8, "big")
    bq = q.to_bytes((q.bit_length() + 7) // 8, "big")
    return _SK_MAGIC + struct.pack(">BHH", _KEY_VERSION, len(bp), len(bq)) + bp + bq


def private_key_from_bytes(data: bytes, public_key: PublicKey | None = None) -> PrivateKey:
    """Inverse of :func:`private_key_to_bytes`; with ``public_key`` also checks ``p * q == n``."""
    data = bytes(data)
    if len(data) < 9 or data[:4] != _SK_MAGIC or data[4] != _KEY_VERSION:
        raise ValueError("private key bytes: bad magic or version")
    lp, lq = struct.unpack(">HH", data[5:9])
    if len(data) != 9 + lp + lq:
        raise ValueError("private key bytes: length does not match the header")
    p = int.from_bytes(data[9:9 + lp], "big")
    q = int.from_bytes(data[9 + lp:], "big")
    if p < 3 or q < 3 or p == q:
        raise ValueError("private key bytes: p and q must be distinct primes")
    if public_key is not None and p * q != int(public_key.n):
        raise ValueError("private key bytes: p * q does not match the given public key")
    return PrivateKey(PublicKey(p * q), p, q)


def key_fingerprint(public_key: PublicKey) -> bytes:
    """SHA-256 of :func:`public_key_to_bytes` (32 bytes)."""
    return hashlib.sha256(public_key_to_bytes(public_key)).digest()


# ------------------------------------------------------------------------------ raw operations
def encrypt_raw(public_key: PublicKey, plaintext: int, obfuscator: int | None = None) -> int:
    """Encrypt an integer ``0 <= plaintext < n``.

    ``obfuscator=None``: ``phe``'s ``raw_encrypt`` with a fresh random ``r`` (full cost). Otherwise
    ``raw_encrypt(plaintext, r_value=1) * obfuscator mod n**2`` where ``obfuscator = r**n mod n**2``
    was precomputed (:class:`ObfuscatorPool`); it must never be used twice.
    """
    m = int(plaintext)
    if not 0 <= m < public_key.n:
        raise ValueError(f"plaintext must be in [0, n), got a {m.bit_length()}-bit value")
    if obfuscator is None:
        return public_key.raw_encrypt(m)
    nude = public_key.raw_encrypt(m, r_value=1)  # (1 + m n) mod n^2: powmod(1, n, n^2) is free
    return int(gmpy2.mpz(nude) * int(obfuscator) % public_key.nsquare)


def decrypt_raw(private_key: PrivateKey, ciphertext: int) -> int:
    """``phe``'s raw decryption: the plaintext in ``[0, n)``."""
    return private_key.raw_decrypt(int(ciphertext))


def weighted_sum(public_key: PublicKey, ciphertexts: Sequence[Sequence[int]], weights: Sequence[int]) -> list[int]:
    """Element-wise ``prod_i c_i[k]**w_i mod n**2``: encrypts ``sum_i w_i m_i[k] mod n``.

    ``ciphertexts[i]`` is client ``i``'s list (all the same length); ``weights`` are integers >= 0.
    Needs only the public key.
    """
    weights = _check_weights(weights, len(ciphertexts))
    lengths = {len(c) for c in ciphertexts}
    if len(lengths) != 1:
        raise ValueError(f"ciphertexts: the lists differ in length ({sorted(lengths)})")
    n2 = gmpy2.mpz(public_key.nsquare)
    terms = [(w, c) for w, c in zip(weights, ciphertexts) if w > 0]
    out = []
    for k in range(lengths.pop()):
        acc = gmpy2.mpz(1)
        for w, c in terms:
            ck = gmpy2.mpz(c[k])
            acc = acc * (ck if w == 1 else gmpy2.powmod(ck, w, n2)) % n2
        out.append(int(acc))
    return out


def decrypt_many(private_key: PrivateKey, ciphertexts: Sequence[int], threads: int | None = None) -> list[int]:
    """``phe``'s raw (CRT) decryption of every ciphertext, in ``threads`` threads (default: the CPUs this
    process may use, at most 8) whose gmpy2 context releases the GIL; the same integers as
    :func:`decrypt_raw` one by one (tested)."""
    cts = [int(c) for c in ciphertexts]
    threads = threads or min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if threads <= 1 or len(cts) < 16:
        return [private_key.raw_decrypt(c) for c in cts]
    chunks = [cts[i::threads] for i in range(threads)]

    def work(chunk: list[int]) -> list[int]:
        gmpy2.get_context().allow_release_gil = True  # this worker thread's context only
        return [private_key.raw_decrypt(c) for c in chunk]

    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="fedsim-decrypt") as ex:
        parts = list(ex.map(work, chunks))
    out = [0] * len(cts)
    for i, part in enumerate(parts):
        out[i::threads] = part
    return out


def _check_weights(weights: Sequence[int], count: int) -> list[int]:
    out = []
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
            raise ValueError(f"weights must be integers >= 0, got {list(weights)!r}")
        out.append(int(w))
    if len(out) != count or count == 0:
        raise ValueError(f"weights: {len(out)} weights for {count} ciphertext lists")
    if sum(out) < 1:
        raise ValueError("weights must not all be 0")
    return out
