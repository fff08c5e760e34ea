"""The client half of seed 002's lossless perturbation (``lossless-client``; the server transform
``lossless-perturbation`` makes every client run it first - it is not configured by hand).

Per round (FedSGD: one gradient at the received model):

* ``adapt_model``: loads the perturbed model ``W^`` in float64 from the server's ``EXTRAS`` record
  (``fedsim.protocol.LOSSLESS_MODEL``; the ``ARRAYS`` copy is in the model's dtype, too coarse for the
  recovery's cancellations), casts the model to float64 (inputs are cast by a forward pre-hook) and
  reads the public noise (``r^(a)``, the output partition);
* ``compute_gradient``: :func:`fedsim.lossless.client_terms` on the batch - the perturbed gradient (used
  for the local step, so the reply's model is ``W^ - lr grad^``) and the noise terms ``sigma~_s``,
  ``beta`` (MSE; cross-entropy under the shift noise needs none);
* ``reply_extras``: the terms in float64, :meth:`fedsim.lossless.ClientTerms.to_arrays` flattened and
  concatenated into one array (``fedsim.protocol.LOSSLESS_TERMS``; one array instead of ``(m + 2) P``
  keeps Flower's per-array serialisation cost down).

The loss is the client's configured ``train.loss`` (the loss function local training hands over).
The client's own training metrics (loss, accuracy) are computed on ``W^``: with the paper's noise they
say nothing about the true model.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedsim import lossless as ll
from fedsim.defense import Defense, DefenseContext, LossFn, register
from fedsim.protocol import LOSSLESS_GROUPS, LOSSLESS_MODEL, LOSSLESS_R_A, LOSSLESS_TERMS
from fedsim.training.loss import mse_onehot


def _float64_inputs(module: nn.Module, args: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def loss_of(loss_fn: LossFn) -> str:
    """:mod:`fedsim.lossless`'s name of the loss local training uses."""
    if loss_fn is mse_onehot:
        return "mse"
    if loss_fn is F.cross_entropy:
        return "cross_entropy"
    raise ValueError(f"lossless-client: unsupported loss function {getattr(loss_fn, '__name__', loss_fn)!r}; "
                     "train.loss must be 'mse' or 'cross-entropy'")


@register
class LosslessClient(Defense):
    """Trains on the perturbed model in float64 and returns the perturbed gradient with its noise terms."""

    name = "lossless-client"

    def __init__(self) -> None:
        self._spec: ll.FCSpec | None = None
        self._public: ll.PublicNoise | None = None
        self._terms: ll.ClientTerms | None = None
        self._metrics: dict[str, float] = {}

    def adapt_model(self, model: nn.Module, ctx: DefenseContext) -> nn.Module:
        needed = [f"{LOSSLESS_MODEL}{n}" for n in ctx.param_names] + [LOSSLESS_R_A, LOSSLESS_GROUPS]
        missing = [k for k in needed if k not in ctx.incoming]
        if missing:
            raise ValueError(f"lossless-client: the server's message lacks {missing[:3]} (is the "
                             "lossless-perturbation transform configured on the server?)")
        self._spec = ll.fc_spec(model)
        state = {n: torch.from_numpy(np.array(ctx.incoming[f"{LOSSLESS_MODEL}{n}"], dtype=np.float64))
                 for n in ctx.param_names}
        model = model.double()
        model.load_state_dict(state, strict=True)
        model.register_forward_pre_hook(_float64_inputs)
        self._public = ll.PublicNoise.from_arrays([ctx.incoming[LOSSLESS_R_A], ctx.incoming[LOSSLESS_GROUPS]])
        self._terms = None
        return model

    def compute_gradient(self, model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                         ctx: DefenseContext) -> list[torch.Tensor]:
        if self._spec is None or self._public is None:
            raise ValueError("lossless-client: compute_gradient before the perturbed model was loaded")
        if self._terms is not None:
            raise ValueError("lossless-client: a second local step in one round; the recovery is exact only for "
                             "FedSGD (train.local_steps = 1)")
        loss = loss_of(loss_fn)
        layers = ll.get_layers(model, self._spec, dtype=torch.float64)
        n_out = self._spec.shapes[-1][0]
        target = F.one_hot(y.long(), n_out).double() if loss == "mse" else y
        self._terms = ll.client_terms(layers, self._public, x, target, loss=loss,
                                      negative_slope=self._spec.negative_slope)
        by_name: dict[str, torch.Tensor] = {}
        for (wn, bn), (gw, gb) in zip(self._spec.names, self._terms.grads):
            by_name[wn] = gw
            if bn is not None:
                by_name[bn] = gb
        t = self._terms
        n_arrays = sum(w.numel() + (b.numel() if b is not None else 0) for block in [t.grads, *t.sigma, t.beta]
                       for w, b in block)
        self._metrics = {"groups": float(len(t.sigma) or 1), "terms_mb": n_arrays * 8 / 1e6}
        return [by_name[n] for n, p in model.named_parameters() if p.requires_grad]

    def reply_extras(self, ctx: DefenseContext) -> dict[str, np.ndarray]:
        if self._terms is None:
            raise ValueError("lossless-client: no gradient was computed this round")
        return {LOSSLESS_TERMS: np.concatenate([a.ravel() for a in self._terms.to_arrays()])}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)
