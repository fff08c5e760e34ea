"""Feature (style) shift: the same task drawn in several styles, one style per client.

``[data] styles = ["plain", "inverted"]`` turns an image dataset into one with a source per style
(:func:`with_styles`): the training images are dealt to the styles (a fixed permutation, equal shares,
no image in two styles) and each share is drawn in its style; the test set holds every test image in
every style, so the global model is scored on all of them (and per style: ``test.<style>_accuracy``).
With ``data.partition = "natural"`` each client gets one style - the labels stay balanced and only the
look of the images differs, as between seed 003's two text-recognition clients (Synth90K and SynthText:
the same task, different fonts and backgrounds; thesis §4.3.2, Table 4.3).

Styles act on images in [0, 1] of shape (N, C, H, W) and keep them there.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F


def _blurred(x: torch.Tensor) -> torch.Tensor:
    k = torch.ones(x.shape[1], 1, 3, 3) / 9.0
    return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), k, groups=x.shape[1])


STYLES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "plain": (lambda x: x, "the images as they are"),
    "inverted": (lambda x: 1.0 - x, "1 - x: dark strokes on a light background"),
    "rotated": (lambda x: torch.rot90(x, 1, dims=(2, 3)), "turned 90 degrees anticlockwise"),
    "low-contrast": (lambda x: 0.3 + 0.4 * x, "0.3 + 0.4 x: a grey, faded look"),
    "blurred": (_blurred, "a 3 x 3 box blur"),
    "thick": (lambda x: F.max_pool2d(x, 3, stride=1, padding=1), "3 x 3 grey dilation: thicker strokes"),
}


def check_styles(styles: Sequence[str]) -> list[str]:
    styles = list(styles)
    unknown = [s for s in styles if s not in STYLES]
    if unknown:
        raise ValueError(f"data.styles: unknown style(s) {unknown}; known: {sorted(STYLES)}")
    if len(set(styles)) != len(styles):
        raise ValueError(f"data.styles: a style is named twice: {styles}")
    return styles


def with_styles(ds, styles: Sequence[str]):
    """``ds`` (a :class:`fedsim.data.Dataset` of images) with a source per style (module docstring)."""
    styles = check_styles(styles)
    if not styles:
        return ds
    if ds.kind != "image" or ds.x_train.ndim != 4:
        raise ValueError(f"data.styles needs an image dataset; {ds.name!r} is {ds.kind}")
    if ds.sources is not None:
        raise ValueError(f"data.styles: {ds.name!r} already has natural sources")
    k = len(styles)

    def draw(x: torch.Tensor, source: np.ndarray) -> torch.Tensor:
        out = x.clone()
        for s, name in enumerate(styles):
            idx = torch.as_tensor(np.flatnonzero(source == s))
            if len(idx):
                out[idx] = STYLES[name][0](x[idx]).clamp(0.0, 1.0)
        return out

    def deal(n: int) -> np.ndarray:  # equal shares of a fixed (seed-0) permutation
        src = np.empty(n, dtype=np.int64)
        src[np.random.default_rng([0, 0x57]).permutation(n)] = np.arange(n) % k
        return src

    src_train, src_root = deal(len(ds.y_train)), deal(len(ds.y_root))
    n_test = len(ds.y_test)
    src_test = np.repeat(np.arange(k), n_test)
    return replace(ds, name=f"{ds.name}, styles {'/'.join(styles)}",
                   x_train=draw(ds.x_train, src_train),
                   x_test=draw(ds.x_test.repeat(k, 1, 1, 1), src_test), y_test=ds.y_test.repeat(k),
                   x_root=draw(ds.x_root, src_root),
                   sources=torch.from_numpy(src_train), test_sources=torch.from_numpy(src_test),
                   source_names=tuple(styles))
