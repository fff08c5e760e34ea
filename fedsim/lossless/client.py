"""The client's side (seed 002 §4.2): ordinary training on the perturbed model plus the noise terms."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch.nn import functional as F

from fedsim.lossless.network import (
    LOSSES,
    Layer,
    compute_alpha,
    flat,
    forward,
    layer_grads,
    loss_targets,
    unflat,
)
from fedsim.lossless.noise import PublicNoise


# -------------------------------------------------------------------------------------- client side
@dataclass
class ClientTerms:
    """What a client returns (all batch means over its examples):

    * ``grads[l]`` = ``nabla F(W^(l), D_k)``, the perturbed gradient (weight, bias);
    * ``sigma[s][l]`` = ``sigma~_{k,s}^(l)``, ``s = 0..m-1`` (empty for cross-entropy);
    * ``beta[l]`` = ``beta_k^(l)`` (identically zero for the last layer; empty for cross-entropy).
    """

    grads: list[Layer]
    sigma: list[list[Layer]]
    beta: list[Layer]
    loss: str
    num_examples: int

    def to_arrays(self) -> list[np.ndarray]:
        """Flat list: grads, then sigma group 0..m-1, then beta, each as W1, b1, W2, b2, ... (no None)."""
        out: list[np.ndarray] = []
        for block in [self.grads, *self.sigma, *([self.beta] if self.beta else [])]:
            out.extend(t.detach().cpu().numpy().copy() for t in flat(block))
        return out

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray], like: Sequence[Layer], num_groups: int, loss: str,
                    num_examples: int) -> ClientTerms:
        """Inverse of :meth:`to_arrays`; ``like`` gives the layer structure (e.g. the model's layers)."""
        if loss not in LOSSES:
            raise ValueError(f"lossless.loss must be one of {list(LOSSES)}, got {loss!r}")
        per = len(flat(like))
        blocks = 1 + (num_groups + 1 if loss == "mse" else 0)
        if len(arrays) != per * blocks:
            raise ValueError(f"expected {per * blocks} arrays ({blocks} blocks of {per}), got {len(arrays)}")
        ts = [torch.as_tensor(np.asarray(a)) for a in arrays]
        parts = [unflat(ts[i * per:(i + 1) * per], like) for i in range(blocks)]
        if loss == "mse":
            return cls(parts[0], parts[1:1 + num_groups], parts[-1], loss, int(num_examples))
        return cls(parts[0], [], [], loss, int(num_examples))


def client_terms(perturbed: Sequence[Layer], public: PublicNoise, x: torch.Tensor, target: torch.Tensor, *,
                 loss: str = "mse", negative_slope: float = 0.0) -> ClientTerms:
    """A client's reply (§4.2): ordinary forward/backward on the perturbed model plus the noise terms.

    ``loss="mse"``: ``1/2 ||y^ - t||^2`` per example (eq. 13), ``target`` float ``(B, n_L)``; returns the
    mean perturbed gradient, ``m`` terms ``sigma~_s`` and ``beta`` (``m + 2`` backward passes).
    ``loss="cross_entropy"``: mean softmax cross-entropy, ``target`` int64 labels ``(B,)`` or probability
    rows; only exact for shift-invariant noise (``public.shift_invariant``), otherwise ``ValueError``.
    Computed in the dtype of ``perturbed`` (use float64).
    """
    if loss not in LOSSES:
        raise ValueError(f"lossless.loss must be one of {list(LOSSES)}, got {loss!r}")
    if loss == "cross_entropy" and not public.shift_invariant:
        raise ValueError(
            "lossless.loss='cross_entropy' cannot be recovered exactly with the paper's additive noise "
            "(r^(a) with distinct components or m > 1): the client's logit gradient softmax(y + alpha r) - t is "
            "a transcendental function of the secret r, so the true aggregate is not a fixed combination of "
            "batch aggregates. Use loss='mse' (the paper's derivation) or draw_secrets(..., mode='shift') "
            "(exact, but the predicted probabilities are then visible to clients)")
    L = len(perturbed)
    n_out = int(perturbed[-1][0].shape[0])
    if n_out != int(public.r_a.numel()):
        raise ValueError(f"public noise is for {public.r_a.numel()} outputs, the model has {n_out}")
    if len(x) == 0:
        raise ValueError("client_terms needs at least one example")
    dt, dev = perturbed[0][0].dtype, perturbed[0][0].device
    params_layers = [(w.detach().clone().requires_grad_(True),
                      b.detach().clone().requires_grad_(True) if b is not None else None) for w, b in perturbed]
    params = flat(params_layers)
    xf = x.reshape(len(x), -1).to(dev, dt)
    t = loss_targets(loss, target, n_out, len(x), dt, dev)
    out, hidden = forward(params_layers, xf, negative_slope=negative_slope)
    if loss == "cross_entropy":
        grads = layer_grads(F.cross_entropy(out, t), params, perturbed)
        return ClientTerms(grads, [], [], loss, len(x))
    diff = out - t
    grads = layer_grads(0.5 * (diff * diff).sum(1).mean(), params, perturbed)
    alpha = compute_alpha(params_layers, xf, hidden)
    a0 = alpha.detach()
    r_a, groups = public.r_a.to(dev, dt), public.groups.to(dev)
    sigma = []
    for s in range(public.num_groups):
        ra_s = torch.where(groups == s, r_a, torch.zeros_like(r_a))
        c_s = (diff.detach() * ra_s).sum(1)
        sigma.append(layer_grads((a0 * (out * ra_s).sum(1) + c_s * alpha).mean(), params, perturbed))
    if L > 1:
        beta = layer_grads(0.5 * (alpha * alpha).mean(), params, perturbed)
    else:  # alpha is a function of the input only
        beta = [(torch.zeros_like(w), torch.zeros_like(b) if b is not None else None) for w, b in perturbed]
    return ClientTerms(grads, sigma, beta, loss, len(x))
