"""From an intercepted weight update back to gradients (seed 001, Algorithm 1 lines 4-6).

A client running plain SGD for one step returns ``w1 = w0 - lr * g``, so ``g = -(w1 - w0) / lr``
exactly (up to float rounding). After ``K`` local steps (FedAvg) the update is the sum of ``K``
gradients taken at different weights, ``-(w_K - w0) / lr = sum_k g_k``; dividing by ``lr * K``
gives their average, the best single "pseudo-gradient" an attacker can match without modelling the
local steps. :func:`simulate_update` models them instead: it replays ``K`` SGD steps of candidate
data differentiably (``torch.func.functional_call``) so that an attack can match the simulated update
to the observed one (Geiping et al. 2020, section 5).

Only trainable parameters (``model.named_parameters()``) are matched: BatchNorm running statistics
also travel in the update but are not gradients.

Beyond plain SGD (``train.momentum``, ``train.weight_decay``, FedProx's ``proximal-mu``; the server
configures them, so they are in the recipe an attacker reads): with one local step the gradient is
still recovered exactly (the momentum buffer starts at zero; weight decay adds ``weight_decay * w0``,
which :func:`update_to_gradient` removes given the global weights; the proximal term is zero at
``w0``). With several steps, momentum weights step ``k`` of ``K`` by ``(1 - momentum^(K-k+1)) / (1 -
momentum)``; the pseudo-gradient divides by the sum of these weights instead of ``K`` (the average
gradient when the gradients are alike), and :func:`simulate_update` replays momentum, weight decay
and the proximal term exactly.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedsim.protocol import BATCH_SIZE, LOCAL_EPOCHS, LOCAL_STEPS, LR, MOMENTUM, PROXIMAL_MU, WEIGHT_DECAY


def _recipe_mapping(recipe: Any) -> Mapping[str, Any]:
    return recipe.to_mapping() if hasattr(recipe, "to_mapping") else recipe


def local_step_count(recipe: Any, num_examples: int | None = None) -> int:
    """Number of local SGD steps a recipe makes.

    ``local_steps`` when set; otherwise ``local_epochs * ceil(num_examples / batch_size)`` (every
    epoch keeps its last partial batch, as :func:`fedsim.training.batches.batch_schedule` does).
    """
    r = _recipe_mapping(recipe)
    steps = r.get(LOCAL_STEPS)
    if steps:
        return int(steps)
    epochs = r.get(LOCAL_EPOCHS)
    if not epochs:
        raise ValueError("recipe needs local_steps or local_epochs")
    if not num_examples:
        raise ValueError("a local_epochs recipe needs num_examples to count its local steps")
    bs = min(int(r[BATCH_SIZE]), int(num_examples))
    return int(epochs) * math.ceil(int(num_examples) / bs)


def effective_steps(recipe: Any, num_examples: int | None = None) -> float:
    """How many gradients one local round adds up to: ``K`` for plain SGD, ``sum_k (1 - m^k) / (1 - m)``
    with momentum ``m`` (the weight of the ``k``-th from last gradient)."""
    r = _recipe_mapping(recipe)
    steps = local_step_count(r, num_examples)
    m = float(r.get(MOMENTUM) or 0.0)
    if not m:
        return float(steps)
    return float(sum((1 - m ** k) / (1 - m) for k in range(1, steps + 1)))


def update_to_gradient(update: Mapping[str, torch.Tensor], recipe: Any, *,
                       names: Sequence[str] | None = None,
                       num_examples: int | None = None,
                       global_state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Pseudo-gradient ``-update / (lr * steps)`` for every trainable parameter.

    ``update`` maps state-dict names to ``new - old`` weights; ``recipe`` is a
    :class:`fedsim.training.recipe.Recipe` or its mapping. ``names`` restricts the result to those entries
    (pass the names of ``model.named_parameters()`` to drop buffers); without it, entries that cannot
    be gradients (integer buffers such as ``num_batches_tracked``, ``running_*`` statistics) are
    dropped. For one local step this is the exact gradient; for several it is their average.
    With momentum the divisor is :func:`effective_steps`; with weight decay ``weight_decay * w0`` is
    subtracted when ``global_state`` (the weights the client started from) is given.
    """
    r = _recipe_mapping(recipe)
    lr = float(r[LR])
    if lr <= 0:
        raise ValueError(f"recipe lr must be positive, got {lr}")
    steps = effective_steps(r, num_examples)
    if names is None:
        names = [k for k, v in update.items()
                 if v.is_floating_point() and not k.rsplit(".", 1)[-1].startswith(("running_", "num_batches"))]
    missing = [n for n in names if n not in update]
    if missing:
        raise KeyError(f"update lacks parameters {missing}")
    out = {n: -update[n].detach().float() / (lr * steps) for n in names}
    wd = float(r.get(WEIGHT_DECAY) or 0.0)
    if wd and global_state is not None:
        for n in names:
            out[n] = out[n] - wd * global_state[n].detach().float().to(out[n].device)
    return out


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def select_names(names: Sequence[str], muted: Sequence[str] | None) -> list[str]:
    """The names that no ``fnmatch`` pattern in ``muted`` matches (seed 000, Table I column D)."""
    muted = list(muted or [])
    kept = [n for n in names if not any(fnmatch.fnmatchcase(n, pat) for pat in muted)]
    if not kept:
        raise ValueError(f"attack.muted {muted} mutes every parameter; nothing left to match")
    return kept


def assumed_schedule(num_examples: int, recipe: Any) -> list[list[int]]:
    """The mini-batches of the candidate data an attack replays, in a fixed order.

    Same shape as the client's :func:`fedsim.training.batches.batch_schedule` (full batches in
    ``local_steps`` mode, a trailing partial batch per epoch in ``local_epochs`` mode) but without
    its shuffling: the attacker does not know the client's permutation, and since the candidates are
    free variables any fixed order is as good as the true one.
    """
    r = _recipe_mapping(recipe)
    n = int(num_examples)
    bs = min(int(r[BATCH_SIZE]), n)
    batches: list[list[int]] = []
    if r.get(LOCAL_STEPS):
        k = 0
        per_pass = n // bs
        while len(batches) < int(r[LOCAL_STEPS]):
            j = k % per_pass
            batches.append(list(range(j * bs, (j + 1) * bs)))
            k += 1
    else:
        for _ in range(int(r[LOCAL_EPOCHS])):
            batches.extend(list(range(s, min(s + bs, n))) for s in range(0, n, bs))
    return batches


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy with hard (int64) or soft (probability rows) targets, as the client uses."""
    return F.cross_entropy(logits, y)


def simulate_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float,
                    schedule: Sequence[Sequence[int]], *, names: Sequence[str] | None = None,
                    create_graph: bool = True, momentum: float = 0.0, weight_decay: float = 0.0,
                    proximal_mu: float = 0.0) -> dict[str, torch.Tensor]:
    """Differentiable replay of local SGD on candidate data; returns ``w_K - w_0`` per parameter.

    ``x``/``y`` are the candidate local data (``y`` hard labels or probability rows), ``schedule``
    the index lists of each local step (see :func:`assumed_schedule`). Every trainable parameter is
    stepped; the result holds ``names`` (default: all of them). With ``create_graph`` the result is
    differentiable with respect to ``x`` (and ``y`` when soft). ``momentum``, ``weight_decay`` and
    ``proximal_mu`` replay the client's optimiser exactly (``fedsim.training.local.step_extended``).
    """
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    p0 = dict(params)
    cur = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    keys = list(cur)
    bufs: dict[str, torch.Tensor] = {}
    for idx in schedule:
        ti = torch.as_tensor(list(idx), device=x.device, dtype=torch.long)
        out = functional_call(model, {**cur, **frozen, **buffers}, (x[ti],))
        loss = cross_entropy(out, y[ti])
        grads = torch.autograd.grad(loss, [cur[k] for k in keys], create_graph=create_graph)
        if not (momentum or weight_decay or proximal_mu):
            cur = {k: cur[k] - lr * g for k, g in zip(keys, grads)}
            continue
        nxt = {}
        for k, g in zip(keys, grads):
            d = g + weight_decay * cur[k] + proximal_mu * (cur[k] - p0[k])
            if momentum:
                d = bufs[k] * momentum + d if k in bufs else d
                bufs[k] = d
            nxt[k] = cur[k] - lr * d
        cur = nxt
    names = list(names) if names is not None else keys
    return {n: cur[n] - p0[n] for n in names}


def layer_weights(spec: Any, names: Sequence[str],
                  target: Mapping[str, torch.Tensor] | None = None) -> list[float] | None:
    """Per-layer weights for the matching loss.

    ``None`` (all 1), ``"linear"`` (first matched tensor 1, falling linearly to 1/L for the last),
    ``"exp"`` (softmax of ``L..1`` times ``L``, an exponential emphasis on the first layers),
    ``"norm"`` (``1 / ||target_l||^2``: every tensor counts equally, however small its gradient - useful
    where early-layer gradients vanish), a sequence of ``L`` floats, or a mapping from ``fnmatch``
    pattern to weight (first matching pattern wins, default 1).
    """
    L = len(names)
    if spec is None:
        return None
    if isinstance(spec, str) and spec == "norm":
        if target is None:
            raise ValueError("layer_weights='norm' needs the target gradients")
        return [1.0 / max(float(target[n].double().pow(2).sum()), 1e-30) for n in names]
    if isinstance(spec, str):
        if spec == "linear":
            return [(L - i) / L for i in range(L)]
        if spec == "exp":
            w = torch.softmax(torch.arange(L, 0, -1, dtype=torch.float64), 0)
            return [float(v) * L for v in w]
        raise ValueError(f"attack.layer_weights must be None, 'linear', 'exp', 'norm', a list or a mapping, "
                         f"got {spec!r}")
    if isinstance(spec, Mapping):
        out = []
        for n in names:
            out.append(next((float(w) for pat, w in spec.items() if fnmatch.fnmatchcase(n, pat)), 1.0))
        return out
    spec = [float(v) for v in spec]
    if len(spec) != L:
        raise ValueError(f"attack.layer_weights has {len(spec)} entries for {L} matched parameter tensors")
    return spec


def flatten_gradients(tensors: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor | None = None,
                      stacked: bool = False) -> torch.Tensor:
    """The tensors as one vector (per victim when ``stacked``: every tensor has a leading victim
    dimension), each scaled by the square root of its layer weight (``weights`` ``(A, L)`` when stacked):
    :func:`gradient_distance` of two lists is :func:`vector_distance` of their flat forms (up to float
    rounding), in a few operations instead of a few per tensor."""
    lead = tensors[0].shape[:1] if stacked else ()
    if weights is None:
        return torch.cat([t.reshape(*lead, -1) for t in tensors], -1)

    def sq(i: int):
        return weights[:, i].sqrt().unsqueeze(1) if stacked else math.sqrt(float(weights[i]))

    return torch.cat([t.reshape(*lead, -1) * sq(i) for i, t in enumerate(tensors)], -1)


def vector_distance(d: torch.Tensor, t: torch.Tensor, metric: str = "l2") -> torch.Tensor:
    """:func:`gradient_distance` between two flat gradients (:func:`flatten_gradients`), over the last
    dimension."""
    if metric == "l2":
        return (d - t).pow(2).sum(-1)
    if metric == "cosine":
        dn, tn = d.pow(2).sum(-1), t.pow(2).sum(-1)
        return 1 - (d * t).sum(-1) / (dn.clamp_min(1e-24).sqrt() * tn.clamp_min(1e-24).sqrt())
    raise ValueError(f"unknown gradient distance {metric!r}; use 'l2' or 'cosine'")


def gradient_distance(dummy: Sequence[torch.Tensor], target: Sequence[torch.Tensor], metric: str = "l2",
                      weights: Sequence[float] | None = None) -> torch.Tensor:
    """Distance between two gradient lists (same order, same shapes).

    ``"l2"``: DLG's ``sum_l w_l ||d_l - t_l||^2``. ``"cosine"``: Geiping et al.'s
    ``1 - sum_l w_l <d_l, t_l> / (sqrt(sum_l w_l ||d_l||^2) sqrt(sum_l w_l ||t_l||^2))``, one cosine
    over all matched layers together.
    """
    if len(dummy) != len(target):
        raise ValueError("gradient lists differ in length")
    w = weights if weights is not None else [1.0] * len(dummy)
    if metric == "l2":
        return sum(wi * (d - t).pow(2).sum() for wi, d, t in zip(w, dummy, target))
    if metric == "cosine":
        dot = sum(wi * (d * t).sum() for wi, d, t in zip(w, dummy, target))
        dn = sum(wi * d.pow(2).sum() for wi, d in zip(w, dummy))
        tn = sum(wi * t.pow(2).sum() for wi, t in zip(w, target))
        return 1 - dot / (dn.clamp_min(1e-24).sqrt() * tn.clamp_min(1e-24).sqrt())
    raise ValueError(f"unknown gradient distance {metric!r}; use 'l2' or 'cosine'")


def fedavg_distance(model: nn.Module, x: torch.Tensor, y: torch.Tensor, observed: Mapping[str, torch.Tensor],
                    recipe: Any, *, names: Sequence[str], metric: str = "l2",
                    weights: Sequence[float] | None = None,
                    schedule: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """FedAvg-aware matching: replay the recipe's local steps on ``(x, y)`` and compare updates.

    ``observed`` is the intercepted update (``new - old`` per state-dict name); only ``names`` (the
    matched, un-muted trainable parameters) enter the distance. Both updates are scaled to
    pseudo-gradients (``-update / (lr * K)``) so that L2 distances are on the same scale as in the
    single-step case. ``schedule`` defaults to :func:`assumed_schedule` over ``len(x)`` candidates.
    """
    r = _recipe_mapping(recipe)
    lr = float(r[LR])
    schedule = schedule if schedule is not None else assumed_schedule(len(x), r)
    scale = -1.0 / (lr * len(schedule))
    sim = simulate_update(model, x, y, lr, schedule, names=names, momentum=float(r.get(MOMENTUM) or 0.0),
                          weight_decay=float(r.get(WEIGHT_DECAY) or 0.0),
                          proximal_mu=float(r.get(PROXIMAL_MU) or 0.0))
    return gradient_distance([sim[n] * scale for n in names],
                             [observed[n].to(x.device).float() * scale for n in names], metric, weights)
