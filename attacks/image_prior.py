"""Untrained-CNN image prior (deep image prior, Ulyanov et al. 2018), as seed 004 uses it.

Instead of optimising pixels, the attack optimises the weights of a randomly initialised convolutional
generator that maps fixed random codes (one per image) to the images; the structure of a CNN favours
natural images over noise. Seed 004 (appendix F) uses a PixelCNN++-style U-Net on a Wide-ResNet with
self-attention and group normalisation; this is a compact U-Net of the same family sized for small
images on a CPU: two down-sampling and two up-sampling stages with skip connections, group
normalisation, LeakyReLU, and a sigmoid output so that images lie in the data range [0, 1].

All weights and the codes are drawn from an explicit ``torch.Generator`` (deterministic, no global RNG).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F


def _gn(channels: int) -> nn.GroupNorm:
    groups = math.gcd(channels, 8)
    return nn.GroupNorm(groups, channels)


class _Block(nn.Module):
    """``convs`` 3x3 convolutions with group normalisation and LeakyReLU, and a (1x1 where the widths
    differ) skip connection around them."""

    def __init__(self, cin: int, cout: int, convs: int = 2):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm1 = _gn(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1) if convs > 1 else None
        self.norm2 = _gn(cout) if convs > 1 else None
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(self.conv1(x))
        if self.conv2 is not None:
            h = self.norm2(self.conv2(F.leaky_relu(h, 0.2)))
        return F.leaky_relu(h + self.skip(x), 0.2)


class ImagePrior(nn.Module):
    """``forward()`` returns ``batch`` images shaped ``out_shape`` (C, H, W) with values in (0, 1).

    ``width`` channels at full resolution (``2 width`` and ``4 width`` below), ``depth`` convolutions per
    block (2: two per block, the usual U-Net block; 1: one), ``code_channels`` channels of fixed N(0, 1)
    code per image at full resolution.
    """

    def __init__(self, out_shape: Sequence[int], batch: int, gen: torch.Generator, width: int = 16,
                 code_channels: int = 8, depth: int = 2):
        super().__init__()
        c, h, w = (int(s) for s in out_shape)
        self.out_shape = (c, h, w)
        self.register_buffer("code", torch.randn((batch, code_channels, h, w), generator=gen))
        w1, w2, w3 = width, 2 * width, 4 * width
        self.enc1 = _Block(code_channels, w1, depth)
        self.enc2 = _Block(w1, w2, depth)
        self.mid = _Block(w2, w3, depth)
        self.dec2 = _Block(w3 + w2, w2, depth)
        self.dec1 = _Block(w2 + w1, w1, depth)
        self.out = nn.Conv2d(w1, c, 1)
        self.reset_parameters(gen)

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        """He-uniform convolution weights (PyTorch's default bound) drawn from ``gen``; zero biases."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
                bound = 1.0 / math.sqrt(fan_in)
                m.weight.copy_(torch.empty(m.weight.shape).uniform_(-bound, bound, generator=gen) * math.sqrt(3))
                if m.bias is not None:
                    m.bias.zero_()

    def forward(self) -> torch.Tensor:
        e1 = self.enc1(self.code)
        e2 = self.enc2(F.avg_pool2d(e1, 2, ceil_mode=True))
        m = self.mid(F.avg_pool2d(e2, 2, ceil_mode=True))
        u2 = F.interpolate(m, size=e2.shape[-2:], mode="bilinear", align_corners=False)
        d2 = self.dec2(torch.cat([u2, e2], 1))
        u1 = F.interpolate(d2, size=e1.shape[-2:], mode="bilinear", align_corners=False)
        d1 = self.dec1(torch.cat([u1, e1], 1))
        return torch.sigmoid(self.out(d1))
