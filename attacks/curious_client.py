"""Gradient inversion by a curious client (seed 002, §3 and §6.4.2).

Threat model: an honest-but-curious client of a FedSGD federation sees the global model it is sent
every round (the true ``W_t`` without a defence, the perturbed ``W^_t`` under seed 002's defence),
its own data and its own reply. From two consecutive global models and the learning rate it computes
the other clients' combined gradient (:func:`others_gradient`)::

    W_{t+1} = W_t - lr (w_own g_own + (1 - w_own) g_others)
    g_others = ((W_t - W_{t+1}) / lr - w_own g_own) / (1 - w_own)

which is exact without a defence. Under the defence the client can only plug in ``W^_t``, ``W^_{t+1}``
(perturbed with independent one-time secrets) and its own *perturbed* gradient, and gets noise.

From ``g_others`` it extracts inputs:

* :func:`invert_single` - one example: a row ``i`` of the first layer's weight gradient is
  ``delta_i x`` and the bias gradient ``delta_i``, so ``x = dW[i] / db[i]`` exactly;
* :func:`invert_rows` - several examples, analytically: rows in which only one example is active
  give that example exactly (confirmed by two rows agreeing);
* :func:`invert_optimisation` - several examples: DLG-style (Zhu et al. 2019) matching of the gradient
  of dummy inputs and dummy soft labels on the model the client holds, with the project's L-BFGS loop
  (:func:`attacks._common.lbfgs_loop`) and gradient distance (:func:`attacks.gradients.gradient_distance`);
* :func:`span_inversion` - an adaptive attack on the defence itself (not in the paper). The first
  layer is perturbed by a per-row positive scale only (eq. 8, ``R^(1)_ij = r^(1)_i``), so the row
  *directions* of ``[W | b]`` are public. With fresh scales each round,
  ``[W^_{t+1} | b^_{t+1}]_i = r'_i ([W_t | b_t]_i - lr g_i)`` and ``[W^_t | b^_t]_i = r_i [W_t | b_t]_i``,
  hence ``g_i`` lies in the plane spanned by the two observed rows. When the other clients' gradient
  comes from a single example ``x``, ``g_i = delta_i [x | 1]``: every row in which the attacker's own
  examples are inactive (it sees the activation pattern, which positive scaling preserves) and the
  victim's is active gives a plane containing ``[x | 1]``. Two or more such planes intersect in that
  line, and the last coordinate fixes the scale: ``x`` comes back exactly.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Sequence

import torch
from torch.nn import functional as F

from fedsim.components import check_value
from fedsim.lossless import Layer, forward
from fedsim.params import OneOf, Range

from ._common import Count, Positive, init_dummy, lbfgs_loop
from .gradients import gradient_distance

LOSSES = ("mse", "cross_entropy")
Loss = Annotated[str, OneOf(*LOSSES)]
OwnWeight = Annotated[float, Range(0, 1, open_high=True)]


def others_gradient(prev: Sequence[Layer], new: Sequence[Layer], own_grad: Sequence[Layer], lr: float,
                    own_weight: float) -> list[Layer]:
    """The other clients' combined (weighted-mean) gradient from two consecutive global models.

    ``own_weight`` is the attacker's aggregation weight ``n_own / n_total`` (assumed known: generous to
    the attacker); ``own_grad`` the gradient it computed itself.
    """
    check_value("attack.lr", lr, Positive)
    check_value("attack.own_weight", own_weight, OwnWeight)  # < 1: someone else must contribute
    lr, w = float(lr), float(own_weight)
    out: list[Layer] = []
    for (pw, pb), (nw, nb), (gw, gb) in zip(prev, new, own_grad, strict=True):
        ow = ((pw - nw) / lr - w * gw) / (1 - w)
        ob = ((pb - nb) / lr - w * gb) / (1 - w) if pb is not None else None
        out.append((ow, ob))
    return out


def invert_single(grads: Sequence[Layer]) -> torch.Tensor:
    """Input of a single example from its gradient: first-layer weight row / bias entry, taking the row
    with the largest ``|bias gradient|``. Returns the flat input ``(n_0,)``."""
    gw, gb = grads[0]
    if gb is None:
        raise ValueError("invert_single needs a first layer with a bias")
    i = int(gb.abs().argmax())
    if float(gb[i].abs()) == 0.0:
        raise ValueError("the first layer's bias gradient is zero: no active unit to invert")
    return gw[i] / gb[i]


def invert_rows(grads: Sequence[Layer], *, rtol: float = 1e-6, min_rows: int = 2) -> torch.Tensor:
    """Analytic inputs of a *batch* gradient on an FC net: ``x = dW[i] / db[i]`` for every first-layer row
    in which exactly one example is active (ReLU sparsity makes such rows common for small batches).

    A row shared by several examples gives a mixture; such mixtures almost never coincide, whereas a
    single example's rows all give exactly its input. Candidates are therefore grouped when they agree to
    ``rtol`` (relative, max-norm) and a group of at least ``min_rows`` rows is reported as one recovered
    input. Returns ``(k, n_0)`` (``k`` may be 0).
    """
    gw, gb = grads[0]
    if gb is None:
        raise ValueError("invert_rows needs a first layer with a bias")
    check_value("attack.min_rows", min_rows, Count)
    check_value("attack.rtol", rtol, Positive)
    rtol = float(rtol)
    gw, gb = gw.double(), gb.double()
    live = (gb.abs() > 1e-12 * gb.abs().max().clamp_min(1e-300)).nonzero().flatten()
    cand = gw[live] / gb[live, None]
    scale = 1 + cand.abs().amax(1)
    close = (cand[:, None, :] - cand[None, :, :]).abs().amax(2) <= rtol * torch.maximum(scale[:, None],
                                                                                         scale[None, :])
    free = torch.ones(len(cand), dtype=torch.bool)
    found = []
    for i in range(len(cand)):
        if not free[i]:
            continue
        members = close[i] & free
        if int(members.sum()) >= min_rows:
            found.append(cand[members].mean(0))
            free &= ~members
    n0 = gw.shape[1]
    return torch.stack(found).to(grads[0][0].dtype) if found else torch.zeros((0, n0), dtype=grads[0][0].dtype)


def _loss(loss: str, out: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    if loss == "mse":
        return 0.5 * ((out - soft) ** 2).sum(1).mean()
    return -(soft * torch.log_softmax(out, 1)).sum(1).mean()


def invert_optimisation(layers: Sequence[Layer], target: Sequence[Layer], batch_size: int, input_shape: Sequence[int],
                        *, loss: str = "mse", labels: torch.Tensor | None = None, iterations: int = 300,
                        init: str = "random", seed: int = 0, negative_slope: float = 0.0,
                        history: int = 100) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """DLG against a combined gradient on an FC model: optimise ``batch_size`` dummy inputs (and soft
    labels unless ``labels`` are given) so that their mean gradient on ``layers`` matches ``target``.

    ``loss`` is the training loss the attacker assumes (``mse`` on one-hot targets as in seed 002, or
    ``cross_entropy``). Returns inputs ``(B, *input_shape)`` clamped to [0, 1], labels ``(B,)`` and the
    L-BFGS trace (``loss``, ``iterations``, ``seconds``).
    """
    for key, value, kind in (("loss", loss, Loss), ("batch_size", batch_size, Count), ("iterations", iterations, Count)):
        check_value(f"attack.{key}", value, kind)
    t0 = time.perf_counter()
    dt, dev = layers[0][0].dtype, layers[0][0].device
    params = [t.detach().clone().requires_grad_(True) for w, b in layers for t in ((w,) if b is None else (w, b))]
    it = iter(params)
    lay = [(next(it), next(it) if b is not None else None) for _, b in layers]
    tgt = [t.detach().to(dev, dt) for w, b in target for t in ((w,) if b is None else (w, b))]
    n_out = int(layers[-1][0].shape[0])
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    shape = tuple(int(s) for s in input_shape)
    img = shape if len(shape) == 3 else (1, 1, int(torch.tensor(shape).prod()))
    x = init_dummy(init, (batch_size, *img), gen).reshape(batch_size, *shape).to(dev, dt).requires_grad_(True)
    variables = [x]
    if labels is None:
        z = torch.randn((batch_size, n_out), generator=gen).to(dev, dt).requires_grad_(True)
        variables.append(z)
    else:
        fixed = F.one_hot(labels.long().to(dev), n_out).to(dt)

    def objective():
        soft = torch.softmax(z, 1) if labels is None else fixed
        out, _ = forward(lay, x, negative_slope=negative_slope)
        grads = torch.autograd.grad(_loss(loss, out, soft), params, create_graph=True)
        dist = gradient_distance(grads, tgt, "l2")
        return dist, dist

    trace = lbfgs_loop(variables, objective, iterations, history, 1.0)
    trace["seconds"] = time.perf_counter() - t0
    lab = z.detach().argmax(1) if labels is None else labels.long()
    return x.detach().clamp(0, 1), lab.cpu(), trace


def span_inversion(prev_first: Layer, new_first: Layer, own_inputs: torch.Tensor | None = None, *,
                   parallel_tol: float = 1e-9) -> tuple[torch.Tensor, dict[str, Any]]:
    """Recover a single other-client example from two consecutive *perturbed* first layers.

    ``prev_first`` / ``new_first`` are ``(W^, b^)`` of the first layer in rounds ``t`` and ``t+1``;
    ``own_inputs`` the attacker's own examples of round ``t`` (their rows are excluded where any of them
    is active, since the attacker's own gradient also moved those rows). Rows whose two observations are
    parallel (``sin`` of their angle below ``parallel_tol``) did not move and are skipped. Returns the
    flat input ``(n_0,)`` and a trace with the number of rows used and the residual (the smallest
    eigenvalue: ~0 when the planes really share a line).
    """
    (pw, pb), (nw, nb) = prev_first, new_first
    if pb is None or nb is None:
        raise ValueError("span_inversion needs a first layer with a bias (it fixes the scale)")
    A = torch.cat([pw, pb[:, None]], 1).double()
    B = torch.cat([nw, nb[:, None]], 1).double()
    keep = torch.ones(len(A), dtype=torch.bool, device=A.device)
    if own_inputs is not None and len(own_inputs):
        pre = F.linear(own_inputs.reshape(len(own_inputs), -1).to(A.device).double(), pw.double(), pb.double())
        keep &= ~(pre > 0).any(0)  # sign(r_i z) = sign(z): the attacker sees its own activation pattern
    An = A / A.norm(dim=1, keepdim=True).clamp_min(1e-300)
    Bn = B / B.norm(dim=1, keepdim=True).clamp_min(1e-300)
    sin = (Bn - (Bn * An).sum(1, keepdim=True) * An).norm(dim=1)
    keep &= sin > parallel_tol
    rows = keep.nonzero().flatten()
    if len(rows) < 2:
        raise ValueError(f"span_inversion needs at least 2 moved rows free of the attacker's own examples, "
                         f"found {len(rows)}")
    d = A.shape[1]
    eye = torch.eye(d, dtype=torch.float64, device=A.device)
    M = torch.zeros(d, d, dtype=torch.float64, device=A.device)
    for i in rows.tolist():
        Q, _ = torch.linalg.qr(torch.stack([A[i], B[i]], 1))
        M += eye - Q @ Q.T
    evals, evecs = torch.linalg.eigh(M)
    z = evecs[:, 0]
    if abs(float(z[-1])) < 1e-12:
        raise ValueError("the recovered direction has no bias component; cannot fix the scale")
    return (z[:-1] / z[-1]).to(pw.dtype), {"rows": len(rows), "residual": float(evals[0]),
                                          "gap": float(evals[1]) if d > 1 else float("nan")}
