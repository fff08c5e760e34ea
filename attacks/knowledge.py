"""Attacker knowledge: threat-model ablations of the curious server (``[[attack.knowledge]]``).

The curious server's normal threat model is what the channel shows it (the global model it sent, the
intercepted update, the recipe, the example count). A *knowledge* entry grants it more - a defense's
secret, an extra reply array a defense sends only in an ablation - to measure which secret matters. Each
entry is a :class:`Knowledge` registered in :data:`fedsim.components.KNOWLEDGE` and built from the config
with the run config (``cfg``) as a hidden parameter::

    [[attack.knowledge]]
    name = "fedkl"      # attacks/fedkl.py: FedKL's key and/or lock
    key = true

:meth:`Knowledge.grant` rewrites the :class:`attacks.base.AttackInput` the server built from the
intercepted update (the architecture, the global state, the update) before the attacks run; the
leakage rows then carry a ``knowledge`` column naming what was granted.
"""
from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from fedsim.components import KNOWLEDGE, Declared
from fedsim.observers import ClientUpdate

from .base import AttackInput


class Knowledge(Declared):
    """Base class. Subclasses set ``name``, take parameters as keyword arguments (plus ``cfg``)."""

    name: ClassVar[str] = ""

    def grant(self, inp: AttackInput, update: ClientUpdate) -> AttackInput:  # pragma: no cover - interface
        raise NotImplementedError

    def label(self) -> str:
        """How the leakage rows name this knowledge."""
        return self.name


KNOWLEDGE.base = Knowledge


def register(cls: type[Knowledge]) -> type[Knowledge]:
    return KNOWLEDGE.register(cls)


@register
class BNStatistics(Knowledge):
    """The threat model "BN statistics of the victim's batch known" (GradInversion, Yin et al. 2021): the
    BatchNorm-input statistics of the victim's first local batch under the global model, re-created from
    the victim's data the way the scorer re-creates ground truth (no message carries them). Used by
    ``ig-bn`` / ``ig-fr`` with ``bn_target = "victim"``."""

    name = "bn-statistics"

    def __init__(self, *, cfg: Mapping[str, Any]):
        self.cfg = cfg

    def grant(self, inp: AttackInput, update: ClientUpdate) -> AttackInput:
        from fedsim.factories import client_data
        from fedsim.training.batches import iter_batches
        from fedsim.training.recipe import Recipe

        from .bn_prior import batch_bn_stats

        x, y = client_data(self.cfg, update.client_id)
        # the first batch only, drawn lazily: bounded memory for any local_steps
        first = next(iter_batches(self.cfg["seed"], update.round, update.client_id, len(y),
                                  Recipe.from_mapping(update.recipe)))
        inp.bn_stats = batch_bn_stats(inp.global_model(), x[torch.as_tensor(first)].to(inp.device))
        return inp
