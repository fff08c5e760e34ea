"""The client defense interface (a seam of the core) and the pipeline that composes defenses in order.

Defenses themselves are plugins (``clients/``); they subclass :class:`Defense` and register in
:data:`fedsim.components.DEFENSES`. ``[[defenses]]`` entries are built by :func:`fedsim.build.client_pipeline`.

A defense acts at the stage where it belongs (see ``fedsim.training.local.local_train``):

1. ``compute_gradient``  - replaces how a mini-batch gradient is computed (per-sample clipping,
   DP-SGD). At most one defense in a pipeline may implement it.
2. ``transform_gradient`` - changes each mini-batch gradient before the SGD step (gradient dropout,
   per-step noise).
3. ``transform_update``   - changes the outgoing update (new weights - global weights) once per round
   (additive noise, pruning, compression with error feedback, PLD, seed 000's slice perturbation).

State that must survive between rounds (compression residuals, a FedKL key) lives in
``ctx.state``, a dict of NumPy arrays that the ClientApp keeps in Flower's per-node ``Context.state``;
it never leaves the client. A client process builds its pipeline once per config and reuses it for every
message and every partition it serves (``fedsim.app.client.pipeline_for``): a defense keeps nothing
between messages on itself; what it sets on itself during a round (counts for ``metrics()``, the round's
plan) is set again by ``setup`` or its hooks in every round. Every defense reports what it did through ``metrics()``; the values are
prefixed with the defense's position and name in the client's reply metrics.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedsim.components import DEFENSES, Declared

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DefenseContext:
    round: int
    client_id: int
    generator: torch.Generator  # seeded from (seed, round, client, position): reproducible randomness
    param_names: tuple[str, ...]
    recipe: Mapping[str, Any]
    state: dict[str, np.ndarray] = field(default_factory=dict)  # persistent across rounds, client-only
    device: torch.device = torch.device("cpu")
    public_data: tuple[torch.Tensor, torch.Tensor] | None = None  # the public root split, when needed
    num_examples: int = 0  # size of the client's local training set (DP-SGD's sample rate); 0 = unknown
    incoming: Mapping[str, np.ndarray] = field(default_factory=dict)  # extra arrays the server sent (EXTRAS)


class Defense(Declared):
    """Base class. Subclasses set ``name`` and accept their parameters as keyword arguments.

    Stages, in the order ``fedsim.training.local.local_train`` calls them: ``adapt_model`` (may change the
    model's structure and load client-private entries from ``ctx.state``), ``setup``,
    ``compute_gradient`` / ``transform_gradient`` per mini-batch, ``end_round`` (after the last step,
    e.g. to save client-private entries), ``transform_update``, then ``reply_extras`` and
    ``metrics``. State-dict entries of the adapted model that the global model does not have are
    client-private: they are never sent.
    """

    name: ClassVar[str] = ""

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        """Checks against the rest of the config (raise ValueError); called when the config is loaded."""

    @classmethod
    def global_model(cls, model: nn.Module, params: Mapping[str, Any]) -> nn.Module:
        """The architecture every party shares when this defense is configured: called by
        :func:`fedsim.factories.model_for` (the server's global model, the clients' received model, the
        attacker's) with the ``[[defenses]]`` entry (``params``; validated when the config is loaded).
        Default: unchanged. (``adapt_model`` changes the client's own copy only.)"""
        return model

    def adapt_model(self, model: nn.Module, ctx: DefenseContext) -> nn.Module:
        """The model to train this round (default: the global model as received)."""
        return model

    def setup(self, model: nn.Module, ctx: DefenseContext) -> None:
        """Called at the start of every round, after the global weights are loaded."""

    def end_round(self, model: nn.Module, ctx: DefenseContext) -> None:
        """Called after the last local step, with the trained (adapted) model."""

    def reply_extras(self, ctx: DefenseContext) -> dict[str, np.ndarray]:
        """Extra arrays to send with the reply (record ``EXTRAS``), e.g. noise terms a server transform
        needs. Names must be unique across the pipeline."""
        return {}

    def server_observers(self) -> list[dict[str, Any]]:
        """Observer entries the server adds when this defense is configured (e.g. an evaluation the
        defense implies)."""
        return []

    def compute_gradient(self, model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                         ctx: DefenseContext) -> list[torch.Tensor] | None:
        """Return the mini-batch gradient (one tensor per parameter) or None to use plain autograd."""
        return None

    def transform_gradient(self, grads: list[torch.Tensor], ctx: DefenseContext) -> list[torch.Tensor]:
        return grads

    def transform_update(self, update: list[torch.Tensor], ctx: DefenseContext) -> list[torch.Tensor]:
        return update

    def metrics(self) -> dict[str, float]:
        """What this defense did in the last round (sparsity, noise scale, clipped fraction, ...)."""
        return {}

    def noise_variance(self) -> float | None:
        """Per-entry variance of zero-mean noise this defense adds to the update, if it declares one
        (server-side compensation uses it)."""
        return None

    def privacy(self, cfg: Mapping[str, Any], key: str, previous: "Defense | None") -> Any:
        """The differential privacy this defense gives, as a :class:`fedsim.privacy.Mechanism` reported under
        ``privacy.<key>`` (``previous``: the defense right before it in the pipeline, e.g. the clipping that
        bounds what a noise defense perturbs), or None when it claims none. Default: a defense that declares
        noise (:meth:`noise_variance`) gets "no formal guarantee" - noise without a bound on what it hides."""
        if self.noise_variance() is None:
            return None
        from fedsim.privacy import Mechanism

        return Mechanism(key, f"{self.name}: noise of variance {self.noise_variance():.3g} per entry", reason=(
            f"{self.name} adds noise to an update with no clipping bound (no sensitivity to calibrate it to)"))

    def overrides_compute_gradient(self) -> bool:
        return type(self).compute_gradient is not Defense.compute_gradient


DEFENSES.base = Defense  # an import reference in [[defenses]] must name a Defense


def register(cls: type[Defense]) -> type[Defense]:
    """Class decorator: register a defense under its ``name`` (``[[defenses]] name = ...``)."""
    return DEFENSES.register(cls)


class DefensePipeline:
    """Defenses in config order; each stage calls them in that order."""

    def __init__(self, defenses: Sequence[Defense]):
        self.defenses = list(defenses)
        owners = [d.name for d in self.defenses if d.overrides_compute_gradient()]
        if len(owners) > 1:
            raise ValueError(f"defenses: only one defense may compute gradients, got {owners}")

    def __len__(self) -> int:
        return len(self.defenses)

    def _ctx(self, ctx: DefenseContext, i: int) -> DefenseContext:
        prefix = f"{i}."
        sub = {k[len(prefix):]: v for k, v in ctx.state.items() if k.startswith(prefix)}
        return DefenseContext(ctx.round, ctx.client_id, ctx.generator, ctx.param_names, ctx.recipe, sub,
                              ctx.device, ctx.public_data, ctx.num_examples, ctx.incoming)

    def run_round(self, ctx: DefenseContext) -> "_RoundRunner":
        return _RoundRunner(self, ctx)

    def adapts_model(self) -> bool:
        """Whether a defense changes the model's structure (then the model cannot be reused)."""
        return any(type(d).adapt_model is not Defense.adapt_model for d in self.defenses)

    def noise_variance(self) -> float | None:
        vs = [v for d in self.defenses if (v := d.noise_variance()) is not None]
        return float(sum(vs)) if vs else None

    def privacy(self, cfg: Mapping[str, Any]) -> list[Any]:
        """The mechanisms the defenses declare (:meth:`Defense.privacy`), keyed like their metrics
        (``defense.<position>.<name>``)."""
        out, previous = [], None
        for i, d in enumerate(self.defenses):
            m = d.privacy(cfg, f"defense.{i}.{d.name}", previous)
            if m is not None:
                out.append(m)
            previous = d
        return out


class _RoundRunner:
    """Binds the pipeline to one round's context; keeps per-defense sub-states and writes them back."""

    def __init__(self, pipe: DefensePipeline, ctx: DefenseContext):
        self.pipe, self.ctx = pipe, ctx
        self.subs = [pipe._ctx(ctx, i) for i in range(len(pipe.defenses))]

    def adapt_model(self, model: nn.Module) -> nn.Module:
        for d, c in zip(self.pipe.defenses, self.subs):
            model = d.adapt_model(model, c)
        return model

    def setup(self, model: nn.Module) -> None:
        for d, c in zip(self.pipe.defenses, self.subs):
            d.setup(model, c)

    def end_round(self, model: nn.Module) -> None:
        for d, c in zip(self.pipe.defenses, self.subs):
            d.end_round(model, c)

    def reply_extras(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for d, c in zip(self.pipe.defenses, self.subs):
            for k, v in d.reply_extras(c).items():
                if k in out:
                    raise ValueError(f"defenses: two defenses send the extra array {k!r}")
                out[k] = np.asarray(v)
        return out

    def compute_gradient(self, model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor):
        for d, c in zip(self.pipe.defenses, self.subs):
            if d.overrides_compute_gradient():
                return d.compute_gradient(model, loss_fn, x, y, c)
        return None

    def transform_gradient(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        for d, c in zip(self.pipe.defenses, self.subs):
            grads = d.transform_gradient(grads, c)
        return grads

    def transform_update(self, update: list[torch.Tensor]) -> list[torch.Tensor]:
        for d, c in zip(self.pipe.defenses, self.subs):
            update = d.transform_update(update, c)
        return update

    def finish(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """New persistent state and the metrics of every defense."""
        state: dict[str, np.ndarray] = {}
        metrics: dict[str, float] = {}
        for i, (d, c) in enumerate(zip(self.pipe.defenses, self.subs)):
            state.update({f"{i}.{k}": np.asarray(v) for k, v in c.state.items()})
            metrics.update({f"defense.{i}.{d.name}.{k}": float(v) for k, v in d.metrics().items()})
        return state, metrics
