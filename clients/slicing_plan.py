"""Seed 000 (Wang et al., INFOCOM 2022) §IV-B: risk-balanced slicing of the parameters (used by ``lrp``,
:mod:`clients.slicing`).

**Slicing (§IV-B).** The trainable parameters, flattened in ``model.parameters()`` order, are cut
into blocks of ``b = gcd(numel of every trainable tensor)`` coordinates. Every block of layer ``l``
gets the risk ``R_b = R_l`` (``block_risk="layer"``, the default: the paper balances "the leakage
risk weighted with layer size", so a layer weighs ``R_l * S_l / b`` in total) or ``R_l * b / S_l``
(``block_risk="share"``: a layer weighs ``R_l`` in total). The blocks are packed into ``s`` slices
by the LPT greedy (blocks by decreasing risk, each to the slice with the least risk so far). Blocks
of one layer have equal risk, so each layer is packed in one vectorised "water-filling" step that
gives the same result as the one-by-one greedy, and each slice's share of a layer is one contiguous
range. ``method="size"`` is Table III[A]'s baseline: ``s`` contiguous, equally sized (block-aligned)
slices of the flat vector, irrespective of risk.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import reduce
from typing import Sequence

import numpy as np
import torch

# --------------------------------------------------------------------------- slicing (§IV-B)


@dataclass(frozen=True)
class SlicingPlan:
    """A partition of the flat trainable-parameter vector into ``num_slices`` slices.

    ``ranges`` is an ``(n, 3)`` int64 array of ``(slice, start, end)`` rows (``end`` exclusive,
    coordinates of the concatenation of the trainable tensors in parameter order), sorted by slice
    then start; every coordinate in ``[0, total)`` lies in exactly one range.
    """

    ranges: np.ndarray
    num_slices: int
    total: int
    block_size: int
    slice_risk: np.ndarray  # total (block) risk per slice; for method "size" the risk if known, else counts
    method: str = "sensitivity"

    def slice_ranges(self, i: int) -> list[tuple[int, int]]:
        rows = self.ranges[self.ranges[:, 0] == i]
        return [(int(a), int(b)) for a, b in rows[:, 1:]]

    def slice_sizes(self) -> np.ndarray:
        return np.bincount(self.ranges[:, 0], weights=self.ranges[:, 2] - self.ranges[:, 1],
                           minlength=self.num_slices).astype(np.int64)

    def indices(self, slices: int | Sequence[int]) -> np.ndarray:
        """Flat coordinates (sorted) of one slice or of a set of slices."""
        sel = np.atleast_1d(np.asarray(slices, dtype=np.int64))
        rows = self.ranges[np.isin(self.ranges[:, 0], sel)]
        if len(rows) == 0:
            return np.zeros(0, dtype=np.int64)
        idx = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in rows[:, 1:]])
        return np.sort(idx)

    def mask(self, slices: int | Sequence[int]) -> np.ndarray:
        m = np.zeros(self.total, dtype=bool)
        m[self.indices(slices)] = True
        return m

    def gather(self, flat, slices: int | Sequence[int]):
        """The entries of ``flat`` (NumPy array or tensor of length ``total``) in the given slices."""
        idx = self.indices(slices)
        if isinstance(flat, torch.Tensor):
            return flat[torch.as_tensor(idx, device=flat.device)]
        return np.asarray(flat)[idx]

    def scatter(self, flat, slices: int | Sequence[int], values):
        """A copy of ``flat`` with the coordinates of the given slices replaced by ``values``
        (in :meth:`indices` order)."""
        idx = self.indices(slices)
        if isinstance(flat, torch.Tensor):
            out = flat.clone()
            out[torch.as_tensor(idx, device=flat.device)] = torch.as_tensor(values).to(flat)
            return out
        out = np.array(flat, copy=True)
        out[idx] = values
        return out

    def digest(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self.ranges, dtype=np.int64).tobytes())
        h.update(np.array([self.num_slices, self.total, self.block_size], dtype=np.int64).tobytes())
        return h.hexdigest()

    def to_state(self) -> dict[str, np.ndarray]:
        return {"plan.ranges": np.ascontiguousarray(self.ranges, dtype=np.int64),
                "plan.shape": np.array([self.num_slices, self.total, self.block_size], dtype=np.int64),
                "plan.slice_risk": np.asarray(self.slice_risk, dtype=np.float64)}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray], method: str = "sensitivity") -> "SlicingPlan | None":
        if "plan.ranges" not in state or "plan.shape" not in state:
            return None
        s, total, b = (int(v) for v in np.asarray(state["plan.shape"]).reshape(-1)[:3])
        ranges = np.asarray(state["plan.ranges"], dtype=np.int64).reshape(-1, 3)
        risk = np.asarray(state.get("plan.slice_risk", np.zeros(s)), dtype=np.float64)
        return cls(ranges, s, total, b, risk, method)


def _water_fill(loads: np.ndarray, r: float, n: int) -> np.ndarray:
    """Counts per bin when ``n`` items of equal weight ``r`` are added one by one to the least-loaded
    bin (ties: lowest index). Vectorised: the greedy takes the ``n`` smallest candidates
    ``loads[k] + t*r`` (t >= 0), so a level ``T`` found by bisection fixes all but a few items."""
    s = len(loads)
    counts = np.zeros(s, dtype=np.int64)
    if n <= 0:
        return counts
    if not r > 0:  # risk-free blocks: spread them by count, starting with the least-loaded bins
        order = np.argsort(loads, kind="stable")
        counts[order] = n // s
        counts[order[: n % s]] += 1
        return counts
    loads = loads.astype(np.float64).copy()

    def taken(level: float) -> np.ndarray:
        return np.maximum(0, np.floor((level - loads) / r)).astype(np.int64)

    lo, hi = float(loads.min()), float(loads.max()) + (n // s + 1) * r
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if taken(mid).sum() <= n:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(abs(hi), r):
            break
    counts = taken(lo)
    if counts.sum() > n:  # numerical safety; never expected
        counts[:] = 0
    loads += counts * r
    for _ in range(int(n - counts.sum())):
        k = int(np.argmin(loads))
        loads[k] += r
        counts[k] += 1
    return counts


def build_plan(sizes: Sequence[int], num_slices: int, risk: Sequence[float] | None = None,
               method: str = "sensitivity", block_risk: str = "layer") -> SlicingPlan:
    """Slice a flat vector made of tensors of ``sizes`` (parameter order) into ``num_slices`` slices.

    ``method="sensitivity"`` balances the total block risk per slice (LPT greedy, needs ``risk``, one
    value per tensor); ``method="size"`` cuts ``num_slices`` contiguous, equally sized block-aligned
    slices. The number of slices is capped at the number of blocks.
    """
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) <= 0:
        raise ValueError("build_plan needs at least one non-empty tensor")
    if int(num_slices) < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}")
    if method not in ("sensitivity", "size"):
        raise ValueError(f"method must be 'sensitivity' or 'size', got {method!r}")
    if block_risk not in ("layer", "share"):
        raise ValueError(f"block_risk must be 'layer' or 'share', got {block_risk!r}")
    b = reduce(math.gcd, sizes)
    nblocks = [s // b for s in sizes]
    total_blocks = sum(nblocks)
    s = min(int(num_slices), total_blocks)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(offsets[-1])
    if risk is not None:
        risk = np.asarray(risk, dtype=np.float64)
        if risk.shape != (len(sizes),):
            raise ValueError(f"risk needs one value per tensor ({len(sizes)}), got shape {risk.shape}")
        if not np.all(np.isfinite(risk)) or np.any(risk < 0):
            raise ValueError("risk values must be finite and >= 0")
        block_r = risk if block_risk == "layer" else risk / np.asarray(nblocks, dtype=np.float64)
    rows: list[tuple[int, int, int]] = []
    if method == "size":
        cuts = [(total_blocks * k) // s for k in range(s + 1)]
        for k in range(s):
            if cuts[k + 1] > cuts[k]:
                rows.append((k, cuts[k] * b, cuts[k + 1] * b))
        if risk is not None:
            per_coord = np.repeat(block_r / b, sizes)
            slice_risk = np.array([per_coord[a:e].sum() for _, a, e in rows])
        else:
            slice_risk = np.array([float(e - a) for _, a, e in rows])
    else:
        if risk is None:
            raise ValueError("method='sensitivity' needs the per-tensor risk")
        loads = np.zeros(s, dtype=np.float64)
        order = sorted(range(len(sizes)), key=lambda i: (-block_r[i], i))  # LPT: largest block risk first
        for i in order:
            counts = _water_fill(loads, float(block_r[i]), nblocks[i])
            loads += counts * block_r[i]
            start = int(offsets[i])
            for k in range(s):
                if counts[k]:
                    end = start + int(counts[k]) * b
                    rows.append((k, start, end))
                    start = end
        slice_risk = loads
    ranges = np.array(sorted(rows), dtype=np.int64).reshape(-1, 3)
    return SlicingPlan(ranges, s, total, b, np.asarray(slice_risk, dtype=np.float64), method)
