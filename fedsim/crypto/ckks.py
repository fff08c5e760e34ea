"""CKKS (Cheon-Kim-Kim-Song 2017) for integer-weighted sums the server computes without decrypting, on TenSEAL.

A pure library like the rest of :mod:`fedsim.crypto` (TenSEAL and its SEAL bindings, NumPy; no Flower): the
CKKS channel (``[channel] name = "ckks"``) is built on it. Design, threat model and measurements:
docs/paillier.md ("The CKKS channel").

Parameters (fixed, 128-bit security or more): ring dimension ``N = 8192`` (``N/2 = 4096`` complex slots per
ciphertext, each carrying two values - real and imaginary part - so 8192 values per ciphertext), coefficient
moduli of 60 and 60 bits (120 bits in all; the homomorphic encryption standard allows up to 218 bits at ``N =
8192`` for 128-bit security with a ternary secret, fewer bits are more secure, and SEAL refuses parameters
above it: tested): one data prime ``q`` (every ciphertext lives modulo ``q`` alone) and SEAL's key-level
prime, which nothing uses (no relinearisation or Galois keys are made). Scale ``2**40``. No level is spent:
the server multiplies each client's ciphertexts by its integer weight ``w_i`` (a plaintext constant at scale
1: exact, the scale stays ``2**40``) and adds them; a payload carries its total weight ``W`` (1 for a
client's), and the decrypting client divides by it.

Capacity: a coefficient of ``sum_i w_i ct_i`` is at most ``W (sqrt(2) X 2**40 + 1/2 + 21)`` (values ``|x| <=
X``, so slots of modulus up to ``sqrt(2) X``; the encoding's rounding; SEAL's centered-binomial error ``|e_j|
<= 21``), which must stay below ``q/2``: ``sqrt(2) W X <= CAPACITY = 524287`` (:func:`capacity` derives it
from ``q``). The channel bounds ``W`` (its ``precision`` plus the clients per round) and gives the clients
``X = floor(CAPACITY / (sqrt(2) W_max))`` (:func:`max_abs`: 90 at ``W_max = 4106``); :func:`encode` refuses
larger values, so an honest client's sum cannot overflow (:func:`decode` also refuses an aggregate outside
``[-X, X]``, a sanity check).

Error: a decrypted weighted mean ``sum_i (w_i/W) x_i`` differs from the exact one by the weighted clients'
encryption errors (secret-key encryption: the error polynomial ``e`` alone, coefficients of variance
``sigma**2 = 10.5``; a slot's real part, and its imaginary part, has standard deviation ``sigma sqrt(N/2)``,
and convex weights do not raise it), the encoding's rounding (variance 1/12 per coefficient) and float64
rounding in the encoding and decoding FFTs; :func:`error_bound` adds ``6 sigma sqrt(N)`` and ``6 sqrt(N/12)``
(8.5 standard deviations each) over the scale, and the FFTs' worst case ``2 (log2 N + 1) N 2**-53 sqrt(2)
X``: 5.0e-9 at ``X = 90`` (measured: below 1e-9). Integer weights that round a rule's real weights add ``X
sum_i |w_i/W - p_i|`` (the channel reports it).

Key material: :func:`make_keys` returns the public context (parameters and a key id, no key: the server
needs none to weight and add ciphertexts) and the private one (the secret key; the clients encrypt with it,
symmetrically) as bytes; the private one is delivered to the other clients sealed (:mod:`fedsim.keydelivery`)
and never reaches the server.

Payload: ``"FSCK" | version u8 | num_values u64 | num_ciphertexts u32 | total weight u32 | public-context
fingerprint (32)`` then per ciphertext ``length u32 | SEAL serialisation`` (8192 values; a client's
ciphertexts are saved *seeded*: SEAL stores the uniform half of a secret-key ciphertext as the 64-byte seed it
was drawn from, half the bytes).
"""
from __future__ import annotations

import atexit
import hashlib
import math
import os
import secrets
import shutil
import struct
import tempfile
import threading
from functools import lru_cache
from typing import Sequence

import numpy as np
import tenseal as ts
import tenseal.sealapi as sa

from fedsim.crypto.errors import IntegrityError

POLY_MODULUS_DEGREE = 8192
COEFF_MOD_BIT_SIZES = (60, 60)  # the data prime, and SEAL's key-level prime (unused: no key switching)
SCALE_BITS = 40
SLOTS = POLY_MODULUS_DEGREE // 2  # complex slots: each carries two values (real and imaginary part)
VALUES = 2 * SLOTS  # values per ciphertext
MAX_COEFF_MODULUS_BITS_128 = 218  # HE standard (2018), N = 8192, 128-bit classical security, ternary secret
SIGMA = math.sqrt(10.5)  # SEAL's error: centered binomial of 21 coin pairs (variance 21/2), |e_j| <= 21
ERROR_MAX = 21
CAPACITY = 524287  # the largest W * max|x| (capacity(): floor((q/2 - 2**25) / 2**40) for the 60-bit data prime)
MAX_WEIGHT = 2 ** 20  # a payload's total weight (the capacity argument needs W * (1/2 + 21) <= 2**25)

_MAGIC, _VERSION = b"FSCK", 2
_HEAD = struct.Struct(">4sBQII32s")
_LEN = struct.Struct(">I")
_KEY_MAGIC = b"FSCKKEY2"
_KEY_ID = 32


def error_bound(max_abs: float, n: int = POLY_MODULUS_DEGREE, scale_bits: int = SCALE_BITS,
                sigma: float = SIGMA) -> float:
    """Per-value bound on ``|decrypted weighted mean - exact weighted mean|`` for values ``|x| <= max_abs``
    and exact integer weights: the encryption error ``6 sigma sqrt(N)`` and the encoding's rounding ``6
    sqrt(N/12)`` over the scale (each the bound of a slot's real part and of its imaginary part), plus the
    float64 FFTs' worst case ``2 (log2 N + 1) N 2**-53 sqrt(2) max_abs``."""
    noise = (6 * sigma * math.sqrt(n) + 6 * math.sqrt(n / 12)) / 2.0 ** scale_bits
    return noise + 2 * (math.log2(n) + 1) * n * 2.0 ** -53 * math.sqrt(2) * float(max_abs)


def capacity(public: bytes) -> int:
    """The largest ``W * max|x|`` a context's data prime ``q`` carries: ``W (X 2**40 + 1/2 + 21) < q/2`` for
    every ``W <= MAX_WEIGHT`` (:data:`CAPACITY` for the channel's parameters)."""
    q = _tools(bytes(public)).seal.first_context_data().parms().coeff_modulus()[0].value()
    return (q // 2 - 2 ** 25) >> SCALE_BITS


def max_abs(max_total_weight: int) -> int:
    """The values' bound ``X`` for combinations of total weight up to ``W = max_total_weight``: ``floor(CAPACITY
    / (sqrt(2) W))`` (a complex slot of two values up to ``X`` has modulus up to ``sqrt(2) X``); ``ValueError``
    when it is below 1."""
    w = int(max_total_weight)
    x = math.floor(CAPACITY / (math.sqrt(2) * w)) if 1 <= w <= MAX_WEIGHT else 0
    if x < 1:
        raise ValueError(f"a total weight of {w} leaves no room for the values (CKKS capacity {CAPACITY})")
    return x


def make_keys() -> tuple[bytes, bytes]:
    """A fresh CKKS key as ``(public bytes, private bytes)``: ``"FSCKKEY2" | key id (32 random bytes) |
    TenSEAL context``. The private context holds the secret key and encrypts *symmetrically* (SEAL's
    secret-key encryption: every client holds the secret key in this protocol; faster than public-key
    encryption, with less noise, and seedable); the public one holds the parameters only - the server
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


def _key_id(data: bytes) -> bytes:
    return bytes(data[len(_KEY_MAGIC):len(_KEY_MAGIC) + _KEY_ID])


def fingerprint(public: bytes) -> bytes:
    """SHA-256 of the public context bytes."""
    return hashlib.sha256(bytes(public)).digest()


@lru_cache(maxsize=8)
def load_context(data: bytes) -> ts.Context:
    """A TenSEAL context from :func:`make_keys`' bytes (cached per process), checked to carry the channel's
    parameters; ``ValueError`` otherwise (keys of earlier fedsim versions - 60/40/60-bit moduli - included)."""
    data = bytes(data)
    if data[:len(_KEY_MAGIC)] != _KEY_MAGIC:
        raise ValueError("not a fedsim CKKS key of this version (keys made before the one-prime parameters, "
                         "60/60 bits, are refused: resume such a run with the fedsim that started it)")
    try:
        ctx = ts.context_from(data[len(_KEY_MAGIC) + _KEY_ID:])
    except Exception as exc:  # noqa: BLE001 - TenSEAL raises several kinds on malformed bytes
        raise ValueError(f"CKKS context bytes cannot be read ({type(exc).__name__})") from None
    n, bits = parameters(ctx)
    chain = ctx.seal_context().data.first_context_data().parms().coeff_modulus()
    if n != POLY_MODULUS_DEGREE or bits != sum(COEFF_MOD_BIT_SIZES) or [m.bit_count() for m in chain] != [60]:
        raise ValueError(f"CKKS context with N = {n} and {bits}-bit coefficient modulus; the channel uses "
                         f"N = {POLY_MODULUS_DEGREE} and {'/'.join(map(str, COEFF_MOD_BIT_SIZES))} bits")
    ctx.global_scale = 2.0 ** SCALE_BITS
    return ctx


def parameters(ctx: ts.Context) -> tuple[int, int]:
    """``(N, total coefficient-modulus bits)`` of a context, read from SEAL."""
    data = ctx.seal_context().data.key_context_data()
    return int(data.parms().poly_modulus_degree()), int(data.total_coeff_modulus_bit_count())


def check_keys(public: bytes, private: bytes) -> None:
    """``ValueError`` unless ``private`` holds the secret key of ``public``: the same key id, and a probe the
    private context encrypts passes the server's checks under the public context and decrypts."""
    pub, priv = load_context(bytes(public)), load_context(bytes(private))
    if not priv.has_secret_key() or pub.has_secret_key():
        raise ValueError("CKKS keys: the private context must hold the secret key and the public one must not")
    if _key_id(public) != _key_id(private):
        raise ValueError("CKKS keys: the private context does not belong to the public one (key id)")
    probe = np.linspace(-1.0, 1.0, 16)
    try:
        got = _decode(private, combine(public, [encode(private, probe, public)], [1], probe.size), probe.size)
    except IntegrityError as exc:
        raise ValueError(f"CKKS keys: the private context does not belong to the public one ({exc})") from None
    if not np.allclose(got, probe, atol=1e-6):
        raise ValueError("CKKS keys: the private context does not belong to the public one")


class _Tools:
    """SEAL's encoder, evaluator and (with the secret key) encryptor and decryptor for one context."""

    def __init__(self, ctx: ts.Context):
        self.ctx, self.seal = ctx, ctx.seal_context().data
        self.level = self.seal.first_parms_id()
        self.encoder, self.evaluator = sa.CKKSEncoder(self.seal), sa.Evaluator(self.seal)
        if ctx.has_secret_key():
            key = ctx.secret_key().data
            self.encryptor, self.decryptor = sa.Encryptor(self.seal, key), sa.Decryptor(self.seal, key)


@lru_cache(maxsize=8)
def _tools(data: bytes) -> _Tools:
    return _Tools(load_context(data))


class _Files:
    """SEAL objects to and from bytes: TenSEAL's SEAL bindings save and load by path only, so through a file
    per process and thread in a private temporary directory (in memory where ``/dev/shm`` exists), unlinked
    after each use (a killed process leaves an empty directory); the directory is removed at exit. Only
    ciphertexts pass through it, never a key or a plaintext."""

    def __init__(self):
        self.dir, self.pid, self.lock = "", 0, threading.Lock()

    def path(self) -> str:
        with self.lock:
            if self.pid != os.getpid():
                shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
                self.dir, self.pid = tempfile.mkdtemp(prefix="fedsim-ckks-", dir=shm), os.getpid()
                atexit.register(_remove, self.dir, self.pid)
        return os.path.join(self.dir, str(threading.get_ident()))

    def save(self, obj) -> bytes:
        path = self.path()
        try:
            obj.save(path)
            with open(path, "rb") as f:
                return f.read()
        finally:
            os.unlink(path)

    def load(self, seal, data: bytes) -> sa.Ciphertext:
        path = self.path()
        try:
            with open(path, "wb") as f:
                f.write(data)
            c = sa.Ciphertext()
            c.load(seal, path)  # SEAL checks the ciphertext against the context (sizes, moduli, coefficients)
            return c
        finally:
            os.unlink(path)


def _remove(path: str, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


_FILES = _Files()


def _chunks(count: int) -> list[tuple[int, int]]:
    return [(i, min(i + VALUES, count)) for i in range(0, count, VALUES)]


def _pack(x: np.ndarray) -> list[complex]:
    """Up to 8192 values as 4096 complex slots: the first 4096 values are the real parts, the rest the
    imaginary parts (zeros where there are fewer)."""
    z = np.zeros(SLOTS, dtype=np.complex128)
    z.real[:min(x.size, SLOTS)] = x[:SLOTS]
    z.imag[:max(x.size - SLOTS, 0)] = x[SLOTS:]
    return z.tolist()


def encode(private: bytes, values: np.ndarray, public: bytes, max_abs: float | None = None) -> bytes:
    """Encrypt a flat float vector (one seeded ciphertext per 8192 values, two per complex slot) under the
    secret key of ``private`` into a payload of total weight 1 whose header carries ``public``'s fingerprint.
    ``ValueError`` for a value above ``max_abs`` (the channel's :func:`max_abs`: more could overflow the sum)."""
    tools = _tools(bytes(private))
    if not tools.ctx.has_secret_key():
        raise ValueError("CKKS encode: encryption needs the private context (secret-key encryption)")
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError("CKKS encode: need a non-empty vector of finite values")
    top = float(np.max(np.abs(x)))
    if max_abs is not None and top > max_abs:
        raise ValueError(f"CKKS encode: a value of magnitude {top:.4g} exceeds the channel's bound {max_abs} "
                         "(the capacity of the one 60-bit prime over the total weight: lower channel.precision)")
    cts = []
    for a, b in _chunks(x.size):
        plain = sa.Plaintext()
        tools.encoder.encode(_pack(x[a:b]), tools.level, 2.0 ** SCALE_BITS, plain)
        cts.append(_FILES.save(tools.encryptor.encrypt_symmetric(plain)))
    return _build(public, x.size, 1, cts)


def _build(public: bytes, num_values: int, weight: int, cts: Sequence[bytes]) -> bytes:
    head = _HEAD.pack(_MAGIC, _VERSION, int(num_values), len(cts), int(weight), fingerprint(public))
    return head + b"".join(_LEN.pack(len(c)) + c for c in cts)


def _split(payload: bytes) -> tuple[int, int, int, bytes, list[bytes]]:
    if len(payload) < _HEAD.size:
        raise IntegrityError("header", f"payload of {len(payload)} bytes is shorter than the header")
    magic, version, num, count, weight, fp = _HEAD.unpack_from(payload, 0)
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
    return num, count, weight, fp, cts


def verify(public: bytes, payload: bytes, num_values: int) -> list[sa.Ciphertext]:
    """Server-side checks of a client's payload with the public context alone; returns the ciphertexts or
    raises :class:`IntegrityError` naming the field: header, version, ``fingerprint`` (another key),
    ``count`` (values, ciphertexts, truncation), ``weight`` (not 1: a combination), ``ciphertext[i]``
    (unreadable, not 2 polynomials at the data prime, or another scale)."""
    num, count, weight, fp, raw = _split(bytes(payload))
    if fp != fingerprint(public):
        raise IntegrityError("fingerprint", "the payload was encrypted under another public key")
    if num != num_values:
        raise IntegrityError("count", f"payload holds {num} values, expected {num_values}")
    if count != len(_chunks(num_values)):
        raise IntegrityError("count", f"{count} ciphertexts for {num_values} values, expected {len(_chunks(num_values))}")
    if weight != 1:
        raise IntegrityError("weight", f"total weight {weight}: a client's payload has weight 1")
    tools = _tools(bytes(public))
    out = []
    for k, data in enumerate(raw):
        try:
            c = _FILES.load(tools.seal, data)
        except Exception as exc:  # noqa: BLE001 - SEAL rejects malformed ciphertexts with several kinds
            raise IntegrityError(f"ciphertext[{k}]", f"cannot be read ({type(exc).__name__})") from None
        if c.size() != 2 or c.parms_id() != tools.level or not c.is_ntt_form():
            raise IntegrityError(f"ciphertext[{k}]", f"{c.size()} polynomials at {c.coeff_modulus_size()} primes; "
                                                     "expected 2 at the data prime, in NTT form")
        if c.scale != 2.0 ** SCALE_BITS:
            raise IntegrityError(f"ciphertext[{k}]", f"scale {c.scale!r}, expected 2**{SCALE_BITS}")
        out.append(c)
    return out


def combine(public: bytes, payloads: Sequence[bytes], weights: Sequence[int], num_values: int) -> bytes:
    """``sum_i weights[i] * payload_i`` (each :func:`verify`-ed) with the public context alone."""
    return combine_read(public, [verify(public, p, num_values) for p in payloads], weights, num_values)


def combine_read(public: bytes, parsed: Sequence[Sequence[sa.Ciphertext]], weights: Sequence[int],
                 num_values: int) -> bytes:
    """:func:`combine` of payloads already :func:`verify`-ed (and read) when they arrived: each is read once,
    however often it is combined (the ciphertexts are not modified). ``weights``: integers >= 0 with a sum in
    ``[1, MAX_WEIGHT]``; a weight multiplies its ciphertexts as a plaintext constant at scale 1 (exact: the
    scale and the level stay)."""
    if not parsed or len(weights) != len(parsed) or any(isinstance(w, bool) or int(w) != w or w < 0 for w in weights) \
            or not 1 <= sum(int(w) for w in weights) <= MAX_WEIGHT:
        raise ValueError(f"weights: {len(weights)} integers >= 0 with a sum in [1, {MAX_WEIGHT}] for "
                         f"{len(parsed)} payloads")
    tools = _tools(bytes(public))
    acc: list[sa.Ciphertext | None] = [None] * len(parsed[0])
    for w, cts in zip((int(x) for x in weights), parsed):
        if w == 0:
            continue
        plain = sa.Plaintext()
        tools.encoder.encode(w, tools.level, 1.0, plain)  # the constant w at scale 1
        for k, c in enumerate(cts):
            if acc[k] is not None and w == 1:
                tools.evaluator.add_inplace(acc[k], c)
                continue
            term = sa.Ciphertext()
            tools.evaluator.multiply_plain(c, plain, term)  # a new ciphertext: the one read stays as read
            if acc[k] is None:
                acc[k] = term
            else:
                tools.evaluator.add_inplace(acc[k], term)
    return _build(public, num_values, sum(int(w) for w in weights), [_FILES.save(c) for c in acc])


def decode(private: bytes, payload: bytes, num_values: int, max_abs: float | None = None) -> np.ndarray:
    """Decrypt a payload (a combination, or a client's) to the flat float64 vector it encrypts divided by its
    total weight (needs the private context). ``IntegrityError`` for a malformed payload, or values outside
    ``[-max_abs, max_abs]`` (a sanity check: a sum that overflowed decodes to values that may fall anywhere;
    :func:`encode`'s bound is what prevents it)."""
    return _decode(private, payload, num_values, max_abs)


def _decode(private: bytes, payload: bytes, num_values: int, max_abs: float | None = None) -> np.ndarray:
    tools = _tools(bytes(private))
    if not tools.ctx.has_secret_key():
        raise ValueError("private: decoding needs the CKKS secret key")
    num, count, weight, _, raw = _split(bytes(payload))
    if num != num_values or count != len(_chunks(num_values)):
        raise IntegrityError("count", f"payload holds {num} values in {count} ciphertexts, expected {num_values}")
    if not 1 <= weight <= MAX_WEIGHT:
        raise IntegrityError("weight", f"total weight {weight} outside [1, {MAX_WEIGHT}]")
    out = []
    for data in raw:
        plain = sa.Plaintext()
        tools.decryptor.decrypt(_FILES.load(tools.seal, data), plain)
        z = np.asarray(tools.encoder.decode_complex(plain), dtype=np.complex128)
        out += [z.real, z.imag]
    flat = np.concatenate(out)[:num_values] / weight
    if not np.all(np.isfinite(flat)):
        raise IntegrityError("values", "the decrypted vector has non-finite values")
    if max_abs is not None and float(np.max(np.abs(flat))) > max_abs + error_bound(max_abs):
        raise IntegrityError("values", f"a decrypted value of magnitude {float(np.max(np.abs(flat))):.4g} is above "
                                       f"the channel's bound {max_abs}: the sum overflowed")
    return flat
