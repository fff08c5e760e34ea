"""The base of the defenses that act on the outgoing update (``transform_update`` stage: noise, clipping,
pruning, compression) and the helpers they share: which entries of the state-dict-ordered update are
parameters, floating buffers or integer buffers, and the constraint of a fraction parameter (``Fraction``)."""
from __future__ import annotations

from typing import Annotated

from torch import nn

from fedsim.defense import Defense, DefenseContext
from fedsim.params import Range

PARAM, BUFFER, INT = "param", "buffer", "int"


def entry_kinds(model: nn.Module) -> dict[str, str]:
    """Kind of every state-dict entry: trainable/frozen parameter, floating buffer or integer buffer."""
    params = dict(model.named_parameters(remove_duplicate=False))
    kinds: dict[str, str] = {}
    for k, v in model.state_dict().items():
        if k in params:
            kinds[k] = PARAM
        elif v.is_floating_point():
            kinds[k] = BUFFER
        else:
            kinds[k] = INT
    return kinds


def guess_kind(name: str) -> str:
    """Kind of a state-dict entry from its name alone (used when ``setup`` has not seen the model)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "num_batches_tracked":
        return INT
    if leaf in ("running_mean", "running_var"):
        return BUFFER
    return PARAM


class UpdateDefense(Defense):
    """Base for defenses that act on selected entries of the update (parameters, optionally buffers)."""

    include_buffers: bool = False

    def setup(self, model: nn.Module, ctx: DefenseContext) -> None:
        self._kinds = entry_kinds(model)

    def targets(self, ctx: DefenseContext, n: int) -> list[bool]:
        """Which of the ``n`` update entries (``ctx.param_names`` order) this defense acts on."""
        names = ctx.param_names
        if len(names) != n:
            raise ValueError(f"{self.name}: the update has {n} tensors but ctx.param_names has {len(names)}")
        kinds = getattr(self, "_kinds", None) or {}
        allowed = {PARAM, BUFFER} if self.include_buffers else {PARAM}
        return [kinds.get(k, guess_kind(k)) in allowed for k in names]


# a share of the update's entries, as a constraint for a defense's signature (``ratio: Fraction``)
Fraction = Annotated[float, Range(0, 1)]
