"""A model's loss and accuracy on a split."""
from __future__ import annotations

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
