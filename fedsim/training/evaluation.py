"""A model's loss and accuracy on a split."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device | str = "cpu",
             batch_size: int = 1000) -> tuple[float, float]:
    """(loss, accuracy) of the model on (x, y)."""
    device = torch.device(device)
    model.to(device).eval()
    total_loss, correct = 0.0, 0
    for k in range(0, len(y), batch_size):
        xb, yb = x[k:k + batch_size].to(device), y[k:k + batch_size].to(device)
        out = model(xb)
        total_loss += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    n = max(len(y), 1)
    return total_loss / n, correct / n


@torch.no_grad()
def source_accuracies(model: nn.Module, ds: Any, device: torch.device | str = "cpu") -> list[float]:
    """The model's accuracy on each source's share of the test set (``ds.test_sources``, in the order of
    ``ds.source_names``); empty for a dataset without test sources."""
    if ds.test_sources is None or not ds.source_names:
        return []
    out = []
    for s in range(len(ds.source_names)):
        idx = torch.nonzero(ds.test_sources == s).flatten()
        out.append(evaluate(model, ds.x_test[idx], ds.y_test[idx], device)[1] if len(idx) else float("nan"))
    return out
