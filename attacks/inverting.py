"""Inverting Gradients (Geiping et al., NeurIPS 2020).

Matches the direction of the gradient rather than its magnitude: the loss is one cosine distance over
all matched layers, ``1 - <g_dummy, g> / (|g_dummy| |g|)`` (optionally weighted per layer), plus a
total-variation prior ``tv * TV(x)``. The dummy images are optimised with Adam on the *sign* of the
loss gradient, with the step size divided by 10 at 3/8, 5/8 and 7/8 of the iterations, and clamped
to the data range [0, 1] after every step (box constraint). Labels come from the gradient
(:mod:`attacks.labels`). Several restarts keep the one with the lowest final loss.

``fedavg_aware=True`` attacks a multi-step FedAvg update as in the paper's section 5: the candidates
are the client's whole local set (``num_examples`` images), the recipe's local SGD steps are replayed
on them differentiably (:func:`attacks.gradients.simulate_update`) and the simulated update is
matched to the observed one. Without it a multi-step update is matched as its average gradient.
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from fedsim import progress

from ._common import (
    Count,
    Init,
    Labels,
    LayerWeights,
    Muted,
    NonNegative,
    Positive,
    RestartLog,
    Target,
    Threshold,
    choose_labels,
    clamp_to,
    finish,
    finish_group,
    generator,
    init_dummy,
    patterns,
    prepare_target,
)
from .base import Attack, AttackInput, AttackResult, register


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic TV: mean absolute difference of horizontal plus of vertical neighbours."""
    dx = (x[:, :, :, 1:] - x[:, :, :, :-1]).abs().mean()
    dy = (x[:, :, 1:, :] - x[:, :, :-1, :]).abs().mean()
    return dx + dy


@register
class InvertingGradients(Attack):
    """Inverting Gradients. Parameters:

    * ``iterations`` (2000): Adam steps per restart; ``lr`` (0.1) the initial step size;
    * ``tv`` (3e-3): weight of the total-variation prior (images in [0, 1]). Measured on the sigmoid
      LeNet at batch 1 (10 fmnist-small test images, 2000 steps): SSIM >= 0.9 on 2/10 with 1e-2 (the
      default before the strongest-attack study), 8/10 with 1e-3, 9/10 with 3e-3, 4/10 with 1e-4.
      Records (tabular data, inputs (F,)) have no neighbouring features: the prior is not applied to
      them (``trace["tv_applied"]`` says which), and nor is the [0, 1] box (``AttackInput.bounds``);
    * ``init`` (``"random"``): see :func:`attacks._common.init_dummy`; ``restarts`` (1): attempts from
      fresh starts, a new one only while none has reached ``threshold`` (the lowest final loss is kept);
    * ``layer_weights``: None (all layers equal), ``"linear"``, ``"exp"``, a list or a pattern mapping;
    * ``muted``: ``fnmatch`` patterns of parameter names left out of the matching loss;
    * ``labels`` (``"idlg"``): inferred from the gradient, or ``"known"``;
    * ``fedavg_aware`` (False): replay the recipe's local steps (see module doc);
    * ``lr_decay`` (True): the step decay; ``signed`` (True): Adam on the sign of the gradient;
    * ``threshold`` (None): cosine distance under which ``trace["converged_at"]`` is recorded.
    """

    name = "ig"
    supports_records = True  # on records: no TV prior, no box (AttackInput.bounds is None)

    def __init__(self, iterations: Count = 2000, lr: Positive = 0.1, tv: NonNegative = 3e-3, init: Init = "random",
                 pattern: Count = 2, restarts: Count = 1, layer_weights: LayerWeights = None, muted: Muted = None,
                 labels: Labels = "idlg", fedavg_aware: bool = False, lr_decay: bool = True, signed: bool = True,
                 threshold: Threshold = None):
        self.iterations, self.lr, self.tv = iterations, float(lr), float(tv)
        self.init, self.pattern, self.restarts = init, pattern, restarts
        self.layer_weights, self.muted, self.labels = layer_weights, patterns(muted), labels
        self.fedavg_aware, self.lr_decay, self.signed = bool(fedavg_aware), bool(lr_decay), bool(signed)
        self.threshold = None if threshold is None else float(threshold)

    def run(self, inp: AttackInput) -> AttackResult:
        t0 = time.perf_counter()
        target = prepare_target(inp, self.muted, self.layer_weights)
        n = int(inp.num_examples) if self.fedavg_aware else inp.batch_size
        y = choose_labels(self.labels, target, inp, n)
        log = RestartLog()
        for attempt in range(self.restarts):
            x, trace = self._attempt(inp, target, y, n, attempt)
            log.add(x, y, trace)
            if log.done:
                break
        x, _, trace = log.result(fedavg_aware=self.fedavg_aware, tv_applied=self._tv(inp) > 0)
        return finish(x, y, trace, t0, inp.bounds)

    def _tv(self, inp: AttackInput) -> float:
        """The TV weight for these inputs: 0 on records (no neighbouring features)."""
        return 0.0 if inp.records else self.tv

    def _start(self, inp: AttackInput, n: int, attempt: int) -> torch.Tensor:
        gen = generator(inp, attempt)
        return clamp_to(init_dummy(self.init, (n, *inp.input_shape), gen, self.pattern), inp.bounds)

    def _milestones(self) -> list[int]:
        return sorted({max(1, int(self.iterations * f)) for f in (3 / 8, 5 / 8, 7 / 8)})

    def _attempt(self, inp: AttackInput, target: Target, y: torch.Tensor, n: int,
                 attempt: int) -> tuple[torch.Tensor, dict]:
        x = self._start(inp, n, attempt).to(inp.device).requires_grad_(True)
        tv, box = self._tv(inp), inp.bounds
        opt = torch.optim.Adam([x], lr=self.lr)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=self._milestones(), gamma=0.1) \
            if self.lr_decay else None
        losses: list[float] = []
        best_x, best_loss = x.detach().clone(), math.inf
        converged_at = None
        for it in range(self.iterations):
            opt.zero_grad(set_to_none=True)
            dist, _ = target.distance(x, y, "cosine", fedavg=self.fedavg_aware)
            loss = dist + tv * total_variation(x) if tv else dist
            (x.grad,) = torch.autograd.grad(loss, [x])
            value = float(loss.detach())
            if not math.isfinite(value):
                break
            losses.append(value)
            if value < best_loss:
                best_x, best_loss = x.detach().clone(), value
            if self.threshold is not None and converged_at is None and float(dist.detach()) < self.threshold:
                converged_at = it
            progress.tick(it + 1, self.iterations, distance=float(dist.detach()))
            if self.signed:
                x.grad.sign_()
            opt.step()
            if sched is not None:
                sched.step()
            if box is not None:
                with torch.no_grad():
                    x.clamp_(*box)
        return best_x, {"loss": losses, "iterations": len(losses), "converged_at": converged_at}

    # ---- several victims at once (attacks.batched) ----
    def batchable(self) -> bool:
        return not self.fedavg_aware  # the replay of local steps is not stacked

    def run_group(self, inputs: Sequence[AttackInput]) -> list[AttackResult]:
        from .batched import StackedTarget

        t0 = time.perf_counter()
        st = StackedTarget.build(inputs, self.muted, self.layer_weights)
        n = inputs[0].batch_size
        ys = [choose_labels(self.labels, t, inp, n) for t, inp in zip(st.targets, inputs)]
        logs = [RestartLog() for _ in inputs]
        for attempt in range(self.restarts):
            todo = [v for v, log in enumerate(logs) if not log.done]
            if not todo:
                break
            for v, (x, trace) in zip(todo, self._attempt_group(inputs, st, ys, n, attempt, todo)):
                logs[v].add(x, ys[v], trace)
        out = [log.result(fedavg_aware=False, tv_applied=self._tv(inputs[0]) > 0) for log in logs]
        return finish_group([o[0] for o in out], ys, [o[2] for o in out], t0, inputs[0].bounds)

    def _attempt_group(self, inputs: Sequence[AttackInput], st, ys: list[torch.Tensor], n: int, attempt: int,
                       todo: list[int]) -> list[tuple[torch.Tensor, dict]]:
        """One attempt for the victims ``todo``: Adam on the stacked images is element-wise, so each
        victim's images move exactly as in :meth:`_attempt`."""
        from .batched import stack_tick, stacked_distance

        dev = inputs[0].device
        x = torch.stack([self._start(inputs[v], n, attempt) for v in todo]).to(dev).requires_grad_(True)
        y = torch.stack([ys[v] for v in todo]).to(dev)
        victims = torch.tensor(todo, dtype=torch.long, device=dev)
        target, weights = st.select(victims)
        tv, box = self._tv(inputs[0]), inputs[0].bounds
        opt = torch.optim.Adam([x], lr=self.lr)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=self._milestones(), gamma=0.1) \
            if self.lr_decay else None
        A = len(todo)
        losses: list[list[float]] = [[] for _ in todo]
        best_x = x.detach().clone()
        best_loss = [math.inf] * A
        converged: list[int | None] = [None] * A
        alive = [True] * A
        for it in range(self.iterations):
            opt.zero_grad(set_to_none=True)
            grads, _ = st.dummy_gradients(x, y)
            dist = stacked_distance(grads, target, "cosine", weights)
            loss = dist + tv * tv_stacked(x) if tv else dist
            lv, dv = loss.detach().tolist(), dist.detach().tolist()
            for j in range(A):
                if not alive[j]:
                    continue
                if not math.isfinite(lv[j]):  # as _attempt: this victim's attempt ends here
                    alive[j] = False
                    continue
                losses[j].append(lv[j])
                if lv[j] < best_loss[j]:
                    best_loss[j] = lv[j]
                    best_x[j] = x[j].detach()
                if self.threshold is not None and converged[j] is None and dv[j] < self.threshold:
                    converged[j] = it
            if not any(alive):
                break
            stack_tick(it + 1, self.iterations, [d for d, a in zip(dv, alive) if a], sum(alive), A)
            (x.grad,) = torch.autograd.grad(loss.nan_to_num(0.0).sum(), [x])
            if self.signed:
                x.grad.sign_()
            opt.step()
            if sched is not None:
                sched.step()
            if box is not None:
                with torch.no_grad():
                    x.clamp_(*box)
        return [(best_x[j], {"loss": losses[j], "iterations": len(losses[j]), "converged_at": converged[j]})
                for j in range(A)]


def tv_stacked(x: torch.Tensor) -> torch.Tensor:
    """:func:`total_variation` of each victim's batch in a stack ``(A, B, C, H, W)``: ``(A,)``."""
    dx = (x[..., :, 1:] - x[..., :, :-1]).abs().flatten(1).mean(1)
    dy = (x[..., 1:, :] - x[..., :-1, :]).abs().flatten(1).mean(1)
    return dx + dy
