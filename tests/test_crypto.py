"""fedsim.crypto: quantization, packing, Paillier payloads, precomputed obfuscation, key delivery.

Keys are 1024 bits (the ``WeakKeyWarning`` is expected) except where a 2048-bit fact is asserted.
Expected values are recomputed independently with plain integer / numpy arithmetic.
"""
from __future__ import annotations

import ast
import hashlib
import threading
import warnings
from pathlib import Path

import gmpy2
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from phe import paillier as phe_paillier

from fedsim.crypto import IntegrityError, KeyDeliveryError
from fedsim.crypto import keyexchange as kx
from fedsim.crypto import paillier as pl
from fedsim.crypto.packing import (
    PackingLayout,
    canary_values,
    pack,
    packing_layout,
    required_slot_bits,
    unpack,
)
from fedsim.crypto.paillier.payload import _build_payload as build_payload
from fedsim.crypto.quantize import Quantizer, aggregate_error_bound, integer_weights

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(4, 3, 5), (11,), (7, 9)]  # 134 values: not a multiple of the slot count
NUM = sum(int(np.prod(s)) for s in SHAPES)


def _keypair(bits=1024):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pl.WeakKeyWarning)
        return pl.generate_keypair(bits)


@pytest.fixture(scope="module")
def key_a():
    return _keypair()


@pytest.fixture(scope="module")
def key_b():
    return _keypair()


def client_updates(seed: int, clients: int, scale: float = 0.1):
    rng = np.random.default_rng(seed)
    return [[rng.normal(0.0, scale, s) for s in SHAPES] for _ in range(clients)]


def redigest(payload: bytes) -> bytes:
    """Recompute the SHA-256 of an altered payload, as anyone (e.g. a faulty server) can."""
    head = payload[:pl.HEADER_BYTES - 32]
    body = payload[pl.HEADER_BYTES:]
    return head + hashlib.sha256(head + body).digest() + body


def set_ciphertext(payload: bytes, index: int, value: int) -> bytes:
    h = pl.parse_header(payload)
    start = pl.HEADER_BYTES + index * h.width
    return redigest(payload[:start] + int(value).to_bytes(h.width, "big") + payload[start + h.width:])


# ------------------------------------------------------------------------------- quantization
def test_quantizer_rounding_clipping_and_refusals():
    qz = Quantizer(bits=12, clip=0.5)
    assert qz.max_int == 2047 and qz.scale == pytest.approx(2047 / 0.5)
    x = np.random.default_rng(0).uniform(-0.5, 0.5, 5000)
    q, clipped = qz.quantize(x)
    assert clipped == 0 and q.dtype == np.int64 and np.abs(q).max() <= 2047
    err = np.abs(qz.dequantize(q) - x)
    assert err.max() <= 0.5 / qz.scale + 1e-15  # measured 1.22e-4 = 0.5/scale to 4 digits
    assert err.max() > 0.4 / qz.scale  # the rounding bound is tight, not loose
    # clipping: counted and saturated at +-M
    q, clipped = qz.quantize(np.array([0.7, -3.0, 0.2, 0.5]))
    assert clipped == 2 and q.tolist() == [2047, -2047, round(0.2 * 4094), 2047]
    with pytest.raises(ValueError, match="channel.overflow"):
        Quantizer(bits=12, clip=0.5, overflow="raise").quantize(np.array([0.1, 0.6]))
    with pytest.raises(ValueError, match="NaN"):
        qz.quantize(np.array([0.1, np.nan]))
    for kwargs, field in (({"bits": 1}, "channel.bits"), ({"bits": 33}, "channel.bits"),
                          ({"clip": 0.0}, "channel.clip"), ({"clip": float("inf")}, "channel.clip"),
                          ({"overflow": "wrap"}, "channel.overflow")):
        with pytest.raises(ValueError, match=field):
            Quantizer(**kwargs)


def test_error_bound_of_integer_weights():
    """aggregate_error_bound = 0.5/scale + max|x| * sum|w_i/W - p_i|, and <= the N/W worst case."""
    qz = Quantizer(bits=16, clip=1.0)
    p = np.array([0.123, 0.377, 0.05, 0.45])
    w = integer_weights(p, 10)
    assert w == [1, 4, 0, 4]  # round(p * 10), half to even
    W = sum(w)
    by_hand = 0.5 / 32767 + 1.0 * (abs(1 / 9 - .123) + abs(4 / 9 - .377) + abs(0 - .05) + abs(4 / 9 - .45))
    bound = aggregate_error_bound(qz, w, p)
    assert bound == pytest.approx(by_hand, rel=1e-12)
    assert bound <= 0.5 / 32767 + len(w) / W
    # the bound is attained by the worst-case inputs x_i = +-clip with the sign of (w_i/W - p_i)
    x = np.sign(np.array(w) / W - p)
    assert abs(np.dot(np.array(w) / W - p, x)) == pytest.approx(bound - 0.5 / 32767, rel=1e-12)
    assert aggregate_error_bound(qz, w) == pytest.approx(0.5 / 32767)
    with pytest.raises(ValueError, match="channel.precision"):
        integer_weights(p, 0)


# ------------------------------------------------------------------------------------ packing
def test_layout_headroom_and_refusals():
    lay = packing_layout(2048, 16, 128)
    assert 128 * (2 ** 16 - 2) < 2 ** 23 <= 2 * 128 * (2 ** 16 - 2)  # 23 bits are needed and enough
    assert (lay.slot_bits, lay.slots) == (23, 2047 // 23 - 1) == (23, 88)
    assert lay.plaintext_bits <= 2047
    for kwargs, field in (({"slot_bits": 22}, "channel.slot_bits"), ({"slots": 89}, "channel.slots"),
                          ({"bits": 33}, "channel.bits"), ({"max_total_weight": 0}, "channel.max_total_weight"),
                          ({"key_bits": 40}, "channel.key_bits"),
                          ({"bits": 32, "max_total_weight": 2 ** 30 + 1}, "channel.max_total_weight")):
        args = {"key_bits": 2048, "bits": 16, "max_total_weight": 128, **kwargs}
        with pytest.raises(ValueError, match=field):
            packing_layout(**args)
    assert packing_layout(2048, 16, 128, slots=10).slots == 10


def test_headroom_is_exact_and_a_narrower_slot_would_overflow():
    """Worst case (every value +M or -M, total weight = max) decodes exactly with the computed slot
    width; one bit less (a layout packing_layout refuses) corrupts the sum and trips the canary."""
    lay = packing_layout(1024, 8, 100)
    m = lay.offset
    rng = np.random.default_rng(1)
    weights = [37, 63]
    for sign in (1, -1):
        qs = [np.full(300, sign * m, dtype=np.int64) for _ in weights]
        qs[1][::7] = rng.integers(-m, m + 1, size=len(qs[1][::7]))
        pts = [pack(q, lay) for q in qs]
        agg = [sum(w * p[j] for w, p in zip(weights, pts)) for j in range(len(pts[0]))]
        expected = sum(w * q for w, q in zip(weights, qs))
        assert np.array_equal(unpack(agg, lay, 300, 100), expected)
    narrow = PackingLayout(key_bits=1024, bits=8, max_total_weight=100, slot_bits=lay.slot_bits - 1, slots=lay.slots)
    with pytest.raises(ValueError, match="channel.slot_bits"):
        packing_layout(1024, 8, 100, slot_bits=narrow.slot_bits)
    qs = [np.full(300, m, dtype=np.int64) for _ in weights]
    pts = [pack(q, narrow) for q in qs]
    agg = [sum(w * p[j] for w, p in zip(weights, pts)) for j in range(len(pts[0]))]
    with pytest.raises(IntegrityError) as exc:
        unpack(agg, narrow, 300, 100)
    assert exc.value.field in ("canary", "plaintext")


def test_pack_unpack_integer_sums_with_canary():
    lay = packing_layout(512, 10, 40)
    m = lay.offset
    rng = np.random.default_rng(2)
    qs = [rng.integers(-m, m + 1, size=257) for _ in range(3)]
    weights = [5, 0, 17]
    pts = [pack(q, lay) for q in qs]
    assert len(pts[0]) == -(-257 // lay.slots) and max(pts[0]).bit_length() <= lay.plaintext_bits
    agg = [sum(w * p[j] for w, p in zip(weights, pts)) for j in range(len(pts[0]))]
    assert np.array_equal(unpack(agg, lay, 257, 22), 5 * qs[0] + 17 * qs[2])
    # the canary slot reads W * c_j; a wrong total weight or swapped plaintexts are refused
    assert agg[3] >> (lay.slots * lay.slot_bits) == 22 * canary_values(4, 10)[3]
    with pytest.raises(IntegrityError, match="canary"):
        unpack(agg, lay, 257, 23)
    with pytest.raises(IntegrityError, match="canary"):
        unpack([agg[1], agg[0]] + agg[2:], lay, 257, 22)
    assert required_slot_bits(10, 40) == (40 * 1022).bit_length()


# --------------------------------------------------------------------- encrypted aggregation
@pytest.mark.parametrize("packed", [True, False])
def test_decrypted_aggregate_is_the_weighted_mean(key_a, packed):
    pk, sk = key_a
    qz = Quantizer(bits=16, clip=0.5)
    xs = client_updates(3, 4)
    xs[2][0] -= 0.2  # a mostly negative client
    p = np.array([0.1, 0.45, 0.3, 0.15])
    w = integer_weights(p, 100)  # eq. 4.4 with P = 100: [10, 45, 30, 15]
    codec = pl.PaillierCodec(pk, qz, 128, private_key=sk, packed=packed)
    payloads = [codec.encode(x) for x in xs]
    assert codec.last_clipped == 0
    out = codec.decode(pl.combine(pk, payloads, w), SHAPES)
    assert [o.shape for o in out] == SHAPES
    got = np.concatenate([o.ravel() for o in out])
    flat = [np.concatenate([a.ravel() for a in x]) for x in xs]
    assert got.min() < -0.1 < 0.1 < got.max()
    exact_w = sum(wi * f for wi, f in zip(w, flat)) / sum(w)
    assert np.abs(got - exact_w).max() <= qz.step_error + 1e-12  # measured ~5.9e-6 of 7.6e-6
    exact_p = sum(pi * f for pi, f in zip(p, flat))
    max_abs = max(np.abs(f).max() for f in flat)
    assert np.abs(got - exact_p).max() <= aggregate_error_bound(qz, w, p, max_abs) + 1e-12


def test_packed_equals_per_element_exactly(key_a):
    pk, sk = key_a
    qz = Quantizer(bits=14, clip=0.3)
    xs = client_updates(4, 3, scale=0.2)  # some values beyond 0.3 get clipped: same in both paths
    w = [7, 2, 11]
    sums = {}
    for packed in (True, False):
        codec = pl.PaillierCodec(pk, qz, 64, private_key=sk, packed=packed)
        payloads = [codec.encode(x) for x in xs]
        assert codec.clipped_total > 0
        sums[packed] = codec.decode_sums(pl.combine(pk, payloads, w), NUM)
    qs = [qz.quantize(np.concatenate([a.ravel() for a in x]))[0] for x in xs]
    expected = sum(wi * q for wi, q in zip(w, qs))
    assert sums[True].dtype == np.int64 and np.array_equal(sums[True], sums[False])
    assert np.array_equal(sums[True], expected)


def test_combine_refuses_weights_that_could_overflow_and_nests(key_a):
    pk, sk = key_a
    codec = pl.PaillierCodec(pk, Quantizer(bits=8, clip=1.0), 20, private_key=sk)
    a, b, c = (codec.encode(x) for x in client_updates(5, 3))
    with pytest.raises(ValueError, match="weights: total weight 21"):
        pl.combine(pk, [a, b], [10, 11])
    with pytest.raises(ValueError, match="weights"):
        pl.combine(pk, [a, b], [0, 0])
    with pytest.raises(ValueError, match="weights"):
        pl.combine(pk, [a, b], [1.5, 2])
    ab = pl.combine(pk, [a, b], [2, 3])
    assert pl.parse_header(ab).total_weight == 5
    with pytest.raises(ValueError, match="total weight 25"):
        pl.combine(pk, [ab, c], [4, 5])  # nested weights multiply: 4*5 + 5
    nested = codec.decode_sums(pl.combine(pk, [ab, c], [2, 4]), NUM)
    flat = codec.decode_sums(pl.combine(pk, [a, b, c], [4, 6, 4]), NUM)
    assert np.array_equal(nested, flat)


# ------------------------------------------------------------------------------- integrity
def test_verify_catches_flipped_byte_wrong_key_wrong_count(key_a, key_b):
    pk, sk = key_a
    codec = pl.PaillierCodec(pk, Quantizer(), 16, private_key=sk)
    payload = codec.encode(client_updates(6, 1)[0])
    h = pl.verify(pk, payload, num_values=NUM)
    assert (h.num_values, h.num_ciphertexts, h.total_weight) == (NUM, codec.num_ciphertexts(NUM), 1)

    def field(data, key=pk, **kw):
        with pytest.raises(IntegrityError) as exc:
            pl.verify(key, data, **kw)
        return exc.value.field

    body = pl.HEADER_BYTES + 5
    assert field(payload[:body] + bytes([payload[body] ^ 1]) + payload[body + 1:]) == "digest"
    assert field(payload, key=key_b[0]) == "fingerprint"
    assert field(payload, num_values=NUM + 1) == "count"
    assert field(payload[:-1]) == "count"  # truncated
    assert field(payload[:20]) == "header"
    assert field(b"XXXX" + payload[4:]) == "header"
    n2 = pk.nsquare
    assert field(set_ciphertext(payload, 1, 0)) == "ciphertext[1]"
    assert field(set_ciphertext(payload, 0, n2 + 5)) == "ciphertext[0]"  # fits the width, >= n^2
    assert field(set_ciphertext(payload, 0, pk.n * 3)) == "ciphertext[0]"  # shares a factor with n
    other = pl.PaillierCodec(pk, Quantizer(), 16, private_key=sk).encode(client_updates(6, 1)[0][:2])
    with pytest.raises(IntegrityError, match="num_values"):
        pl.combine(pk, [payload, other], [1, 1])


def test_canary_catches_corrupted_and_wrong_key_aggregates(key_a, key_b):
    pk, sk = key_a
    codec = pl.PaillierCodec(pk, Quantizer(bits=16, clip=0.5), 64, private_key=sk)
    agg = pl.combine(pk, [codec.encode(x) for x in client_updates(7, 3)], [3, 4, 5])
    codec.decode(agg, SHAPES)  # intact: decodes
    # a corrupted ciphertext that still passes the server's checks (digest recomputed)
    cts = pl.read_ciphertexts(pk, agg)[1]
    corrupted = set_ciphertext(agg, 1, cts[1] * 7 % pk.nsquare)
    pl.verify(pk, corrupted)
    with pytest.raises(IntegrityError, match="canary"):
        codec.decode(corrupted, SHAPES)
    # a targeted change of the canary slot: c * Enc(2^(slots*slot_bits)) adds 1 to the canary of plaintext 0
    lay = codec.layout
    bump = set_ciphertext(agg, 0, cts[0] * pl.encrypt_raw(pk, 1 << (lay.slots * lay.slot_bits)) % pk.nsquare)
    with pytest.raises(IntegrityError, match="canary"):
        codec.decode(bump, SHAPES)
    # ciphertexts under key A presented as an aggregate under key B (same layout, fingerprint of B)
    pk_b, sk_b = key_b
    codec_b = pl.PaillierCodec(pk_b, Quantizer(bits=16, clip=0.5), 64, private_key=sk_b)
    h = pl.parse_header(agg)
    wrong = build_payload(pk_b, mode=h.mode, bits=h.bits, slot_bits=h.slot_bits, slots=h.slots, clip=h.clip,
                              max_total_weight=h.max_total_weight, total_weight=h.total_weight,
                              num_values=h.num_values, ciphertexts=[c % pk_b.nsquare for c in cts])
    pl.verify(pk_b, wrong)
    with pytest.raises(IntegrityError, match="canary"):
        codec_b.decode(wrong, SHAPES)
    # a wrong total weight claimed by the decoder, or a payload whose header lies about it
    with pytest.raises(IntegrityError, match="total_weight"):
        codec.decode(agg, SHAPES, total_weight=11)
    head = bytearray(agg[:pl.HEADER_BYTES])
    lied = build_payload(pk, mode=h.mode, bits=h.bits, slot_bits=h.slot_bits, slots=h.slots, clip=h.clip,
                             max_total_weight=h.max_total_weight, total_weight=13, num_values=h.num_values,
                             ciphertexts=cts)
    assert bytes(head) != lied[:pl.HEADER_BYTES]
    with pytest.raises(IntegrityError, match="canary"):
        codec.decode(lied, SHAPES)
    # per-element path: the wrong key shows up as out-of-range sums
    per = pl.PaillierCodec(pk, Quantizer(bits=16, clip=0.5), 64, private_key=sk, packed=False)
    p_agg = per.encode(client_updates(7, 1)[0])
    hp, pcts = pl.read_ciphertexts(pk, p_agg)
    wrong_p = build_payload(pk_b, mode=hp.mode, bits=hp.bits, slot_bits=0, slots=1, clip=hp.clip,
                                max_total_weight=64, total_weight=1, num_values=NUM,
                                ciphertexts=[c % pk_b.nsquare for c in pcts])
    with pytest.raises(IntegrityError, match="range"):
        pl.PaillierCodec(pk_b, Quantizer(bits=16, clip=0.5), 64, private_key=sk_b, packed=False).decode(
            wrong_p, SHAPES)
    # a codec with other channel settings refuses the payload instead of misreading it
    with pytest.raises(IntegrityError, match="layout"):
        pl.PaillierCodec(pk, Quantizer(bits=16, clip=0.25), 64, private_key=sk).decode(agg, SHAPES)
    with pytest.raises(ValueError, match="private_key"):
        pl.PaillierCodec(pk, Quantizer(bits=16, clip=0.5), 64).decode(agg, SHAPES)


# --------------------------------------------------------------------- precomputed obfuscation
def test_precomputed_obfuscation_decrypts_like_phe(key_a):
    pk, sk = key_a
    n, n2 = pk.n, pk.nsquare
    r = pk.get_random_lt_n()
    obf = int(gmpy2.powmod(r, n, n2))
    for m in (0, 1, 12345, n - 1, n // 2 + 3):
        c = pl.encrypt_raw(pk, m, obf)
        assert c == pk.raw_encrypt(m, r_value=r)  # same ciphertext as phe with the same r
        assert sk.raw_decrypt(c) == m
    for v in (0, 12345, -7):  # phe's own (signed) decryption of our ciphertexts
        c = pl.encrypt_raw(pk, v % n, obf)
        assert sk.decrypt(phe_paillier.EncryptedNumber(pk, c, 0)) == v
    # the CRT route gives the same obfuscator for the same r
    crt_pool = pl.ObfuscatorPool(pk, sk, method="full")
    crt_pool._draw_r = lambda: gmpy2.mpz(r)
    assert crt_pool.compute() == obf
    # pooled encryptions decrypt correctly, are all different, and the pool hands out each once
    pool = pl.ObfuscatorPool(pk, sk)
    pool.fill(20)
    assert len(pool) == 20 and pool.precomputed == 20 and pool.precompute_seconds > 0
    cts = [pl.encrypt_raw(pk, 42, pool.take()) for _ in range(20)]
    assert [sk.raw_decrypt(c) for c in cts] == [42] * 20 and len(set(cts)) == 20
    assert len(pool) == 0 and pool.taken == 20 and pool.inline == 0
    pl.encrypt_raw(pk, 42, pool.take())
    assert pool.inline == 1  # empty pool: computed inline, counted


def test_obfuscators_are_never_reused_under_concurrency(key_a):
    pk, sk = key_a
    pool = pl.ObfuscatorPool(pk, sk)
    pool.fill_async(150)
    taken: list[list[int]] = [[], []]

    def consumer(k):
        for _ in range(100):
            taken[k].append(pool.take())

    threads = [threading.Thread(target=consumer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.wait()
    got = taken[0] + taken[1] + [pool.take() for _ in range(len(pool))]
    # every obfuscator is either taken from the pool (150 precomputed) or computed inline
    assert pool.precomputed == 150 and pool.taken == 150 and len(pool) == 0 and pool.taken + pool.inline == len(got)
    assert len(set(got)) == len(got)  # no obfuscator handed out twice
    assert all(pow(o, 1, pk.nsquare) == o and gmpy2.gcd(o, pk.n) == 1 for o in got)
    with pytest.raises(ValueError, match="count"):
        pool.fill(-1)


def test_codec_with_pool_uses_one_obfuscator_per_ciphertext(key_a):
    pk, sk = key_a
    pool = pl.ObfuscatorPool(pk, sk)
    codec = pl.PaillierCodec(pk, Quantizer(bits=16, clip=0.5), 64, private_key=sk, pool=pool)
    need = codec.num_ciphertexts(NUM)
    pool.fill(need)
    xs = client_updates(8, 2)
    a = codec.encode(xs[0])
    assert (pool.taken, pool.inline, len(pool)) == (need, 0, 0)
    b = codec.encode(xs[0])  # the same update again: inline this time, and different ciphertexts
    assert pool.inline == need
    assert set(pl.read_ciphertexts(pk, a)[1]).isdisjoint(pl.read_ciphertexts(pk, b)[1])
    plain = pl.PaillierCodec(pk, Quantizer(bits=16, clip=0.5), 64, private_key=sk)
    assert np.array_equal(codec.decode_sums(a, NUM), plain.decode_sums(plain.encode(xs[0]), NUM))


# ---------------------------------------------------------------------------------------- keys
def test_key_generation_sizes_and_serialisation(key_a):
    pk2048, sk2048 = pl.generate_keypair()  # the default: no warning
    assert pk2048.n.bit_length() == 2048
    assert packing_layout(2048, 16, 1024).slots == 2047 // 26 - 1  # 77 values per 2048-bit plaintext
    with pytest.warns(pl.WeakKeyWarning):
        pk512, _ = pl.generate_keypair(512)
    assert pk512.n.bit_length() == 512
    for bad in (510, 511, 1023, "2048"):
        with pytest.raises(ValueError, match="channel.key_bits"):
            pl.generate_keypair(bad)
    pk, sk = key_a
    pk_bytes = pl.public_key_to_bytes(pk)
    assert pl.public_key_from_bytes(pk_bytes) == pk
    sk_bytes = pl.private_key_to_bytes(sk)
    sk2 = pl.private_key_from_bytes(sk_bytes, pk)
    assert (sk2.p, sk2.q) == (sk.p, sk.q)
    c = pk.raw_encrypt(987654321)
    assert sk2.raw_decrypt(c) == 987654321
    with pytest.raises(ValueError, match="public key"):
        pl.private_key_from_bytes(sk_bytes, pk2048)
    with pytest.raises(ValueError, match="private key bytes"):
        pl.private_key_from_bytes(sk_bytes[:-1])
    with pytest.raises(ValueError, match="public key bytes"):
        pl.public_key_from_bytes(pk_bytes + b"\0")
    assert pl.key_fingerprint(pk) != pl.key_fingerprint(pk2048)


# ------------------------------------------------------------------------------- key delivery
def test_key_sealing_round_trip_tampering_and_wrong_recipient(key_a):
    secret = pl.private_key_to_bytes(key_a[1])
    a_sk, a_pub = kx.x25519_keypair()
    b_sk, b_pub = kx.x25519_keypair()
    c_sk, c_pub = kx.x25519_keypair()
    ctx = {"run_id": "run-1", "sender": "client-0", "recipient": "client-1"}
    box = kx.seal_secret(secret, a_sk, b_pub, **ctx)
    assert kx.open_secret(box, b_sk, a_pub, **ctx) == secret
    assert kx.seal_secret(secret, a_sk, b_pub, **ctx) != box  # fresh nonce every time
    for pos in (2, 4, 10, 40, len(box) - 1):  # magic, nonce, ciphertext, tag
        bad = box[:pos] + bytes([box[pos] ^ 0x10]) + box[pos + 1:]
        with pytest.raises(KeyDeliveryError):
            kx.open_secret(bad, b_sk, a_pub, **ctx)
    with pytest.raises(KeyDeliveryError, match="failed authentication"):
        kx.open_secret(box, c_sk, a_pub, **ctx)  # another client's key
    with pytest.raises(KeyDeliveryError, match="failed authentication"):
        kx.open_secret(box, b_sk, a_pub, **{**ctx, "recipient": "client-2"})
    with pytest.raises(KeyDeliveryError, match="failed authentication"):
        kx.open_secret(box, b_sk, a_pub, **{**ctx, "run_id": "run-2"})
    with pytest.raises(KeyDeliveryError, match="failed authentication"):
        kx.open_secret(box, b_sk, c_pub, **{**ctx, "sender": "client-0"})  # relayed a wrong sender key
    with pytest.raises(KeyDeliveryError, match="malformed"):
        kx.open_secret(box[:20], b_sk, a_pub, **ctx)
    with pytest.raises(KeyDeliveryError, match="32 bytes"):
        kx.open_secret(box, b_sk, a_pub[:31], **ctx)
    with pytest.raises(ValueError, match="recipient"):
        kx.seal_secret(secret, a_sk, b_pub, run_id="r", sender="x", recipient="x")


def test_full_flow_and_server_artifacts_hold_no_secrets():
    """Client 0 makes the key and seals it to clients 1-3 through the server; clients encode, the server
    verifies and combines, every other client decodes. Nothing the server handles contains p, q, the
    X25519 shared secrets or the derived AES keys."""
    pk, sk = _keypair(1024)
    ids = [f"client-{i}" for i in range(4)]
    x = {cid: kx.x25519_keypair() for cid in ids}
    server_seen: list[bytes] = [pl.public_key_to_bytes(pk)] + [pub for _, pub in x.values()]
    boxes = {}
    for cid in ids[1:]:
        boxes[cid] = kx.seal_secret(pl.private_key_to_bytes(sk), x["client-0"][0], x[cid][1], run_id="r7",
                                    sender="client-0", recipient=cid)
    server_seen += list(boxes.values())
    server_pk = pl.public_key_from_bytes(server_seen[0])
    keys = {"client-0": sk}
    for cid in ids[1:]:
        opened = kx.open_secret(boxes[cid], x[cid][0], x["client-0"][1], run_id="r7", sender="client-0",
                                recipient=cid)
        keys[cid] = pl.private_key_from_bytes(opened, server_pk)
    qz = Quantizer(bits=16, clip=0.5)
    updates = client_updates(9, 4)
    payloads = [pl.PaillierCodec(server_pk, qz, 100).encode(u) for u in updates]
    server_seen += payloads
    for p in payloads:
        pl.verify(server_pk, p, num_values=NUM)
    weights = [1, 2, 3, 4]
    agg = pl.combine(server_pk, payloads, weights)
    server_seen.append(agg)
    expected = sum(w * np.concatenate([a.ravel() for a in u]) for w, u in zip(weights, updates)) / 10
    for cid in ids:
        out = pl.PaillierCodec(server_pk, qz, 100, private_key=keys[cid]).decode(agg, SHAPES)
        assert np.abs(np.concatenate([o.ravel() for o in out]) - expected).max() <= qz.step_error + 1e-12

    secrets_: list[bytes] = []
    for v in (int(sk.p), int(sk.q)):
        be = v.to_bytes((v.bit_length() + 7) // 8, "big")
        secrets_ += [be, be[::-1], str(v).encode(), format(v, "x").encode()]
    for cid in ids[1:]:
        shared = x["client-0"][0].exchange(X25519PublicKey.from_public_bytes(x[cid][1]))
        info = kx.context("r7", "client-0", cid, x["client-0"][1], x[cid][1])
        secrets_ += [shared, kx.derive_key(x["client-0"][0], x[cid][1], info)]
    # the search works: the (unsealed) private key bytes do contain p
    assert secrets_[0] in pl.private_key_to_bytes(sk)
    blob = b"\n".join(server_seen)
    for s in secrets_:
        assert len(s) >= 32 and s not in blob


def test_crypto_package_imports_no_plugin_and_no_flower():
    found = set()
    for path in (ROOT / "fedsim" / "crypto").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    assert {"phe", "gmpy2", "cryptography", "numpy"} <= found
    assert not found & {"flwr", "strategies", "channels", "clients", "attacks", "torch", "ray"}


# ------------------------------------------------------------------------ the cheaper Paillier (issue 27)
def test_short_exponent_obfuscators_decrypt_like_phe_on_random_inputs(key_a):
    """``h**alpha`` (fixed-base tables, CRT with the private key) is the same integer as gmpy2's powmod
    modulo ``n**2`` for the same ``r0`` and ``alpha``, with and without the private key; ciphertexts made with
    it decrypt with phe (raw and signed) to the plaintext; the exponent has 2 * kappa bits."""
    pk, sk = key_a
    rng = np.random.default_rng(1)
    r0 = int(pk.get_random_lt_n())
    with_key = pl.ShortExponentObfuscator(pk, sk, base=r0)
    public_only = pl.ShortExponentObfuscator(pk, base=r0)
    h = gmpy2.powmod(r0, pk.n, pk.nsquare)
    assert with_key.alpha_bits == 2 * pl.security_bits(1024) == 160
    assert pl.ShortExponentObfuscator(*_keypair(2048)).alpha_bits == 224  # kappa = 112 at 2048 bits
    for alpha in [0, 1, 255, 256, (1 << 160) - 1, *[int(x) for x in rng.integers(0, 2**62, 5)]]:
        assert with_key.power(alpha) == public_only.power(alpha) == int(gmpy2.powmod(h, alpha, pk.nsquare))
    for _ in range(20):
        m = int(rng.integers(0, 2**62)) * int(rng.integers(1, 2**62)) % pk.n
        c = pl.encrypt_raw(pk, m, with_key.draw())
        assert sk.raw_decrypt(c) == m
        v = int(rng.integers(-2**40, 2**40))
        assert sk.decrypt(phe_paillier.EncryptedNumber(pk, pl.encrypt_raw(pk, v % pk.n, with_key.draw()), 0)) == v
    draws = {with_key.draw() for _ in range(50)}
    assert len(draws) == 50  # fresh exponents


def test_the_short_exponent_pool_gives_the_same_sums_as_full_obfuscators(key_a):
    pk, sk = key_a
    xs = client_updates(11, 3)
    sums = []
    for method in ("short", "full"):
        pool = pl.ObfuscatorPool(pk, sk, method=method)
        codec = pl.PaillierCodec(pk, Quantizer(bits=16, clip=0.5), 64, private_key=sk, pool=pool)
        combined = codec.combine([codec.encode(x) for x in xs], [3, 1, 2])
        sums.append(codec.decode_sums(combined, NUM))
        assert pool.inline == codec.num_ciphertexts(NUM) * 3  # nothing precomputed: computed inline, counted
    np.testing.assert_array_equal(*sums)


def test_the_weighted_sum_equals_phe_arithmetic_exactly(key_a):
    """The server's combination: the same ciphertext integers as phe's own scalar multiplication and addition
    of EncryptedNumbers (no re-randomisation in either), and it decrypts to the weighted sum."""
    pk, sk = key_a
    rng = np.random.default_rng(2)
    ms = [[int(v) for v in rng.integers(0, 2**50, 6)] for _ in range(4)]
    cts = [[pk.raw_encrypt(m) for m in row] for row in ms]
    for weights in ([1, 1, 1, 1], [4096, 3, 0, 17], [1, 2**12 + 7, 255, 256]):
        got = pl.weighted_sum(pk, cts, weights)
        for k in range(6):
            acc = None
            for w, row in zip(weights, cts):
                if w == 0:
                    continue
                term = phe_paillier.EncryptedNumber(pk, row[k], 0) * w
                acc = term if acc is None else acc + term
            assert got[k] == acc.ciphertext(be_secure=False)
            assert sk.raw_decrypt(got[k]) == sum(w * row[k] for w, row in zip(weights, ms)) % pk.n


def test_threaded_decryption_equals_phe(key_a):
    pk, sk = key_a
    cts = [pk.raw_encrypt(int(m)) for m in np.random.default_rng(3).integers(0, 2**60, 40)]
    expected = [sk.raw_decrypt(c) for c in cts]
    for threads in (1, 2, 3):
        assert pl.decrypt_many(sk, cts, threads=threads) == expected


def test_key_bits_are_bounded():
    for ok in (512, 2048, 8192):
        assert pl.check_key_bits(ok) == ok
    for bad in (511, 1023, 8194, 16384, 65536, True, 2048.0):
        with pytest.raises(ValueError, match=r"channel.key_bits must be an even integer in \[512, 8192\]"):
            pl.check_key_bits(bad)
