"""The high-level Paillier codec: model arrays -> quantized, packed, encrypted payload -> decrypted,
checked sums and means."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from fedsim.crypto.errors import IntegrityError
from fedsim.crypto.packing import PackingLayout, pack, packing_layout, unpack
from fedsim.crypto.paillier.keys import PrivateKey, PublicKey, decrypt_many, encrypt_raw
from fedsim.crypto.paillier.obfuscation import ObfuscatorPool
from fedsim.crypto.paillier.payload import (
    MODE_PACKED,
    MODE_PER_ELEMENT,
    PayloadHeader,
    _build_payload,
    _check_per_element,
    _ciphertexts,
    combine,
    parse_header,
    verify,
)
from fedsim.crypto.quantize import Quantizer


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
