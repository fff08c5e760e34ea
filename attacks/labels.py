"""Label inference from the last fully connected layer's gradient.

With mean cross-entropy over a batch of ``B`` examples and logits ``z = W h + b``, the gradient of the
last layer is ``dL/dW_c = (1/B) sum_b (p_bc - y_bc) h_b`` and ``dL/db_c = (1/B) sum_b (p_bc - y_bc)``.

* Batch 1 (iDLG, Zhao et al. 2020): ``p_c - y_c`` is negative for the true class only and positive for
  every other, and each row of ``dL/dW`` is that number times the same feature vector ``h``. The row
  sums therefore share one sign except at the true class: with non-negative features (sigmoid, ReLU)
  the true class is the one negative row sum. :func:`infer_label_single` takes the row whose sign
  differs from the others, which is exact for any activation (when ``sum(h) != 0``). It stays exact
  for several local steps on one example, since every step's contribution has the same sign pattern.
* Batch > 1 (:func:`infer_label_counts`, the default): instance-wise batch label restoration, the
  approach of Ma et al. (iLRG, ICLR 2023), written for fedsim. With ``G = B dL/dW`` and ``g = B dL/db``,
  ``g = sum_b p_b - n`` where ``n`` counts the classes in the batch, so the counts follow from the
  summed probabilities ``sum_b p_b``. Row ``c`` of ``G`` divided by ``g_c`` is a weighted mean of the
  features with weights ``p_bc - [y_b = c]``: for a class present in the batch whose probability is small
  it is (about) the mean feature of that class's samples, for an absent class the ``p_c``-weighted mean
  of all features. Passing these per-class features through the last layer gives each class's
  probability vector ``q_j`` and the linear system ``g = sum_j k_j (q_j - e_j)``, ``sum_j k_j = B``,
  solved here by bounded least squares (``0 <= k_j <= B``; iLRG uses the unbounded pseudo-inverse,
  which lets badly conditioned classes take large negative and positive counts on a trained model),
  then rounded to integers that sum to ``B`` (largest remainders). Exact when every sample of a class
  has about the same probabilities, which holds on untrained models; on trained models the
  confidently classified samples barely move the gradient and the counts degrade
  (``benchmarks/label_inference.py``, docs/attacks.md "Labels").
* Batch > 1 without a bias (:func:`infer_labels_batch`): an LLG-style heuristic (Wainakh et al.,
  "User-level label leakage from gradients in federated learning", PETS 2022). Let ``g_c`` be the weight
  row sums rescaled so that the negative entries sum to ``-B`` (``g_c ~ B pbar_c - n_c``). (1) Every
  class with ``g_c < 0`` is present: take it once (the ``B`` most negative if there are more). (2)
  Estimate the impact of one example as ``m = -(sum of the negative g_c) / B`` (about ``1 - pbar``). (3)
  Add ``m`` to each class taken and fill the remaining slots one at a time with the currently most
  negative ``g_c``, adding ``m`` after each pick, so that a class is repeated when its gradient is still
  strongly negative.
* :func:`infer_labels_counts` is the probe-based count estimate of Geng et al. ("Towards general deep
  leakage in federated learning", 2021; fedsim's default before iLRG): the mean softmax of the global
  model on random U(0, 1) inputs stands in for the batch's mean probabilities, ``n_c ~ B phat_c - g_c``.
  Random inputs are not images of the data set, so the stand-in is off on models whose outputs depend
  on the input (it missed a class in a batch of 4 on the sigmoid LeNet); kept for comparison.
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


def round_counts(est: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``batch_size`` sorted labels from real-valued class counts ``est`` (C,): the labels are handed out
    one at a time to the class with the largest remaining estimate, which is then decremented by 1
    (largest remainders once every whole count is given)."""
    est = est.detach().double().cpu().clone()
    labels = []
    for _ in range(int(batch_size)):
        c = int(torch.argmax(est))
        labels.append(c)
        est[c] -= 1.0
    return torch.tensor(sorted(labels), dtype=torch.int64)


def class_count_estimate(weight: torch.Tensor, bias: torch.Tensor, grad_weight: torch.Tensor,
                         grad_bias: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Real-valued class counts ``(C,)`` of a batch from the last layer's weights and (pseudo-)gradients
    (the bounded least-squares solution of the iLRG system; see the module doc)."""
    from scipy.optimize import lsq_linear

    B = int(batch_size)
    W, c = weight.detach().double().cpu(), bias.detach().double().cpu()
    G = grad_weight.detach().double().cpu() * B
    g = grad_bias.detach().double().cpu() * B
    C = len(g)
    tiny = 1e-30
    denom = torch.where(g.abs() > tiny, g, torch.full_like(g, tiny))
    feats = G / denom[:, None]  # row j: the features of class j's samples (weighted mean)
    Q = torch.softmax(feats @ W.T + c, dim=-1)  # row j: their probabilities
    eye = torch.eye(C, dtype=torch.float64)
    scale = max(1.0, float(g.abs().max()))  # the sum equation outweighs any single class's equation
    A = torch.cat([(Q.T - eye), 1e3 * scale * torch.ones(1, C, dtype=torch.float64)]).numpy()
    rhs = torch.cat([g, torch.tensor([1e3 * scale * B], dtype=torch.float64)]).numpy()
    sol = lsq_linear(A, rhs, bounds=(0.0, float(B)))
    return torch.as_tensor(sol.x, dtype=torch.float64)


def infer_label_counts(weight: torch.Tensor, bias: torch.Tensor, grad_weight: torch.Tensor,
                       grad_bias: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``batch_size`` labels (int64, sorted): :func:`class_count_estimate` rounded (:func:`round_counts`)."""
    return round_counts(class_count_estimate(weight, bias, grad_weight, grad_bias, batch_size), batch_size)


def infer_labels_counts(bias_grad: torch.Tensor, batch_size: int, mean_probs: torch.Tensor) -> torch.Tensor:
    """Geng et al.'s estimate: ``batch_size`` labels (int64, sorted) from ``n_c ~ B phat_c - B dL/db_c``
    with a stand-in ``phat`` for the batch's mean probabilities (see module doc)."""
    B = int(batch_size)
    return round_counts(B * mean_probs.detach().double().cpu() - B * bias_grad.detach().double().cpu(), B)


@torch.no_grad()
def probe_probs(model: nn.Module, input_shape: Sequence[int], gen: torch.Generator, probes: int = 64,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Mean softmax of the model on ``probes`` random U(0, 1) inputs (drawn on the CPU from ``gen``)."""
    x = torch.rand((probes, *input_shape), generator=gen).to(device)
    return torch.softmax(model(x).double(), dim=-1).mean(0)


def infer_labels(model: nn.Module, grads: Mapping[str, torch.Tensor], batch_size: int) -> torch.Tensor:
    """Labels of a batch (int64, sorted for batches > 1) from a (pseudo-)gradient dict keyed by parameter name.

    Batch 1 uses iDLG's row-sum rule on the weight gradient (exact for cross-entropy). Larger batches use
    the iLRG count estimate of :func:`infer_label_counts` when the last layer has a bias, else the
    LLG-style sign heuristic of :func:`infer_labels_batch`. Every attack that infers labels calls this.
    """
    w, b = last_linear(model)
    if w not in grads:
        raise ValueError(f"label inference needs the gradient of {w!r}")
    if batch_size == 1:
        return torch.tensor([infer_label_single(grads[w])], dtype=torch.int64)
    if b is not None and b in grads:
        params = dict(model.named_parameters())
        return infer_label_counts(params[w], params[b], grads[w], grads[b], batch_size)
    return infer_labels_batch(grads, batch_size, w, b)
