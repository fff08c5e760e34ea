"""Reconstruction metrics: MSE, PSNR, SSIM, label accuracy, batch assignment, attack success rates.

Images are tensors or arrays shaped (C, H, W) (one image) or (B, C, H, W) (a batch) with values in
the data range [0, 1]; every metric uses a data range of 1.0. This is the only code in fedsim that
compares a reconstruction with the ground truth.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

import numpy as np
import torch

PSNR_CAP = 100.0  # dB: what an exact reconstruction (MSE 0, PSNR inf) counts as in means


def _np(a: Any) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    return np.asarray(a, dtype=np.float64)


def _batched(a: Any, what: str, item_dims: str) -> np.ndarray:
    """``a`` as float64 with a leading batch axis: one item shaped ``(item_dims)`` gets one, a batch
    ``(B, item_dims)`` is kept, anything else is refused naming both shapes."""
    a = _np(a)
    n = len([d for d in item_dims.split(",") if d.strip()])
    if a.ndim == n:
        a = a[None]
    if a.ndim != n + 1:
        raise ValueError(f"expected {what} shaped ({item_dims}) or "
                         f"(B, {item_dims.rstrip(',')}), got {a.shape}")
    return a


def _batch(a: Any) -> np.ndarray:
    return _batched(a, "images", "C, H, W")


def mse(a: Any, b: Any) -> np.ndarray | float:
    """Mean squared error per image (a float for one (C, H, W) image, an array for a batch)."""
    single = _np(a).ndim == 3
    a, b = _batch(a), _batch(b)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {b.shape}")
    out = ((a - b) ** 2).reshape(len(a), -1).mean(axis=1)
    return float(out[0]) if single else out


def psnr_from_mse(m: float | np.ndarray, data_range: float = 1.0) -> float | np.ndarray:
    """``10 log10(data_range^2 / mse)`` in dB; ``inf`` where the MSE is 0 (identical images)."""
    m = np.asarray(m, dtype=np.float64)
    with np.errstate(divide="ignore"):
        out = np.where(m > 0, 10.0 * np.log10(data_range ** 2 / np.where(m > 0, m, 1.0)), np.inf)
    return float(out) if out.ndim == 0 else out


def psnr(a: Any, b: Any) -> float | np.ndarray:
    """Peak signal-to-noise ratio in dB with data range 1.0 (images in [0, 1]).

    Identical images give ``inf``; :func:`score_reconstruction` caps it at :data:`PSNR_CAP` (100 dB,
    an MSE of 1e-10) before averaging so that one exact image does not make the mean infinite.
    """
    return psnr_from_mse(mse(a, b))


def _ssim_one(a: np.ndarray, b: np.ndarray) -> float:
    from skimage.metrics import structural_similarity  # here: it imports scipy.ndimage, a second at start-up

    c, h, w = a.shape
    win = min(7, h, w)
    win -= 1 - win % 2  # odd, at most 7 (scikit-image's default window), at most the image side
    if win < 3:
        raise ValueError(f"SSIM needs images of at least 3x3 pixels, got {h}x{w}")
    if c == 1:
        return float(structural_similarity(a[0], b[0], data_range=1.0, win_size=win))
    return float(structural_similarity(np.moveaxis(a, 0, -1), np.moveaxis(b, 0, -1), data_range=1.0,
                                       channel_axis=-1, win_size=win))


def ssim(a: Any, b: Any) -> float | np.ndarray:
    """Structural similarity (scikit-image ``structural_similarity``, data_range=1.0, 7x7 uniform window).

    Grey images (C=1) are compared as 2-D arrays; colour images (C>1) with ``channel_axis`` (the mean
    of per-channel SSIMs). A float for one (C, H, W) image, an array for a batch.
    """
    single = _np(a).ndim == 3
    a, b = _batch(a), _batch(b)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {b.shape}")
    out = np.array([_ssim_one(x, y) for x, y in zip(a, b)])
    return float(out[0]) if single else out


def label_accuracy(pred: Any, true: Any) -> float:
    """Fraction of positions where the labels agree."""
    p, t = _np(pred).astype(np.int64).ravel(), _np(true).astype(np.int64).ravel()
    if p.shape != t.shape:
        raise ValueError(f"label counts differ: {p.shape} vs {t.shape}")
    return float((p == t).mean()) if len(t) else float("nan")


def label_multiset_accuracy(pred: Any, true: Any) -> float:
    """Fraction of the true labels recovered, order ignored: ``|pred ∩ true| / |true|`` as multisets."""
    p = Counter(_np(pred).astype(np.int64).ravel().tolist())
    t = Counter(_np(true).astype(np.int64).ravel().tolist())
    n = sum(t.values())
    return sum((p & t).values()) / n if n else float("nan")


def match_batch(recon: Any, truth: Any) -> np.ndarray:
    """Optimal assignment of reconstructions to true images (seed 003, section 3.3.2.2).

    Solves the assignment problem on the pairwise MSE matrix with
    ``scipy.optimize.linear_sum_assignment``. Returns ``perm`` (int64, one entry per true image) with
    ``recon[perm[j]]`` the reconstruction matched to ``truth[j]``; there must be at least as many
    reconstructions as true images.
    """
    r = _batch(recon).reshape(len(_batch(recon)), -1)
    t = _batch(truth).reshape(len(_batch(truth)), -1)
    if r.shape[1] != t.shape[1]:
        raise ValueError("reconstructions and true images differ in shape")
    if len(r) < len(t):
        raise ValueError(f"{len(r)} reconstructions cannot cover {len(t)} true images")
    from scipy.optimize import linear_sum_assignment  # here: the import costs a second at start-up

    cost = ((r[:, None, :] - t[None, :, :]) ** 2).mean(axis=2)  # (n_recon, n_true)
    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(len(t), dtype=np.int64)
    perm[cols] = rows
    return perm


def score_reconstruction(recon_x: Any, recon_y: Any, true_x: Any, true_y: Any, *,
                         psnr_threshold: float | None = None, ssim_threshold: float | None = 0.5,
                         psnr_cap: float = PSNR_CAP) -> dict[str, Any]:
    """Score one attacked batch against its ground truth.

    Reconstructions are first matched to the true images with :func:`match_batch` (order is
    meaningless for a batch gradient). Returned keys:

    * ``mse``, ``psnr``, ``ssim``: means over the matched pairs (per-image PSNR capped at
      ``psnr_cap`` dB, so an exact reconstruction counts as 100 dB rather than inf);
    * ``label_acc``: fraction of the true labels recovered, compared as multisets (order-free);
    * ``success_content`` (ASR_c): fraction of true images whose match passes the content test,
      ``SSIM >= ssim_threshold`` (default 0.5) and, when ``psnr_threshold`` is set (default None, not
      used), ``PSNR >= psnr_threshold``;
    * ``success_label`` (ASR_l): same as ``label_acc`` (each recovered true label is one success);
    * ``per_image``: lists ``mse``, ``psnr`` (uncapped), ``ssim``, ``label_correct`` (label of the
      matched reconstruction equals the true label), ``success`` - one entry per true image;
    * ``assignment``: the permutation from :func:`match_batch`.

    Unlike seed 001, which averages MSE/SSIM over successful reconstructions only, the means here are
    over every matched pair; filter ``per_image`` for the other convention.
    """
    if ssim_threshold is None and psnr_threshold is None:
        raise ValueError("set at least one of ssim_threshold and psnr_threshold")
    rx, tx = _batch(recon_x), _batch(true_x)
    ry, ty = _np(recon_y).astype(np.int64).ravel(), _np(true_y).astype(np.int64).ravel()
    if len(ry) != len(rx) or len(ty) != len(tx):
        raise ValueError("one label per image is needed on both sides")
    perm = match_batch(rx, tx)
    mx, my = rx[perm], ry[perm]
    m = ((mx - tx) ** 2).reshape(len(tx), -1).mean(axis=1)
    p = np.atleast_1d(psnr_from_mse(m))
    s = np.array([_ssim_one(a, b) for a, b in zip(mx, tx)])
    ok = np.ones(len(tx), dtype=bool)
    if ssim_threshold is not None:
        ok &= s >= ssim_threshold
    if psnr_threshold is not None:
        ok &= p >= psnr_threshold
    lacc = label_multiset_accuracy(ry, ty)
    return {
        "mse": float(m.mean()),
        "psnr": float(np.minimum(p, psnr_cap).mean()),
        "ssim": float(s.mean()),
        "label_acc": lacc,
        "success_content": float(ok.mean()),
        "success_label": lacc,
        "per_image": {
            "mse": m.tolist(),
            "psnr": [float(v) if math.isfinite(v) else float("inf") for v in p],
            "ssim": s.tolist(),
            "label_correct": (my == ty).tolist(),
            "success": ok.tolist(),
        },
        "assignment": perm.tolist(),
        "thresholds": {"ssim": ssim_threshold, "psnr": psnr_threshold, "psnr_cap": psnr_cap},
    }


def score_many(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Means of the scalar scores of several batches, weighted by the batch sizes."""
    if not results:
        return {}
    n = np.array([len(r["per_image"]["mse"]) for r in results], dtype=np.float64)
    keys = ("mse", "psnr", "ssim", "label_acc", "success_content", "success_label")
    return {k: float((np.array([r[k] for r in results]) * n).sum() / n.sum()) for k in keys}
