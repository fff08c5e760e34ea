"""Paillier channel cost: per-element vs BatchCrypt-packed encryption, and online encryption with
precomputed obfuscators.

What a client of the channel encrypts: an update of a LeNet-5-size model (61,706 values: the classic
LeNet-5 layer shapes; ``--what update``, the default, as the channel encrypts since issue 27: N(0, 0.01)
per client, over the channel's automatic clip, the power of two above the largest entry) or a whole
model (``--what model``: a common N(0, 0.1) global model plus a per-client N(0, 0.01) update, over
``--clip`` 4.0, the channel's ``encrypt = "model"``), for ``--clients`` clients, quantized to
``--bits`` bits, eq. 4.4 integer weights ``round(p_i * P)`` with ``P = --precision``; ``--key-bits``
Paillier keys. The defaults of ``--key-bits``, ``--bits`` and ``--precision`` are read from the
channel's own defaults (``channels.paillier``: 2048 bits; 12-bit updates, 16-bit models; P = 4096), and
the packing layout's ``max_total_weight`` is the channel's ``precision + clients``, so the run measures
the layout a user of ``[channel] name = "paillier"`` gets (80 values per plaintext for updates at 10
clients, 69 for models). Measured side by side in one run:

* packed: every client encodes its whole update (quantize, pack, full ``phe`` encryption with a fresh
  ``r``), the server verifies and combines, one client decodes; checked against the plaintext
  weighted mean;
* per-element (one value per ciphertext): the same on the first ``--sample`` values of every client,
  extrapolated linearly to the whole update (printed as extrapolated); its decrypted integer sums
  are compared with the packed path's;
* obfuscators: one client's ``r**n mod n**2`` (``phe``'s, plain and by CRT with the private key every
  client holds) and the channel's short-exponent ``h**alpha`` (plain and by CRT, its default), then the
  online encode with a filled pool; and how much a background fill slows a pure-Python loop on the
  main thread (GIL released vs held). The packed row's "encrypt" uses full ``phe`` encryption.

    .venv/bin/python benchmarks/paillier.py [--key-bits 2048] [--clients 10] [--bits 12]
        [--clip C] [--precision 4096] [--what update|model] [--sample 200] [--seed 0]
"""
from __future__ import annotations

import argparse
import inspect
import threading
import time

import gmpy2
import numpy as np

from channels.paillier import BITS, PaillierChannel
from fedsim.crypto import paillier as pl
from fedsim.crypto.quantize import Quantizer, aggregate_error_bound, integer_weights, range_exponent

CHANNEL_DEFAULTS = {k: v.default for k, v in inspect.signature(PaillierChannel.__init__).parameters.items()
                    if v.default is not inspect.Parameter.empty}
LENET5 = [(6, 1, 5, 5), (6,), (16, 6, 5, 5), (16,), (120, 400), (120,), (84, 120), (84,), (10, 84), (10,)]


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def python_work(steps: int = 300_000) -> float:
    """Seconds of a pure-Python loop: the worst case for a background thread that holds the GIL."""
    t = time.perf_counter()
    acc = 0
    for i in range(steps):
        acc += i * i % 7
    return time.perf_counter() - t


def gil_holding_fill(pk, stop: threading.Event) -> None:
    """What the pool would do if gmpy2 kept the GIL (its default)."""
    gmpy2.get_context().allow_release_gil = False
    while not stop.is_set():
        gmpy2.powmod(gmpy2.mpz(pk.get_random_lt_n()), pk.n, pk.nsquare)


def interference(pk, sk, repeats: int = 3) -> tuple[float, float, float]:
    """Best-of-``repeats`` time of :func:`python_work` alone, beside ``ObfuscatorPool.fill_async``
    (GIL released) and beside a fill that holds the GIL; interleaved."""
    best = [float("inf")] * 3
    for _ in range(repeats):
        best[0] = min(best[0], python_work())
        pool = pl.ObfuscatorPool(pk, sk)
        pool.fill_async(100_000)
        time.sleep(0.05)
        best[1] = min(best[1], python_work())
        pool.stop()
        stop = threading.Event()
        th = threading.Thread(target=gil_holding_fill, args=(pk, stop))
        th.start()
        time.sleep(0.05)
        best[2] = min(best[2], python_work())
        stop.set()
        th.join()
    return best[0], best[1], best[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = CHANNEL_DEFAULTS
    ap.add_argument("--key-bits", type=int, default=d["key_bits"])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--bits", type=int, default=None,
                    help="default: the channel's (12 bits for updates, 16 for whole models: channels.paillier.BITS)")
    ap.add_argument("--clip", type=float, default=d["clip"],
                    help="default: the channel's automatic clip for updates (the power of two above the largest "
                         "update entry), 4.0 for models")
    ap.add_argument("--precision", type=int, default=d["precision"])
    ap.add_argument("--what", choices=("model", "update"), default="update",
                    help="encrypt updates (what the channel does by default) or whole models (encrypt = model)")
    ap.add_argument("--sample", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    at_defaults = all(getattr(args, k) == d[k] for k in ("key_bits", "bits", "clip", "precision")) and \
        args.what == d["encrypt"]
    if args.bits is None:
        args.bits = BITS[args.what]

    rng = np.random.default_rng(args.seed)
    base = [rng.normal(0.0, 0.1, s) if args.what == "model" else np.zeros(s) for s in LENET5]
    updates = [[b + rng.normal(0.0, 0.01, s) for b, s in zip(base, LENET5)] for _ in range(args.clients)]
    flat = [np.concatenate([a.ravel() for a in u]) for u in updates]
    flat_base = np.concatenate([b.ravel() for b in base])
    num = flat[0].size
    p = rng.dirichlet(np.ones(args.clients))
    weights = integer_weights(p, args.precision)
    max_w = args.precision + args.clients  # the channel's max_total_weight: W = sum round(p_i P) <= P + N/2
    if args.clip is None:
        args.clip = 2.0 ** range_exponent(np.concatenate(flat) - np.tile(flat_base, args.clients)) \
            if args.what == "update" else 4.0
    qz = Quantizer(bits=args.bits, clip=args.clip)
    (pk, sk), t_keygen = timed(pl.generate_keypair, args.key_bits)
    packed = pl.PaillierCodec(pk, qz, max_w, private_key=sk)
    per_elem = pl.PaillierCodec(pk, qz, max_w, private_key=sk, packed=False)
    lay = packed.layout
    n_ct = packed.num_ciphertexts(num)
    print(f"{num} values ({args.what}s) x {args.clients} clients, {args.key_bits}-bit key (keygen {t_keygen:.2f} s), "
          f"{args.bits}-bit values over [-{args.clip}, {args.clip}], weights {weights} (P={args.precision}, "
          f"W={sum(weights)}, max {max_w})")
    print("settings: " + ("the Paillier channel's defaults" if at_defaults else
                          "NOT the channel's defaults (key_bits {key_bits}, bits {bits}, clip {clip}, "
                          "precision {precision}): users of the channel get another layout".format(**d)))
    print(f"packing: {lay.slots} values + canary per plaintext, {lay.slot_bits}-bit slots, "
          f"{lay.plaintext_bits}/{args.key_bits - 1} bits used; {n_ct} ciphertexts per client", flush=True)

    # Interleaved per client (packed whole update, then per-element on the first `sample` values) so
    # that load from other processes hits both paths alike; per-element times are extrapolated.
    s = min(args.sample, num)
    k = num / s
    enc_times, payloads, enc_s, pe_payloads = [], [], [], []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for u, f in zip(updates, flat):
        payload, t = timed(packed.encode, u)
        payloads.append(payload)
        enc_times.append(t)
        payload, t = timed(per_elem.encode, [f[:s]])
        pe_payloads.append(payload)
        enc_s.append(t)
    agg, t_agg = timed(pl.combine, pk, payloads, weights)
    pe_agg, t_agg_s = timed(pl.combine, pk, pe_payloads, weights)
    out, t_dec = timed(packed.decode, agg, LENET5)
    pe_sums, t_dec_s = timed(per_elem.decode_sums, pe_agg, s)
    got = np.concatenate([o.ravel() for o in out])
    target = sum(w * f for w, f in zip(weights, flat)) / sum(weights)
    err = float(np.abs(got - target).max())
    err_p = float(np.abs(got - sum(pi * f for pi, f in zip(p, flat))).max())
    # sum_i (w_i/W - p_i) = 0, so the weight-rounding error is bounded by the values' spread around any common
    # point (here the common global model), not by their magnitude (docs/paillier.md)
    bound_p = aggregate_error_bound(qz, weights, p, max(float(np.abs(f - flat_base).max()) for f in flat))
    same = bool(np.array_equal(pe_sums, packed.decode_sums(agg, num)[:s]))
    print(f"packed: max error {err:.2e} vs the w/W mean (bound {qz.step_error:.2e}), {err_p:.2e} vs the p "
          f"mean (bound {bound_p:.2e}); {packed.clipped_total} values clipped; per-element integer sums on "
          f"{s} values equal to the packed path's: {same}", flush=True)

    # ---- precomputed obfuscation for one client: phe's r^n and the short exponent h^alpha, each plain and
    # by CRT, interleaved in chunks of 50
    plain_pool, crt_pool = pl.ObfuscatorPool(pk, method="full"), pl.ObfuscatorPool(pk, sk, method="full")
    short_pool, short_crt = pl.ObfuscatorPool(pk), pl.ObfuscatorPool(pk, sk)
    for start in range(0, n_ct, 50):
        for pool in (plain_pool, crt_pool, short_pool, short_crt):
            pool.fill(min(50, n_ct - start))
    online = pl.PaillierCodec(pk, qz, max_w, private_key=sk, pool=short_crt)
    online_payload, t_online = timed(online.encode, updates[0])
    assert short_crt.inline == 0 and len(short_crt) == 0
    same_online = bool(np.array_equal(online.decode_sums(online_payload, num), packed.decode_sums(payloads[0], num)))
    busy = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    alone, beside_pool, beside_gil = interference(pk, sk)

    rows = [
        ("per-element (extrapolated)", num, sum(enc_s) * k, t_agg_s * k, t_dec_s * k, len(pe_payloads[0]) * k),
        ("packed", n_ct, sum(enc_times), t_agg, t_dec, len(payloads[0])),
    ]
    print()
    print(f"{'path':<28} {'ct/client':>9} {'encrypt s':>10} {'combine s':>10} {'decrypt s':>10} {'total s':>10} "
          f"{'MB/client':>10}")
    for name, cts, e, a, d, size in rows:
        print(f"{name:<28} {cts:>9} {e:>10.1f} {a:>10.2f} {d:>10.2f} {e + a + d:>10.1f} {size / 1e6:>10.2f}")
    (_, _, e0, a0, d0, s0), (_, _, e1, a1, d1, s1) = rows
    print(f"{'speed-up packed/per-element':<28} {num / n_ct:>8.1f}x {e0 / e1:>9.1f}x {a0 / a1:>9.1f}x "
          f"{d0 / d1:>9.1f}x {(e0 + a0 + d0) / (e1 + a1 + d1):>9.1f}x {s0 / s1:>9.1f}x")
    print(f"(encrypt = all {args.clients} clients one after another; combine = server verify + weighted "
          f"product; decrypt = one client's decrypt + decode; per-element rows are {s} measured values "
          f"x {k:.1f})")
    print()
    per_client = float(np.mean(enc_times))
    print(f"one client, packed, {n_ct} ciphertexts:")
    print(f"  full encryption (fresh r, on the critical path)     {per_client:8.3f} s")
    print(f"  off-line precompute r^n mod n^2 (plain)             {plain_pool.precompute_seconds:8.3f} s")
    print(f"  off-line precompute r^n mod n^2 (CRT, private key)  {crt_pool.precompute_seconds:8.3f} s  "
          f"({plain_pool.precompute_seconds / crt_pool.precompute_seconds:.2f}x faster)")
    print(f"  short exponent h^alpha ({short_crt._short.alpha_bits}-bit alpha, fixed-base tables)  "
          f"{short_pool.precompute_seconds:8.3f} s  ({plain_pool.precompute_seconds / short_pool.precompute_seconds:.1f}x)")
    print(f"  short exponent h^alpha, CRT (the channel's default)  {short_crt.precompute_seconds:8.3f} s  "
          f"({plain_pool.precompute_seconds / short_crt.precompute_seconds:.1f}x faster than plain r^n)")
    print(f"  online encode with the pool (critical path)         {t_online:8.3f} s  "
          f"({per_client / t_online:.0f}x faster than full encryption; target <= 1 s; "
          f"inline obfuscators {short_crt.inline}; decodes to the same sums: {same_online})")
    print(f"  a pure-Python loop on the main thread: {alone:.3f} s alone, {beside_pool:.3f} s "
          f"({beside_pool / alone:.2f}x) beside fill_async (GIL released), {beside_gil:.3f} s "
          f"({beside_gil / alone:.2f}x) beside a fill that holds the GIL")
    print(f"this process got {busy:.2f} CPU-seconds per second of wall time (1.00 = a core to itself; "
          f"lower = other processes competed and every wall time above is inflated)")


if __name__ == "__main__":
    main()
