"""GRNN's generator (seed 003, section 3.2.2, Figure 3.2, Table 3.1): the image branch (a 4x4 stem, then
upsampling blocks of nearest x2, 3x3 convolution, BatchNorm and GLU, a sigmoid) and the label branch (one
linear layer and a softmax), with the fast forms of the stem and of narrow upsampling blocks (the same
function up to float rounding). The attack that trains it is :mod:`attacks.grnn`."""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F


def _glu(x: torch.Tensor) -> torch.Tensor:
    return F.glu(x, dim=1)  # first half * sigmoid(second half): channels halve


# Nearest x2 upsampling followed by a 3x3 convolution (padding 1) is a 3x3 convolution at the low
# resolution with four output phases (sub-pixel form): output row 2i sees input rows i-1 (tap -1) and i
# (taps 0 and +1), row 2i+1 rows i (taps -1 and 0) and i+1 (tap +1); the same for columns. _PHASE_TAPS
# maps the 9 taps of a kernel to the 4 phases x 9 taps of the low-resolution kernel (entries 0/1).
_ROW_TAPS = torch.tensor([[[1., 0, 0], [0, 1, 1], [0, 0, 0]],  # phase 0: new tap (row) x old tap (column)
                          [[0., 0, 0], [1, 1, 0], [0, 0, 1]]])  # phase 1
_PHASE_TAPS = torch.einsum("akl,bnm->abknlm", _ROW_TAPS, _ROW_TAPS).reshape(36, 9)
SUBPIXEL_BELOW = 8  # convolutions with fewer output channels run in the sub-pixel form (measured below)


def upsample_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``conv2d(interpolate(x, scale 2, nearest), weight, padding=1)`` for a 3x3 ``weight``, computed as one
    convolution at ``x``'s resolution into four phases and a pixel shuffle: the same function (equal up
    to float rounding), without the upsampled copy. On the CPU (oneDNN, one thread) it is 4x faster for
    GRNN's last block (16 -> 2 channels at 32x32, batch 8: 1.0 vs 4.0 ms forward and backward) and
    slower for wide outputs (32 channels at 8x8: 1.9 vs 1.4 ms), hence :data:`SUBPIXEL_BELOW`."""
    co, ci = weight.shape[:2]
    taps = _PHASE_TAPS.to(weight)
    w4 = (weight.reshape(co * ci, 9) @ taps.T).view(co, ci, 4, 3, 3).transpose(1, 2).reshape(4 * co, ci, 3, 3)
    return F.pixel_shuffle(F.conv2d(x, w4, padding=1), 2)


class _Up(nn.Module):
    """Table 3.1: nearest x2, conv 3x3 (stride 1, padding 1), BatchNorm, GLU."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, 2 * cout, 3, 1, 1, bias=False)
        # no running statistics: the generator always runs in train mode (batch statistics)
        self.bn = nn.BatchNorm2d(2 * cout, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.conv.weight
        if w.shape[0] < SUBPIXEL_BELOW:
            h = upsample_conv(x, w)
        else:
            h = self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return _glu(self.bn(h))


class GRNNGenerator(nn.Module):
    """GRNN's two branches from one latent batch ``(B, latent_dim)``: images ``(B, C, H, W)`` in [0, 1]
    and label probabilities ``(B, num_classes)``."""

    def __init__(self, latent_dim: int, num_classes: int, out_shape: Sequence[int], max_width: int = 512,
                 fit: str = "crop"):
        super().__init__()
        C, H, W = (int(s) for s in out_shape)
        side = 4
        while side < max(H, W):
            side *= 2
        n_up = int(math.log2(side)) - 2  # 4 -> side
        self.out_shape, self.side, self.fit = (C, H, W), side, fit
        widths = [min(max_width, side * 2 ** k) for k in range(n_up - 1, -1, -1)]  # 4x4 ... side/2
        self.label = nn.Linear(latent_dim, num_classes)
        self.stem = nn.ConvTranspose2d(latent_dim, 2 * widths[0], 4, 1, 0)
        chans = widths + [C]
        self.ups = nn.ModuleList(_Up(chans[i], chans[i + 1]) for i in range(n_up))

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.softmax(self.label(z), dim=-1)
        # the stem, a 4x4 transposed convolution of a 1x1 input, is one matrix product (the same
        # function; oneDNN's transposed convolution took 5-10x longer here)
        w, b = self.stem.weight, self.stem.bias
        h = _glu((z @ w.flatten(1)).view(len(z), w.shape[1], *w.shape[2:]) + b[:, None, None])
        for up in self.ups:
            h = up(h)
        x = torch.sigmoid(h)
        C, H, W = self.out_shape
        if (H, W) != (self.side, self.side):
            if self.fit == "crop":
                top, left = (self.side - H) // 2, (self.side - W) // 2
                x = x[:, :, top:top + H, left:left + W]
            else:
                x = F.interpolate(x, size=(H, W), mode="area")
        return x, y


def init_generator(gen: nn.Module, rng: torch.Generator) -> None:
    """PyTorch's default initialisation (U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases of
    convolutions and linear layers; BatchNorm 1 and 0), drawn from ``rng`` on the CPU."""
    with torch.no_grad():
        for m in gen.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
                w = m.weight
                fan_in = w.shape[1] * w[0, 0].numel()  # as torch.nn.init computes it (also for ConvTranspose)
                bound = 1.0 / math.sqrt(fan_in)
                w.copy_(torch.empty(w.shape).uniform_(-bound, bound, generator=rng))
                if m.bias is not None:
                    m.bias.copy_(torch.empty(m.bias.shape).uniform_(-bound, bound, generator=rng))
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.fill_(1.0)
                m.bias.fill_(0.0)


def build_generator(latent_dim: int, num_classes: int, out_shape: Sequence[int], rng: torch.Generator,
                    device: torch.device, max_width: int = 512, fit: str = "crop") -> GRNNGenerator:
    """A freshly initialised generator, without touching the global RNG (built on the meta device)."""
    with torch.device("meta"):
        gen = GRNNGenerator(latent_dim, num_classes, out_shape, max_width, fit)
    gen = gen.to_empty(device="cpu")
    init_generator(gen, rng)
    return gen.to(device)
