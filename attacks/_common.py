"""Pieces shared by the optimisation-based attacks (DLG, iDLG, CPL, Inverting Gradients).

* :func:`init_dummy` - dummy-data initialisations (random, Gaussian, CPL's patterned, dark/light, R/G/B);
* :class:`Target` / :func:`prepare_target` - the observed update turned into the gradients to match,
  with muted layers left out and optional per-layer weights;
* :meth:`Target.distance` - the matching loss (single-step gradient or FedAvg-aware replay);
* :func:`lbfgs_loop` - the L-BFGS loop of DLG and CPL with threshold-based termination;
* the constraints the attacks' parameters share (``POSITIVE``, ``LABELS``, ``PATTERNS``, ...).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from fedsim import progress
from fedsim.params import OneOf, Range, Satisfies

from .base import AttackInput, AttackResult
from .gradients import (
    _recipe_mapping,
    assumed_schedule,
    cross_entropy,
    fedavg_distance,
    flatten_gradients,
    gradient_distance,
    layer_weights,
    local_step_count,
    select_names,
    trainable_names,
    update_to_gradient,
    vector_distance,
)
from .labels import infer_labels

INITS = ("random", "randn", "patterned", "dark", "light", "R", "G", "B")


# ---------------------------------------------------------------- parameter constraints
# the limits the attacks' parameters share, as constraint objects for their signatures (fedsim.params):
# ``iterations: Annotated[int, POSITIVE] = 300``; the registry checks them (errors name attack.<key>)
POSITIVE = Range(1)  # an integer count >= 1
NON_NEGATIVE = Range(0)
ABOVE_ZERO = Range(0, open_low=True)
LABELS = OneOf("idlg", "known")  # labels inferred from the gradient, or the threat model's known labels


def _is_patterns(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))


def _is_layer_weights(value: Any) -> bool:
    if value in ("linear", "exp", "norm"):
        return True
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    for v in value)


PATTERNS = Satisfies(_is_patterns, "a list of parameter-name patterns (fnmatch)")
LAYER_WEIGHTS = Satisfies(_is_layer_weights, "None, 'linear', 'exp', 'norm', a list of numbers or a mapping from "
                                             "parameter-name pattern to number")


# the parameter types the attacks share (constraints included), e.g. ``iterations: Count = 300``
Count = Annotated[int, POSITIVE]
NonNegative = Annotated[float, NON_NEGATIVE]
Positive = Annotated[float, ABOVE_ZERO]
Threshold = Annotated[float | None, NON_NEGATIVE]  # None: no threshold
Init = Annotated[str, OneOf(*INITS)]
Labels = Annotated[str, LABELS]
Muted = Annotated[Sequence[str] | None, PATTERNS]
LayerWeights = Annotated[Any, LAYER_WEIGHTS]


def patterns(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """A ``muted`` value (None, one pattern or a list) as a tuple of patterns."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


# ---------------------------------------------------------------- initialisation
def init_dummy(kind: str, shape: Sequence[int], gen: torch.Generator, pattern: int = 2) -> torch.Tensor:
    """Dummy data of ``shape`` (B, C, H, W) for images or (B, F) for records, drawn on the CPU from ``gen``.

    ``random`` U(0, 1); ``randn`` N(0, 1) (DLG's original ``torch.randn``); ``patterned`` (CPL) a
    random U(0, 1) tile of ``ceil(H/pattern) x ceil(W/pattern)`` repeated ``pattern x pattern`` times
    (``pattern=2``: the tile is a quarter of the image, the example of seed 001); ``dark`` all 0;
    ``light`` all 1; ``R``/``G``/``B`` that colour channel 1 and the others 0 (3 channels only).

    Records (seed 001 Table 3) get the same draws per feature. ``patterned`` there is the literal 1-D
    reading: a random tile of ``ceil(F/pattern)`` features repeated ``pattern`` times along the feature
    axis (features have no neighbourhood, so the tile is only a start with fewer free values, not an
    image prior); on standardised features ``dark`` (all 0) is the mean record. ``R``/``G``/``B`` need
    colour images.
    """
    if len(shape) == 2:  # records
        B, F = (int(s) for s in shape)
        if kind in ("random", "randn", "dark", "light"):
            return init_dummy(kind, (B, 1, 1, F), gen, pattern).reshape(B, F)
        if kind == "patterned":
            tile = torch.rand((B, math.ceil(F / pattern)), generator=gen)
            return tile.repeat(1, pattern)[:, :F].contiguous()
        if kind in ("R", "G", "B"):
            raise ValueError(f"attack.init={kind!r} is a colour initialisation and needs colour images; "
                             f"the data are records of {F} features")
        raise ValueError(f"attack.init must be one of {list(INITS)}, got {kind!r}")
    B, C, H, W = (int(s) for s in shape)
    if kind == "random":
        return torch.rand((B, C, H, W), generator=gen)
    if kind == "randn":
        return torch.randn((B, C, H, W), generator=gen)
    if kind == "patterned":
        th, tw = math.ceil(H / pattern), math.ceil(W / pattern)
        tile = torch.rand((B, C, th, tw), generator=gen)
        return tile.repeat(1, 1, pattern, pattern)[:, :, :H, :W].contiguous()
    if kind == "dark":
        return torch.zeros((B, C, H, W))
    if kind == "light":
        return torch.ones((B, C, H, W))
    if kind in ("R", "G", "B"):
        if C != 3:
            raise ValueError(f"attack.init={kind!r} is a colour initialisation and needs 3 channels, "
                             f"the data have {C}")
        x = torch.zeros((B, C, H, W))
        x[:, "RGB".index(kind)] = 1.0
        return x
    raise ValueError(f"attack.init must be one of {list(INITS)}, got {kind!r}")


def clamp_to(x: torch.Tensor, bounds: tuple[float, float] | None) -> torch.Tensor:
    """``x`` clamped to the attacker's value box (:attr:`attacks.base.AttackInput.bounds`; None: as is)."""
    return x if bounds is None else x.clamp(bounds[0], bounds[1])


def box_penalty(x: torch.Tensor, bounds: tuple[float, float] | None, stacked: bool = False) -> torch.Tensor:
    """``sum(relu(x - hi)^2 + relu(lo - x)^2)``: how far ``x`` lies outside the value box ``bounds``
    (0 for None); per victim (over all but the first dimension) when ``stacked``."""
    if bounds is None:
        return x.new_zeros(x.shape[:1] if stacked else ())
    out = (x - bounds[1]).clamp_min(0).pow(2) + (bounds[0] - x).clamp_min(0).pow(2)
    return out.flatten(1).sum(1) if stacked else out.sum()


# ---------------------------------------------------------------- target gradients
@dataclass
class Target:
    """What an attack matches: the victim's (pseudo-)gradient for the un-muted parameters."""

    model: nn.Module  # the global model, train mode, on the attack device
    names: list[str]  # every trainable parameter
    matched: list[str]  # the un-muted ones, in model order
    grads: dict[str, torch.Tensor]  # pseudo-gradient -update / (lr * steps) for every trainable name
    update: dict[str, torch.Tensor]  # the observed update for every trainable name
    recipe: dict[str, Any]
    steps: int
    weights: list[float] | None  # per matched tensor, or None

    @property
    def matched_grads(self) -> list[torch.Tensor]:
        return [self.grads[n] for n in self.matched]

    def norm2(self) -> float:
        """The (layer-weighted) squared norm of the matched gradients: the L2 distance of a zero gradient."""
        w = self.weights if self.weights is not None else [1.0] * len(self.matched)
        return float(sum(wi * float(g.double().pow(2).sum()) for wi, g in zip(w, self.matched_grads)))

    @cached_property
    def matched_params(self) -> list[torch.Tensor]:
        p = dict(self.model.named_parameters())
        return [p[n] for n in self.matched]

    @cached_property
    def flat_grads(self) -> torch.Tensor:
        """The matched gradients as one vector, layer weights applied (:func:`flatten_gradients`)."""
        return flatten_gradients(self.matched_grads, self.weights)

    def params(self, names: Sequence[str] | None = None) -> list[torch.Tensor]:
        if names is None:
            return self.matched_params
        p = dict(self.model.named_parameters())
        return [p[n] for n in names]

    def dummy_gradients(self, x: torch.Tensor, y: torch.Tensor,
                        create_graph: bool = True) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Gradients of the matched parameters for dummy data (and the logits)."""
        out = self.model(x)
        loss = cross_entropy(out, y)
        grads = torch.autograd.grad(loss, self.params(), create_graph=create_graph)
        return list(grads), out

    def distance(self, x: torch.Tensor, y: torch.Tensor, metric: str = "l2",
                 fedavg: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Matching loss for dummy data ``x`` with labels ``y`` (int64 or probability rows).

        ``fedavg=False``: one gradient of ``(x, y)`` against the pseudo-gradient. ``fedavg=True``: the
        recipe's local SGD steps are replayed on ``(x, y)`` (``x`` is then the whole candidate local
        set) and the simulated update is compared with the observed one, both scaled to
        pseudo-gradients. Returns the distance and, in single-step mode, the logits.
        """
        if not fedavg:
            grads, out = self.dummy_gradients(x, y)
            return gradient_distance(grads, self.matched_grads, metric, self.weights), out
        schedule = assumed_schedule(len(x), self.recipe)
        return fedavg_distance(self.model, x, y, self.update, self.recipe, names=self.matched, metric=metric,
                               weights=self.weights, schedule=schedule), None

    def flat_distance(self, x: torch.Tensor, y: torch.Tensor, metric: str = "l2") -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`distance` in single-step mode, on the gradients as one vector (:func:`vector_distance`):
        the same distance up to float rounding, in a few operations instead of a few per tensor."""
        grads, out = self.dummy_gradients(x, y)
        return vector_distance(flatten_gradients(grads, self.weights), self.flat_grads, metric), out

    def infer_labels(self, batch_size: int) -> torch.Tensor:
        return infer_labels(self.model, self.grads, batch_size)


def prepare_target(inp: AttackInput, muted: Sequence[str] = (), weights: Any = None) -> Target:
    model = inp.global_model()
    model.train()  # the client trains in train mode (BatchNorm uses batch statistics)
    names = trainable_names(model)
    matched = select_names(names, muted)
    recipe = dict(_recipe_mapping(inp.recipe))
    steps = local_step_count(recipe, inp.num_examples)
    grads = {n: g.to(inp.device) for n, g in
             update_to_gradient(inp.update, recipe, names=names, num_examples=inp.num_examples,
                                global_state=inp.global_state).items()}
    update = {n: inp.update[n].detach().float().to(inp.device) for n in names}
    return Target(model, names, matched, grads, update, recipe, steps, layer_weights(weights, matched, grads))


def choose_labels(mode: str, target: Target, inp: AttackInput, batch_size: int) -> torch.Tensor:
    """``idlg``: inferred from the gradient; ``known``: the threat model's ``known_labels``."""
    if mode == "known":
        if inp.known_labels is None:
            raise ValueError("attack.labels='known' but this threat model grants no labels")
        y = torch.as_tensor(inp.known_labels, dtype=torch.int64).flatten()
        if len(y) != batch_size:
            raise ValueError(f"known_labels has {len(y)} entries for a batch of {batch_size}")
        return y.to(inp.device)
    return target.infer_labels(batch_size).to(inp.device)


def generator(inp: AttackInput, salt: int = 0) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed((int(inp.seed) * 1_000_003 + salt) % (2**63))


# ---------------------------------------------------------------- optimisation
PATIENCE_TOL = 1e-2  # a distance counts as progress when it is below (1 - this) x the last progress mark


class Stagnation:
    """The patience rule: ``step(dist)`` returns True once ``patience`` consecutive gradient distances
    have not made progress (fallen below ``(1 - PATIENCE_TOL)`` times the distance at the last progress).
    A converging reconstruction keeps making progress (its distance falls by orders of magnitude), so
    only a stalled one (saturated units, a plateau, the float floor after convergence) is stopped. The
    distance, not the loss, is watched: a regulariser (CPL's label term) can dominate a loss whose
    gradient-matching part is still falling. At the float floor L-BFGS keeps finding rare 1% falls, so
    a distance below ``floor`` (an exact match) also ends the attempt."""

    def __init__(self, patience: int | None, floor: float = 0.0):
        self.patience, self.mark, self.since, self.floor = patience, math.inf, 0, floor

    def step(self, loss: float) -> bool:
        if self.patience is None:
            return False
        if loss < self.floor:
            return True
        if loss < self.mark * (1 - PATIENCE_TOL) or not math.isfinite(self.mark):
            self.mark, self.since = loss, 0
            return False
        self.since += 1
        return self.since >= self.patience


def lbfgs_loop(variables: list[torch.Tensor], objective: Callable[[], tuple[torch.Tensor, torch.Tensor]],
               iterations: int, history: int = 100, lr: float = 1.0, line_search: str | None = None,
               threshold: float | None = None, stop_at_threshold: bool = False,
               patience: int | None = None, floor: float = 0.0) -> dict[str, Any]:
    """Minimise ``objective`` (returning (loss, gradient distance)) over ``variables`` with L-BFGS.

    One iteration is one L-BFGS step (``max_iter=1``: one evaluation of the objective without a line
    search, several with ``line_search="strong_wolfe"``). ``loss[t]`` is the objective at the ``t``-th
    iterate; ``converged_at`` is the first ``t`` whose gradient distance is below ``threshold``. On exit
    the variables hold the iterate with the lowest loss seen (the converged one when stopping at the
    threshold); a non-finite loss stops the loop (``diverged``), so does a gradient distance stalled for
    ``patience`` iterations or below ``floor`` (:class:`Stagnation`; ``stopped="patience"``). Each
    iteration reports its gradient distance to the open progress task (``fedsim.progress.tick``;
    nothing when none is open).
    """
    opt = torch.optim.LBFGS(variables, lr=lr, max_iter=1, history_size=history, line_search_fn=line_search,
                            tolerance_grad=0.0, tolerance_change=0.0)
    losses: list[float] = []
    state: dict[str, Any] = {}

    def closure():
        opt.zero_grad(set_to_none=True)
        loss, dist = objective()
        # gradients of the optimised variables only (backward() would also fill the model's parameters)
        for v, g in zip(variables, torch.autograd.grad(loss, variables)):
            v.grad = g
        if "loss" not in state:  # the first evaluation of a step is at its starting iterate
            state["dist"] = float(dist.detach())
            state["loss"] = float(loss.detach())
        return loss

    best, best_loss = [v.detach().clone() for v in variables], math.inf
    converged_at, diverged, stopped = None, False, None
    stall = Stagnation(patience, floor)
    for it in range(iterations):
        snapshot = [v.detach().clone() for v in variables]
        state.clear()
        opt.step(closure)
        loss = state["loss"]
        if not math.isfinite(loss):
            diverged = True
            break
        losses.append(loss)
        if loss < best_loss:
            best, best_loss = snapshot, loss
        if threshold is not None and converged_at is None and state["dist"] < threshold:
            converged_at = it
            if stop_at_threshold:
                best, stopped = snapshot, "threshold"
                progress.tick(it + 1, iterations, distance=state["dist"])
                break
        progress.tick(it + 1, iterations, distance=state["dist"])
        if stall.step(state["dist"]):
            stopped = "patience"
            break
    with torch.no_grad():
        for v, b in zip(variables, best):
            v.copy_(b)
    return {"loss": losses, "iterations": len(losses), "converged_at": converged_at, "diverged": diverged,
            "stopped": "diverged" if diverged else stopped}


class FlatParameters:
    """The parameters of ``module`` that ``keep(name)`` selects, stored in one flat leaf tensor :attr:`flat`
    for an optimiser to step as one tensor: each parameter becomes a view of :attr:`flat`'s memory
    (:attr:`params`, in module order), so an in-place step of :attr:`flat` moves the module's weights.
    Calling it runs the module; :meth:`set_grad` gives :attr:`flat` the gradients of :attr:`params`.

    torch's CPU optimisers loop over their tensors in Python (or in foreach fallbacks): Adam over the
    image prior's 30 tensors took 1.4 ms a step, 0.16 ms over one flat tensor (one core). The update
    is element-wise, so stepping the flat tensor is the same arithmetic. The module runs on its own
    parameters (no ``functional_call``, which re-binds every parameter at each call: 0.3-0.6 ms)."""

    def __init__(self, module: nn.Module, keep: Callable[[str], bool] = lambda name: True):
        self.module = module
        self.params = [p for n, p in module.named_parameters() if keep(n)]
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        with torch.no_grad():
            for p, v in zip(self.params, self.flat.split([p.numel() for p in self.params])):
                p.data = v.view_as(p)  # the parameter now lives in flat's memory

    def __call__(self, *args: Any) -> Any:
        return self.module(*args)

    def set_grad(self, grads: Sequence[torch.Tensor]) -> None:
        """``flat.grad`` from the gradients of :attr:`params` (e.g. ``torch.autograd.grad(loss, params)``)."""
        self.flat.grad = torch.cat([g.reshape(-1) for g in grads])


class RestartLog:
    """Bookkeeping of attempts from fresh starts: a new attempt is made only while none has converged
    (its gradient distance fell below the threshold, which the attacker sees); the attempt kept is the
    first converged one, else the one with the lowest loss. ``spent``/``converged_at`` count iterations
    over all attempts made (the attack's cost)."""

    def __init__(self) -> None:
        self.best: tuple[float, torch.Tensor, torch.Tensor, dict] | None = None
        self.spent, self.converged_at, self.sizes = 0, None, []

    @property
    def done(self) -> bool:
        return self.converged_at is not None

    def add(self, x: torch.Tensor, labels: torch.Tensor, trace: dict[str, Any]) -> None:
        final = min(trace["loss"]) if trace["loss"] else math.inf
        fresh = trace["converged_at"] is not None and self.converged_at is None
        if self.best is None or final < self.best[0] or fresh:
            self.best = (final, x, labels, trace)
        if fresh:
            self.converged_at = self.spent + trace["converged_at"]
        self.spent += trace["iterations"]
        self.sizes.append(trace["iterations"])

    def result(self, **extra: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        assert self.best is not None
        _, x, labels, trace = self.best
        trace = dict(trace)
        trace.update(iterations=self.spent, converged_at=self.converged_at, attempts=len(self.sizes),
                     attempt_iterations=list(self.sizes), **extra)
        return x, labels, trace


def finish(x: torch.Tensor, labels: torch.Tensor, trace: dict[str, Any], t0: float,
           bounds: tuple[float, float] | None = (0.0, 1.0)) -> AttackResult:
    trace = dict(trace)
    trace["seconds"] = time.perf_counter() - t0
    trace.setdefault("converged_at", None)
    return AttackResult(clamp_to(x.detach(), bounds).cpu().float(), labels.detach().cpu().to(torch.int64), trace)


def finish_group(xs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], traces: Sequence[dict[str, Any]],
                 t0: float, bounds: tuple[float, float] | None = (0.0, 1.0)) -> list[AttackResult]:
    """:func:`finish` for a stacked group: each trace gets the group's wall time divided by its size."""
    per = (time.perf_counter() - t0) / max(1, len(xs))
    out = []
    for x, y, tr in zip(xs, labels, traces):
        tr = dict(tr)
        tr["seconds"] = per
        tr["group_size"] = len(xs)
        tr.setdefault("converged_at", None)
        out.append(AttackResult(clamp_to(x.detach(), bounds).cpu().float(), y.detach().cpu().to(torch.int64), tr))
    return out
