"""Additive noise on the outgoing update: Gaussian (seed 000's DP-G, seed 001's G-1e-k, seed 004's
GradNoise) and Laplace (seed 000's DP-L, seed 001's L-1e-k).

Both act in the ``transform_update`` stage, once per round, on the update (new weights - global
weights). By default only the model's parameters are perturbed; BatchNorm running statistics are
left alone unless ``include_buffers = true``, and integer buffers (``num_batches_tracked``) never get
noise. Randomness comes from ``ctx.generator`` (reproducible per seed, round, client).

The base of every update-stage defense is :class:`clients.update_defense.UpdateDefense`.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Mapping

import torch

from clients.update_defense import BUFFER, UpdateDefense, entry_kinds
from fedsim.defense import Defense, DefenseContext, register
from fedsim.params import Range
from fedsim.privacy import AGAINST_SERVER, Mechanism


def _has_float_buffers(cfg: Mapping[str, Any]) -> bool:
    from fedsim.factories import model_for

    with torch.random.fork_rng(devices=[]):
        return BUFFER in entry_kinds(model_for(cfg)).values()


# --------------------------------------------------------------------------- noise defenses


class _AdditiveNoise(UpdateDefense):
    std: float = 0.0

    def _sample(self, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def transform_update(self, update: list[torch.Tensor], ctx: DefenseContext) -> list[torch.Tensor]:
        mask = self.targets(ctx, len(update))
        out, total, sq, count = [], 0.0, 0.0, 0
        for u, on in zip(update, mask, strict=True):
            if not on or self.std == 0.0:
                out.append(u)
                continue
            noise = self._sample(u.shape, ctx.generator)
            total += float(noise.sum())
            sq += float((noise.double() ** 2).sum())
            count += noise.numel()
            out.append(u + noise.to(device=u.device, dtype=u.dtype))
        self._count = count
        mean = total / count if count else 0.0
        self._empirical_std = math.sqrt(max(sq / count - mean * mean, 0.0)) if count else 0.0
        return out

    def noise_variance(self) -> float | None:
        return self.std ** 2

    def metrics(self) -> dict[str, float]:
        return {"noise_std": self.std,
                "empirical_std": getattr(self, "_empirical_std", 0.0),
                "noised_entries": float(getattr(self, "_count", 0))}


def _one_of(spread: str, value: float | None, variance: float | None,
            variance_note: str = "") -> tuple[str, float]:
    """Exactly one of a spread parameter (``"sigma (...)"``) or ``variance``, validated >= 0.

    Returns (the key that was given, its value as float).
    """
    key = spread.split(" ")[0]
    if (value is None) == (variance is None):
        raise ValueError(f"give exactly one of {spread} or variance{variance_note}")
    key, v = (key, value) if value is not None else ("variance", variance)
    if float(v) < 0:
        raise ValueError(f"{key} must be >= 0, got {v}")
    return key, float(v)


@register
class GaussianNoise(_AdditiveNoise):
    """Zero-mean Gaussian noise on every parameter entry of the update.

    Give exactly one of ``sigma`` (the standard deviation) or ``variance`` (= sigma**2; seeds 000 and
    001 quote variances 1e-4 .. 1e-1, seed 004 quotes standard deviations).
    """

    name = "gaussian-noise"

    def __init__(self, sigma: float | None = None, variance: float | None = None,
                 include_buffers: bool = False,
                 delta: Annotated[float, Range(0, 1, open_low=True, open_high=True)] = 1e-5):
        key, value = _one_of("sigma (standard deviation)", sigma, variance)
        self.std = value if key == "sigma" else math.sqrt(value)
        self.include_buffers = bool(include_buffers)
        self.delta = float(delta)

    def _sample(self, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * self.std

    def privacy(self, cfg: Mapping[str, Any], key: str, previous: Defense | None) -> Mechanism:
        """Client-level local DP when ``clip-update`` runs right before it on the same entries (the Gaussian
        mechanism with noise multiplier sigma / clip_norm, once per round the client takes part in, reported
        at ``delta``); otherwise no formal guarantee."""
        from clients.clipping import ClipUpdate

        desc = f"gaussian-noise: std {self.std:.3g} per entry"
        reason = None
        if not isinstance(previous, ClipUpdate):
            reason = ("no clipping bound on the update it perturbs: put clip-update directly before it (the noise "
                      "multiplier is then sigma / clip_norm)")
        elif previous.include_buffers != self.include_buffers:
            reason = "clip-update and gaussian-noise act on different entries (include_buffers differs)"
        elif not self.include_buffers and _has_float_buffers(cfg):
            reason = ("the model's floating buffers (BatchNorm running statistics) are sent without clipping or "
                      "noise: set include_buffers = true on both")
        elif self.std == 0:
            reason = "no noise (sigma = 0)"
        if reason is not None:
            return Mechanism(key, desc, reason=reason)
        z = self.std / previous.clip_norm
        return Mechanism(key, f"{desc} after clip-update to {previous.clip_norm:g} (noise multiplier {z:.4g})",
                         "client", AGAINST_SERVER, self.delta, per_participation=lambda r, c, conf: [(z, 1.0, 1)])


@register
class LaplaceNoise(_AdditiveNoise):
    """Zero-mean Laplace noise with scale ``b`` on every parameter entry of the update.

    Give exactly one of ``scale`` (b; the density is exp(-|x|/b)/(2b)) or ``variance`` (= 2 b**2).
    """

    name = "laplace-noise"

    def __init__(self, scale: float | None = None, variance: float | None = None,
                 include_buffers: bool = False):
        key, value = _one_of("scale (Laplace b)", scale, variance, variance_note=" (= 2 b^2)")
        self.scale = value if key == "scale" else math.sqrt(value / 2.0)
        self.std = math.sqrt(2.0) * self.scale
        self.include_buffers = bool(include_buffers)

    def privacy(self, cfg: Mapping[str, Any], key: str, previous: Defense | None) -> Mechanism:
        return Mechanism(key, f"laplace-noise: scale {self.scale:.3g} per entry", reason=(
            "the Laplace mechanism needs an L1 bound on the update; no defense gives one (clip-update bounds "
            "the L2 norm: use gaussian-noise after it)"))

    def _sample(self, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
        # the difference of two Exp(1) variables is Laplace(0, 1); 1 - U lies in (0, 1], so log is finite
        e1 = -torch.log1p(-torch.rand(shape, generator=gen, dtype=torch.float64))
        e2 = -torch.log1p(-torch.rand(shape, generator=gen, dtype=torch.float64))
        return ((e1 - e2) * self.scale).float()

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "scale": self.scale}
