"""Cryptographic core of the Paillier channel (thesis seed 003, ch. 4, §4.2.2; BatchCrypt packing).

A pure library: no Flower, no plugin imports. Design and threat model: ``docs/paillier.md``.

* :mod:`fedsim.crypto.quantize` - floats -> signed integers of ``bits`` bits, and back from a weighted
  integer sum (with the error bound).
* :mod:`fedsim.crypto.packing` - BatchCrypt-style packing of many quantized values per Paillier
  plaintext with headroom for a weighted sum, plus an integrity canary slot.
* :mod:`fedsim.crypto.paillier` - keys (``phe`` + ``gmpy2``), raw encryption with precomputed
  obfuscators, homomorphic weighted sums, the ciphertext payload format with server-side checks, and
  the high-level :class:`~fedsim.crypto.paillier.PaillierCodec` (encode / combine / decode).
* :mod:`fedsim.crypto.keyexchange` - delivery of the Paillier private key between clients through an
  untrusted relay: X25519 + HKDF-SHA256 + AES-GCM.
"""
from fedsim.crypto.errors import IntegrityError, KeyDeliveryError

__all__ = ["IntegrityError", "KeyDeliveryError"]
