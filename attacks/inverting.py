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
from typing import Any, Sequence

import torch

from fedsim import progress

from ._common import (
    INITS,
    Target,
    check_choice,
    check_float,
    check_int,
    check_layer_weights,
    check_patterns,
    choose_labels,
    finish,
    generator,
    init_dummy,
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
    * ``tv`` (1e-2): weight of the total-variation prior (images in [0, 1]);
    * ``init`` (``"random"``): see :func:`attacks._common.init_dummy`; ``restarts`` (1);
    * ``layer_weights``: None (all layers equal), ``"linear"``, ``"exp"``, a list or a pattern mapping;
    * ``muted``: ``fnmatch`` patterns of parameter names left out of the matching loss;
    * ``labels`` (``"idlg"``): inferred from the gradient, or ``"known"``;
    * ``fedavg_aware`` (False): replay the recipe's local steps (see module doc);
    * ``lr_decay`` (True): the step decay; ``signed`` (True): Adam on the sign of the gradient;
    * ``threshold`` (None): cosine distance under which ``trace["converged_at"]`` is recorded.
    """

    name = "ig"

    def __init__(self, iterations: int = 2000, lr: float = 0.1, tv: float = 1e-2, init: str = "random",
                 pattern: int = 2, restarts: int = 1, layer_weights: Any = None,
                 muted: Sequence[str] | None = None, labels: str = "idlg", fedavg_aware: bool = False,
                 lr_decay: bool = True, signed: bool = True, threshold: float | None = None):
        self.iterations = check_int("iterations", iterations)
        self.lr = check_float("lr", lr, strict=True)
        self.tv = check_float("tv", tv)
        self.init = check_choice("init", init, INITS)
        self.pattern = check_int("pattern", pattern)
        self.restarts = check_int("restarts", restarts)
        self.layer_weights = check_layer_weights("layer_weights", layer_weights)
        self.muted = check_patterns("muted", muted)
        self.labels = check_choice("labels", labels, ("idlg", "known"))
        self.fedavg_aware = bool(check_choice("fedavg_aware", fedavg_aware, (True, False)))
        self.lr_decay = bool(check_choice("lr_decay", lr_decay, (True, False)))
        self.signed = bool(check_choice("signed", signed, (True, False)))
        self.threshold = check_float("threshold", threshold, allow_none=True)

    def run(self, inp: AttackInput) -> AttackResult:
        t0 = time.perf_counter()
        target = prepare_target(inp, self.muted, self.layer_weights)
        n = int(inp.num_examples) if self.fedavg_aware else inp.batch_size
        y = choose_labels(self.labels, target, inp, n)
        best: tuple[float, torch.Tensor, dict] | None = None
        spent = 0
        for attempt in range(self.restarts):
            x, trace = self._attempt(inp, target, y, n, attempt)
            final = min(trace["loss"]) if trace["loss"] else math.inf
            if trace["converged_at"] is not None:
                trace["converged_at"] += spent
            spent += trace["iterations"]
            if best is None or final < best[0]:
                best = (final, x, trace)
        assert best is not None
        _, x, trace = best
        trace.update(iterations=spent, attempts=self.restarts, fedavg_aware=self.fedavg_aware)
        return finish(x, y, trace, t0)

    def _attempt(self, inp: AttackInput, target: Target, y: torch.Tensor, n: int,
                 attempt: int) -> tuple[torch.Tensor, dict]:
        gen = generator(inp, attempt)
        x = init_dummy(self.init, (n, *inp.input_shape), gen, self.pattern).to(inp.device)
        x = x.clamp(0, 1).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=self.lr)
        milestones = sorted({max(1, int(self.iterations * f)) for f in (3 / 8, 5 / 8, 7 / 8)})
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.1) if self.lr_decay \
            else None
        losses: list[float] = []
        best_x, best_loss = x.detach().clone(), math.inf
        converged_at = None
        for it in range(self.iterations):
            opt.zero_grad(set_to_none=True)
            dist, _ = target.distance(x, y, "cosine", fedavg=self.fedavg_aware)
            loss = dist + self.tv * total_variation(x) if self.tv else dist
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
            with torch.no_grad():
                x.clamp_(0, 1)
        return best_x, {"loss": losses, "iterations": len(losses), "converged_at": converged_at}
