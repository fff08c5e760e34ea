"""Seed 000 (Wang et al., INFOCOM 2022) §IV: leakage-risk quantification, risk-balanced slicing and
local random perturbation (``lrp``).

**Risk (eq. 1-2)** is :mod:`clients.slicing_risk` (:func:`~clients.slicing_risk.layer_risk`), **slicing
(§IV-B)** :mod:`clients.slicing_plan` (:func:`~clients.slicing_plan.build_plan`, :class:`~clients.slicing_plan.SlicingPlan`).

**Perturbation (Alg. 1).** Each round ``d = max(1, floor(s * gamma))`` slices are drawn by reservoir
sampling (Algorithm R) from ``ctx.generator`` and N(0, sigma_u^2) noise is added to their coordinates
of the outgoing update. See :class:`LocalRandomPerturbation` for the noise scale.
"""
from __future__ import annotations

import copy
import hashlib
import math
from collections import OrderedDict
from typing import Annotated

import numpy as np
import torch
from torch import nn

from clients.clipping import clip_per_sample, per_sample_gradients
from clients.slicing_plan import SlicingPlan, build_plan
from clients.slicing_risk import RISK_METHODS, layer_risk, per_sample_copy, trainable_parameters
from fedsim.defense import Defense, DefenseContext, LossFn, register
from fedsim.params import OneOf, Range
from fedsim.protocol import LR

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

    def __init__(self, slices: Annotated[int, Range(1)] = 10,
                 gamma: Annotated[float, Range(0, 1, open_low=True)] = 0.3,
                 sigma: Annotated[float, Range(0)] = 0.1,
                 scale: Annotated[str, OneOf("update", "gradient")] = "gradient",
                 risk: Annotated[str, OneOf("sensitivity", "size")] = "sensitivity",
                 root_size: Annotated[int, Range(1)] = 100,
                 risk_method: Annotated[str, OneOf(*RISK_METHODS)] = "auto",
                 probes: Annotated[int, Range(1)] = 8,
                 block_risk: Annotated[str, OneOf("layer", "share")] = "layer",
                 plan_from: Annotated[str, OneOf("global", "reinit")] = "global",
                 clip: Annotated[float | None, Range(0, open_low=True)] = None,
                 root_bias: Annotated[float, Range(0, 1)] = 0.0):
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
            self._clip_model = per_sample_copy(model)
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
