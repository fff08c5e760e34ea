"""Reconstruction metrics (the only code that sees ground truth): images (:mod:`fedsim.metrics.image`)
and records, i.e. tabular data (:mod:`fedsim.metrics.records`)."""
from .image import (
    PSNR_CAP,
    label_accuracy,
    label_multiset_accuracy,
    match_batch,
    mse,
    psnr,
    psnr_from_mse,
    score_many,
    score_reconstruction,
    ssim,
)
from .records import MSE_THRESHOLD, match_records, score_records

__all__ = ["MSE_THRESHOLD", "PSNR_CAP", "label_accuracy", "label_multiset_accuracy", "match_batch", "match_records",
           "mse", "psnr", "psnr_from_mse", "score_many", "score_reconstruction", "score_records", "ssim"]
