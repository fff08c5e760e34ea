"""Deep Leakage from Gradients (Zhu et al., NeurIPS 2019) and iDLG (Zhao et al. 2020).

DLG optimises dummy inputs and dummy label logits jointly so that the gradient they produce on the
global model matches the observed one in squared L2 distance, with L-BFGS (learning rate 1, no line
search, a long history). The dummy label enters the cross-entropy as soft targets
``softmax(dummy_logits)``; the reported label is their argmax. iDLG instead reads the label off the
last layer's gradient (:mod:`attacks.labels`) and optimises the inputs only.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch

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
    lbfgs_loop,
    prepare_target,
)
from .base import Attack, AttackInput, AttackResult, register

LABEL_MODES = ("joint", "idlg", "known")


@register
class DLG(Attack):
    """DLG. Parameters:

    * ``iterations`` (300): L-BFGS steps (one objective evaluation each);
    * ``labels`` (``"joint"``): ``joint`` optimises soft dummy labels with the data (DLG), ``idlg``
      infers them from the gradient (iDLG), ``known`` uses the threat model's known labels;
    * ``init`` (``"random"``, U(0, 1)): see :func:`attacks._common.init_dummy`; ``pattern`` its tile count;
    * ``muted``: ``fnmatch`` patterns of parameter names left out of the matching loss;
    * ``layer_weights``: optional per-layer weights of the distance;
    * ``history`` (100): L-BFGS history; ``line_search`` (None or ``"strong_wolfe"``);
    * ``threshold`` (1e-4): gradient distance under which the attack counts as converged
      (``trace["converged_at"]``); ``stop_at_threshold`` (False) ends the attack there;
    * ``restarts`` (1): attempts from fresh random initialisations; a new attempt starts only while no
      attempt has converged (the attacker sees the distance), and the attempt with the lowest final
      loss is returned. ``trace["iterations"]`` and ``converged_at`` count iterations over all
      attempts made (the attack's cost), ``trace["loss"]`` is the returned attempt's curve.
    """

    name = "dlg"
    default_labels = "joint"
    default_init = "random"
    default_stop = False

    def __init__(self, iterations: int = 300, labels: str | None = None, init: str | None = None,
                 pattern: int = 2, muted: Sequence[str] | None = None, layer_weights: Any = None,
                 history: int = 100, line_search: str | None = None, threshold: float | None = 1e-4,
                 stop_at_threshold: bool | None = None, restarts: int = 1):
        self.iterations = check_int("iterations", iterations)
        self.labels = check_choice("labels", labels if labels is not None else self.default_labels, LABEL_MODES)
        self.init = check_choice("init", init if init is not None else self.default_init, INITS)
        self.pattern = check_int("pattern", pattern)
        self.muted = check_patterns("muted", muted)
        self.layer_weights = check_layer_weights("layer_weights", layer_weights)
        self.history = check_int("history", history)
        self.line_search = check_choice("line_search", line_search, (None, "strong_wolfe"))
        self.threshold = check_float("threshold", threshold, allow_none=True)
        stop = self.default_stop if stop_at_threshold is None else stop_at_threshold
        self.stop_at_threshold = bool(check_choice("stop_at_threshold", stop, (True, False)))
        self.restarts = check_int("restarts", restarts)

    # hook for CPL's label regulariser: extra loss from the dummy logits and the labels
    def regulariser(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        return None

    def run(self, inp: AttackInput) -> AttackResult:
        t0 = time.perf_counter()
        target: Target = prepare_target(inp, self.muted, self.layer_weights)
        B = inp.batch_size
        y_fixed = None if self.labels == "joint" else choose_labels(self.labels, target, inp, B)
        best: tuple[float, torch.Tensor, torch.Tensor, dict] | None = None
        spent, converged_at, sizes = 0, None, []
        for attempt in range(self.restarts):
            x, labels, trace = self._attempt(inp, target, y_fixed, attempt)
            final = min(trace["loss"]) if trace["loss"] else float("inf")
            if best is None or final < best[0] or (trace["converged_at"] is not None and converged_at is None):
                best = (final, x, labels, trace)
            if trace["converged_at"] is not None and converged_at is None:
                converged_at = spent + trace["converged_at"]
            spent += trace["iterations"]
            sizes.append(trace["iterations"])
            if converged_at is not None:
                break
        assert best is not None
        _, x, labels, trace = best
        trace.update(iterations=spent, converged_at=converged_at, attempts=len(sizes),
                     attempt_iterations=sizes, labels_mode=self.labels)
        return finish(x, labels, trace, t0)

    def _attempt(self, inp: AttackInput, target: Target, y_fixed: torch.Tensor | None,
                 attempt: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        B = inp.batch_size
        gen = generator(inp, attempt)
        x = init_dummy(self.init, (B, *inp.input_shape), gen, self.pattern).to(inp.device).requires_grad_(True)
        variables = [x]
        if y_fixed is None:
            y_logits = torch.randn((B, inp.num_classes), generator=gen).to(inp.device).requires_grad_(True)
            variables.append(y_logits)

        def objective():
            y = torch.softmax(y_logits, dim=-1) if y_fixed is None else y_fixed
            dist, logits = target.distance(x, y, "l2")
            reg = self.regulariser(logits, y)
            return (dist if reg is None else dist + reg), dist

        trace = lbfgs_loop(variables, objective, self.iterations, self.history, 1.0, self.line_search,
                           self.threshold, self.stop_at_threshold)
        labels = y_logits.detach().argmax(-1) if y_fixed is None else y_fixed
        return x.detach(), labels, trace


@register
class IDLG(DLG):
    """iDLG: DLG with the label inferred from the last layer's gradient (``labels="idlg"``)."""

    name = "idlg"
    default_labels = "idlg"
