"""The imprint module of "Robbing the Fed" (Fowl et al., ICLR 2022) - a MALICIOUS server's model.

Threat model: malicious, not merely curious. The server changes the architecture and weights it sends:
it puts an *imprint block* in front of the model. The client trains the imprinted model as usual
and its update of the block's first layer carries its inputs almost verbatim
(``attacks.robbing``). This module only builds the model, so that a client can build the same
architecture the server's weights belong to; it imports nothing from ``attacks``, ``strategies`` or
``clients``.

The block (:class:`ImprintBlock`) for inputs of ``d = C*H*W`` values and ``k`` bins:

* ``linear0`` (``d -> k``) + ReLU: every row is the same *measurement* ``m(x) = <w, x>`` of the
  flattened input (default: the mean brightness, ``w = 1/d``) and the biases are minus the bin
  boundaries ``t_0 < t_1 < ... < t_{k-1}``, so unit ``i`` is ``relu(m(x) - t_i)``: active for every
  input whose measurement exceeds ``t_i``. Boundaries at quantiles of the measurement's distribution
  on data the server knows (:func:`quantile_bins`) or of an assumed normal law (:func:`gaussian_bins`)
  put about the same number of inputs in every bin.
* ``linear1`` (``k -> d``, no bias) adds ``scale * sum_i a_i`` to every input value and feeds the sum
  to the original model. Because all of ``linear1``'s columns are equal, the loss gradient reaching
  unit ``i`` from input ``b`` is the same number ``c_b`` for every active unit. Then
  ``dL/dW_i - dL/dW_{i+1} = sum_{b: t_i < m(x_b) <= t_{i+1}} c_b x_b`` and
  ``dL/db_i - dL/db_{i+1} = sum_{same b} c_b``: a bin holding one input gives it back exactly as the
  ratio.

Scaling: ``linear0`` holds ``gain * w`` and ``-gain * t_i``. The gradients above do not depend on
``gain``, the float32 rounding of the client's weights does (it is relative to the weights), and
``c_b`` grows with ``scale``; what the original model sees added to its input is
``scale * gain * sum_i relu(m(x) - t_i)``. With 128 brightness bins on fmnist the defaults
(``gain=1e-3``, ``scale=1``) add 0.01 on average (at most 0.05) to each input value, and recover the
inputs alone in their bin after one local step at > 90 dB PSNR; ``gain=1, scale=1e-3`` (the same
perturbation) loses to float rounding (30-50 dB on a ReLU LeNet). A small ``gain`` makes the bins fragile under several local steps (each step moves the
weights by more than their size); ``gain`` near 1 keeps them stable (docs/attacks.md).

:func:`imprint_model` builds the server's imprinted model from a base model, bins and the input shape;
:class:`ImprintedModel` with random weights is the architecture a client builds before loading the
server's weights.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

# the server transform that imprints the model it sends (strategies/robbing.py); attack.name "robbing" needs it
IMPRINT_TRANSFORM = "robbing-imprint"
MEASUREMENTS = ("brightness", "random")


class ImprintBlock(nn.Module):
    """``x -> x + linear1(relu(linear0(flatten(x))))`` (see module doc)."""

    def __init__(self, in_shape: Sequence[int], num_bins: int):
        super().__init__()
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 2:
            raise ValueError(f"imprint num_bins must be an integer >= 2, got {num_bins!r}")
        self.in_shape = tuple(int(s) for s in in_shape)
        d = math.prod(self.in_shape)
        self.linear0 = nn.Linear(d, num_bins)
        self.linear1 = nn.Linear(num_bins, d, bias=False)

    @property
    def num_bins(self) -> int:
        return self.linear0.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.linear0(x.flatten(1)))
        return x + self.linear1(a).view_as(x)


class ImprintedModel(nn.Module):
    """An imprint block in front of ``base``: ``base(imprint(x))``.

    State-dict names are ``imprint.linear0.*``, ``imprint.linear1.weight`` and ``base.<the base
    model's names>``. The base model's last linear layer stays the model's last ``nn.Linear``.
    """

    def __init__(self, base: nn.Module, in_shape: Sequence[int], num_bins: int):
        super().__init__()
        self.imprint = ImprintBlock(in_shape, num_bins)
        self.base = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(self.imprint(x))


def measurement_vector(in_shape: Sequence[int], kind: str = "brightness",
                       gen: torch.Generator | None = None) -> torch.Tensor:
    """The measurement ``w`` (flattened, length ``C*H*W``): ``"brightness"`` the mean value (``w = 1/d``);
    ``"random"`` a random direction N(0, 1/d) per entry drawn from ``gen`` (Fowl et al.'s default)."""
    d = math.prod(int(s) for s in in_shape)
    if kind == "brightness":
        return torch.full((d,), 1.0 / d)
    if kind == "random":
        gen = gen if gen is not None else torch.Generator().manual_seed(0)
        return torch.randn((d,), generator=gen) / math.sqrt(d)
    raise ValueError(f"imprint measurement must be one of {list(MEASUREMENTS)}, got {kind!r}")


def quantile_bins(values: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Boundaries at the ``i / num_bins`` quantiles of ``values`` (measurements of data the server
    knows); the lowest is moved one data range below the minimum so that no input falls below every
    bin. Quantiles that coincide in float32 (more bins than distinct values) are merged, so fewer than
    ``num_bins`` boundaries can come back."""
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 2:
        raise ValueError(f"imprint num_bins must be an integer >= 2, got {num_bins!r}")
    v = torch.as_tensor(values).detach().double().flatten()
    if len(v) < 2:
        raise ValueError("quantile_bins needs at least two measurements")
    t = torch.quantile(v, torch.arange(num_bins, dtype=torch.float64) / num_bins)
    t[0] = v.min() - (v.max() - v.min()).clamp_min(1e-6)
    return torch.unique(t.float())  # sorted, strictly increasing


def gaussian_bins(mean: float, std: float, num_bins: int) -> torch.Tensor:
    """``num_bins`` boundaries at the ``i / num_bins`` quantiles of N(mean, std^2) (the lowest at 8 std
    below the mean)."""
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 2:
        raise ValueError(f"imprint num_bins must be an integer >= 2, got {num_bins!r}")
    if not (std > 0):
        raise ValueError(f"imprint std must be > 0, got {std!r}")
    p = torch.arange(1, num_bins, dtype=torch.float64) / num_bins
    z = torch.cat([torch.tensor([-8.0], dtype=torch.float64), torch.special.ndtri(p)])
    return (mean + std * z).float()


@torch.no_grad()
def imprint_model(base: nn.Module, bins: torch.Tensor, in_shape: Sequence[int], *,
                  measurement: str | torch.Tensor = "brightness", scale: float = 1.0, gain: float = 1e-3,
                  gen: torch.Generator | None = None) -> ImprintedModel:
    """The malicious server's model: ``base`` behind an imprint block with the given bin boundaries.

    ``bins``: increasing boundaries ``t_0 < ... < t_{k-1}`` of the measurement (``k >= 2`` bins);
    ``measurement``: ``"brightness"``, ``"random"`` (drawn from ``gen``) or an explicit vector of
    length ``C*H*W``; ``scale``: the value of every entry of ``linear1``; ``gain``: the factor on the
    measurement and the boundaries in ``linear0`` (module doc). ``base`` is used as is (not copied).
    """
    t = torch.as_tensor(bins).detach().float().flatten()
    if len(t) < 2 or not bool((t[1:] > t[:-1]).all()):
        raise ValueError("imprint bins must hold at least two strictly increasing boundaries")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"imprint scale must be a number > 0, got {scale!r}")
    if not (isinstance(gain, (int, float)) and not isinstance(gain, bool) and math.isfinite(gain) and gain > 0):
        raise ValueError(f"imprint gain must be a number > 0, got {gain!r}")
    model = ImprintedModel(base, in_shape, len(t))
    block = model.imprint
    d = math.prod(block.in_shape)
    w = measurement if isinstance(measurement, torch.Tensor) else measurement_vector(in_shape, measurement, gen)
    w = w.detach().float().flatten()
    if len(w) != d:
        raise ValueError(f"imprint measurement has {len(w)} entries for inputs of {d} values")
    ref = next(base.parameters(), None)
    block.to(ref.device if ref is not None else "cpu")
    block.linear0.weight.copy_(gain * w[None, :].expand(len(t), d))
    block.linear0.bias.copy_(-gain * t)
    block.linear1.weight.fill_(float(scale))
    return model


def build_imprinted(base: nn.Module, in_shape: Sequence[int], num_bins: int) -> ImprintedModel:
    """The imprinted architecture with untrained block weights (what a client builds before it loads
    the server's weights)."""
    return ImprintedModel(base, in_shape, num_bins)
