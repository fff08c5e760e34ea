"""The Paillier payload (one client's encrypted update, or a combination): header, what the server can
verify with the public key alone, and the homomorphic combination of payloads."""
from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Sequence

import gmpy2
import numpy as np

from fedsim.crypto.errors import IntegrityError
from fedsim.crypto.packing import packing_layout
from fedsim.crypto.paillier.keys import PublicKey, _check_weights, key_fingerprint, weighted_sum
from fedsim.crypto.quantize import Quantizer

MODE_PER_ELEMENT, MODE_PACKED = 0, 1
_MAGIC, _VERSION = b"FSPC", 1
_HEAD = struct.Struct(">4sBBBBHHdQQQQI32s")  # everything before the digest
_DIGEST_LEN = 32
HEADER_BYTES = _HEAD.size + _DIGEST_LEN

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
