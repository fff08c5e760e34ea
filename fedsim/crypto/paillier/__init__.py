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

The package: :mod:`~fedsim.crypto.paillier.keys` (keys, raw operations),
:mod:`~fedsim.crypto.paillier.obfuscation` (precomputed obfuscators), :mod:`~fedsim.crypto.paillier.payload`
(header, verification, combination), :mod:`~fedsim.crypto.paillier.codec` (:class:`PaillierCodec`).
"""
from __future__ import annotations

from fedsim.crypto.paillier.codec import PaillierCodec
from fedsim.crypto.paillier.keys import (
    DEFAULT_KEY_BITS,
    MAX_KEY_BITS,
    MIN_KEY_BITS,
    PrivateKey,
    PublicKey,
    WeakKeyWarning,
    check_key_bits,
    decrypt_many,
    decrypt_raw,
    encrypt_raw,
    generate_keypair,
    key_fingerprint,
    private_key_from_bytes,
    private_key_to_bytes,
    public_key_from_bytes,
    public_key_to_bytes,
    security_bits,
    weighted_sum,
)
from fedsim.crypto.paillier.obfuscation import ObfuscatorPool, ShortExponentObfuscator
from fedsim.crypto.paillier.payload import (
    HEADER_BYTES,
    MODE_PACKED,
    MODE_PER_ELEMENT,
    PayloadHeader,
    combine,
    combine_read,
    parse_header,
    read_ciphertexts,
    verify,
)

__all__ = [
    "DEFAULT_KEY_BITS", "HEADER_BYTES", "MAX_KEY_BITS", "MIN_KEY_BITS", "MODE_PACKED", "MODE_PER_ELEMENT",
    "ObfuscatorPool", "PaillierCodec", "PayloadHeader", "PrivateKey", "PublicKey",
    "ShortExponentObfuscator", "WeakKeyWarning", "check_key_bits", "combine", "combine_read", "decrypt_many", "decrypt_raw",
    "encrypt_raw", "generate_keypair", "key_fingerprint", "parse_header", "private_key_from_bytes",
    "private_key_to_bytes", "public_key_from_bytes", "public_key_to_bytes", "read_ciphertexts",
    "security_bits", "verify", "weighted_sum",
]
