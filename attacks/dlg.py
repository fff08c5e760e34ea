"""Deep Leakage from Gradients (Zhu et al., NeurIPS 2019) and iDLG (Zhao et al. 2020).

DLG optimises dummy inputs and dummy label logits jointly so that the gradient they produce on the
global model matches the observed one in squared L2 distance, with L-BFGS (learning rate 1, no line
search, a long history). The dummy label enters the cross-entropy as soft targets
``softmax(dummy_logits)``; the reported label is their argmax. iDLG instead reads the label off the
last layer's gradient (:mod:`attacks.labels`) and optimises the inputs only.
"""
from __future__ import annotations

import time
from typing import Annotated, Sequence

import torch

from fedsim.lifecycle import preset
from fedsim.params import OneOf

from ._common import (
    POSITIVE,
    Count,
    Init,
    LayerWeights,
    Muted,
    NonNegative,
    RestartLog,
    Target,
    Threshold,
    box_penalty,
    choose_labels,
    finish,
    finish_group,
    generator,
    init_dummy,
    lbfgs_loop,
    patterns,
    prepare_target,
)
from .base import ATTACKS, Attack, AttackInput, AttackResult, register

LABEL_MODES = ("joint", "idlg", "known")


@register
class DLG(Attack):
    """DLG. Parameters (defaults: the strongest measured setting, docs/benchmarks.md "Attack strength"):

    * ``iterations`` (3000): the attack's budget of L-BFGS steps (one objective evaluation each), over
      all its attempts;
    * ``labels`` (``"joint"``): ``joint`` optimises soft dummy labels with the data (DLG), ``idlg``
      infers them from the gradient (iDLG), ``known`` uses the threat model's known labels;
    * ``init`` (``"random"``, U(0, 1)): see :func:`attacks._common.init_dummy` (images or records);
      ``pattern`` its tile count;
    * ``muted``: ``fnmatch`` patterns of parameter names left out of the matching loss;
    * ``layer_weights``: optional per-layer weights of the distance;
    * ``history`` (100): L-BFGS history; ``line_search`` (None or ``"strong_wolfe"``; the line search
      stalled on the sigmoid LeNet in every measured batch-4 attack);
    * ``threshold`` (1e-4): gradient distance under which the attack counts as converged
      (``trace["converged_at"]``); ``stop_at_threshold`` (False) ends the attack there;
    * ``patience`` (100): an attempt ends when its gradient distance has made no progress (a 1%
      fall) for this many iterations (:class:`attacks._common.Stagnation`): stalled starts (saturated
      sigmoids) end early; None: never (also disables ``tol``);
    * ``box`` (0): weight of a penalty on dummy values outside the attacker's value box
      (:attr:`attacks.base.AttackInput.bounds`; images: [0, 1]), ``box * sum(relu(x - hi)^2 +
      relu(lo - x)^2)`` (:func:`attacks._common.box_penalty`) added to the loss, not to the gradient
      distance that ``patience``, ``tol`` and ``threshold`` watch; 0 (the default, as in DLG and CPL): no
      penalty. An extension: the ``strongest`` preset sets it (at batch 8 its unboxed L-BFGS reached
      gradient distances of 1e-5 with pixels at -0.5 and 1.27, which clamping turned into 1e-2);
    * ``tol`` (1e-10): with ``patience`` set, an attempt also ends once its gradient distance is below
      ``tol`` times the squared norm of the target gradient: the match is exact to float precision
      (on the sigmoid LeNet at batch 1 the distance settles at 1e-11 to 4e-11 of it, where L-BFGS
      still finds rare 1% falls);
    * ``restarts`` (4): at most this many attempts from fresh random initialisations, sharing the
      budget: each attempt may use what the earlier ones left, so a new attempt follows only an attempt
      that ended early without converging (it stalled or diverged; with ``patience=None`` the first
      attempt uses the whole budget unless it stops at the threshold). No new attempt follows a
      converged one (the attacker sees the distance). The attempt returned is the first converged one,
      else the one with the lowest loss. ``trace["iterations"]`` and ``converged_at`` count iterations
      over all attempts made (the attack's cost, at most ``iterations``), ``trace["loss"]`` is the
      returned attempt's curve, ``trace["attempt_iterations"]`` each attempt's length,
      ``trace["stopped"]`` why the returned attempt ended (``"threshold"``, ``"patience"``,
      ``"diverged"`` or None: the budget ran out).

    The defaults before the strongest-attack study were ``iterations=300, restarts=1, patience=None``
    (then ``restarts`` gave every attempt the full ``iterations``; ``iterations=k*n, restarts=k`` with
    ``patience`` set is the closest setting now).
    """

    name = "dlg"
    supports_records = True  # images (C, H, W) or records (F,): nothing here is image-shaped but init_dummy

    def __init__(self, iterations: Count = 3000, labels: Annotated[str, OneOf(*LABEL_MODES)] = "joint",
                 init: Init = "random", pattern: Count = 2, muted: Muted = None, layer_weights: LayerWeights = None,
                 history: Count = 100, line_search: Annotated[str | None, OneOf("strong_wolfe")] = None,
                 threshold: Threshold = 1e-4, stop_at_threshold: bool = False, restarts: Count = 4,
                 patience: Annotated[int | None, POSITIVE] = 100, tol: NonNegative = 1e-10,
                 box: NonNegative = 0.0):
        self.iterations, self.labels, self.init, self.pattern = iterations, labels, init, pattern
        self.muted, self.layer_weights = patterns(muted), layer_weights
        self.history, self.line_search = history, line_search
        self.threshold = None if threshold is None else float(threshold)
        self.stop_at_threshold = bool(stop_at_threshold)
        self.restarts, self.patience, self.tol, self.box = restarts, patience, float(tol), float(box)

    # hook for CPL's label regulariser: extra loss from the dummy logits and the labels
    def regulariser(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        return None

    def run(self, inp: AttackInput) -> AttackResult:
        t0 = time.perf_counter()
        target: Target = prepare_target(inp, self.muted, self.layer_weights)
        B = inp.batch_size
        y_fixed = None if self.labels == "joint" else choose_labels(self.labels, target, inp, B)
        log = RestartLog()
        for attempt in range(self.restarts):
            log.add(*self._attempt(inp, target, y_fixed, attempt, self.iterations - log.spent))
            if log.done or log.spent >= self.iterations:
                break
        x, labels, trace = log.result(labels_mode=self.labels)
        return finish(x, labels, trace, t0, inp.bounds)

    # ---- several victims at once (attacks.batched) ----
    def batchable(self) -> bool:
        return self.line_search is None  # the batched L-BFGS has no line search

    def run_group(self, inputs: Sequence[AttackInput]) -> list[AttackResult]:
        from .batched import StackedTarget

        t0 = time.perf_counter()
        st = StackedTarget.build(inputs, self.muted, self.layer_weights)
        B = inputs[0].batch_size
        y_fixed = None if self.labels == "joint" else \
            [choose_labels(self.labels, t, inp, B) for t, inp in zip(st.targets, inputs)]
        logs = [RestartLog() for _ in inputs]
        for attempt in range(self.restarts):
            todo = [v for v, log in enumerate(logs) if not log.done and log.spent < self.iterations]
            if not todo:
                break
            budgets = [self.iterations - logs[v].spent for v in todo]
            for v, res in zip(todo, self._attempt_group(inputs, st, y_fixed, attempt, todo, budgets)):
                logs[v].add(*res)
        out = [log.result(labels_mode=self.labels) for log in logs]
        return finish_group([o[0] for o in out], [o[1] for o in out], [o[2] for o in out], t0, inputs[0].bounds)

    def _attempt_group(self, inputs: Sequence[AttackInput], st, y_fixed: list[torch.Tensor] | None, attempt: int,
                       todo: list[int], budgets: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
        from .batched import batched_lbfgs_loop

        B, dev = inputs[0].batch_size, inputs[0].device
        xs, ys = [], []
        for v in todo:  # each victim's start drawn exactly as run() draws it
            gen = generator(inputs[v], attempt)
            xs.append(init_dummy(self.init, (B, *inputs[v].input_shape), gen, self.pattern))
            if y_fixed is None:
                ys.append(torch.randn((B, inputs[v].num_classes), generator=gen))
        variables = [torch.stack(xs).to(dev)] + ([torch.stack(ys).to(dev)] if y_fixed is None else [])
        victims = torch.tensor(todo, dtype=torch.long, device=dev)
        labels_fixed = torch.stack([y_fixed[v] for v in todo]).to(dev) if y_fixed is not None else None

        def objective(rows: torch.Tensor, vs: list[torch.Tensor]):
            y = torch.softmax(vs[1], dim=-1) if labels_fixed is None else labels_fixed.index_select(0, rows)
            dist, logits = st.distance(vs[0], y, victims.index_select(0, rows), "l2")
            reg = self.regulariser(logits, y)
            loss = dist if reg is None else dist + reg
            if self.box:
                loss = loss + self.box * box_penalty(vs[0], inputs[0].bounds, stacked=True)
            return loss, dist

        final, traces = batched_lbfgs_loop(variables, objective, max(budgets), self.history, 1.0,
                                           self.threshold, self.stop_at_threshold, self.patience, limits=budgets,
                                           floors=[self.tol * st.targets[v].norm2() for v in todo])
        out = []
        for j, v in enumerate(todo):
            labels = final[1][j].argmax(-1) if y_fixed is None else y_fixed[v]
            out.append((final[0][j], labels, traces[j]))
        return out

    def _attempt(self, inp: AttackInput, target: Target, y_fixed: torch.Tensor | None,
                 attempt: int, iterations: int, start: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """One attempt from the ``init`` draw of ``attempt`` or, given, from the images ``start``."""
        B = inp.batch_size
        gen = generator(inp, attempt)
        x0 = init_dummy(self.init, (B, *inp.input_shape), gen, self.pattern) if start is None else start.detach()
        x = x0.clone().to(inp.device).requires_grad_(True)
        variables = [x]
        if y_fixed is None:
            y_logits = torch.randn((B, inp.num_classes), generator=gen).to(inp.device).requires_grad_(True)
            variables.append(y_logits)

        def objective():
            y = torch.softmax(y_logits, dim=-1) if y_fixed is None else y_fixed
            dist, logits = target.distance(x, y, "l2")
            reg = self.regulariser(logits, y)
            loss = dist if reg is None else dist + reg
            if self.box:
                loss = loss + self.box * box_penalty(x, inp.bounds)
            return loss, dist

        trace = lbfgs_loop(variables, objective, iterations, self.history, 1.0, self.line_search,
                           self.threshold, self.stop_at_threshold, self.patience, self.tol * target.norm2())
        labels = y_logits.detach().argmax(-1) if y_fixed is None else y_fixed
        return x.detach(), labels, trace


DLGOriginal = ATTACKS.register(preset(
    DLG, "dlg-original", class_name="DLGOriginal", init="randn", iterations=300 * 20, restarts=1, patience=300 * 20,
    doc="""DLG as in the original (Zhu et al. 2019's code; the DLG seed 003's Table 3.6 compares against):
    one attempt from N(0, 1) dummy data and label logits (``randn``), L-BFGS with learning rate 1 and
    history 100 without a line search, and the original's budget: 300 ``torch.optim.LBFGS`` steps of
    PyTorch's default ``max_iter=20`` iterations, i.e. at most 6,000 iterations here (one objective
    evaluation each; the L-BFGS trajectory is the same, the optimiser's state carries over between
    steps). No stall stop (``patience`` = the budget); like the original, which ends a step when the
    loss changes by less than 1e-9, it stops at an exact match (``tol``), where more steps cannot change
    the images. A preset of :class:`DLG`: only these defaults differ, every parameter can be set."""))

IDLG = ATTACKS.register(preset(
    DLG, "idlg", class_name="IDLG", labels="idlg",
    doc="""iDLG: DLG with the label inferred from the last layer's gradient (a preset: ``labels="idlg"``)."""))
