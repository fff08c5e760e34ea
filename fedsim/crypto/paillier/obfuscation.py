"""Precomputed Paillier obfuscators: :class:`ShortExponentObfuscator` (``h**alpha`` with fixed-base comb
tables and the CRT) and :class:`ObfuscatorPool` (computed ahead of time, handed out once)."""
from __future__ import annotations

import collections
import os
import secrets
import threading
import time

import gmpy2
import numpy as np

from fedsim.crypto.paillier.keys import PrivateKey, PublicKey, security_bits


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
