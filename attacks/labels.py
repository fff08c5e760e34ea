"""Label inference from the last fully connected layer's gradient.

With mean cross-entropy over a batch of ``B`` examples and logits ``z = W h + b``, the gradient of the
last layer is ``dL/dW_c = (1/B) sum_b (p_bc - y_bc) h_b`` and ``dL/db_c = (1/B) sum_b (p_bc - y_bc)``.

* Batch 1 (iDLG, Zhao et al. 2020): ``p_c - y_c`` is negative for the true class only and positive for
  every other, and each row of ``dL/dW`` is that number times the same feature vector ``h``. The row
  sums therefore share one sign except at the true class: with non-negative features (sigmoid, ReLU)
  the true class is the one negative row sum. :func:`infer_label_single` takes the row whose sign
  differs from the others, which is exact for any activation (when ``sum(h) != 0``). It stays exact
  for several local steps on one example, since every step's contribution has the same sign pattern.
* Batch > 1 (:func:`infer_labels_batch`): an LLG-style heuristic (Wainakh et al., "User-level label
  leakage from gradients in federated learning", PETS 2022). Let ``g_c`` be the bias gradient times
  ``B`` (or, without a bias, the weight row sums rescaled the same way), i.e. ``g_c ~ B pbar_c - n_c``
  where ``n_c`` counts class ``c`` in the batch. (1) Every class with ``g_c < 0`` is present: take it
  once (the ``B`` most negative if there are more). (2) Estimate the impact of one example as
  ``m = -(sum of the negative g_c) / B`` (about ``1 - pbar``). (3) Add ``m`` to each class taken and
  fill the remaining slots one at a time with the currently most negative ``g_c``, adding ``m`` after
  each pick, so that a class is repeated when its gradient is still strongly negative.
* Batch > 1 with a probe (:func:`infer_labels_counts`, the default of :func:`infer_labels` when the
  input shape is known): the count estimate of Geng et al. ("Towards general deep leakage in
  federated learning", 2021). The attacker runs the global model on ``probes`` random U(0, 1) inputs
  and takes their mean softmax ``phat`` as a stand-in for ``pbar``; then ``n_c ~ B phat_c - g_c``.
  The ``B`` labels are handed out one at a time to the class with the largest remaining estimate,
  which is decremented by 1. This recovers classes the model already predicts with high probability
  (their ``g_c`` is positive although they are present), which the sign rule misses; it needs a bias.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn


def last_linear(model: nn.Module) -> tuple[str, str | None]:
    """State-dict names of the weight (and bias, or None) of the model's last ``nn.Linear``."""
    last = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            last = (name, mod)
    if last is None:
        raise ValueError("label inference needs a model whose output layer is nn.Linear")
    name, mod = last
    prefix = f"{name}." if name else ""
    return prefix + "weight", (prefix + "bias") if mod.bias is not None else None


def infer_label_single(weight_grad: torch.Tensor) -> int:
    """iDLG: the class whose weight-gradient row sum has the sign the other rows do not have."""
    s = weight_grad.detach().double().sum(dim=1)
    neg = (s < 0).nonzero().flatten()
    pos = (s > 0).nonzero().flatten()
    if len(neg) == 1:
        return int(neg[0])
    if len(pos) == 1 and len(neg) == len(s) - 1:  # features summing to a negative number (e.g. tanh)
        return int(pos[0])
    return int(torch.argmin(s))  # degenerate: fall back to the most negative row


def infer_labels_batch(last_grads: Mapping[str, torch.Tensor], batch_size: int, weight_name: str,
                       bias_name: str | None) -> torch.Tensor:
    """``batch_size`` labels (int64, sorted) from the last layer's (pseudo-)gradient; see module doc."""
    B = int(batch_size)
    if bias_name is not None and bias_name in last_grads:
        g = last_grads[bias_name].detach().double() * B
    else:  # row sums of the weight gradient, rescaled so that the negative entries sum to about -B
        s = last_grads[weight_name].detach().double().sum(dim=1)
        neg_total = -s[s < 0].sum()
        g = s * (B / neg_total) if neg_total > 0 else s
    g = g.clone()
    neg = (g < 0).nonzero().flatten()
    order = neg[torch.argsort(g[neg])][:B]
    m = float(-g[g < 0].sum() / B) if len(neg) else 1.0
    labels = [int(c) for c in order]
    for c in labels:
        g[c] += m
    while len(labels) < B:
        c = int(torch.argmin(g))
        labels.append(c)
        g[c] += m
    return torch.tensor(sorted(labels), dtype=torch.int64)


def infer_labels_counts(bias_grad: torch.Tensor, batch_size: int, mean_probs: torch.Tensor) -> torch.Tensor:
    """``batch_size`` labels (int64, sorted) from ``n_c ~ B phat_c - B dL/db_c``; see module doc."""
    B = int(batch_size)
    est = (B * mean_probs.detach().double().cpu() - B * bias_grad.detach().double().cpu()).clone()
    labels = []
    for _ in range(B):
        c = int(torch.argmax(est))
        labels.append(c)
        est[c] -= 1.0
    return torch.tensor(sorted(labels), dtype=torch.int64)


@torch.no_grad()
def probe_probs(model: nn.Module, input_shape: Sequence[int], gen: torch.Generator, probes: int = 64,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Mean softmax of the model on ``probes`` random U(0, 1) inputs (drawn on the CPU from ``gen``)."""
    x = torch.rand((probes, *input_shape), generator=gen).to(device)
    return torch.softmax(model(x).double(), dim=-1).mean(0)


def infer_labels(model: nn.Module, grads: Mapping[str, torch.Tensor], batch_size: int, *,
                 input_shape: Sequence[int] | None = None, gen: torch.Generator | None = None,
                 probes: int = 64) -> torch.Tensor:
    """Labels of a batch from a (pseudo-)gradient dict keyed by parameter name.

    Batch 1 uses iDLG's row-sum rule on the weight gradient (exact for cross-entropy). Larger batches
    use the probe-based count estimate of :func:`infer_labels_counts` when ``input_shape`` is given and
    the last layer has a bias, else the LLG-style sign heuristic of :func:`infer_labels_batch`.
    """
    w, b = last_linear(model)
    if w not in grads:
        raise ValueError(f"label inference needs the gradient of {w!r}")
    if batch_size == 1:
        return torch.tensor([infer_label_single(grads[w])], dtype=torch.int64)
    if input_shape is not None and b is not None and b in grads:
        dev = next(model.parameters()).device
        gen = gen if gen is not None else torch.Generator().manual_seed(0)
        return infer_labels_counts(grads[b], batch_size, probe_probs(model, input_shape, gen, probes, dev))
    return infer_labels_batch(grads, batch_size, w, b)
