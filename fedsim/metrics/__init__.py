"""Reconstruction metrics (the only code that sees ground truth); see :mod:`fedsim.metrics.image`."""
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

__all__ = ["PSNR_CAP", "label_accuracy", "label_multiset_accuracy", "match_batch", "mse", "psnr",
           "psnr_from_mse", "score_many", "score_reconstruction", "ssim"]
