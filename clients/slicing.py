"""Seed 000 (Wang et al., INFOCOM 2022) §IV: leakage-risk quantification, risk-balanced slicing and
local random perturbation (``lrp``).

**Risk (eq. 1-2).** For every trainable parameter tensor ``l`` the leakage risk is

    R_l = 1/k * sum_i || d g_l(X_i) / d X_i ||_F,      g_l(X) = d loss(f(X), y) / d theta_l,

the Frobenius norm of the input-gradient Jacobian of the *single-sample* cross-entropy gradient,
averaged over ``k`` public root samples. :func:`layer_risk` computes it with ``torch.func``
(``functional_call`` + ``grad``, differentiated forward-mode w.r.t. the input with ``jvp``/``vmap``):

* ``method="exact"``: ``||J||_F^2 = sum_j ||J e_j||^2`` over every input coordinate ``e_j``
  (``D`` Jacobian-vector products per sample, D = input size; what ``jacfwd`` does, without
  materialising ``J``). About 0.5 s per 28x28 sample for LeNet on 2 CPU cores.
* ``method="randomized"``: Hutchinson's estimator ``E_u ||J u||^2 = ||J||_F^2`` with ``probes``
  Rademacher vectors ``u`` in *input* space (``E[u u^T] = I``). One JVP gives the estimate for every
  layer at once, which is why the probes live in input space rather than parameter space (a
  ``J^T v`` probe mixes layers and would need one vector-Jacobian product per layer). The square root
  of the unbiased ``||J||_F^2`` estimate is taken per sample (slightly biased low by Jensen); the
  relative standard error on R_l is at most ``1/sqrt(2 * probes * k)`` (2.5% for 8 probes x 100
  samples; measured within 3% of the exact value on LeNet). Cost on 2 CPU cores, 100 root samples x
  8 probes: about 1 s for LeNet, tens of seconds for the width-16 ConvNet.
* ``method="auto"``: exact when ``k * D <= 4096`` Jacobian-vector products, randomized otherwise.

Models are evaluated per sample in *training* mode (as a batch-1 local step would): BatchNorm2d/3d
layers use the statistics of the single sample and never touch the running buffers; BatchNorm1d,
which cannot normalise one sample, uses its running statistics (eval mode).

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

**Perturbation (Alg. 1).** Each round ``d = max(1, floor(s * gamma))`` slices are drawn by reservoir
sampling (Algorithm R) from ``ctx.generator`` and N(0, sigma_u^2) noise is added to their coordinates
of the outgoing update. See :class:`LocalRandomPerturbation` for the noise scale.
"""
from __future__ import annotations

import copy
import hashlib
import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from functools import reduce
from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vmap
from torch.nn import functional as F

from clients.clipping import clip_per_sample, per_sample_gradients
from fedsim.defense import Defense, DefenseContext, LossFn, register
from fedsim.protocol import LR

RISK_METHODS = ("exact", "randomized", "auto")
AUTO_EXACT_BUDGET = 4096  # max (samples x input size) Jacobian-vector products for method="auto"


# --------------------------------------------------------------------------- risk (eq. 1-2)


def trainable_parameters(model: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """Trainable parameters in ``model.parameters()`` order (the order ``local_train`` steps them)."""
    return OrderedDict((n, p) for n, p in model.named_parameters() if p.requires_grad)


def _per_sample_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that computes single-sample training-mode outputs without side effects:
    BatchNorm2d/3d normalise with the sample's own statistics (no running buffers); BatchNorm1d uses
    its running statistics."""
    fm = copy.deepcopy(model)
    fm.train()
    for mod in fm.modules():
        if isinstance(mod, (nn.BatchNorm2d, nn.BatchNorm3d)):
            mod.track_running_stats = False
            mod.running_mean = None
            mod.running_var = None
            mod.num_batches_tracked = None
        elif isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.eval()
    for p in fm.parameters():
        p.requires_grad_(False)
    return fm


def _gradient_jvp_fn(model: nn.Module):
    """``f(x, y, t) -> [||J_l t||^2 for each trainable l]`` for one sample ``x`` and tangent ``t``."""
    fm = _per_sample_copy(model)
    names = list(trainable_parameters(model))
    params = {n: p.detach() for n, p in fm.named_parameters() if n in set(names)}
    frozen = {n: p.detach() for n, p in fm.named_parameters() if n not in params}
    buffers = {n: b for n, b in fm.named_buffers()}

    def sample_grad(x: torch.Tensor, y: torch.Tensor):
        def loss(p):
            out = functional_call(fm, ({**p, **frozen}, buffers), (x.unsqueeze(0),))
            return F.cross_entropy(out, y.unsqueeze(0))

        return grad(loss)(params)

    def sq_norms(x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            # torch's first forward-mode AD call scripts its own decompositions with torch.jit.script and
            # warns that jit.script is deprecated: torch's internals, nothing a fedsim user can act on
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*", category=FutureWarning)
            _, tangent = jvp(lambda xx: sample_grad(xx, y), (x,), (t,))
        return torch.stack([tangent[n].pow(2).sum() for n in names])

    return names, sq_norms


def layer_risk(model: nn.Module, x_root: torch.Tensor, y_root: torch.Tensor, method: str = "auto", *,
               root_size: int | None = None, probes: int = 8, chunk_size: int = 256,
               generator: torch.Generator | None = None) -> "OrderedDict[str, float]":
    """Leakage risk R_l (eq. 2) of every trainable parameter tensor, in ``model.parameters()`` order.

    ``root_size`` limits the root set to its first ``root_size`` samples (all when None).
    ``probes`` is the number of Rademacher probes per sample for ``method="randomized"``; their
    randomness comes from ``generator`` (a fixed seed-0 generator when None, so the result is a
    deterministic function of the weights and the root data). ``chunk_size`` bounds how many
    Jacobian-vector products are vectorised at once (memory). The model itself is not modified.
    """
    if method not in RISK_METHODS:
        raise ValueError(f"method must be one of {RISK_METHODS}, got {method!r}")
    n = len(y_root) if root_size is None else min(int(root_size), len(y_root))
    if n <= 0:
        raise ValueError("layer_risk needs at least one root sample")
    first = next(model.parameters())
    dev = first.device
    x = x_root[:n].to(dev, first.dtype if first.is_floating_point() else torch.float32)
    y = y_root[:n].to(dev)
    in_shape = tuple(x.shape[1:])
    dim = int(np.prod(in_shape))
    if method == "auto":
        method = "exact" if n * dim <= AUTO_EXACT_BUDGET else "randomized"
    names, sq_norms = _gradient_jvp_fn(model)
    total = torch.zeros(len(names), dtype=torch.float64)
    if method == "exact":
        basis = torch.eye(dim, device=dev, dtype=x.dtype).reshape(dim, *in_shape)
        per_basis = vmap(sq_norms, in_dims=(None, None, 0), chunk_size=chunk_size)
        for i in range(n):
            total += per_basis(x[i], y[i], basis).double().sum(0).sqrt().cpu()
    else:
        if probes < 1:
            raise ValueError(f"probes must be >= 1, got {probes}")
        gen = generator if generator is not None else torch.Generator().manual_seed(0)
        u = torch.randint(0, 2, (n, probes, *in_shape), generator=gen).to(x.dtype).mul_(2).sub_(1).to(dev)
        per_sample = vmap(vmap(sq_norms, in_dims=(None, None, 0)), in_dims=(0, 0, 0),
                          chunk_size=max(1, chunk_size // probes))
        total += per_sample(x, y, u).double().mean(1).sqrt().sum(0).cpu()
    risk = (total / n).tolist()
    return OrderedDict(zip(names, risk))


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


# --------------------------------------------------------------------------- Algorithm 1


def reservoir_sample(n_items: int, k: int, generator: torch.Generator | None = None) -> list[int]:
    """Algorithm R (Alg. 1's Slice_selector): ``min(k, n_items)`` distinct items of ``range(n_items)``,
    every k-subset equally likely, O(n_items) random draws from ``generator``."""
    n_items, k = int(n_items), int(k)
    if k < 0 or n_items < 0:
        raise ValueError("n_items and k must be >= 0")
    k = min(k, n_items)
    reservoir = list(range(k))
    for i in range(k, n_items):
        j = int(torch.randint(0, i + 1, (1,), generator=generator).item())
        if j < k:
            reservoir[j] = i
    return reservoir


def num_perturbed(num_slices: int, gamma: float) -> int:
    """``max(1, floor(s * gamma))`` (with a tolerance for binary fractions such as 0.3 * 10)."""
    return max(1, min(int(num_slices), int(math.floor(num_slices * gamma + 1e-9))))


_RISK_CACHE: "OrderedDict[tuple, list[float]]" = OrderedDict()  # per process: clients share the plan work


def biased_root(x: torch.Tensor, y: torch.Tensor, n: int, bias: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The root set of ``n`` samples with a share ``bias`` from one class (the lowest label), the rest
    the first samples of the other classes (seed 000 Table III[C]); ``bias = 0``: the first ``n``."""
    n = min(int(n), len(y))
    if bias <= 0.0:
        return x[:n], y[:n]
    cls = y.min()
    same = torch.nonzero(y == cls).flatten()
    other = torch.nonzero(y != cls).flatten()
    k = min(int(round(bias * n)), len(same))
    idx = torch.cat([same[:k], other[: n - k]])
    return x[idx], y[idx]


def _digest_tensors(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        a = t.detach().cpu().contiguous()
        h.update(str((a.dtype, tuple(a.shape))).encode())
        h.update(a.numpy().tobytes())
    return h.hexdigest()


def _reinit_copy(model: nn.Module, seed: int = 0) -> nn.Module:
    ref = copy.deepcopy(model).cpu()  # CPU: seeded by torch.manual_seed alone, whatever the device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for mod in ref.modules():
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
    return ref


@register
class LocalRandomPerturbation(Defense):
    """Seed 000's local random perturbation (Alg. 1) on risk-balanced slices.

    Parameters
    ----------
    slices : number of slices ``s`` (capped at the number of gcd blocks).
    gamma : perturbation ratio in (0, 1]; ``d = max(1, floor(s * gamma))`` slices get noise per round
        (paper: 0.2 against DLG, 0.3 against the GIA).
    sigma : noise standard deviation (paper: variance 1e-2, i.e. sigma = 0.1).
    scale : ``"gradient"`` (default): sigma is the std on the gradient scale, as Alg. 1 adds the noise
        to "G, the local gradients" with G = d loss / d theta (§II-A); the update (``-lr * G`` for a
        one-step client, ``-lr * sum_t g_t`` for several steps) gets ``lr * sigma``, so the server's
        gradient estimate ``-update / lr`` carries exactly N(0, sigma^2) on the perturbed entries.
        ``"update"``: sigma is the std of the noise added to the update itself (like
        ``gaussian-noise``); with the paper's sigma = 0.1 and lr = 1e-2 that is 100x the gradient
        scale and no compensation can recover it.
    risk : ``"sensitivity"`` (eq. 1-2 risk balancing) or ``"size"`` (Table III[A]'s baseline).
    root_size : number of public root samples (``ctx.public_data``, first ones) used for the risk.
    root_bias : Table III[C]'s bias probability: this share of the root set is drawn from one class (the
        public split's lowest label), the rest are the split's first samples of the other classes; 0
        (default): the first ``root_size`` samples (a uniform sample of the public split).
    risk_method : ``"auto"``, ``"exact"`` or ``"randomized"`` (see :func:`layer_risk`).
    probes : Rademacher probes per root sample for the randomized estimator.
    block_risk : ``"layer"`` (R_b = R_l) or ``"share"`` (R_b = R_l * b / S_l), see the module doc.
    plan_from : ``"global"``: the risk is measured on the global weights the client holds the first
        time it runs this defense (identical on all clients that first train in the same round, e.g.
        round 1); ``"reinit"``: on a seed-0 re-initialisation of the same architecture (identical on
        every client whenever it joins, but ignores custom initialisations).
    clip : optional per-sample clipping bound B (§V-C): each sample's gradient is scaled by
        ``1 / max(1, ||g||_2 / B)`` (per-sample gradients with torch.func) before averaging, and the
        noise std becomes ``sigma * B`` (the paper's N(0, sigma^2 B^2)). BatchNorm2d layers normalise
        each sample with its own statistics for the per-sample gradients.

    The plan is computed once per client and kept in ``ctx.state`` (``plan.*`` entries); within a
    process the risk computation is also cached by a digest of (weights, root data, settings).

    ``noise_variance()`` is the per-entry noise variance on the update averaged over all trainable
    parameter coordinates: ``fraction_perturbed * sigma_u^2`` with the realised fraction after a
    round, ``d / s * sigma_u^2`` (its expectation under uniform slice selection) before; None when
    ``scale="gradient"`` and the learning rate is not known yet.
    """

    name = "lrp"

    def __init__(self, slices: int = 10, gamma: float = 0.3, sigma: float = 0.1, scale: str = "gradient",
                 risk: str = "sensitivity", root_size: int = 100, risk_method: str = "auto", probes: int = 8,
                 block_risk: str = "layer", plan_from: str = "global", clip: float | None = None,
                 root_bias: float = 0.0):
        if int(slices) < 1:
            raise ValueError(f"slices must be >= 1, got {slices}")
        if not 0.0 < float(gamma) <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        if float(sigma) < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        if scale not in ("update", "gradient"):
            raise ValueError(f"scale must be 'update' or 'gradient', got {scale!r}")
        if risk not in ("sensitivity", "size"):
            raise ValueError(f"risk must be 'sensitivity' or 'size', got {risk!r}")
        if int(root_size) < 1:
            raise ValueError(f"root_size must be >= 1, got {root_size}")
        if risk_method not in RISK_METHODS:
            raise ValueError(f"risk_method must be one of {RISK_METHODS}, got {risk_method!r}")
        if int(probes) < 1:
            raise ValueError(f"probes must be >= 1, got {probes}")
        if block_risk not in ("layer", "share"):
            raise ValueError(f"block_risk must be 'layer' or 'share', got {block_risk!r}")
        if plan_from not in ("global", "reinit"):
            raise ValueError(f"plan_from must be 'global' or 'reinit', got {plan_from!r}")
        if clip is not None and not float(clip) > 0:
            raise ValueError(f"clip must be > 0 or unset, got {clip}")
        if not 0.0 <= float(root_bias) <= 1.0:
            raise ValueError(f"root_bias must be in [0, 1], got {root_bias}")
        self.root_bias = float(root_bias)
        self.slices, self.gamma, self.sigma = int(slices), float(gamma), float(sigma)
        self.scale, self.risk, self.root_size = scale, risk, int(root_size)
        self.risk_method, self.probes, self.block_risk = risk_method, int(probes), block_risk
        self.plan_from = plan_from
        self.clip = None if clip is None else float(clip)
        self.plan: SlicingPlan | None = None
        self.last_selected: list[int] = []
        self._lr: float | None = None
        self._fraction: float | None = None
        self._plan_round = -1
        self._clip_steps = self._clipped = self._samples = 0

    # ---- scales -----------------------------------------------------------------------------
    def noise_std(self) -> float | None:
        """Std of the noise added to each perturbed update coordinate (None if lr unknown)."""
        std = self.sigma * (self.clip if self.clip is not None else 1.0)
        if self.scale == "gradient":
            if self._lr is None:
                return None
            std *= self._lr
        return std

    def noise_variance(self) -> float | None:
        std = self.noise_std()
        if std is None:
            return None
        if self._fraction is not None:
            frac = self._fraction
        else:
            s = self.plan.num_slices if self.plan is not None else self.slices
            frac = num_perturbed(s, self.gamma) / s
        return frac * std ** 2

    # ---- plan -------------------------------------------------------------------------------
    def _compute_plan(self, model: nn.Module, ctx: DefenseContext, sizes: list[int]) -> SlicingPlan:
        if self.risk == "size":
            return build_plan(sizes, self.slices, None, method="size")
        if ctx.public_data is None:
            raise ValueError("lrp with risk='sensitivity' needs the public root data (ctx.public_data)")
        x_root, y_root = biased_root(*ctx.public_data, self.root_size, self.root_bias)
        ref = _reinit_copy(model) if self.plan_from == "reinit" else model
        tp = list(trainable_parameters(ref).values())
        key = (_digest_tensors(tp + list(ref.buffers())), _digest_tensors([x_root[:self.root_size],
                                                                           y_root[:self.root_size]]),
               self.root_size, self.risk_method, self.probes, type(ref).__name__)
        if key in _RISK_CACHE:
            risk = _RISK_CACHE[key]
        else:
            risk = list(layer_risk(ref, x_root, y_root, self.risk_method, root_size=self.root_size,
                                   probes=self.probes).values())
            _RISK_CACHE[key] = risk
            while len(_RISK_CACHE) > 8:
                _RISK_CACHE.popitem(last=False)
        self._layer_risk = np.asarray(risk, dtype=np.float64)
        return build_plan(sizes, self.slices, risk, method="sensitivity", block_risk=self.block_risk)

    def setup(self, model: nn.Module, ctx: DefenseContext) -> None:
        tp = trainable_parameters(model)
        pos = {n: i for i, n in enumerate(ctx.param_names)}
        missing = [n for n in tp if n not in pos]
        if missing:
            raise ValueError(f"lrp: trainable parameters {missing[:3]} are not in ctx.param_names")
        self._train_idx = [pos[n] for n in tp]
        self._sizes = [p.numel() for p in tp.values()]
        self._lr = float(ctx.recipe[LR]) if LR in ctx.recipe else None
        self._fraction = None
        method = "size" if self.risk == "size" else "sensitivity"
        plan = SlicingPlan.from_state(ctx.state, method)
        if plan is None or plan.total != sum(self._sizes) or "plan.config" not in ctx.state \
                or not np.array_equal(ctx.state["plan.config"], self._config_code()):
            plan = self._compute_plan(model, ctx, self._sizes)
            ctx.state.update(plan.to_state())
            ctx.state["plan.config"] = self._config_code()
            ctx.state["plan.round"] = np.array([ctx.round], dtype=np.int64)
        self.plan = plan
        self._plan_round = int(np.asarray(ctx.state.get("plan.round", [ctx.round])).reshape(-1)[0])
        self._clip_steps = self._clipped = self._samples = 0
        if self.clip is not None:
            self._clip_model = _per_sample_copy(model)
            self._clip_names = list(tp)

    def _config_code(self) -> np.ndarray:
        """What the cached plan depends on (a changed config recomputes it)."""
        return np.array([self.slices, ("sensitivity", "size").index(self.risk), self.root_size,
                         RISK_METHODS.index(self.risk_method), self.probes,
                         ("layer", "share").index(self.block_risk), ("global", "reinit").index(self.plan_from),
                         int(round(self.root_bias * 1e6))], dtype=np.int64)

    # ---- §V-C per-sample clipping ---------------------------------------------------------------
    def compute_gradient(self, model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                         ctx: DefenseContext) -> list[torch.Tensor] | None:
        if self.clip is None:
            return None
        fm, names = self._clip_model, self._clip_names
        live = trainable_parameters(model)
        params = {n: live[n].detach() for n in names}
        rest = {**{n: p.detach() for n, p in model.named_parameters() if n not in params},
                **dict(fm.named_buffers())}
        per = per_sample_gradients(fm, params, rest, loss_fn, x, y)
        clipped, norms = clip_per_sample([per[n] for n in names], self.clip)
        self._clip_steps += 1
        self._samples += len(y)
        self._clipped += int((norms > self.clip).sum())
        return [g.mean(0) for g in clipped]

    # ---- Alg. 1 -----------------------------------------------------------------------------
    def overrides_compute_gradient(self) -> bool:
        return self.clip is not None

    def transform_update(self, update: list[torch.Tensor], ctx: DefenseContext) -> list[torch.Tensor]:
        if self.plan is None:
            raise RuntimeError("lrp: setup() must run before transform_update()")
        if len(update) != len(ctx.param_names):
            raise ValueError(f"lrp: the update has {len(update)} tensors, ctx.param_names {len(ctx.param_names)}")
        plan = self.plan
        d = num_perturbed(plan.num_slices, self.gamma)
        self.last_selected = reservoir_sample(plan.num_slices, d, ctx.generator)
        idx = plan.indices(sorted(self.last_selected))
        self._fraction = len(idx) / plan.total
        std = self.noise_std()
        if std is None:
            raise ValueError("lrp: scale='gradient' needs the learning rate in the recipe")
        self._std = std
        out = list(update)
        if std == 0.0 or len(idx) == 0:
            return out
        parts = [update[i] for i in self._train_idx]
        flat = torch.cat([p.reshape(-1) for p in parts]).clone()
        noise = torch.randn(len(idx), generator=ctx.generator, dtype=torch.float32) * std
        ti = torch.as_tensor(idx, device=flat.device)
        flat[ti] += noise.to(device=flat.device, dtype=flat.dtype)
        offset = 0
        for i, p in zip(self._train_idx, parts):
            out[i] = flat[offset:offset + p.numel()].reshape(p.shape).to(p.dtype)
            offset += p.numel()
        return out

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {"sigma": self.sigma, "slices": float(self.plan.num_slices if self.plan else self.slices),
                               "slices_perturbed": float(len(self.last_selected)),
                               "fraction_perturbed": float(self._fraction or 0.0),
                               "noise_std": float(getattr(self, "_std", 0.0) or 0.0),
                               "plan_round": float(self._plan_round)}
        if self.plan is not None:
            m["plan_digest"] = float(int(self.plan.digest()[:12], 16))  # 48 bits: exact in a float64
            risk = self.plan.slice_risk
            if len(risk) and risk.min() > 0:
                m["slice_risk_imbalance"] = float(risk.max() / risk.min())
        if self.clip is not None:
            m["clip"] = self.clip
            m["clipped_fraction"] = self._clipped / self._samples if self._samples else 0.0
        return m
