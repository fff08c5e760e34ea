"""The attack interface.

An attack sees only what its threat model shares (:class:`AttackInput`): the intercepted update,
the global model it was computed from, and the local training recipe the server configured. It
returns reconstructed inputs and labels plus a trace (:class:`AttackResult`). Scoring against the
ground truth is separate (``fedsim.metrics``) and is the only code that sees the truth.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn

from fedsim.components import ATTACKS, Declared
from fedsim.protocol import BATCH_SIZE


@dataclass
class AttackInput:
    """What a curious server holds when it attacks one client's update."""

    model_fn: Callable[[], nn.Module]  # builds the architecture (fresh, untrained)
    global_state: Mapping[str, torch.Tensor]  # the weights it sent this client (state_dict)
    update: Mapping[str, torch.Tensor]  # returned weights - global weights (same keys)
    recipe: Mapping[str, Any]  # lr, batch_size, local_steps or local_epochs (the configured recipe)
    input_shape: Sequence[int]  # (C, H, W) for images, (F,) for records (tabular data)
    num_classes: int
    num_examples: int  # as reported by the client (examples per round)
    known_labels: torch.Tensor | None = None  # only for threat models that grant labels
    # only under the threat model "BN statistics of the victim's batch known": BN layer name ->
    # (mean, biased variance) of that layer's input over the victim's batch (attacks.bn_prior)
    bn_stats: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    device: torch.device = torch.device("cpu")
    seed: int = 0  # the attacker's own randomness (initialisation)
    # the value box the attacker assumes for the inputs: images are in [0, 1]; records (standardised
    # features, unbounded) have none (None: reconstructions are not clamped)
    bounds: tuple[float, float] | None = (0.0, 1.0)

    def global_model(self) -> nn.Module:
        m = self.model_fn()
        m.load_state_dict({k: v.clone() for k, v in self.global_state.items()})
        return m.to(self.device)

    @property
    def records(self) -> bool:
        """Whether the inputs are records (one feature vector each) rather than images (C, H, W)."""
        return len(self.input_shape) != 3

    @property
    def batch_size(self) -> int:
        """Images to reconstruct: one local mini-batch."""
        return int(min(self.recipe[BATCH_SIZE], self.num_examples))


@dataclass
class AttackResult:
    inputs: torch.Tensor  # (B, C, H, W) images in [0, 1], or (B, F) records (AttackInput.bounds)
    labels: torch.Tensor  # (B,) int64
    trace: dict[str, Any] = field(default_factory=dict)  # loss (list), iterations, seconds, converged_at, ...


class Attack(Declared):
    """Base class. Subclasses set ``name`` and take their hyper-parameters as keyword arguments."""

    name: ClassVar[str] = ""
    # whether the attack reconstructs records (tabular data, inputs (F,)) as well as images; the
    # curious server refuses an attack that does not on such data, before the run trains
    supports_records: ClassVar[bool] = False

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        """Checks of this attack against the rest of the config (raise ValueError naming the keys), as every
        component has: called through the curious server when the config is loaded, and again when the
        run starts (the dataset is there then). Default: an attack that does not reconstruct records
        (``supports_records``) refuses a dataset of records."""
        if self.supports_records:
            return
        shape = input_shape(cfg)
        if shape is not None and len(shape) != 3:
            ok = sorted(n for n, cls in ATTACKS.items() if getattr(cls, "supports_records", False))
            raise ValueError(f"reconstructs images (C, H, W) only; data.dataset = {cfg['data']['dataset']!r} has "
                             f"records of {tuple(shape)} features (attacks for records: {ok})")

    def run(self, inp: AttackInput) -> AttackResult:  # pragma: no cover - interface
        raise NotImplementedError

    def run_many(self, inputs: Sequence[AttackInput], max_group: int | None = None) -> list[AttackResult]:
        """Attack several victims' updates (e.g. every victim of a round); results in input order.

        Attacks that can (``batchable()``) stack the inputs that share the global model, recipe and
        shapes (:func:`group_inputs`, at most ``max_group`` per stack) into one batched
        optimisation (``run_group``); the results equal those of ``run`` on each input up to
        floating-point rounding. Other inputs and attacks run one by one. In a stacked result
        ``trace["seconds"]`` is the stack's wall time divided by its size, ``trace["group_size"]`` the size.
        """
        inputs = list(inputs)
        if max_group is not None and (isinstance(max_group, bool) or not isinstance(max_group, int)
                                      or max_group < 1):
            raise ValueError(f"max_group must be an integer >= 1 or None, got {max_group!r}")
        out: list[AttackResult | None] = [None] * len(inputs)
        if self.batchable() and len(inputs) > 1:
            groups = group_inputs(inputs, max_group)
        else:
            groups = [[i] for i in range(len(inputs))]
        for g in groups:
            if len(g) == 1:
                out[g[0]] = self.run(inputs[g[0]])
                continue
            for i, res in zip(g, self.run_group([inputs[i] for i in g])):
                out[i] = res
        return [r for r in out if r is not None]

    def batchable(self) -> bool:
        """Whether this attack, with its parameters, has a stacked implementation (``run_group``)."""
        return False

    def run_group(self, inputs: Sequence[AttackInput]) -> list[AttackResult]:  # pragma: no cover
        """Attack compatible inputs (see ``run_many``) as one stacked optimisation."""
        raise NotImplementedError


ATTACKS.base = Attack


def config_model(cfg: Mapping[str, Any]) -> nn.Module | None:
    """A fresh global model as the config describes it (for an attack's ``validate_config``), or None when
    the model itself has a problem (:func:`fedsim.config_checks.model_problem` reports it, naming model.name) or
    the data are not available here."""
    import torch

    from fedsim.config_checks import model_problem
    from fedsim.factories import model_for

    if input_shape(cfg) is None or model_problem(cfg) is not None:
        return None
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
        return model_for(cfg)


def input_shape(cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The config's input shape ((C, H, W) images, (F,) records), or None when its dataset cannot be
    loaded here (config validation tolerates that; the run reports it before anything is written)."""
    from fedsim.data import DatasetUnavailable
    from fedsim.factories import dataset_for

    try:
        return tuple(dataset_for(cfg).in_shape)
    except (DatasetUnavailable, ValueError):
        return None


def register(cls: type[Attack]) -> type[Attack]:
    """Class decorator: register an attack under its ``name`` (``[attack] name = ...``)."""
    return ATTACKS.register(cls)


# ---------------------------------------------------------------- grouping (Attack.run_many)
def _same_state(a: AttackInput, b: AttackInput) -> bool:
    if a.global_state is b.global_state:
        return True
    if list(a.global_state) != list(b.global_state):
        return False
    return all(a.global_state[k] is b.global_state[k] or
               (a.global_state[k].shape == b.global_state[k].shape and torch.equal(a.global_state[k],
                                                                                   b.global_state[k]))
               for k in a.global_state)


def _compatible(a: AttackInput, b: AttackInput) -> bool:
    return (tuple(a.input_shape) == tuple(b.input_shape) and a.num_classes == b.num_classes
            and a.batch_size == b.batch_size and a.bounds == b.bounds
            and torch.device(a.device) == torch.device(b.device)
            and dict(a.recipe) == dict(b.recipe) and int(a.num_examples) == int(b.num_examples)
            and _same_state(a, b))


def group_inputs(inputs: Sequence[AttackInput], max_group: int | None = None) -> list[list[int]]:
    """Indices of ``inputs`` partitioned into stackable groups (first-come order, at most ``max_group``
    per group)."""
    groups: list[list[int]] = []
    for i, inp in enumerate(inputs):
        for g in groups:
            if (max_group is None or len(g) < max_group) and _compatible(inputs[g[0]], inp):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups
