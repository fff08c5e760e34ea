"""BatchCrypt-style packing: many quantized values per Paillier plaintext (Zhang et al., ATC 2020).

Layout of one plaintext (most significant slot first)::

    | canary | value[slots-1] | ... | value[1] | value[0] |      each slot slot_bits wide
    '------------- (slots + 1) * slot_bits <= key_bits - 1 bits -------------'

Signed values use an **offset** (not two's complement): a quantized value ``q`` in ``[-M, M]``
(``M = 2**(bits-1) - 1``) is stored as ``u = q + M`` in ``[0, 2M]``, so every slot is non-negative and
adding plaintexts never borrows across slots. Multiplying a ciphertext by an integer weight ``w``
(``c**w``) and multiplying ciphertexts (adding plaintexts) acts slot by slot as long as no slot
exceeds its width. After a weighted sum with total weight ``W = sum w_i`` a slot holds
``sum_i w_i u_i = sum_i w_i q_i + W * M``; the decoder subtracts ``W * M``.

Headroom: a slot's sum is at most ``W_max * 2M``, so the slot width is the bit length of that number,
``slot_bits = bitlen(W_max * (2**bits - 2))`` (about ``bits + log2(W_max)``). :func:`packing_layout`
refuses any layout in which a slot or the whole plaintext could overflow:

* ``slot_bits`` below ``bitlen(W_max * 2M)`` (a slot would carry into its neighbour),
* ``(slots + 1) * slot_bits > key_bits - 1`` (the plaintext could reach ``n >= 2**(key_bits-1)`` and
  wrap modulo ``n``),
* values wider than 32 bits or a total weight above ``2**30`` (so slots stay <= 62 bits and sums
  are decoded exactly in int64).

Canary: the top slot of plaintext ``j`` holds the known value ``c_j = 1 + (j mod 2M)`` in ``[1, 2M]``
(same headroom as a value). After decryption it must read exactly ``W * c_j``. A ciphertext encrypted
or decrypted under another key, a corrupted ciphertext, a plaintext that wrapped, a wrong total weight
or ciphertexts moved to other positions all break it (a random plaintext passes with probability
about ``2**-slot_bits`` per plaintext). Bits above the canary must be zero and padding slots of the
last plaintext must decode to 0; both are checked too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np

from fedsim.components import check_value
from fedsim.crypto.errors import IntegrityError
from fedsim.crypto.quantize import MAX_BITS, MIN_BITS
from fedsim.params import Constraint, Range

MAX_SLOT_BITS = 62
MAX_TOTAL_WEIGHT = 1 << 30


def _int(key: str, value: Any, *limits: Constraint) -> int:
    """``value`` as an int within ``limits``, by the one parameter check (:func:`fedsim.components.check_value`):
    a one-line ValueError naming ``key`` otherwise. NumPy integers count as integers."""
    value = int(value) if isinstance(value, np.integer) else value
    check_value(key, value, Annotated[(int, *limits)])
    return value


def required_slot_bits(bits: int, max_total_weight: int) -> int:
    """Smallest slot width that holds ``max_total_weight * 2M``, the largest weighted slot sum."""
    return (int(max_total_weight) * ((1 << int(bits)) - 2)).bit_length()


@dataclass(frozen=True)
class PackingLayout:
    """A validated layout (build it with :func:`packing_layout`).

    ``slots`` values per plaintext plus one canary slot, each ``slot_bits`` wide; values of ``bits``
    bits; weighted sums with total weight up to ``max_total_weight``; for keys of ``key_bits`` bits.
    """

    key_bits: int
    bits: int
    max_total_weight: int
    slot_bits: int
    slots: int

    @property
    def offset(self) -> int:
        """``M``: a value ``q`` is stored as ``q + M``."""
        return (1 << (self.bits - 1)) - 1

    @property
    def plaintext_bits(self) -> int:
        """Bits used in a plaintext, canary included: ``(slots + 1) * slot_bits``."""
        return (self.slots + 1) * self.slot_bits

    def num_plaintexts(self, count: int) -> int:
        """Plaintexts (= ciphertexts) needed for ``count`` values."""
        return -(-int(count) // self.slots)


def packing_layout(key_bits: int, bits: int, max_total_weight: int, *, slot_bits: int | None = None,
                   slots: int | None = None) -> PackingLayout:
    """The packing layout, or ``ValueError`` naming the field when it could overflow.

    ``slot_bits`` defaults to :func:`required_slot_bits` and ``slots`` to the most that fit below
    ``key_bits - 1`` bits next to the canary. Explicit values that are too small (``slot_bits``) or too
    many (``slots``) are refused.
    """
    key_bits = _int("channel.key_bits", key_bits, Range(16))
    bits = _int("channel.bits", bits, Range(MIN_BITS, MAX_BITS))
    max_total_weight = _int("channel.max_total_weight", max_total_weight, Range(1, MAX_TOTAL_WEIGHT))
    need = required_slot_bits(bits, max_total_weight)  # <= 62 since bits <= 32 and weight <= 2**30
    if slot_bits is None:
        slot_bits = need
    else:
        slot_bits = _int("channel.slot_bits", slot_bits, Range(1, MAX_SLOT_BITS))
        if slot_bits < need:
            raise ValueError(
                f"channel.slot_bits={slot_bits} could overflow: a weighted sum of {bits}-bit values with "
                f"total weight up to {max_total_weight} needs {need} bits per slot")
    room = (key_bits - 1) // slot_bits - 1  # value slots that fit next to the canary
    if room < 1:
        raise ValueError(f"channel.key_bits={key_bits} is too small for one value and the canary in "
                         f"{slot_bits}-bit slots (channel.bits={bits}, "
                         f"channel.max_total_weight={max_total_weight})")
    if slots is None:
        slots = room
    else:
        slots = _int("channel.slots", slots, Range(1))
        if slots > room:
            raise ValueError(
                f"channel.slots={slots} could overflow the plaintext modulus: {slots} values + canary of "
                f"{slot_bits} bits = {(slots + 1) * slot_bits} bits > {key_bits - 1} (key_bits - 1); "
                f"at most {room} fit")
    return PackingLayout(key_bits=key_bits, bits=bits, max_total_weight=max_total_weight,
                         slot_bits=slot_bits, slots=slots)


def canary_values(num_plaintexts: int, bits: int) -> np.ndarray:
    """The canary of plaintext ``j``: ``1 + (j mod 2M)``, int64, in ``[1, 2M]``."""
    two_m = (1 << int(bits)) - 2
    return 1 + (np.arange(int(num_plaintexts), dtype=np.int64) % two_m)


def _nbytes(layout: PackingLayout) -> int:
    return -(-layout.plaintext_bits // 8)


def pack(q: np.ndarray, layout: PackingLayout) -> list[int]:
    """Pack signed quantized values (``|q| <= M``) into plaintext integers (< ``2**(key_bits-1)``)."""
    q = np.asarray(q)
    if q.dtype.kind not in "iu":
        raise ValueError(f"pack: quantized values must be integers, got dtype {q.dtype}")
    q = q.astype(np.int64).ravel()
    m = layout.offset
    if q.size == 0:
        raise ValueError("pack: no values")
    if np.any(np.abs(q) > m):
        raise ValueError(f"pack: values outside [-{m}, {m}] for channel.bits={layout.bits}")
    s, w = layout.slots, layout.slot_bits
    n_pt = layout.num_plaintexts(q.size)
    grid = np.empty((n_pt, s + 1), dtype=np.uint64)
    u = np.full(n_pt * s, m, dtype=np.uint64)  # padding = the value 0
    u[:q.size] = (q + m).astype(np.uint64)
    grid[:, :s] = u.reshape(n_pt, s)
    grid[:, s] = canary_values(n_pt, layout.bits).astype(np.uint64)
    grid = grid[:, ::-1]  # most significant slot first
    bits = np.unpackbits(grid.astype(">u8").view(np.uint8).reshape(n_pt, s + 1, 8), axis=2)
    bits = bits[:, :, 64 - w:].reshape(n_pt, (s + 1) * w)
    pad = _nbytes(layout) * 8 - layout.plaintext_bits
    bits = np.concatenate([np.zeros((n_pt, pad), dtype=np.uint8), bits], axis=1)
    rows = np.packbits(bits, axis=1)
    return [int.from_bytes(row.tobytes(), "big") for row in rows]


def unpack(plaintexts: list[int], layout: PackingLayout, count: int, total_weight: int) -> np.ndarray:
    """Decode decrypted weighted-sum plaintexts to the int64 sums ``sum_i w_i q_i`` (``count`` values).

    ``total_weight`` is ``W = sum_i w_i``. Raises :class:`IntegrityError` (``"count"``, ``"plaintext"``,
    ``"canary"``, ``"padding"``) when the plaintexts cannot be a weighted sum of packed values with that
    total weight: wrong key, corrupted ciphertext, wrong weight, reordered ciphertexts.
    """
    total_weight = _int("total_weight", total_weight, Range(1, layout.max_total_weight))
    count = _int("count", count, Range(1))
    n_pt = layout.num_plaintexts(count)
    if len(plaintexts) != n_pt:
        raise IntegrityError("count", f"{len(plaintexts)} plaintexts for {count} values, expected {n_pt}")
    nbytes, limit = _nbytes(layout), layout.plaintext_bits
    mask = (1 << limit) - 1
    s, w = layout.slots, layout.slot_bits
    buf = np.frombuffer(b"".join((int(m) & mask).to_bytes(nbytes, "big") for m in plaintexts), dtype=np.uint8)
    bits = np.unpackbits(buf.reshape(n_pt, nbytes), axis=1)[:, nbytes * 8 - limit:].reshape(n_pt, s + 1, w)
    full = np.zeros((n_pt, s + 1, 64), dtype=np.uint8)
    full[:, :, 64 - w:] = bits
    grid = np.packbits(full, axis=2).reshape(n_pt, (s + 1) * 8).view(">u8").astype(np.int64)[:, ::-1]
    expected = total_weight * canary_values(n_pt, layout.bits)
    bad = np.flatnonzero(grid[:, s] != expected)
    if bad.size:
        raise IntegrityError("canary", f"{bad.size} of {n_pt} plaintexts fail the canary (first: plaintext "
                                       f"{int(bad[0])}): wrong key, corrupted ciphertext, wrong total "
                                       f"weight ({total_weight}) or reordered ciphertexts")
    for j, m in enumerate(plaintexts):
        if m < 0 or m.bit_length() > limit:
            raise IntegrityError("plaintext", f"plaintext {j} has {m.bit_length()} bits, the layout allows "
                                              f"{limit}: wrong key or corrupted ciphertext")
    sums = grid[:, :s].reshape(-1) - total_weight * layout.offset
    if np.any(sums[count:] != 0):
        raise IntegrityError("padding", "the padding slots of the last plaintext are not zero")
    return sums[:count].copy()
