"""The server's one-time noise (seed 002 §4.1): the secrets of a round, the public part sent with the model,
and the perturbation of eq. 7-9."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from fedsim.lossless.network import Layer
from fedsim.params import ConfigError, Constraint

MODES = ("paper", "shift")


# ----------------------------------------------------------------------------------------- secrets
@dataclass(frozen=True)
class PublicNoise:
    """What the server sends along with the perturbed model (not secret).

    ``r_a``: the additive vector ``r^(a)``, shape ``(n_L,)``; ``groups``: int64 ``(n_L,)``, the group
    ``s`` in ``[0, m)`` of every output (the partition ``I_1..I_m``, which the client needs to form
    ``sigma~_s``).
    """

    r_a: torch.Tensor
    groups: torch.Tensor

    @property
    def num_groups(self) -> int:
        return int(self.groups.max()) + 1

    @property
    def shift_invariant(self) -> bool:
        """True when the additive output noise is a uniform shift (``m = 1`` and ``r^(a)`` constant)."""
        return self.num_groups == 1 and bool((self.r_a == self.r_a[0]).all())

    def to_arrays(self) -> list[np.ndarray]:
        return [self.r_a.detach().cpu().numpy().copy(), self.groups.detach().cpu().numpy().copy()]

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray]) -> PublicNoise:
        r_a, groups = arrays
        return cls(torch.as_tensor(np.asarray(r_a)).clone(), torch.as_tensor(np.asarray(groups)).long().clone())


@dataclass(frozen=True)
class Secrets:
    """The server's one-time noise of one round. Never send this object (only ``public``)."""

    r: tuple[torch.Tensor, ...]  # r^(1..L-1), positive, shapes (n_l,)
    gamma: torch.Tensor  # (m,) gamma_{I_s}
    public: PublicNoise

    @property
    def num_groups(self) -> int:
        return int(self.gamma.numel())

    @property
    def r_out(self) -> torch.Tensor:
        """The vector ``r = gamma o r^(a)`` of Theorem 1, shape ``(n_L,)``."""
        return self.gamma[self.public.groups] * self.public.r_a

    @property
    def v(self) -> torch.Tensor:
        r = self.r_out
        return (r * r).sum()

    def scale(self, layer: int, num_layers: int, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Multiplicative noise ``R^(l)`` of eq. 8 for the weight ``(n_l, n_{l-1})`` and the bias ``(n_l,)``."""
        n_out, n_in = shape
        dt = self.gamma.dtype
        row = self.r[layer] if layer < num_layers - 1 else torch.ones(n_out, dtype=dt)
        col = 1.0 / self.r[layer - 1] if layer > 0 else torch.ones(n_in, dtype=dt)
        return row[:, None] * col[None, :], row


# bounds of the noise ranges (multiplicative, gamma, additive): each end in [1e-6, 1e6] and high / low at
# most 1e6. The recovery's float64 error grows with (high / low)^2 (docs/lossless.md "Numerics": 1e-5
# relative at [1e-3, 1e3]); far outside, the perturbed model overflows float32 on its way to the clients
RANGE_BOUNDS = (1e-6, 1e6)
MAX_RANGE_RATIO = 1e6


class NoiseRange(Constraint):
    """A noise range ``[low, high]``: finite, positive, ``low <= high``, within :data:`RANGE_BOUNDS` and
    ``high / low <=`` :data:`MAX_RANGE_RATIO` (the transform's signature declares it: fedsim.params)."""

    def describe(self) -> str:
        return "a pair [low, high] of finite numbers with 0 < low <= high"

    def check(self, key: str, value: Any) -> None:
        ok = (isinstance(value, (tuple, list)) and len(value) == 2
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))
        if not ok or not (0 < value[0] <= value[1]):
            raise ConfigError(f"{key} must be {self.describe()}, got {value!r}")
        lo, hi = float(value[0]), float(value[1])
        if lo < RANGE_BOUNDS[0] or hi > RANGE_BOUNDS[1] or hi / lo > MAX_RANGE_RATIO:
            raise ConfigError(f"{key} must lie in [{RANGE_BOUNDS[0]:g}, {RANGE_BOUNDS[1]:g}] with high / low <= "
                              f"{MAX_RANGE_RATIO:g} (the recovery's float64 error grows with (high / low)^2; "
                              f"docs/lossless.md), got {value!r}")


NOISE_RANGE = NoiseRange()


def check_range(key: str, value: Any) -> tuple[float, float]:
    """A noise range as floats (:class:`NoiseRange`; the error names ``key``)."""
    NOISE_RANGE.check(key, value)
    return float(value[0]), float(value[1])


def _log_uniform(n: int, lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))


def _signs(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1


def draw_secrets(shapes: Sequence[tuple[int, int]], m: int, generator: torch.Generator, *,
                 multiplicative: tuple[float, float] = (0.1, 10.0), gamma: tuple[float, float] = (0.1, 10.0),
                 additive: tuple[float, float] = (0.5, 1.5), mode: str = "paper",
                 dtype: torch.dtype = torch.float64) -> Secrets:
    """Draw one round's secrets for a network with weight shapes ``shapes`` ((n_l, n_{l-1}) per layer).

    * ``r^(l)_i`` (``l < L``) ~ log-uniform on ``multiplicative`` (default [0.1, 10]): positive as
      Theorem 1 requires; log-uniform so that a unit is as likely to be shrunk as grown by any factor.
      The paper allows arbitrarily large values; the range trades hiding of per-unit scale against the
      float64 cancellation in :func:`recover` (error grows with ``(max r / min r)^2``, measured in
      ``docs/lossless.md``).
    * partition: the ``n_L`` outputs are randomly permuted and cut into ``m`` groups of (almost) equal
      size; ``m`` trades prediction privacy (Theorem 5: a client guesses the arg-max with probability
      <= 1/m) against upload size (``m`` extra gradient-sized terms).
    * ``gamma_s`` = random sign x log-uniform on ``gamma`` (default [0.1, 10]).
    * ``r^(a)_i`` = random sign x uniform on ``additive`` (default [0.5, 1.5]), redrawn until its
      components are pairwise distinct (paper, §4.1) and non-zero.

    ``mode="shift"`` (needed for cross-entropy): ``m`` must be 1 and ``r^(a)`` is all ones, so the output
    noise is a uniform shift ``alpha gamma 1`` that softmax ignores (see the module docstring).
    The draw uses only ``generator`` (CPU), so the same seed gives the same secrets.
    """
    if mode not in MODES:
        raise ValueError(f"lossless.mode must be one of {list(MODES)}, got {mode!r}")
    shapes = [(int(a), int(b)) for a, b in shapes]
    if not shapes:
        raise ValueError("lossless perturbation needs at least one layer shape")
    for k in range(1, len(shapes)):
        if shapes[k][1] != shapes[k - 1][0]:
            raise ValueError(f"layer {k} takes {shapes[k][1]} inputs but layer {k - 1} gives {shapes[k - 1][0]}")
    n_out = shapes[-1][0]
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= n_out:
        raise ValueError(f"lossless.groups (m) must be an integer in [1, {n_out}] (the number of outputs), "
                         f"got {m!r}")
    if mode == "shift" and m != 1:
        raise ValueError(f"lossless.groups (m) must be 1 with mode='shift', got {m}")
    if not isinstance(generator, torch.Generator):
        raise ValueError("draw_secrets needs a torch.Generator (explicit seeding)")
    mlo, mhi = check_range("lossless.multiplicative", multiplicative)
    glo, ghi = check_range("lossless.gamma", gamma)
    alo, ahi = check_range("lossless.additive", additive)
    r = tuple(_log_uniform(n, mlo, mhi, generator) for n, _ in shapes[:-1])
    perm = torch.randperm(n_out, generator=generator)
    groups = torch.empty(n_out, dtype=torch.int64)
    for s, chunk in enumerate(torch.tensor_split(perm, m)):
        groups[chunk] = s
    g = _signs(m, generator) * _log_uniform(m, glo, ghi, generator)
    if mode == "shift":
        r_a = torch.ones(n_out, dtype=torch.float64)
    else:
        for _ in range(100):
            r_a = _signs(n_out, generator) * (alo + (ahi - alo) * torch.rand(n_out, generator=generator,
                                                                          dtype=torch.float64))
            d = (r_a[:, None] - r_a[None, :]).abs() + torch.eye(n_out, dtype=torch.float64)
            if bool((d > 1e-9 * ahi).all()):
                break
        else:  # pragma: no cover - needs a degenerate range
            raise ValueError(f"lossless.additive {additive!r} cannot give {n_out} pairwise distinct values")
    return Secrets(tuple(v.to(dtype) for v in r), g.to(dtype), PublicNoise(r_a.to(dtype), groups))


# -------------------------------------------------------------------------------------- perturbation
def perturb(layers: Sequence[Layer], secrets: Secrets) -> tuple[list[Layer], PublicNoise]:
    """Eq. 7-9: the perturbed layers (in the secrets' dtype) and the public noise to send with them."""
    L = len(layers)
    if len(secrets.r) != L - 1:
        raise ValueError(f"secrets are for {len(secrets.r) + 1} layers, the model has {L}")
    if int(layers[-1][0].shape[0]) != int(secrets.public.r_a.numel()):
        raise ValueError(f"secrets are for {secrets.public.r_a.numel()} outputs, the model has "
                         f"{layers[-1][0].shape[0]}")
    dt = secrets.gamma.dtype
    out: list[Layer] = []
    for k, (w, b) in enumerate(layers):
        dev = w.device
        Rw, Rb = secrets.scale(k, L, tuple(w.shape))
        if k < L - 1 and Rw.shape[0] != w.shape[0]:
            raise ValueError(f"secrets do not fit layer {k}: r^({k + 1}) has {Rw.shape[0]} entries, the layer "
                             f"{w.shape[0]} units")
        wh = Rw.to(dev) * w.to(dt)
        bh = Rb.to(dev) * b.to(dt) if b is not None else None
        if k == L - 1:
            ra = secrets.r_out.to(dev)
            wh = wh + ra[:, None]
            bh = bh + ra if bh is not None else None
        out.append((wh, bh))
    return out, secrets.public
