"""Attacking several victims' updates at once (:meth:`attacks.base.Attack.run_many`).

The victims of one round received the same global model, so their reconstruction problems differ only
in the target gradient and the attacker's random start. Stacking them gives one optimisation over
``V`` independent problems:

* :class:`StackedTarget` computes every victim's dummy gradient in one pass: the model is evaluated
  with ``torch.func.vmap`` over a victim dimension of the matched parameters (expanded views of the
  shared weights, so the backward pass yields one parameter gradient per victim: convolutions become
  grouped convolutions); the summed per-victim losses differentiate into each victim's own input
  gradient, exactly as if each problem were solved alone;
* :class:`BatchedLBFGS` is ``torch.optim.LBFGS`` (``max_iter=1``, no line search) with a separate
  state per victim: its own curvature history, step length and stopping; the two-loop recursion runs
  over all victims with one tensor operation per history entry, in the order torch's uses;
* :func:`batched_lbfgs_loop` mirrors :func:`attacks._common.lbfgs_loop` per victim (best iterate,
  threshold, early stop), dropping victims that stop from the stacked problem.

Every stacked loop reports each iteration with :func:`stack_tick` (the iteration, the lowest current
gradient distance in the stack, the victims still optimised; printed at most every
``FEDSIM_PROGRESS_INTERVAL`` seconds), which is also where a requested stop (Ctrl-C) interrupts it.

Element-wise optimisers (Adam, RMSprop) need no special handling: applied to a stacked tensor they
update each victim's entries exactly as they would alone. What differs from one-by-one runs is only the
order of floating-point summations (dot products, grouped convolutions), i.e. rounding.

Inputs can be stacked when they share the global weights, the recipe, the input shape, the class
count, the batch size and the device (:func:`attacks.base.group_inputs`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from fedsim import progress

from ._common import Stagnation, Target, prepare_target
from .base import AttackInput


# ---------------------------------------------------------------- stacked target
@dataclass
class StackedTarget:
    """The un-muted (pseudo-)gradients of ``V`` victims of one global model, stacked."""

    model: nn.Module  # the global model, train mode, BatchNorm without running statistics
    matched: list[str]
    params: dict[str, torch.Tensor]  # every trainable parameter (detached)
    grads: list[torch.Tensor]  # per matched name: (V, *shape)
    weights: torch.Tensor | None  # (V, L) per-victim layer weights, or None
    targets: list[Target]  # the victims' own targets (label inference, recipes)

    @classmethod
    def build(cls, inputs: Sequence[AttackInput], muted: Sequence[str] = (), weights: Any = None) -> "StackedTarget":
        targets = [prepare_target(inp, muted, weights) for inp in inputs]
        model = inputs[0].global_model()
        torch.func.replace_all_batch_norm_modules_(model)  # batch statistics only (train mode); vmap-safe
        model.train()
        matched = targets[0].matched
        params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        grads = [torch.stack([t.grads[n] for t in targets]) for n in matched]
        if all(t.weights is None for t in targets):
            w = None
        else:
            w = torch.tensor([t.weights if t.weights is not None else [1.0] * len(matched) for t in targets],
                             dtype=grads[0].dtype, device=grads[0].device)
        return cls(model, matched, params, grads, w, targets)

    @property
    def size(self) -> int:
        return len(self.targets)

    def dummy_gradients(self, x: torch.Tensor, y: torch.Tensor, create_graph: bool = True
                        ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per-victim gradients of the matched parameters for dummy data ``x`` ``(A, B, C, H, W)`` with
        labels ``y`` ``(A, B)`` int64 or ``(A, B, K)`` probabilities; returns ``(A, *shape)`` gradients and
        the logits ``(A, B, K)``. ``A`` is any number of victims (they share the global model)."""
        A, B = x.shape[0], x.shape[1]
        stacked = {n: self.params[n].unsqueeze(0).expand(A, *self.params[n].shape).requires_grad_(True)
                   for n in self.matched}
        fixed = {n: p for n, p in self.params.items() if n not in stacked}
        model = self.model

        def forward(p: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
            return functional_call(model, {**fixed, **p}, (xb,))

        logits = vmap(forward)(stacked, x)
        K = logits.shape[-1]
        target = y.reshape(A * B, K) if y.is_floating_point() else y.reshape(A * B)
        per_victim = F.cross_entropy(logits.reshape(A * B, K), target, reduction="none").view(A, B).mean(1)
        grads = torch.autograd.grad(per_victim.sum(), [stacked[n] for n in self.matched], create_graph=create_graph)
        return list(grads), logits

    def select(self, rows: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Target gradients and layer weights of the victims ``rows``."""
        grads = [g.index_select(0, rows.to(g.device)) for g in self.grads]
        w = self.weights.index_select(0, rows.to(self.weights.device)) if self.weights is not None else None
        return grads, w

    def distance(self, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, metric: str = "l2"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-victim matching loss ``(A,)`` of the victims ``rows`` and the logits (single-step mode)."""
        grads, logits = self.dummy_gradients(x, y)
        target, w = self.select(rows)
        return stacked_distance(grads, target, metric, w), logits


def stacked_distance(dummy: Sequence[torch.Tensor], target: Sequence[torch.Tensor], metric: str = "l2",
                     weights: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`attacks.gradients.gradient_distance` for every victim of a stack: ``(A,)``."""
    A = dummy[0].shape[0]

    def wl(i: int) -> torch.Tensor | float:
        return weights[:, i] if weights is not None else 1.0

    if metric == "l2":
        return sum(wl(i) * (d - t).pow(2).reshape(A, -1).sum(1) for i, (d, t) in enumerate(zip(dummy, target)))
    if metric == "cosine":
        dot = sum(wl(i) * (d * t).reshape(A, -1).sum(1) for i, (d, t) in enumerate(zip(dummy, target)))
        dn = sum(wl(i) * d.pow(2).reshape(A, -1).sum(1) for i, d in enumerate(dummy))
        tn = sum(wl(i) * t.pow(2).reshape(A, -1).sum(1) for i, t in enumerate(target))
        return 1 - dot / (dn.clamp_min(1e-24).sqrt() * tn.clamp_min(1e-24).sqrt())
    raise ValueError(f"unknown gradient distance {metric!r}; use 'l2' or 'cosine'")


# ---------------------------------------------------------------- batched L-BFGS
class BatchedLBFGS:
    """``torch.optim.LBFGS(lr, max_iter=1, history_size, tolerance_grad=0, tolerance_change=0)``, one
    independent state per row of a ``(A, n)`` problem. :meth:`direction` takes the rows' flat gradients
    at the current iterates and returns the step to add (zero for rows that do not move)."""

    def __init__(self, rows: int, n: int, lr: float = 1.0, history: int = 100, dtype=torch.float32,
                 device: torch.device | str = "cpu"):
        self.lr, self.history = float(lr), int(history)
        z = torch.zeros((rows, n), dtype=dtype, device=device)
        self.d, self.prev_g = z.clone(), z.clone()
        self.t = torch.zeros(rows, dtype=dtype, device=device)
        self.h_diag = torch.ones(rows, dtype=dtype, device=device)
        self.n_iter = torch.zeros(rows, dtype=torch.long, device=device)
        self.count = torch.zeros(rows, dtype=torch.long, device=device)
        self.entries: list[list[torch.Tensor]] = []  # [y, s, ro]: ro = 0 where the row did not store it

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` (victims that stopped)."""
        for name in ("d", "prev_g", "t", "h_diag", "n_iter", "count"):
            setattr(self, name, getattr(self, name).index_select(0, rows))
        self.entries = [[e.index_select(0, rows) for e in ent] for ent in self.entries]
        self._prune()

    def _prune(self) -> None:
        self.entries = [e for e in self.entries if bool((e[2] != 0).any())]

    @torch.no_grad()
    def direction(self, g: torch.Tensor) -> torch.Tensor:
        active = g.abs().amax(1) > 0  # torch returns at once when the gradient is exactly zero
        if not bool(active.any()):
            return torch.zeros_like(g)
        self.n_iter += active.long()
        first = active & (self.n_iter == 1)
        later = active & (self.n_iter > 1)
        d_new = self.d
        if bool(later.any()):
            y = g - self.prev_g
            s = self.d * self.t.unsqueeze(1)
            ys = torch.linalg.vecdot(y, s)
            upd = later & (ys > 1e-10)
            if bool(upd.any()):
                full = upd & (self.count == self.history)
                for r in full.nonzero().flatten().tolist():  # drop the row's oldest stored pair
                    for e in self.entries:
                        if e[2][r] != 0:
                            e[0][r] = 0
                            e[1][r] = 0
                            e[2][r] = 0
                            break
                self.count -= full.long()
                m = upd.unsqueeze(1)
                ro = torch.where(upd, 1.0 / torch.where(upd, ys, torch.ones_like(ys)), torch.zeros_like(ys))
                self.entries.append([torch.where(m, y, 0.0), torch.where(m, s, 0.0), ro])
                self.count += upd.long()
                yy = torch.linalg.vecdot(y, y)
                self.h_diag = torch.where(upd, ys / torch.where(upd, yy, torch.ones_like(yy)), self.h_diag)
                self._prune()
            q = g.neg()
            als: list[torch.Tensor] = [torch.empty(0)] * len(self.entries)
            for i in range(len(self.entries) - 1, -1, -1):
                yi, si, ri = self.entries[i]
                al = torch.linalg.vecdot(si, q) * ri
                als[i] = al
                q.addcmul_(yi, al.unsqueeze(1), value=-1)
            r = q * self.h_diag.unsqueeze(1)
            for i in range(len(self.entries)):
                yi, si, ri = self.entries[i]
                be = torch.linalg.vecdot(yi, r) * ri
                r.addcmul_(si, (als[i] - be).unsqueeze(1))
            d_new = torch.where(later.unsqueeze(1), r, self.d)
        self.d = torch.where(first.unsqueeze(1), g.neg(), d_new)
        self.prev_g = torch.where(active.unsqueeze(1), g, self.prev_g)
        t_first = torch.clamp(1.0 / g.abs().sum(1), max=1.0) * self.lr
        self.t = torch.where(first, t_first, torch.where(later, torch.full_like(self.t, self.lr), self.t))
        gtd = torch.linalg.vecdot(g, self.d)
        move = active & (gtd <= 0)  # torch stops the step when g.d > -tolerance_change (= 0)
        return torch.where(move.unsqueeze(1), self.d * self.t.unsqueeze(1), torch.zeros_like(g))


def stack_tick(done: int, total: int, distances: Sequence[float], active: int, size: int) -> None:
    """Progress of a stacked loop (:func:`fedsim.progress.tick`, also the loop's stop check): the
    iteration, the lowest current gradient distance over the victims still optimised and how many of the
    stack's victims those are."""
    finite = [d for d in distances if math.isfinite(d)]
    progress.tick(done, total, **{"min distance": min(finite) if finite else math.nan,
                                  "victims": f"{active}/{size}"})


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(t.shape[0], -1) for t in tensors], 1)


def batched_lbfgs_loop(variables: list[torch.Tensor],
                       objective: Callable[[torch.Tensor, list[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
                       iterations: int, history: int = 100, lr: float = 1.0, threshold: float | None = None,
                       stop_at_threshold: bool = False, patience: int | None = None,
                       limits: Sequence[int] | None = None, floors: Sequence[float] | None = None
                       ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """:func:`attacks._common.lbfgs_loop` for ``V`` stacked problems (``variables`` ``(V, ...)``).

    ``objective(rows, vars)`` gets the indices of the victims still optimised and their variables and
    returns their losses and gradient distances ``(A,)``. ``limits`` caps each victim's iterations
    (default: ``iterations`` for all), ``floors`` are their :class:`Stagnation` floors. Returns the variables each victim ends with (its best iterate,
    as ``lbfgs_loop`` leaves them) and one trace per victim.
    """
    V = variables[0].shape[0]
    device = variables[0].device
    final = [v.detach().clone() for v in variables]
    cur = [v.detach().clone() for v in variables]
    rows = torch.arange(V, device=device)
    opt = BatchedLBFGS(V, sum(v[0].numel() for v in variables), lr, history, variables[0].dtype, device)
    best_loss = [math.inf] * V
    losses: list[list[float]] = [[] for _ in range(V)]
    converged: list[int | None] = [None] * V
    diverged = [False] * V
    stopped: list[str | None] = [None] * V
    stalls = [Stagnation(patience, floors[v] if floors is not None else 0.0) for v in range(V)]
    caps = [int(c) for c in limits] if limits is not None else [iterations] * V
    for it in range(iterations):
        if len(rows) == 0:
            break
        xs = [c.requires_grad_(True) for c in cur]
        loss, dist = objective(rows, xs)
        grads = torch.autograd.grad(loss.sum(), xs)
        lv, dv = loss.detach().tolist(), dist.detach().tolist()
        stop: list[int] = []
        better: list[int] = []
        for j, v in enumerate(rows.tolist()):
            if not math.isfinite(lv[j]):
                diverged[v] = True
                stopped[v] = "diverged"
                stop.append(j)
                continue
            losses[v].append(lv[j])
            if lv[j] < best_loss[v]:
                best_loss[v] = lv[j]
                better.append(j)
            if threshold is not None and converged[v] is None and dv[j] < threshold:
                converged[v] = it
                if stop_at_threshold:
                    stopped[v] = "threshold"
                    stop.append(j)
                    if j not in better:
                        better.append(j)
                    continue
            if stalls[v].step(dv[j]):
                stopped[v] = "patience"
                stop.append(j)
            elif len(losses[v]) >= caps[v]:  # its budget is spent (stopped stays None)
                stop.append(j)
        stack_tick(it + 1, iterations, [d for d, lo in zip(dv, lv) if math.isfinite(lo)], len(rows), V)
        cur, rows = _advance(opt, final, cur, rows, grads, better, stop)
    traces = [{"loss": losses[v], "iterations": len(losses[v]), "converged_at": converged[v],
               "diverged": diverged[v], "stopped": stopped[v]} for v in range(V)]
    return final, traces


@torch.no_grad()
def _advance(opt: "BatchedLBFGS", final: list[torch.Tensor], cur: list[torch.Tensor], rows: torch.Tensor,
             grads: Sequence[torch.Tensor], better: list[int], stop: list[int]
             ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One iteration's bookkeeping of :func:`batched_lbfgs_loop`: the stack positions in ``better`` keep
    their current iterate as their best (in ``final``), every victim takes its L-BFGS step, and the
    positions in ``stop`` leave the stack. Returns the new iterates and the victims still optimised."""
    device = rows.device
    if better:
        bj = torch.tensor(better, device=device)
        bv = rows.index_select(0, bj)
        for f, c in zip(final, cur):
            f.index_copy_(0, bv, c.detach().index_select(0, bj))
    step = opt.direction(_flat(grads))
    offset = 0
    new = []
    for c in cur:
        n = c[0].numel()
        new.append(c.detach() + step[:, offset:offset + n].view_as(c))
        offset += n
    cur = new
    if stop:
        keep = torch.tensor([j for j in range(len(rows)) if j not in set(stop)], dtype=torch.long, device=device)
        rows = rows.index_select(0, keep)
        cur = [c.index_select(0, keep) for c in cur]
        opt.keep(keep)
    return cur, rows
