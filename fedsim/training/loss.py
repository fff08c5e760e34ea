"""The training loss (``train.loss``)."""
from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

LOSSES = ("cross-entropy", "mse")


def mse_onehot(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Seed 002's eq. 13 on one-hot targets: ``1/2 ||y - onehot(t)||^2`` per example (summed over the
    classes), averaged over the batch - the loss ``fedsim.lossless`` derives its exact recovery for."""
    d = logits - F.one_hot(y, logits.shape[-1]).to(logits.dtype)
    return 0.5 * (d * d).sum(1).mean()


def loss_function(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``train.loss``: ``cross-entropy`` (default) or ``mse`` on one-hot targets (seed 002's derivation)."""
    if name == "cross-entropy":
        return F.cross_entropy
    if name == "mse":
        return mse_onehot
    raise ValueError(f"train.loss must be one of {list(LOSSES)}, got {name!r}")
