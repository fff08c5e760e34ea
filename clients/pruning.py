"""Sparsifying defenses.

* ``prune`` - magnitude pruning of the update (seed 004's GradPrune, seed 000's GC baseline): the
  ``ratio`` fraction of entries with the smallest |value| is set to zero, exactly (ties broken by
  index), either globally across all parameter tensors or per tensor.
* ``compress`` - communication-efficient sparsification with error feedback (seed 001 §3.2, after
  Lin et al.'s Deep Gradient Compression): the residual accumulated in earlier rounds is added to
  this round's update, the largest entries are sent and the rest is kept locally in ``ctx.state`` for
  the next round, so nothing is lost: sent + new residual == update + old residual.
* ``pld`` - seed 000's PLD baseline: magnitude pruning of only the fully connected layer's update
  (by default the parameters of the model's last ``nn.Linear``; ``layers`` takes fnmatch patterns).
* ``grad-dropout`` - seed 004's GradDropout: each entry of each mini-batch gradient is zeroed with
  probability ``p`` before the SGD step.

Throughout, ``ratio`` is the fraction of entries *removed* (pruning rate / seed 001's compression
percentage theta), so ratio 0.9 keeps the largest 10%.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Annotated, Sequence

import numpy as np
import torch
from torch import nn

from clients.update_defense import Fraction, UpdateDefense
from fedsim.defense import Defense, DefenseContext, register
from fedsim.params import OneOf, Range

SCOPES = ("global", "layer")


def _n_drop(ratio: float, n: int) -> int:
    return min(n, int(round(ratio * n)))


def _keep_flat(values: torch.Tensor, ratio: float) -> torch.Tensor:
    """Boolean mask over a flat tensor keeping all but the ``round(ratio * n)`` smallest |values|."""
    n = values.numel()
    drop = _n_drop(ratio, n)
    keep = torch.ones(n, dtype=torch.bool, device=values.device)
    if drop == 0:
        return keep
    mag = values.abs()
    if drop <= n - drop:
        keep[torch.topk(mag, drop, largest=False, sorted=False).indices] = False
    else:
        keep.zero_()
        if n - drop > 0:
            keep[torch.topk(mag, n - drop, largest=True, sorted=False).indices] = True
    return keep


def magnitude_masks(tensors: Sequence[torch.Tensor], ratio: float, scope: str = "global") -> list[torch.Tensor]:
    """Keep-masks (same shapes as ``tensors``) removing exactly ``round(ratio * n)`` smallest-magnitude
    entries, counted over all tensors together (``global``) or within each tensor (``layer``)."""
    if not tensors:
        return []
    if scope == "layer":
        return [_keep_flat(t.reshape(-1), ratio).view(t.shape) for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    keep = _keep_flat(flat, ratio)
    out, pos = [], 0
    for t in tensors:
        out.append(keep[pos:pos + t.numel()].view(t.shape))
        pos += t.numel()
    return out


Scope = Annotated[str, OneOf(*SCOPES)]


class _MagnitudePrune(UpdateDefense):
    ratio: float = 0.0
    scope: str = "global"

    def _selected(self, ctx: DefenseContext, update: list[torch.Tensor]) -> list[bool]:
        return self.targets(ctx, len(update))

    def transform_update(self, update: list[torch.Tensor], ctx: DefenseContext) -> list[torch.Tensor]:
        sel = self._selected(ctx, update)
        chosen = [u for u, on in zip(update, sel, strict=True) if on]
        masks = iter(magnitude_masks(chosen, self.ratio, self.scope))
        out = [u * next(masks) if on else u for u, on in zip(update, sel, strict=True)]
        n = sum(u.numel() for u in chosen)
        self._entries = n
        self._pruned = sum(_n_drop(self.ratio, u.numel()) for u in chosen) if self.scope == "layer" \
            else _n_drop(self.ratio, n)
        self._zeros = sum(int((o == 0).sum()) for o, on in zip(out, sel, strict=True) if on)
        return out

    def metrics(self) -> dict[str, float]:
        n = getattr(self, "_entries", 0)
        return {"ratio": self.ratio, "entries": float(n),
                "sparsity": getattr(self, "_pruned", 0) / n if n else 0.0,
                "zero_fraction": getattr(self, "_zeros", 0) / n if n else 0.0}


@register
class Prune(_MagnitudePrune):
    """Zero the ``ratio`` fraction of smallest-magnitude update entries (parameters; BN running
    statistics too with ``include_buffers``), globally or per tensor (``scope``)."""

    name = "prune"

    def __init__(self, ratio: Fraction, scope: Scope = "global", include_buffers: bool = False):
        self.ratio, self.scope, self.include_buffers = float(ratio), scope, bool(include_buffers)


@register
class PLD(_MagnitudePrune):
    """Prune the ``ratio`` fraction of smallest-magnitude entries of the fully connected layer's update
    only. ``layers``: fnmatch patterns over state-dict names (default: the last ``nn.Linear``)."""

    name = "pld"

    def __init__(self, ratio: Fraction, layers: Sequence[str] | str | None = None, scope: Scope = "global"):
        self.ratio, self.scope = float(ratio), scope
        if isinstance(layers, str):
            layers = [layers]
        if layers is not None and (not layers or not all(isinstance(p, str) for p in layers)):
            raise ValueError(f"layers must be a non-empty list of fnmatch patterns, got {layers!r}")
        self.layers = list(layers) if layers is not None else None
        self._fc_names: set[str] | None = None

    def setup(self, model: nn.Module, ctx: DefenseContext) -> None:
        super().setup(model, ctx)
        if self.layers is None:
            last = None
            for name, m in model.named_modules():
                if isinstance(m, nn.Linear):
                    last = name
            if last is None:
                raise ValueError("pld: the model has no nn.Linear layer; set `layers` patterns")
            prefix = f"{last}." if last else ""
            fc = dict(model.named_modules())[last]
            self._fc_names = {f"{prefix}{n}" for n, _ in fc.named_parameters()}

    def _selected(self, ctx: DefenseContext, update: list[torch.Tensor]) -> list[bool]:
        base = self.targets(ctx, len(update))
        names = ctx.param_names
        if self.layers is not None:
            sel = [on and any(fnmatch.fnmatchcase(k, p) for p in self.layers)
                   for k, on in zip(names, base, strict=True)]
            if not any(sel):
                raise ValueError(f"pld: layers {self.layers} match no parameter of the model")
            return sel
        if self._fc_names is None:
            raise ValueError("pld: setup() must see the model to find its last nn.Linear (or set `layers`)")
        return [on and k in self._fc_names for k, on in zip(names, base, strict=True)]

    def selected_names(self, ctx: DefenseContext) -> list[str]:
        dummy = [torch.empty(0)] * len(ctx.param_names)
        return [k for k, on in zip(ctx.param_names, self._selected(ctx, dummy), strict=True) if on]


@register
class Compress(UpdateDefense):
    """Top-k sparsification with error feedback: send the largest (1 - ``ratio``) fraction of
    (update + residual) entries, keep the rest as next round's residual in ``ctx.state``."""

    name = "compress"
    PREFIX = "residual."

    def __init__(self, ratio: Fraction, scope: Scope = "global", include_buffers: bool = False):
        self.ratio, self.scope, self.include_buffers = float(ratio), scope, bool(include_buffers)

    def transform_update(self, update: list[torch.Tensor], ctx: DefenseContext) -> list[torch.Tensor]:
        sel = self.targets(ctx, len(update))
        names = ctx.param_names
        acc: list[torch.Tensor] = []
        for k, u, on in zip(names, update, sel, strict=True):
            if not on:
                continue
            res = ctx.state.get(self.PREFIX + k)
            if res is not None:
                if tuple(res.shape) != tuple(u.shape):
                    raise ValueError(f"compress: stored residual for {k!r} has shape {tuple(res.shape)}, "
                                     f"the update has {tuple(u.shape)}")
                u = u + torch.as_tensor(res, dtype=u.dtype, device=u.device)
            acc.append(u)
        masks = magnitude_masks(acc, self.ratio, self.scope)
        out, it = [], iter(zip(acc, masks, strict=True))
        sent_sq = res_sq = 0.0
        sent_n = total_n = 0
        for k, u, on in zip(names, update, sel, strict=True):
            if not on:
                out.append(u)
                continue
            a, keep = next(it)
            sent = torch.where(keep, a, torch.zeros_like(a))
            residual = a - sent
            ctx.state[self.PREFIX + k] = residual.detach().cpu().numpy().astype(np.float32)
            out.append(sent)
            sent_sq += float((sent.double() ** 2).sum())
            res_sq += float((residual.double() ** 2).sum())
            sent_n += int(keep.sum())
            total_n += a.numel()
        self._stats = {"sent_fraction": sent_n / total_n if total_n else 0.0, "sent_norm": math.sqrt(sent_sq),
                       "residual_norm": math.sqrt(res_sq), "entries": float(total_n)}
        return out

    def metrics(self) -> dict[str, float]:
        return {"ratio": self.ratio, **getattr(self, "_stats", {})}


@register
class GradDropout(Defense):
    """Zero each entry of every mini-batch gradient independently with probability ``p`` (optionally
    rescaling the survivors by 1/(1-p) so the gradient stays unbiased)."""

    name = "grad-dropout"

    def __init__(self, p: Annotated[float, Range(0, 1, open_high=True)], rescale: bool = False):
        self.p = float(p)
        self.rescale = bool(rescale)
        self._dropped = self._total = 0

    def setup(self, model: nn.Module, ctx: DefenseContext) -> None:
        self._dropped = self._total = 0

    def transform_gradient(self, grads: list[torch.Tensor], ctx: DefenseContext) -> list[torch.Tensor]:
        if self.p == 0:
            self._total += sum(g.numel() for g in grads)
            return grads
        out = []
        for g in grads:
            keep = (torch.rand(g.shape, generator=ctx.generator) >= self.p).to(g.device)
            self._dropped += int((~keep).sum())
            self._total += g.numel()
            kept = g * keep
            out.append(kept / (1.0 - self.p) if self.rescale else kept)
        return out

    def metrics(self) -> dict[str, float]:
        return {"p": self.p, "dropped_fraction": self._dropped / self._total if self._total else 0.0}
