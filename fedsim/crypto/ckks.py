"""CKKS (Cheon-Kim-Kim-Song 2017) for weighted sums the server computes without decrypting, on TenSEAL.

A pure library like the rest of :mod:`fedsim.crypto` (TenSEAL and NumPy, no Flower): the CKKS channel
(``[channel] name = "ckks"``) is built on it. Design, threat model and measurements: docs/paillier.md
("The CKKS channel").

Parameters (fixed, 128-bit security): ring dimension ``N = 8192`` (``N/2 = 4096`` real values per
ciphertext, "slots"), coefficient moduli of 60, 40 and 60 bits (160 bits in all; the homomorphic
encryption standard allows up to 218 bits at ``N = 8192`` for 128-bit security with a ternary secret, and
SEAL refuses parameters above it: tested), scale ``2**40``. One level is spent: the server multiplies each
client's ciphertexts by its weight (a plaintext scalar) and rescales, then adds; a client's ciphertexts
must arrive fresh (two polynomials, both data primes, scale ``2**40``).

Error: a decrypted weighted mean ``sum_i p_i x_i`` (``sum p_i = 1``) differs from the exact one by the
encryption noise of the clients' ciphertexts (weighted by ``p_i``, so at most one fresh ciphertext's) and
the rescaling noise, divided by the scale; with the high-probability bounds of Cheon et al. 2017 (Lemmas
1 and 2, ``sigma = 3.2``, ternary secret of Hamming weight ``h <= 2N/3``) :func:`error_bound` gives
``(B_clean + B_rescale) / 2**40`` = 6.1e-7 per value (measured: about 3e-8). Encoding rounding adds about
1e-10, negligible.

Key material: :func:`make_keys` returns the public context (parameters and a key id, no key: the server
needs none to weight and add ciphertexts) and the private one (the secret key; the clients encrypt with it,
symmetrically) as bytes, neither with relinearisation or Galois keys (the channel needs neither); the
private one is delivered to the other clients sealed (:mod:`fedsim.keydelivery`) and never reaches the
server.

Payload: ``"FSCK" | version u8 | num_values u64 | num_ciphertexts u32 | public-context fingerprint (32)``
then per ciphertext ``length u32 | TenSEAL serialisation`` (one CKKS vector of up to 4096 values).
"""
from __future__ import annotations

import hashlib
import math
import secrets
import struct
from functools import lru_cache
from typing import Sequence

import numpy as np
import tenseal as ts

from fedsim.crypto.errors import IntegrityError

POLY_MODULUS_DEGREE = 8192
COEFF_MOD_BIT_SIZES = (60, 40, 60)
SCALE_BITS = 40
SLOTS = POLY_MODULUS_DEGREE // 2
MAX_COEFF_MODULUS_BITS_128 = 218  # HE standard (2018), N = 8192, 128-bit classical security, ternary secret
SIGMA = 3.2

_MAGIC, _VERSION = b"FSCK", 1
_HEAD = struct.Struct(">4sBQI32s")
_LEN = struct.Struct(">I")


def error_bound(n: int = POLY_MODULUS_DEGREE, scale_bits: int = SCALE_BITS, sigma: float = SIGMA) -> float:
    """Per-value bound on ``|decrypted weighted mean - exact weighted mean|`` for convex weights: a fresh
    ciphertext's noise ``B_clean = 8 sqrt(2) sigma N + 6 sigma sqrt(N) + 16 sigma sqrt(h N)`` plus the
    rescaling noise ``B_rs = sqrt(N/3) (3 + 8 sqrt(h))``, ``h = 2N/3`` (Cheon et al. 2017, Lemmas 1-2),
    over the scale."""
    h = 2 * n / 3
    clean = 8 * math.sqrt(2) * sigma * n + 6 * sigma * math.sqrt(n) + 16 * sigma * math.sqrt(h * n)
    rescale = math.sqrt(n / 3) * (3 + 8 * math.sqrt(h))
    return (clean + rescale) / 2.0 ** scale_bits


_KEY_MAGIC = b"FSCKKEY1"
_KEY_ID = 32


def make_keys() -> tuple[bytes, bytes]:
    """A fresh CKKS key as ``(public bytes, private bytes)``: ``"FSCKKEY1" | key id (32 random bytes) |
    TenSEAL context``. The private context holds the secret key and encrypts *symmetrically* (SEAL's
    secret-key encryption: every client holds the secret key in this protocol, and it is 3x faster than
    public-key encryption, with less noise); the public one holds the parameters only - the server
    deserializes, weights and adds ciphertexts, which needs no key - and the key id, which makes its
    fingerprint that key's (a payload under another key is refused by the server)."""
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, POLY_MODULUS_DEGREE, coeff_mod_bit_sizes=list(COEFF_MOD_BIT_SIZES),
                     encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC)
    ctx.global_scale = 2.0 ** SCALE_BITS
    key_id = secrets.token_bytes(_KEY_ID)
    public = ctx.serialize(save_public_key=False, save_secret_key=False, save_galois_keys=False,
                           save_relin_keys=False)
    private = ctx.serialize(save_public_key=False, save_secret_key=True, save_galois_keys=False,
                            save_relin_keys=False)
    return _KEY_MAGIC + key_id + public, _KEY_MAGIC + key_id + private


def _key_id(data: bytes) -> bytes | None:
    """The key id of :func:`make_keys`' bytes; ``None`` for a bare TenSEAL context (keys made before the key
    id: asymmetric, the public context holds the public key)."""
    return bytes(data[len(_KEY_MAGIC):len(_KEY_MAGIC) + _KEY_ID]) if bytes(data[:len(_KEY_MAGIC)]) == _KEY_MAGIC else None


def fingerprint(public: bytes) -> bytes:
    """SHA-256 of the public context bytes."""
    return hashlib.sha256(bytes(public)).digest()


@lru_cache(maxsize=8)
def load_context(data: bytes) -> ts.Context:
    """A TenSEAL context from its bytes (cached per process), checked to carry the channel's parameters;
    ``ValueError`` otherwise."""
    data = bytes(data)
    if _key_id(data) is not None:
        data = data[len(_KEY_MAGIC) + _KEY_ID:]
    try:
        ctx = ts.context_from(data)
    except Exception as exc:  # noqa: BLE001 - TenSEAL raises several kinds on malformed bytes
        raise ValueError(f"CKKS context bytes cannot be read ({type(exc).__name__})") from None
    n, bits = parameters(ctx)
    if n != POLY_MODULUS_DEGREE or bits != sum(COEFF_MOD_BIT_SIZES):
        raise ValueError(f"CKKS context with N = {n} and {bits}-bit coefficient modulus; the channel uses "
                         f"N = {POLY_MODULUS_DEGREE} and {sum(COEFF_MOD_BIT_SIZES)} bits")
    ctx.global_scale = 2.0 ** SCALE_BITS
    return ctx


def parameters(ctx: ts.Context) -> tuple[int, int]:
    """``(N, total coefficient-modulus bits)`` of a context, read from SEAL."""
    data = ctx.seal_context().data.key_context_data()
    return int(data.parms().poly_modulus_degree()), int(data.total_coeff_modulus_bit_count())


def check_keys(public: bytes, private: bytes) -> None:
    """``ValueError`` unless ``private`` holds the secret key of ``public``: the same key id, and a probe the
    private context encrypts (or, for keys without an id, the public one) reads under the public context and
    decrypts under the private one."""
    pub, priv = load_context(bytes(public)), load_context(bytes(private))
    if not priv.has_secret_key() or pub.has_secret_key():
        raise ValueError("CKKS keys: the private context must hold the secret key and the public one must not")
    if _key_id(public) != _key_id(private):
        raise ValueError("CKKS keys: the private context does not belong to the public one (key id)")
    probe = np.linspace(-1.0, 1.0, 16)
    enc = ts.ckks_vector(priv if _key_id(private) is not None else pub, probe.tolist()).serialize()
    got = np.array(ts.ckks_vector_from(priv, ts.ckks_vector_from(pub, enc).serialize()).decrypt())
    if not np.allclose(got, probe, atol=1e-4):
        raise ValueError("CKKS keys: the private context does not belong to the public one")


def _chunks(count: int) -> list[tuple[int, int]]:
    return [(i, min(i + SLOTS, count)) for i in range(0, count, SLOTS)]


def encode(key: bytes, values: np.ndarray, public: bytes | None = None) -> bytes:
    """Encrypt a flat float vector (one CKKS vector per 4096 values) into a payload, with the context of
    ``key``: the private bytes of :func:`make_keys` (secret-key encryption), or a public context that holds a
    public key (keys without an id). ``public``: the public bytes whose fingerprint the header carries
    (default: ``key``'s)."""
    ctx = load_context(bytes(key))
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError("CKKS encode: need a non-empty vector of finite values")
    cts = [ts.ckks_vector(ctx, x[a:b].tolist()).serialize() for a, b in _chunks(x.size)]
    return _build(key if public is None else public, x.size, cts)


def _build(public: bytes, num_values: int, cts: Sequence[bytes]) -> bytes:
    head = _HEAD.pack(_MAGIC, _VERSION, int(num_values), len(cts), fingerprint(public))
    return head + b"".join(_LEN.pack(len(c)) + c for c in cts)


def _split(payload: bytes) -> tuple[int, int, bytes, list[bytes]]:
    if len(payload) < _HEAD.size:
        raise IntegrityError("header", f"payload of {len(payload)} bytes is shorter than the header")
    magic, version, num, count, fp = _HEAD.unpack_from(payload, 0)
    if magic != _MAGIC:
        raise IntegrityError("header", "not a fedsim CKKS payload (bad magic)")
    if version != _VERSION:
        raise IntegrityError("version", f"payload version {version}, this code reads {_VERSION}")
    cts, i = [], _HEAD.size
    for _ in range(count):
        if i + _LEN.size > len(payload):
            raise IntegrityError("count", "payload truncated")
        (n,) = _LEN.unpack_from(payload, i)
        if i + _LEN.size + n > len(payload):
            raise IntegrityError("count", "payload truncated")
        cts.append(payload[i + _LEN.size:i + _LEN.size + n])
        i += _LEN.size + n
    if i != len(payload):
        raise IntegrityError("count", f"{len(payload) - i} bytes after the last ciphertext")
    return num, count, fp, cts


def verify(public: bytes, payload: bytes, num_values: int, *, fresh: bool = True) -> list[ts.CKKSVector]:
    """Server-side checks with the public context alone; returns the ciphertexts or raises
    :class:`IntegrityError` naming the field: header, version, ``fingerprint`` (another key), ``count``
    (values, ciphertexts, truncation), ``ciphertext[i]`` (unreadable, wrong number of values, not fresh -
    with ``fresh`` - or another scale)."""
    num, count, fp, raw = _split(bytes(payload))
    if fp != fingerprint(public):
        raise IntegrityError("fingerprint", "the payload was encrypted under another public key")
    if num != num_values:
        raise IntegrityError("count", f"payload holds {num} values, expected {num_values}")
    chunks = _chunks(num_values)
    if count != len(chunks):
        raise IntegrityError("count", f"{count} ciphertexts for {num_values} values, expected {len(chunks)}")
    ctx = load_context(bytes(public))
    out = []
    for k, ((a, b), data) in enumerate(zip(chunks, raw)):
        try:
            v = ts.ckks_vector_from(ctx, data)
            parts = v.ciphertext()
        except Exception as exc:  # noqa: BLE001 - TenSEAL/SEAL reject malformed ciphertexts with several kinds
            raise IntegrityError(f"ciphertext[{k}]", f"cannot be read ({type(exc).__name__})") from None
        if v.size() != b - a or len(parts) != 1:
            raise IntegrityError(f"ciphertext[{k}]", f"holds {v.size()} values in {len(parts)} ciphertexts, "
                                                     f"expected {b - a} in one")
        c = parts[0]
        want_level = len(COEFF_MOD_BIT_SIZES) - 1 if fresh else 1
        if c.size() != 2 or c.coeff_modulus_size() != want_level:
            raise IntegrityError(f"ciphertext[{k}]", f"{c.size()} polynomials at {c.coeff_modulus_size()} primes; "
                                                     f"expected 2 at {want_level}")
        if fresh and c.scale != 2.0 ** SCALE_BITS:
            raise IntegrityError(f"ciphertext[{k}]", f"scale {c.scale!r}, expected 2**{SCALE_BITS}")
        out.append(v)
    return out


def combine(public: bytes, payloads: Sequence[bytes], weights: Sequence[float], num_values: int) -> bytes:
    """``sum_i weights[i] * payload_i`` (each :func:`verify`-ed fresh) with the public context alone; the
    weights must be finite and >= 0 with a positive sum (they are used as given: normalise them first)."""
    return combine_read(public, [verify(public, p, num_values) for p in payloads], weights, num_values)


def combine_read(public: bytes, parsed: Sequence[Sequence[ts.CKKSVector]], weights: Sequence[float],
                 num_values: int) -> bytes:
    """:func:`combine` of payloads already :func:`verify`-ed (and read) when they arrived: each is read once,
    however often it is combined."""
    w = [float(x) for x in weights]
    if not parsed or len(w) != len(parsed) or not all(math.isfinite(x) and x >= 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"weights: {len(w)} finite weights >= 0 with a positive sum for {len(parsed)} payloads")
    acc: list[ts.CKKSVector] | None = None
    for wi, cts in zip(w, parsed):
        if wi == 0:
            continue
        terms = [c * wi for c in cts]
        acc = terms if acc is None else [a + t for a, t in zip(acc, terms)]
    return _build(public, num_values, [c.serialize() for c in acc])


def decode(private: bytes, payload: bytes, num_values: int) -> np.ndarray:
    """Decrypt a payload (a combination, or a fresh one) to a flat float64 vector (needs the private context)."""
    ctx = load_context(bytes(private))
    if not ctx.has_secret_key():
        raise ValueError("private: decoding needs the CKKS secret key")
    num, count, _, raw = _split(bytes(payload))
    if num != num_values or count != len(_chunks(num_values)):
        raise IntegrityError("count", f"payload holds {num} values in {count} ciphertexts, expected {num_values}")
    out = [np.asarray(ts.ckks_vector_from(ctx, data).decrypt(), dtype=np.float64) for data in raw]
    flat = np.concatenate(out)
    if flat.size != num_values or not np.all(np.isfinite(flat)):
        raise IntegrityError("values", "the decrypted vector has the wrong size or non-finite values")
    return flat
