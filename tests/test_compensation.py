"""Seed 000's global update compensation (random-matrix theory, §V)."""
from __future__ import annotations

import numpy as np
import pytest

from fedsim.compensation import (
    GlobalUpdateCompensation,
    aggregate_noise_variance,
    compensate,
    compensate_with_info,
    matrix_shape,
    mp_bounds,
)


def _low_rank_plus_noise(Q: float, seed: int, w: int = 80, rank: int = 3, noise_var: float = 0.04):
    rng = np.random.default_rng(seed)
    v = int(Q * w)
    Z = rng.normal(size=(v, rank)) @ rng.normal(size=(rank, w)) * 0.3
    C = Z + rng.normal(scale=np.sqrt(noise_var), size=Z.shape)
    return Z.reshape(-1), C.reshape(-1), noise_var


@pytest.mark.parametrize("mode", ["band", "threshold"])
@pytest.mark.parametrize("Q", [2.0, 6.0, 12.0])
def test_compensation_recovers_low_rank_signal(Q, mode):
    # measured error ratios ||C - Z|| / ||Z* - Z|| for seeds 0..4: Q=2 ~4.2, Q=6 ~4.7, Q=12 ~4.9
    # (ideal sqrt(w / rank) = 5.2); the noise has ~40% of the signal's norm
    for seed in range(3):
        Z, C, nv = _low_rank_plus_noise(Q, seed)
        out, info = compensate_with_info(C, nv, Q, mode)
        assert out.shape == C.shape and out.dtype == C.dtype
        assert info["kept"] == 3  # exactly the signal directions
        ratio = np.linalg.norm(C - Z) / np.linalg.norm(out - Z)
        assert ratio >= 3.5, ratio


def test_zero_or_negligible_noise_leaves_update_unchanged():
    rng = np.random.default_rng(0)
    x = rng.normal(size=5000).astype(np.float32)  # full rank once reshaped
    np.testing.assert_array_equal(compensate(x, 0.0), x)
    out = compensate(x, 1e-10)
    np.testing.assert_allclose(out, x, rtol=1e-5, atol=1e-6)
    # a low-rank signal with a negligible declared variance: its (near-)null directions lie inside
    # the tiny band and are removed, which changes nothing
    Z, _, _ = _low_rank_plus_noise(6.0, 1)
    np.testing.assert_allclose(compensate(Z, 1e-12, 6.0), Z, atol=1e-9)


def test_pure_noise_eigenvalues_follow_marchenko_pastur():
    rng = np.random.default_rng(1)
    v, w, var = 1200, 200, 0.5
    R = rng.normal(scale=np.sqrt(var), size=(v, w))
    lam = np.linalg.eigvalsh(R.T @ R / v)
    lo, hi = mp_bounds(var, v / w)
    assert lo == pytest.approx(var * (1 - np.sqrt(w / v)) ** 2)
    assert lam.min() > 0.9 * lo and lam.max() < 1.1 * hi
    assert lam.min() < 1.2 * lo and lam.max() > 0.9 * hi  # the band is tight, not just a bound
    out, info = compensate_with_info(R.reshape(-1), var, v / w)
    assert info["kept"] <= 4  # a few edge eigenvalues at most
    assert np.linalg.norm(out) < 0.2 * np.linalg.norm(R)


def test_padding_and_shapes():
    assert matrix_shape(13426, 6.0) == (286, 47)
    v, w = matrix_shape(1001, 6.0)
    assert v * w >= 1001 and abs(v / w - 6) < 1
    rng = np.random.default_rng(2)
    x = rng.normal(size=(7, 11, 13))  # 1001 entries, not a multiple of w
    out = compensate(x, 0.5)
    assert out.shape == x.shape
    with pytest.raises(ValueError):
        compensate(x, 0.5, Q=0.5)
    with pytest.raises(ValueError):
        compensate(x, 0.5, mode="nope")


def test_aggregate_noise_variance():
    assert aggregate_noise_variance([1] * 10, [0.2] * 10) == pytest.approx(0.02)
    assert aggregate_noise_variance([30, 10], [1.0, 2.0]) == pytest.approx(0.75 ** 2 + 0.25 ** 2 * 2)
    assert aggregate_noise_variance([0.5, 0.5], [0.0, 0.0]) == 0.0
    # empirically: the variance of the example-weighted mean of independent noises
    rng = np.random.default_rng(3)
    w, s = np.array([5.0, 1.0, 2.0]), np.array([0.1, 0.4, 0.2])
    noise = rng.normal(size=(3, 200000)) * np.sqrt(s)[:, None]
    agg = (w[:, None] * noise).sum(0) / w.sum()
    assert agg.var() == pytest.approx(aggregate_noise_variance(w, s), rel=0.02)
    with pytest.raises(ValueError):
        aggregate_noise_variance([1, 2], [0.1])


def test_global_update_compensation_on_state_dict_lists():
    Z, C, nv = _low_rank_plus_noise(6.0, 4)
    n = C.size
    names = ["conv.weight", "conv.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
             "fc.weight"]
    # parameters: C split into three pieces; buffers in between
    pieces = [C[:4000].reshape(40, 100), C[4000:4100], C[4100:]]
    buffers = [np.full(7, 3.0, dtype=np.float32), np.full(7, 2.0, dtype=np.float32), np.array(5, dtype=np.int64)]
    arrays = [pieces[0].astype(np.float32), pieces[1].astype(np.float32), *buffers, pieces[2].astype(np.float32)]
    comp = GlobalUpdateCompensation(Q=6.0)
    out = comp.apply(arrays, nv, names=names)
    assert [a.shape for a in out] == [a.shape for a in arrays]
    assert [a.dtype for a in out] == [a.dtype for a in arrays]
    for i in (2, 3, 4):  # BatchNorm buffers and integer arrays pass through
        np.testing.assert_array_equal(out[i], arrays[i])
    flat = np.concatenate([out[0].reshape(-1), out[1], out[5]]).astype(np.float64)
    assert flat.size == n
    np.testing.assert_allclose(flat, compensate(C.astype(np.float32), nv, 6.0), rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(C - Z) / np.linalg.norm(flat - Z) >= 3.5
    assert comp.metrics()["compensation.kept"] == 3
    # without names every floating array (buffers included) is compensated as one flat vector in list
    # order, ints pass through: recomputed here from the concatenation of the floating arrays
    out2 = comp.apply(arrays, nv)
    np.testing.assert_array_equal(out2[4], arrays[4])
    floating = [0, 1, 2, 3, 5]
    flat_all = np.concatenate([arrays[i].reshape(-1).astype(np.float64) for i in floating])
    expected = compensate(flat_all, nv, 6.0)
    offset = 0
    for i in floating:
        size = arrays[i].size
        np.testing.assert_allclose(out2[i].reshape(-1), expected[offset:offset + size], rtol=1e-5, atol=1e-5)
        offset += size
    for i in (2, 3):  # the buffers really were compensated (the constant 3.0 / 2.0 vectors moved)
        assert np.abs(out2[i] - arrays[i]).max() > 1e-3, i


def test_paper_noise_variance_formula():
    """seed 000 §V-C: m * (d/s) * sum_i eps_i sigma^2 with the declared v_i = (d/s) sigma_i^2."""
    from fedsim.compensation import VARIANCE_RULES, paper_noise_variance

    assert paper_noise_variance([1] * 10, [0.2] * 10) == pytest.approx(10 * 0.2)
    assert paper_noise_variance([30, 10], [1.0, 2.0]) == pytest.approx(2 * (0.75 * 1.0 + 0.25 * 2.0))
    # equal clients: m^2 times the weighted-mean variance
    assert paper_noise_variance([1] * 5, [0.3] * 5) == pytest.approx(25 * aggregate_noise_variance([1] * 5, [0.3] * 5))
    assert set(VARIANCE_RULES) == {"weighted-mean", "paper"}
    with pytest.raises(ValueError):
        paper_noise_variance([1, 2], [0.1])
