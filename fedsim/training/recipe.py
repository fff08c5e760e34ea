"""The local training recipe the server configures (and therefore knows, and an attacker replays)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fedsim.protocol import (
    BATCH_SIZE,
    LOCAL_EPOCHS,
    LOCAL_STEPS,
    LR,
    MOMENTUM,
    PROXIMAL_MU,
    WEIGHT_DECAY,
)


@dataclass(frozen=True)
class Recipe:
    """The local training recipe the server configures (and therefore knows, and an attacker replays).

    Plain SGD by default. ``momentum`` (heavy ball, as ``torch.optim.SGD``: ``b = momentum * b + g``,
    ``w -= lr * b``, the buffer starting at zero every round), ``weight_decay`` (``g += weight_decay *
    w``) and ``proximal_mu`` (FedProx's proximal term: ``g += proximal_mu * (w - w_global)``) change
    what an update is: with any of them on, ``-update / lr`` is no longer the sum of the data
    gradients (see ``attacks.gradients`` for what the attacks assume).
    """

    lr: float
    batch_size: int
    local_steps: int | None = None  # exactly this many SGD steps (FedSGD: 1) ...
    local_epochs: int | None = None  # ... or this many passes over the local data
    momentum: float = 0.0
    weight_decay: float = 0.0
    proximal_mu: float = 0.0

    def __post_init__(self):
        if (self.local_steps is None) == (self.local_epochs is None):
            raise ValueError("set exactly one of train.local_steps and train.local_epochs")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"train.momentum must be in [0, 1), got {self.momentum!r}")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.proximal_mu < 0:
            raise ValueError(f"proximal mu must be >= 0, got {self.proximal_mu!r}")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "Recipe":
        """From ``[train]`` or a train message's recipe keys (``fedsim.protocol.recipe_of``)."""
        steps, epochs = m.get(LOCAL_STEPS), m.get(LOCAL_EPOCHS)
        return cls(float(m[LR]), int(m[BATCH_SIZE]), int(steps) if steps not in (None, 0) else None,
                   int(epochs) if epochs not in (None, 0) else None, float(m.get(MOMENTUM) or 0.0),
                   float(m.get(WEIGHT_DECAY) or 0.0), float(m.get(PROXIMAL_MU) or 0.0))

    def to_mapping(self) -> dict[str, Any]:
        """The recipe keys (momentum, weight decay and proximal mu only when set)."""
        d: dict[str, Any] = {LR: self.lr, BATCH_SIZE: self.batch_size}
        if self.local_steps is not None:
            d[LOCAL_STEPS] = self.local_steps
        else:
            d[LOCAL_EPOCHS] = self.local_epochs
        for key, v in ((MOMENTUM, self.momentum), (WEIGHT_DECAY, self.weight_decay), (PROXIMAL_MU, self.proximal_mu)):
            if v:
                d[key] = v
        return d

    @property
    def plain_sgd(self) -> bool:
        return not (self.momentum or self.weight_decay or self.proximal_mu)
