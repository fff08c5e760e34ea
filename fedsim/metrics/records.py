"""Reconstruction metrics for records (tabular data, seed 001 Table 3): per-record MSE, content and
label success.

A record is a feature vector ``(F,)``; a batch is ``(B, F)``. The datasets standardise every feature
(training mean 0, standard deviation 1; ``breast-cancer``), so the MSE of a reconstruction over its
features is in units of the features' variance: 1 is roughly what the mean record scores, and
``1 - MSE`` is the share of the record's variance the reconstruction explains. SSIM and PSNR are image
measures (a structure window over neighbouring pixels, a peak value of 1) and are not defined here.

Content success (ASR_c) for records is ``MSE <= mse_threshold``. Seed 001 scores images by an SSIM
threshold and does not say how it scores records; the analogue here is a bound on the error in the
features' own units. The default, :data:`MSE_THRESHOLD` = 0.005, means that the reconstruction
explains >= 99.5% of the record's variance (an RMS error of at most 0.071 standard deviations per
feature) and, on breast-cancer, that it is closer to its record than to any other: the closest two
distinct training records are at MSE 0.033 (RMS 0.181; median nearest neighbour 0.15), and a
reconstruction within RMS 0.071 < 0.181 / 2 of its record is nearer to it than to any other record
(triangle inequality), so a success identifies the record.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .image import _batched, _np, label_multiset_accuracy

MSE_THRESHOLD = 0.005  # content success on standardised records (module docstring)


def _records(a: Any) -> np.ndarray:
    return _batched(a, "records", "F,")


def match_records(recon: Any, truth: Any) -> np.ndarray:
    """Optimal assignment of reconstructions to true records on the pairwise MSE (as
    :func:`fedsim.metrics.match_batch` for images): ``recon[perm[j]]`` is matched to ``truth[j]``."""
    r, t = _records(recon), _records(truth)
    if r.shape[1] != t.shape[1]:
        raise ValueError(f"reconstructions have {r.shape[1]} features, the records {t.shape[1]}")
    if len(r) < len(t):
        raise ValueError(f"{len(r)} reconstructions cannot cover {len(t)} true records")
    from scipy.optimize import linear_sum_assignment  # here: the import costs a second at start-up

    cost = ((r[:, None, :] - t[None, :, :]) ** 2).mean(axis=2)
    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(len(t), dtype=np.int64)
    perm[cols] = rows
    return perm


def score_records(recon_x: Any, recon_y: Any, true_x: Any, true_y: Any, *,
                  mse_threshold: float = MSE_THRESHOLD) -> dict[str, Any]:
    """Score one attacked batch of records against its ground truth.

    Reconstructions are matched to the true records by optimal assignment on the MSE. Returned keys
    (as :func:`fedsim.metrics.score_reconstruction`, with ``psnr``/``ssim`` None: not defined for
    records):

    * ``mse``: mean over the matched pairs of each record's MSE over its features;
    * ``success_content`` (ASR_c): share of true records whose match has ``MSE <= mse_threshold``;
    * ``label_acc`` / ``success_label`` (ASR_l): share of the true labels recovered (as multisets);
    * ``per_record``: ``mse``, ``label_correct``, ``success`` per true record; ``assignment``.
    """
    if isinstance(mse_threshold, bool) or not isinstance(mse_threshold, (int, float)) or not mse_threshold > 0:
        raise ValueError(f"mse_threshold must be a number > 0, got {mse_threshold!r}")
    rx, tx = _records(recon_x), _records(true_x)
    ry, ty = _np(recon_y).astype(np.int64).ravel(), _np(true_y).astype(np.int64).ravel()
    if len(ry) != len(rx) or len(ty) != len(tx):
        raise ValueError("one label per record is needed on both sides")
    perm = match_records(rx, tx)
    m = ((rx[perm] - tx) ** 2).mean(axis=1)
    ok = m <= mse_threshold
    lacc = label_multiset_accuracy(ry, ty)
    return {
        "mse": float(m.mean()),
        "psnr": None,
        "ssim": None,
        "label_acc": lacc,
        "success_content": float(ok.mean()),
        "success_label": lacc,
        "per_record": {"mse": m.tolist(), "label_correct": (ry[perm] == ty).tolist(), "success": ok.tolist()},
        "assignment": perm.tolist(),
        "thresholds": {"mse": float(mse_threshold)},
    }
