"""Features at the input of the last fully connected layer, recovered from its gradients.

Seed 004 (section 4.2) first reconstructs the features ``h_b`` that enter the classifier and then
uses them as a feature-matching target. For logits ``z_b = W h_b + c`` and mean cross-entropy over a
batch of ``B`` the gradients of the last layer are

    dL/dW = (1/B) sum_b d_b h_b^T,    dL/dc = (1/B) sum_b d_b,    d_b = softmax(z_b) - onehot(y_b),

so ``dL/dW`` (``C x d``) has rank ``<= min(B, C - 1)`` and its row space is the span of the batch's
features (when ``B <= C - 1`` and the ``d_b`` are independent). This module recovers

* the span (:attr:`Features.basis`, the top right-singular vectors of ``dL/dW``) - exact without
  noise, and what seed 004's span regulariser uses for larger batches;
* the individual features (:attr:`Features.features`), one per label slot: batch 1 exactly
  (``h = dL/dW^T dL/dc / |dL/dc|^2``); for ``B > 1`` by factorising ``dL/dW = (1/B) D^T H`` with the
  constraint that ties each ``d_b`` to its own feature, ``d_b = softmax(W h_b + c) - onehot(y_b)``
  (``W``, ``c`` are the global model's, the labels the inferred ones), solved by least squares over
  the coefficients of ``h_b`` in the span, started from the factorisation with every ``softmax``
  replaced by the batch mean ``mean_b softmax(z_b) = dL/dc + mean_b onehot(y_b)``.

Seed 004 obtains the features with the tensor method of Wang et al. (2023), which needs a purpose-built
wide layer with random Gaussian weights in front of the classifier (Stein's lemma). fedsim's models have
a plain classifier head, so the same quantity is recovered here from the exact low-rank structure of
the classifier's own gradient. As the paper observes for its method, two samples of the same class are
hard to separate (their ``d_b`` differ only through their probabilities): their individual features are
unreliable while the span stays accurate. Since every ``d_b`` sums to 0 over the classes, the rank is
at most ``C - 1``: for batches larger than that (``B >= 10`` with 10 classes) the gradient shows only
part of the features' span and neither form is available (:attr:`Features.complete` is False). Features are defined up to sign in the paper's method; the
feature regulariser uses squared cosines, so this does not matter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class Features:
    features: torch.Tensor  # (B, d), row b belongs to label slot b
    basis: torch.Tensor  # (d, r) orthonormal basis of the recovered span
    residual: float  # relative residual of the gradient equations at the solution (0 = exact)
    separable: bool  # False when the individual features are not identifiable (rank too small)
    complete: bool  # False when B > C - 1: the gradient's row space holds only part of the features' span


def _residual(q: torch.Tensor, Wv: torch.Tensor, c: torch.Tensor, Y: torch.Tensor, gWv: torch.Tensor,
              gc: torch.Tensor) -> torch.Tensor:
    """Relative squared residual of ``(1/B) D^T Q = gW V`` and ``(1/B) D^T 1 = gc`` for coefficients Q."""
    B = q.shape[0]
    D = torch.softmax(q @ Wv.T + c, dim=1) - Y  # (B, C)
    r1 = (D.T @ q / B - gWv).pow(2).sum() / gWv.pow(2).sum().clamp_min(1e-30)
    r2 = (D.mean(0) - gc).pow(2).sum() / gc.pow(2).sum().clamp_min(1e-30)
    return r1 + r2


def _solve(start: torch.Tensor, Wv: torch.Tensor, c: torch.Tensor, Y: torch.Tensor, gWv: torch.Tensor,
           gc: torch.Tensor, iterations: int) -> tuple[torch.Tensor, float]:
    """L-BFGS (strong Wolfe) on :func:`_residual` from ``start``; returns the coefficients and residual."""
    q = start.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([q], lr=1.0, max_iter=iterations, history_size=50, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-14, tolerance_change=1e-16)

    def closure():
        opt.zero_grad()
        loss = _residual(q, Wv, c, Y, gWv, gc)
        loss.backward()
        return loss

    try:
        opt.step(closure)
    except RuntimeError:  # a degenerate line search; keep what we have
        pass
    with torch.no_grad():
        return q.detach().clone(), float(_residual(q, Wv, c, Y, gWv, gc))


def reconstruct_features(weight: torch.Tensor, bias: torch.Tensor | None, grad_weight: torch.Tensor,
                         grad_bias: torch.Tensor, labels: torch.Tensor, *, iterations: int = 200,
                         restarts: int = 4, gen: torch.Generator | None = None) -> Features:
    """Features entering the last linear layer (see module doc).

    ``weight`` (C, d) / ``bias`` (C,) are the layer's global weights, ``grad_weight`` / ``grad_bias`` its
    (pseudo-)gradient, ``labels`` (B,) the batch's labels. The nonlinear refinement runs ``restarts``
    L-BFGS solves of ``iterations`` steps (the first from the mean-probability start, the others from
    perturbations of it drawn from ``gen``) in float64 on the CPU and keeps the lowest residual.
    """
    dev, dtype = grad_weight.device, grad_weight.dtype
    W = weight.detach().double().cpu()
    gW = grad_weight.detach().double().cpu()
    C, d = W.shape
    c = bias.detach().double().cpu() if bias is not None else torch.zeros(C, dtype=torch.float64)
    y = torch.as_tensor(labels).long().cpu()
    B = len(y)
    Y = F.one_hot(y, C).double()
    r = max(1, min(B, C - 1, d))
    _, S, Vh = torch.linalg.svd(gW, full_matrices=False)
    V = Vh[:r].T.contiguous()  # (d, r)

    complete = B <= min(C - 1, d)

    def out(H: torch.Tensor, residual: float, separable: bool) -> Features:
        return Features(H.to(dev, dtype), V.to(dev, dtype), residual, separable and complete, complete)

    if grad_bias is None:
        raise ValueError("feature recovery needs the last linear layer's bias gradient (it fixes the features' "
                         "scale and mixing)")
    gc = grad_bias.detach().double().cpu()
    if B == 1:
        h = gW.T @ gc / gc.pow(2).sum().clamp_min(1e-30)
        res = float((torch.outer(gc, h) - gW).pow(2).sum() / gW.pow(2).sum().clamp_min(1e-30))
        return out(h[None], res, True)
    # start: every softmax replaced by the batch mean pbar = gc + mean_b onehot(y_b)
    pbar = (gc + Y.mean(0)).clamp_min(1e-6)
    pbar = pbar / pbar.sum()
    D0 = pbar[None, :] - Y  # (B, C)
    H0 = torch.linalg.lstsq(D0.T / B, gW).solution  # (B, d), minimum-norm where labels repeat
    q0 = H0 @ V  # coefficients in the span
    Wv, gWv = W @ V, gW @ V
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    best_q, best_res = q0, float(_residual(q0, Wv, c, Y, gWv, gc))
    scale = q0.pow(2).mean().sqrt().clamp_min(1e-12)
    for k in range(restarts):
        start = q0 if k == 0 else q0 + 0.3 * scale * torch.randn(q0.shape, generator=gen, dtype=torch.float64)
        q, res = _solve(start, Wv, c, Y, gWv, gc, iterations)
        if res == res and res < best_res:  # not NaN
            best_q, best_res = q, res
        if best_res < 1e-12:  # solved to float64 precision
            break
    separable = r >= B and len(S) >= B and float(S[B - 1]) > 1e-9 * float(S[0])
    return out(best_q @ V.T, best_res, separable)


def squared_cosine_loss(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Seed 004's feature regulariser: ``mean_b (1 - cos^2(h_b, target_b))`` (sign-free)."""
    cos = F.cosine_similarity(h.flatten(1), target.flatten(1), dim=1, eps=1e-12)
    return (1 - cos.pow(2)).mean()


def span_loss(h: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Seed 004's large-batch form: mean squared sine between ``h_b`` and the recovered span,
    ``mean_b |h_b - P h_b|^2 / |h_b|^2`` with ``P`` the projection onto ``span(basis)``."""
    h = h.flatten(1)
    proj = (h @ basis) @ basis.T
    return ((h - proj).pow(2).sum(1) / h.pow(2).sum(1).clamp_min(1e-24)).mean()
