"""Paillier encryption for weighted sums the server computes without decrypting (seed 003, eq. 4.4).

Keys come from ``phe`` (with ``gmpy2``): ``g = n + 1``, so ``Enc(m; r) = (1 + m n) * r**n mod n**2``.
Homomorphic weighted sum: ``prod_i c_i**w_i mod n**2`` decrypts to ``sum_i w_i m_i mod n``.

Obfuscators: the obfuscator ``s`` of ``Enc(m) = (1 + m n) s mod n**2`` is more than 99.9% of an
encryption. ``phe`` draws ``s = r**n`` for a fresh ``r`` (8.5 ms at 2048 bits). The default here
(:class:`ShortExponentObfuscator`, Damgard-Jurik-Nielsen's speed-up) is ``s = h**alpha mod n**2`` with
``h = r0**n`` fixed per instance and ``alpha`` a fresh uniform exponent of ``2 * kappa`` bits (``kappa``
the security level of the key: 112 bits up to 3071-bit keys, 128 above), computed with fixed-base
comb tables of ``h`` and, with the private key (every client holds it in this protocol), modulo
``p**2`` and ``q**2`` with the CRT: about 30x cheaper than ``r**n`` (docs/paillier.md states the
security argument). ``s`` is an ``n``-th residue like ``r**n``, so the ciphertext decrypts with
``phe`` exactly as its own (tested). :class:`ObfuscatorPool` computes obfuscators ahead of time, in a
background thread that releases the GIL (gmpy2's ``allow_release_gil``), and hands each one out
exactly once; online encryption is ``phe``'s ``raw_encrypt(m, r_value=1)`` (trivial obfuscation
``1**n = 1``) times a pooled obfuscator. A pool that runs dry computes inline and counts it
(``ObfuscatorPool.inline``).

Decrypting many ciphertexts (:func:`decrypt_many`) runs ``phe``'s CRT decryption in threads that release
the GIL.

Payload (one client's encrypted update, or a combination): a fixed header followed by the
ciphertexts, each ``width = bytes(n**2)`` bytes big-endian. Header (big-endian)::

    magic "FSPC" | version u8 | mode u8 (0 per-element, 1 packed) | bits u8 | slot_bits u8 |
    slots u16 | key_bits u16 | clip f64 | max_total_weight u64 | total_weight u64 | num_values u64 |
    num_ciphertexts u64 | width u32 | key fingerprint (SHA-256 of the public key bytes, 32) |
    digest (SHA-256 of the header before it + the ciphertext bytes, 32)

:func:`verify` is what the server can check with the public key alone. The digest detects
corruption and truncation in transit; it is not a MAC (anyone who rewrites the payload can
recompute it). What only a key holder can check - the canary and ranges after decryption - is in
:meth:`PaillierCodec.decode`.

Randomness: keys and obfuscators come from the OS CSPRNG (``secrets``, ``phe``'s ``SystemRandom``),
never from the experiment seed; decrypted aggregates are exact integers, so results stay
deterministic for a given seed.
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import math
import os
import secrets
import struct
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import gmpy2
import numpy as np
from phe import paillier as phe_paillier

from fedsim.crypto.errors import IntegrityError
from fedsim.crypto.packing import PackingLayout, pack, packing_layout, unpack
from fedsim.crypto.quantize import Quantizer

DEFAULT_KEY_BITS = 2048
MIN_KEY_BITS = 512
MAX_KEY_BITS = 8192  # the payload header stores key_bits in 16 bits; larger keys take minutes to generate
PublicKey = phe_paillier.PaillierPublicKey
PrivateKey = phe_paillier.PaillierPrivateKey

MODE_PER_ELEMENT, MODE_PACKED = 0, 1
_MAGIC, _VERSION = b"FSPC", 1
_HEAD = struct.Struct(">4sBBBBHHdQQQQI32s")  # everything before the digest
_DIGEST_LEN = 32
HEADER_BYTES = _HEAD.size + _DIGEST_LEN
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


# ------------------------------------------------------------------------ precomputed obfuscation
def _crt_parts(public_key: PublicKey, private_key: PrivateKey | None):
    if private_key is None:
        return None
    if int(private_key.p) * int(private_key.q) != int(public_key.n):
        raise ValueError("private_key does not belong to public_key")
    p, q = gmpy2.mpz(private_key.p), gmpy2.mpz(private_key.q)
    p2, q2 = p * p, q * q
    return p2, q2, gmpy2.invert(q2, p2)


def _random_unit(n: gmpy2.mpz) -> gmpy2.mpz:
    while True:
        r = gmpy2.mpz(secrets.randbelow(int(n) - 1) + 1)
        if gmpy2.gcd(r, n) == 1:
            return r


class ShortExponentObfuscator:
    """Obfuscators ``h**alpha mod n**2`` (Damgard-Jurik-Nielsen): ``h = r0**n mod n**2`` for a random unit
    ``r0`` drawn once per instance (it stays in the encrypting process, like an obfuscator), ``alpha``
    uniform in ``[0, 2**alpha_bits)`` drawn afresh for every obfuscator (``alpha_bits = 2 * kappa``,
    :func:`security_bits`). ``h**alpha`` is an ``n``-th residue (``(r0**alpha)**n``), so a ciphertext made
    with it decrypts exactly like ``phe``'s. Fixed-base comb: tables ``h**(d * 2**(w*j))`` for every
    ``w``-bit window ``j`` and digit ``d``, so one obfuscator is ``alpha_bits / w`` multiplications; with
    the private key the tables and products are modulo ``p**2`` and ``q**2`` (half-size numbers), joined
    by the CRT. Security argument and assumption: docs/paillier.md."""

    WINDOW = 8

    def __init__(self, public_key: PublicKey, private_key: PrivateKey | None = None, *,
                 alpha_bits: int | None = None, base: int | None = None):
        n = gmpy2.mpz(public_key.n)
        self.n2 = gmpy2.mpz(public_key.nsquare)
        self.alpha_bits = int(alpha_bits or 2 * security_bits(int(n).bit_length()))
        self._crt = _crt_parts(public_key, private_key)
        r0 = _random_unit(n) if base is None else gmpy2.mpz(base)
        moduli = [self._crt[0], self._crt[1]] if self._crt else [self.n2]
        if self._crt:  # h mod p^2 = r0^(n mod p(p-1)) mod p^2 (Euler), likewise for q^2
            p, q = gmpy2.isqrt(self._crt[0]), gmpy2.isqrt(self._crt[1])
            hs = [gmpy2.powmod(r0, n % (p * (p - 1)), self._crt[0]), gmpy2.powmod(r0, n % (q * (q - 1)), self._crt[1])]
        else:
            hs = [gmpy2.powmod(r0, n, self.n2)]
        self._tables = [self._table(h, m) for h, m in zip(hs, moduli)]
        self._moduli = moduli
        self._alphas: list[int] = []
        self._lock = threading.Lock()

    def _table(self, h: gmpy2.mpz, m: gmpy2.mpz) -> list[list[gmpy2.mpz]]:
        w = self.WINDOW
        out, base = [], h
        for _ in range(-(-self.alpha_bits // w)):
            row = [gmpy2.mpz(1), base]
            for _ in range(2, 1 << w):
                row.append(row[-1] * base % m)
            out.append(row)
            base = row[-1] * base % m  # h^(2^(w(j+1)))
        return out

    def power(self, alpha: int) -> int:
        """``h**alpha mod n**2`` for ``0 <= alpha < 2**alpha_bits`` (from the tables)."""
        w, mask = self.WINDOW, (1 << self.WINDOW) - 1
        res = []
        for table, m in zip(self._tables, self._moduli):
            acc, a, j = gmpy2.mpz(1), int(alpha), 0
            while a:
                d = a & mask
                if d:
                    acc = acc * table[j][d] % m
                a >>= w
                j += 1
            res.append(acc)
        if not self._crt:
            return int(res[0])
        p2, q2, q2_inv = self._crt
        a, b = res
        return int(b + ((a - b) * q2_inv % p2) * q2)

    def draw(self) -> int:
        """A fresh obfuscator ``h**alpha`` for a uniform ``alpha`` of ``alpha_bits`` bits (from the OS CSPRNG,
        read 256 exponents at a time: one system call per exponent cost a third of the obfuscator)."""
        with self._lock:
            if not self._alphas:
                nbytes = -(-self.alpha_bits // 8)
                buf = os.urandom(nbytes * 256)
                mask = (1 << self.alpha_bits) - 1
                self._alphas = [int.from_bytes(buf[i:i + nbytes], "big") & mask for i in range(0, len(buf), nbytes)]
            alpha = self._alphas.pop()
        return self.power(alpha)


class ObfuscatorPool:
    """Obfuscators ``r**n mod n**2`` computed ahead of time; each handed out exactly once.

    ``fill(count)`` computes in the caller's thread, ``fill_async(count)`` in a background daemon
    thread (gmpy2 releases the GIL there, so training can go on); ``wait()`` joins it and re-raises its
    error. ``take()`` pops one obfuscator (never returns it again); when the pool is empty it computes
    one inline and counts it in ``inline``. With ``private_key`` the obfuscators are computed by CRT.
    ``method``: ``"short"`` (default: :class:`ShortExponentObfuscator`) or ``"full"`` (``phe``'s ``r**n``
    for a fresh ``r``).

    Counters: ``precomputed`` (computed ahead), ``inline`` (computed on the critical path), ``taken``
    (handed out from the pool), ``precompute_seconds`` (time spent precomputing).
    """

    def __init__(self, public_key: PublicKey, private_key: PrivateKey | None = None, method: str = "short"):
        if method not in ("short", "full"):
            raise ValueError(f"method must be 'short' or 'full', got {method!r}")
        self.public_key, self.method = public_key, method
        self._n = gmpy2.mpz(public_key.n)
        self._n2 = gmpy2.mpz(public_key.nsquare)
        self._crt = None
        crt = _crt_parts(public_key, private_key)
        if crt is not None:
            p2, q2, q2_inv = crt
            p, q = gmpy2.isqrt(p2), gmpy2.isqrt(q2)
            self._crt = (p2, q2, self._n % (p * (p - 1)), self._n % (q * (q - 1)), q2_inv)
        self._short = ShortExponentObfuscator(public_key, private_key) if method == "short" else None
        self._items: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.precomputed = 0
        self.inline = 0
        self.taken = 0
        self.precompute_seconds = 0.0

    def __len__(self) -> int:
        return len(self._items)

    def _draw_r(self) -> gmpy2.mpz:
        return _random_unit(self._n)

    def compute(self) -> int:
        """One fresh obfuscator (not stored): ``h**alpha`` (method ``"short"``) or ``r**n mod n**2`` for a new
        random ``r`` (``"full"``)."""
        if self._short is not None:
            return self._short.draw()
        r = self._draw_r()
        if self._crt is None:
            return int(gmpy2.powmod(r, self._n, self._n2))
        p2, q2, ep, eq, q2_inv = self._crt
        a, b = gmpy2.powmod(r, ep, p2), gmpy2.powmod(r, eq, q2)
        return int(b + ((a - b) * q2_inv % p2) * q2)

    def fill(self, count: int) -> None:
        """Precompute ``count`` more obfuscators in the calling thread (stops early on :meth:`stop`)."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        for _ in range(int(count)):
            if self._stop.is_set():
                break
            t = time.perf_counter()
            item = self.compute()
            with self._lock:
                self._items.append(item)
                self.precomputed += 1
                self.precompute_seconds += time.perf_counter() - t

    def fill_async(self, count: int) -> None:
        """Start precomputing ``count`` obfuscators in a background thread (one fill at a time)."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("ObfuscatorPool: a background fill is already running; call wait() first")
        self._stop.clear()
        self._error = None

        def work():
            gmpy2.get_context().allow_release_gil = True  # this thread's context only
            try:
                self.fill(count)
            except BaseException as exc:  # re-raised by wait()
                self._error = exc

        self._thread = threading.Thread(target=work, name="fedsim-obfuscator-pool", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Join the background fill (if any) and re-raise its error."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def stop(self) -> None:
        """Stop a background fill after its current item and join it."""
        self._stop.set()
        self.wait()

    def take(self) -> int:
        """Pop one precomputed obfuscator (or compute one inline, counted); never returned twice."""
        with self._lock:
            if self._items:
                self.taken += 1
                return self._items.popleft()
            self.inline += 1
        return self.compute()


# ----------------------------------------------------------------------------------- payloads
@dataclass(frozen=True)
class PayloadHeader:
    """The parsed header of a payload (see the module docstring for the byte layout)."""

    mode: int
    bits: int
    slot_bits: int
    slots: int
    key_bits: int
    clip: float
    max_total_weight: int
    total_weight: int
    num_values: int
    num_ciphertexts: int
    width: int
    fingerprint: bytes
    digest: bytes


def _ciphertext_width(public_key: PublicKey) -> int:
    return (int(public_key.nsquare).bit_length() + 7) // 8


def _build_payload(public_key: PublicKey, *, mode: int, bits: int, slot_bits: int, slots: int, clip: float,
                   max_total_weight: int, total_weight: int, num_values: int, ciphertexts: Sequence[int]) -> bytes:
    width = _ciphertext_width(public_key)
    body = b"".join(int(c).to_bytes(width, "big") for c in ciphertexts)
    head = _HEAD.pack(_MAGIC, _VERSION, mode, bits, slot_bits, slots, int(public_key.n).bit_length(), clip,
                      max_total_weight, total_weight, num_values, len(ciphertexts), width,
                      key_fingerprint(public_key))
    return head + hashlib.sha256(head + body).digest() + body


def _expected_ciphertexts(mode: int, num_values: int, slots: int) -> int:
    return num_values if mode == MODE_PER_ELEMENT else -(-num_values // max(slots, 1))


def parse_header(payload: bytes) -> PayloadHeader:
    """The header fields, unchecked except for size, magic and version (use :func:`verify`)."""
    if len(payload) < HEADER_BYTES:
        raise IntegrityError("header", f"payload of {len(payload)} bytes is shorter than the "
                                       f"{HEADER_BYTES}-byte header")
    fields = _HEAD.unpack_from(payload, 0)
    if fields[0] != _MAGIC:
        raise IntegrityError("header", "not a fedsim Paillier payload (bad magic)")
    if fields[1] != _VERSION:
        raise IntegrityError("version", f"payload version {fields[1]}, this code reads {_VERSION}")
    digest = bytes(payload[_HEAD.size:HEADER_BYTES])
    return PayloadHeader(*fields[2:], digest=digest)


def verify(public_key: PublicKey, payload: bytes, *, num_values: int | None = None) -> PayloadHeader:
    """Server-side checks with the public key alone; returns the header or raises :class:`IntegrityError`.

    Checked, in order: header size/magic/version (``"header"``, ``"version"``); the key fingerprint
    (``"fingerprint"``); key size and ciphertext width (``"width"``); the packing layout could not
    overflow (``"layout"``); ``1 <= total_weight <= max_total_weight`` (``"total_weight"``); the
    element count against ``num_values`` when given, the ciphertext count against the value count and
    layout, and the body length (``"count"``); the SHA-256 digest (``"digest"``); every ciphertext in
    ``(0, n**2)`` and coprime with ``n`` (``"ciphertext[i]"``).
    """
    h = parse_header(payload)
    if h.fingerprint != key_fingerprint(public_key):
        raise IntegrityError("fingerprint", "the payload was encrypted under another public key")
    n = int(public_key.n)
    if h.key_bits != n.bit_length() or h.width != _ciphertext_width(public_key):
        raise IntegrityError("width", f"key of {h.key_bits} bits / {h.width}-byte ciphertexts do not match "
                                      f"the {n.bit_length()}-bit public key")
    if not math.isfinite(h.clip) or h.clip <= 0:
        raise IntegrityError("layout", f"clip {h.clip} is not a positive number")
    try:
        if h.mode == MODE_PACKED:
            packing_layout(h.key_bits, h.bits, h.max_total_weight, slot_bits=h.slot_bits, slots=h.slots)
        elif h.mode == MODE_PER_ELEMENT:
            _check_per_element(n, Quantizer(bits=h.bits, clip=h.clip), h.max_total_weight)
            if h.slots != 1 or h.slot_bits != 0:
                raise ValueError("a per-element payload has slots=1 and slot_bits=0")
        else:
            raise ValueError(f"unknown mode {h.mode}")
    except ValueError as exc:
        raise IntegrityError("layout", f"the payload's layout is invalid: {exc}") from None
    if not 1 <= h.total_weight <= h.max_total_weight:
        raise IntegrityError("total_weight", f"total weight {h.total_weight} outside [1, {h.max_total_weight}]")
    if num_values is not None and h.num_values != num_values:
        raise IntegrityError("count", f"payload holds {h.num_values} values, expected {num_values}")
    if h.num_values < 1 or h.num_ciphertexts != _expected_ciphertexts(h.mode, h.num_values, h.slots):
        raise IntegrityError("count", f"{h.num_ciphertexts} ciphertexts cannot hold {h.num_values} values "
                                      f"in this layout")
    body_len = len(payload) - HEADER_BYTES
    if body_len != h.num_ciphertexts * h.width:
        raise IntegrityError("count", f"body of {body_len} bytes, header says {h.num_ciphertexts} "
                                      f"ciphertexts of {h.width} bytes")
    if hashlib.sha256(bytes(payload[:_HEAD.size]) + bytes(payload[HEADER_BYTES:])).digest() != h.digest:
        raise IntegrityError("digest", "SHA-256 digest mismatch: the payload was altered or corrupted")
    n_mpz, n2 = gmpy2.mpz(n), int(public_key.nsquare)
    for i, c in enumerate(_ciphertexts(payload, h)):
        if not 0 < c < n2:
            raise IntegrityError(f"ciphertext[{i}]", "outside (0, n^2)")
        if gmpy2.gcd(c, n_mpz) != 1:
            raise IntegrityError(f"ciphertext[{i}]", "not invertible modulo n^2")
    return h


def _ciphertexts(payload: bytes, h: PayloadHeader) -> list[int]:
    w = h.width
    view = memoryview(payload)[HEADER_BYTES:]
    return [int.from_bytes(view[i * w:(i + 1) * w], "big") for i in range(h.num_ciphertexts)]


def read_ciphertexts(public_key: PublicKey, payload: bytes, *,
                     num_values: int | None = None) -> tuple[PayloadHeader, list[int]]:
    """:func:`verify` the payload, then return its header and ciphertexts (what :func:`combine_read` takes)."""
    h = verify(public_key, payload, num_values=num_values)
    return h, _ciphertexts(payload, h)


_SAME = ("mode", "bits", "slot_bits", "slots", "key_bits", "clip", "max_total_weight", "num_values")


def combine(public_key: PublicKey, payloads: Sequence[bytes], weights: Sequence[int]) -> bytes:
    """The server's eq. 4.4: a payload encrypting ``sum_i weights[i] * payload_i`` (public key only).

    Each payload is :func:`verify`-ed; all must share layout and size (``IntegrityError`` naming the
    field otherwise). The combined total weight ``sum_i weights[i] * total_weight_i`` must be in
    ``[1, max_total_weight]`` (``ValueError`` naming ``weights``): above it a slot could overflow.
    Combined payloads can be combined again.
    """
    if not payloads:
        raise ValueError("payloads: need at least one payload")
    _check_weights(weights, len(payloads))
    return combine_read(public_key, [read_ciphertexts(public_key, p) for p in payloads], weights)


def combine_read(public_key: PublicKey, parsed: Sequence[tuple[PayloadHeader, Sequence[int]]],
                 weights: Sequence[int]) -> bytes:
    """:func:`combine` of payloads already verified and read by :func:`read_ciphertexts` (each payload is
    checked once, when it arrives, however often it is combined); the same checks of layout, size and
    total weight, the same result."""
    if not parsed:
        raise ValueError("payloads: need at least one payload")
    weights = _check_weights(weights, len(parsed))
    h0 = parsed[0][0]
    for i, (h, _) in enumerate(parsed[1:], start=1):
        for name in _SAME:
            if getattr(h, name) != getattr(h0, name):
                raise IntegrityError(name, f"payload {i} has {name}={getattr(h, name)!r}, payload 0 has "
                                           f"{getattr(h0, name)!r}")
    total = sum(w * h.total_weight for w, (h, _) in zip(weights, parsed))
    if total > h0.max_total_weight:
        raise ValueError(f"weights: total weight {total} exceeds the layout's max_total_weight "
                         f"{h0.max_total_weight} (channel.max_total_weight): a slot could overflow")
    summed = weighted_sum(public_key, [c for _, c in parsed], weights)
    return _build_payload(public_key, mode=h0.mode, bits=h0.bits, slot_bits=h0.slot_bits, slots=h0.slots,
                          clip=h0.clip, max_total_weight=h0.max_total_weight, total_weight=total,
                          num_values=h0.num_values, ciphertexts=summed)


def _check_per_element(n: int, quantizer: Quantizer, max_total_weight: int) -> None:
    if isinstance(max_total_weight, bool) or not isinstance(max_total_weight, (int, np.integer)) \
            or max_total_weight < 1:
        raise ValueError(f"channel.max_total_weight must be an integer >= 1, got {max_total_weight!r}")
    if int(max_total_weight) * quantizer.max_int >= n // 2:
        raise ValueError(f"channel.max_total_weight={max_total_weight} with channel.bits={quantizer.bits} "
                         f"could wrap the plaintext modulus")


# --------------------------------------------------------------------------------------- codec
class PaillierCodec:
    """Quantize + pack + encrypt float arrays into a payload, and back from a (combined) payload.

    ``public_key``: the channel's key; ``quantizer``: bits and clipping range; ``max_total_weight``:
    the largest total integer weight any combination may carry (fixes the slot headroom);
    ``private_key``: needed by :meth:`decode` only; ``packed``: BatchCrypt packing (default) or one
    value per ciphertext (signed values as ``q mod n``; for verification and benchmarks); ``pool``: an
    :class:`ObfuscatorPool` for the same public key (online encryption), else every encryption pays
    the full ``r**n``; ``slots``: fewer values per plaintext than fit (default: as many as fit);
    ``decrypt_threads``: threads :meth:`decode_sums` decrypts in (:func:`decrypt_many`).

    ``last_clipped`` / ``clipped_total``: values clipped by the quantizer in the last / all encodes.
    """

    def __init__(self, public_key: PublicKey, quantizer: Quantizer, max_total_weight: int, *,
                 private_key: PrivateKey | None = None, packed: bool = True,
                 pool: ObfuscatorPool | None = None, slots: int | None = None, decrypt_threads: int = 1):
        if not isinstance(quantizer, Quantizer):
            raise ValueError(f"quantizer must be a Quantizer, got {type(quantizer).__name__}")
        if private_key is not None and int(private_key.public_key.n) != int(public_key.n):
            raise ValueError("private_key does not belong to public_key")
        if pool is not None and int(pool.public_key.n) != int(public_key.n):
            raise ValueError("pool was built for another public key")
        self.public_key, self.private_key, self.quantizer, self.pool = public_key, private_key, quantizer, pool
        self.packed = bool(packed)
        self.decrypt_threads = max(1, int(decrypt_threads))
        n = int(public_key.n)
        if self.packed:
            self.layout: PackingLayout | None = packing_layout(n.bit_length(), quantizer.bits, max_total_weight,
                                                                slots=slots)
        else:
            if slots not in (None, 1):
                raise ValueError(f"channel.slots must be 1 (or unset) without packing, got {slots!r}")
            _check_per_element(n, quantizer, max_total_weight)
            self.layout = None
        self.max_total_weight = int(max_total_weight)
        self.last_clipped = 0
        self.clipped_total = 0

    @property
    def values_per_ciphertext(self) -> int:
        return self.layout.slots if self.layout else 1

    def num_ciphertexts(self, num_values: int) -> int:
        """Ciphertexts (= obfuscators) one encode of ``num_values`` values needs."""
        return self.layout.num_plaintexts(num_values) if self.layout else int(num_values)

    def _header_fields(self) -> dict:
        mode = MODE_PACKED if self.layout else MODE_PER_ELEMENT
        return dict(mode=mode, bits=self.quantizer.bits, slot_bits=self.layout.slot_bits if self.layout else 0,
                    slots=self.values_per_ciphertext, clip=self.quantizer.clip,
                    max_total_weight=self.max_total_weight)

    def encode(self, arrays: Sequence[np.ndarray]) -> bytes:
        """Quantize, pack and encrypt ``arrays`` (flattened and concatenated in order) into a payload of
        total weight 1."""
        if len(arrays) == 0:
            raise ValueError("arrays: nothing to encode")
        flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
        if flat.size == 0:
            raise ValueError("arrays: nothing to encode")
        q, clipped = self.quantizer.quantize(flat)
        self.last_clipped = clipped
        self.clipped_total += clipped
        n = int(self.public_key.n)
        plaintexts = pack(q, self.layout) if self.layout else [int(v) % n for v in q.tolist()]
        pool = self.pool
        cts = [encrypt_raw(self.public_key, m, pool.take() if pool is not None else None) for m in plaintexts]
        return _build_payload(self.public_key, total_weight=1, num_values=int(flat.size), ciphertexts=cts,
                              **self._header_fields())

    def combine(self, payloads: Sequence[bytes], weights: Sequence[int]) -> bytes:
        """:func:`combine` with this codec's public key."""
        return combine(self.public_key, payloads, weights)

    def decode_sums(self, payload: bytes, num_values: int, total_weight: int | None = None) -> np.ndarray:
        """Decrypt to the exact int64 weighted sums ``sum_i w_i q_i`` (needs the private key).

        ``total_weight``: ``W = sum_i w_i`` as the caller knows it; ``None`` takes the header's value,
        which the canary (packed) or the range check (per-element) then confirms. Raises
        :class:`IntegrityError` on any failed check (header fields differing from this codec's
        configuration: ``"layout"``).
        """
        if self.private_key is None:
            raise ValueError("private_key: decoding needs the Paillier private key")
        h, cts = self._read(payload, num_values)
        if total_weight is None:
            total_weight = h.total_weight
        elif total_weight != h.total_weight:
            raise IntegrityError("total_weight", f"payload carries total weight {h.total_weight}, expected "
                                                 f"{total_weight}")
        plain = decrypt_many(self.private_key, cts, threads=self.decrypt_threads)
        if self.layout is not None:
            return unpack(plain, self.layout, num_values, int(total_weight))
        n = int(self.public_key.n)
        bound = int(total_weight) * self.quantizer.max_int
        signed = [m - n if m > n // 2 else m for m in plain]
        bad = [i for i, v in enumerate(signed) if abs(v) > bound]
        if bad:
            raise IntegrityError("range", f"{len(bad)} of {len(signed)} decrypted values exceed the largest "
                                          f"possible sum {bound} (first: value {bad[0]}): wrong key, "
                                          f"corrupted ciphertext or wrong total weight")
        return np.asarray(signed, dtype=np.int64)

    def _read(self, payload: bytes, num_values: int) -> tuple[PayloadHeader, list[int]]:
        h = verify(self.public_key, payload, num_values=int(num_values))
        mine = self._header_fields()
        for name, value in mine.items():
            if getattr(h, name) != value:
                raise IntegrityError("layout", f"payload has {name}={getattr(h, name)!r}, this codec "
                                               f"{value!r} (channel settings differ)")
        return h, _ciphertexts(payload, h)

    def decode(self, payload: bytes, shapes: Sequence[Sequence[int]],
               total_weight: int | None = None) -> list[np.ndarray]:
        """The weighted mean ``sum_i w_i x_i / W`` as float64 arrays of ``shapes`` (needs the private key).

        Within :func:`fedsim.crypto.quantize.aggregate_error_bound` of the plaintext weighted mean.
        """
        shapes = [tuple(int(d) for d in s) for s in shapes]
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        sums = self.decode_sums(payload, sum(sizes), total_weight)
        w = total_weight if total_weight is not None else parse_header(payload).total_weight
        values = self.quantizer.dequantize_sum(sums, int(w))
        out, start = [], 0
        for shape, size in zip(shapes, sizes):
            out.append(values[start:start + size].reshape(shape))
            start += size
        return out
