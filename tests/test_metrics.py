"""Reconstruction metrics against values known in closed form."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsim.metrics import (
    PSNR_CAP,
    label_accuracy,
    label_multiset_accuracy,
    match_batch,
    mse,
    psnr,
    psnr_from_mse,
    score_reconstruction,
    score_records,
    ssim,
)


def _images(n=4, c=1, h=16, w=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand((n, c, h, w), generator=g)


def test_mse_and_psnr_known_values():
    a = torch.zeros(1, 8, 8)
    b = torch.full((1, 8, 8), 0.1)
    assert mse(a, b) == pytest.approx(0.01)
    assert psnr(a, b) == pytest.approx(20.0)  # 10 log10(1 / 0.01), data range 1
    assert psnr_from_mse(1e-4) == pytest.approx(40.0)
    assert psnr_from_mse(1.0) == pytest.approx(0.0)
    assert math.isinf(psnr(a, a))
    # batches give one value per image
    x = torch.stack([a, a]), torch.stack([b, a])
    np.testing.assert_allclose(mse(*x), [0.01, 0.0])


def test_psnr_of_a_constant_shift():
    x = _images(1, h=12, w=12)[0] * 0.5  # values in [0, 0.5]; +0.25 stays inside [0, 1]
    assert psnr(x, x + 0.25) == pytest.approx(10 * math.log10(1 / 0.0625), rel=1e-6)


def test_ssim_identity_shift_and_channels():
    x = _images(2, c=1, h=20, w=20)
    assert ssim(x[0], x[0]) == pytest.approx(1.0)
    # a brightness shift keeps the structure but lowers SSIM below 1 (luminance term)
    shifted = (x[0] * 0.5 + 0.5)
    s = ssim(x[0] * 0.5, shifted)
    lum = (2 * 0.25 * 0.75 + 1e-4) / (0.25 ** 2 + 0.75 ** 2 + 1e-4)  # luminance term for means 0.25/0.75
    assert s < 1.0 and s == pytest.approx(lum, abs=0.08)
    # unrelated noise images are dissimilar
    assert abs(ssim(x[0], x[1])) < 0.2
    # colour: channel_axis handling equals the mean over channels of grey SSIMs
    c = _images(2, c=3, h=20, w=20, seed=1)
    per_channel = np.mean([ssim(c[0, k:k + 1], c[1, k:k + 1]) for k in range(3)])
    assert ssim(c[0], c[1]) == pytest.approx(per_channel, rel=1e-6)
    assert ssim(c[0], c[0]) == pytest.approx(1.0)


def test_label_accuracies():
    assert label_accuracy([1, 2, 3], [1, 2, 4]) == pytest.approx(2 / 3)
    assert label_multiset_accuracy([3, 1, 1], [1, 3, 2]) == pytest.approx(2 / 3)
    assert label_multiset_accuracy([1, 1, 1], [1, 2, 2]) == pytest.approx(1 / 3)


def test_match_batch_recovers_shuffle():
    truth = _images(6, h=14, w=14, seed=3)
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    recon = truth[perm] + 0.02 * _images(6, h=14, w=14, seed=4)
    got = match_batch(recon, truth)
    # recon[got[j]] matches truth[j]: got is the inverse of perm
    np.testing.assert_array_equal(perm[torch.as_tensor(got)].numpy(), np.arange(6))


def test_score_reconstruction_matches_and_thresholds():
    truth = _images(4, h=16, w=16, seed=5)
    labels = torch.tensor([3, 1, 4, 1])
    perm = torch.tensor([2, 3, 0, 1])
    recon = truth[perm].clone()
    recon[0] = _images(1, h=16, w=16, seed=9)[0]  # reconstruction of truth[2] is garbage
    sc = score_reconstruction(recon, labels[perm], truth, labels)
    assert sc["assignment"][0] == 2 and sc["assignment"][1] == 3 and sc["assignment"][3] == 1
    assert sc["label_acc"] == 1.0 and sc["success_label"] == 1.0
    assert sc["per_image"]["success"] == [True, True, False, True]
    assert sc["success_content"] == pytest.approx(0.75)
    assert sc["per_image"]["ssim"][0] == pytest.approx(1.0)
    assert math.isinf(sc["per_image"]["psnr"][0])
    # the mean PSNR uses the cap for exact images
    bad = psnr(recon[0], truth[2])
    assert sc["psnr"] == pytest.approx((3 * PSNR_CAP + bad) / 4)
    assert sc["mse"] == pytest.approx(float(mse(recon[0], truth[2])) / 4)
    # a PSNR threshold tightens the content test
    assert score_reconstruction(recon, labels[perm], truth, labels, psnr_threshold=200)["success_content"] == 0.75
    noisy = (recon + 0.01 * (2 * _images(4, h=16, w=16, seed=6) - 1)).clamp(0, 1)  # PSNR about 45 dB
    loose = score_reconstruction(noisy, labels[perm], truth, labels, ssim_threshold=None, psnr_threshold=40)
    strict = score_reconstruction(noisy, labels[perm], truth, labels, ssim_threshold=None, psnr_threshold=50)
    assert loose["success_content"] == 0.75 and strict["success_content"] == 0.0
    # wrong labels count against ASR_l
    sc2 = score_reconstruction(truth, torch.tensor([3, 1, 4, 7]), truth, labels)
    assert sc2["label_acc"] == pytest.approx(0.75)
    assert sc2["per_image"]["label_correct"] == [True, True, True, False]


def test_score_rejects_bad_input():
    x = _images(2)
    with pytest.raises(ValueError):
        score_reconstruction(x[:1], [0], x, [0, 1])
    with pytest.raises(ValueError):
        score_reconstruction(x, [0, 1], x, [0, 1], ssim_threshold=None, psnr_threshold=None)


def test_score_records_matches_thresholds_on_mse_and_has_no_image_measures():
    """Records (seed 001 Table 3): per-record MSE over the standardised features, ASR_c = MSE <= the
    threshold, labels as multisets; SSIM/PSNR are not defined (None)."""
    g = torch.Generator().manual_seed(3)
    truth = torch.randn((4, 30), generator=g)  # standardised features: negative values too
    labels = torch.tensor([0, 1, 1, 0])
    perm = torch.tensor([2, 3, 0, 1])
    recon = truth[perm].clone()
    recon[0] += math.sqrt(0.004)  # the reconstruction of truth[2]: MSE 0.004 on every feature
    recon[1] += math.sqrt(0.006)  # of truth[3]: MSE 0.006
    sc = score_records(recon, labels[perm], truth, labels)  # default threshold 0.005
    assert sc["assignment"] == [2, 3, 0, 1]
    assert sc["per_record"]["mse"] == pytest.approx([0.0, 0.0, 0.004, 0.006])
    assert sc["per_record"]["success"] == [True, True, True, False]
    assert sc["success_content"] == 0.75 and sc["mse"] == pytest.approx(0.010 / 4)
    assert sc["psnr"] is None and sc["ssim"] is None
    assert sc["label_acc"] == 1.0 == sc["success_label"]
    assert score_records(recon, labels[perm], truth, labels, mse_threshold=0.01)["success_content"] == 1.0
    assert score_records(recon, labels[perm], truth, labels, mse_threshold=1e-3)["success_content"] == 0.5
    wrong = score_records(truth, torch.tensor([1, 1, 1, 0]), truth, labels)
    assert wrong["label_acc"] == 0.75 and wrong["per_record"]["label_correct"] == [False, True, True, True]
    assert score_records(truth[0], [0], truth[0], [0])["mse"] == 0.0  # one record (F,)
    with pytest.raises(ValueError, match="features"):
        score_records(truth[:, :29], labels, truth, labels)
    with pytest.raises(ValueError, match="records shaped"):
        score_records(_images(4), labels, truth, labels)
    with pytest.raises(ValueError, match="mse_threshold"):
        score_records(truth, labels, truth, labels, mse_threshold=0)
