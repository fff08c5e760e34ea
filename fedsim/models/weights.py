"""A model's state as NumPy arrays (state-dict order), and back."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """All parameters and buffers (state_dict order) as NumPy arrays."""
    return [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]


def set_weights(model: nn.Module, weights: Sequence[np.ndarray]) -> None:
    """Copy ``weights`` (state_dict order) into the model's parameters and buffers in place (what
    ``load_state_dict`` does for fedsim's models, without its per-key bookkeeping: this runs for every
    client message)."""
    sd = model.state_dict()
    if len(weights) != len(sd):
        raise ValueError(f"expected {len(sd)} arrays for this model, got {len(weights)}")
    with torch.no_grad():
        for v, w in zip(sd.values(), weights):
            v.copy_(torch.as_tensor(np.asarray(w)).reshape(v.shape))


def param_names(model: nn.Module) -> list[str]:
    return list(model.state_dict().keys())
