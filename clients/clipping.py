"""Norm clipping of the update or of each mini-batch gradient (seed 004's GradClip) and DP-SGD
(Abadi et al. 2016: per-sample clipping + Gaussian noise, seed 004 §3.2) with an RDP accountant.

``dp-sgd`` computes per-sample gradients with ``torch.func`` (functional_call + vmap + grad), clips
each to L2 norm ``clip_norm``, sums them, adds N(0, (noise_multiplier * clip_norm)^2) per entry and
divides by the batch size. The privacy spent is tracked with Opacus's RDP accountant, whose history
(noise multiplier, sample rate, steps) lives in ``ctx.state`` so that epsilon accumulates over the
rounds a client takes part in. The sample rate is q = batch_size / local dataset size; the accountant
assumes Poisson subsampling, while fedsim's batch schedule draws shuffled fixed-size batches - the
usual approximation (as in Abadi et al.'s own experiments).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from clients.update_defense import UpdateDefense
from fedsim.defense import Defense, DefenseContext, LossFn, register
from fedsim.factories import model_for, partitions_for
from fedsim.privacy import AGAINST_SERVER, Mechanism, epsilon
from fedsim.protocol import BATCH_SIZE, recipe_of
from fedsim.training.batches import iter_batches
from fedsim.training.recipe import Recipe

if TYPE_CHECKING:
    from opacus.accountants import RDPAccountant


def per_sample_gradients(module: nn.Module, params: dict[str, torch.Tensor], rest: dict[str, torch.Tensor],
                         loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradient of each sample's loss w.r.t. ``params`` (torch.func: functional_call + vmap + grad).

    ``rest`` holds every other parameter and buffer ``module`` needs (name -> tensor). Returns one
    tensor of shape (batch, *param.shape) per entry of ``params``.
    """
    def loss_one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(module, {**p, **rest}, (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    return vmap(grad(loss_one), in_dims=(None, 0, 0), randomness="different")(params, x, y)


def clip_per_sample(per_sample: list[torch.Tensor], bound: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-sample clipping g_i / max(1, ||g_i|| / B) over all tensors jointly; returns (clipped, norms)."""
    b = per_sample[0].shape[0]
    norms = torch.sqrt(sum((g.reshape(b, -1).double() ** 2).sum(1) for g in per_sample))
    factor = (bound / norms.clamp_min(1e-12)).clamp(max=1.0)
    return [g * factor.to(g.dtype).view(b, *([1] * (g.dim() - 1))) for g in per_sample], norms


def _global_norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


def _check_clip_norm(clip_norm: float) -> float:
    clip_norm = float(clip_norm)
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
    return clip_norm


@register
class ClipUpdate(UpdateDefense):
    """Scale the whole update (all parameter entries together) down to L2 norm at most ``clip_norm``."""

    name = "clip-update"

    def __init__(self, clip_norm: float, include_buffers: bool = False):
        self.clip_norm = _check_clip_norm(clip_norm)
        self.include_buffers = bool(include_buffers)

    def transform_update(self, update: list[torch.Tensor], ctx: DefenseContext) -> list[torch.Tensor]:
        mask = self.targets(ctx, len(update))
        norm = _global_norm([u for u, on in zip(update, mask, strict=True) if on])
        scale = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
        self._norm, self._scale = norm, scale
        return [u * scale if on else u for u, on in zip(update, mask, strict=True)]

    def metrics(self) -> dict[str, float]:
        scale = getattr(self, "_scale", 1.0)
        return {"clip_norm": self.clip_norm, "update_norm": getattr(self, "_norm", 0.0),
                "scale": scale, "clipped": float(scale < 1.0)}


@register
class ClipGradient(Defense):
    """Scale each mini-batch gradient (all parameters together) down to L2 norm at most ``clip_norm``
    before the SGD step (seed 004's GradClip applied at every local step)."""

    name = "clip-gradient"

    def __init__(self, clip_norm: float):
        self.clip_norm = _check_clip_norm(clip_norm)
        self._steps, self._clipped, self._norm_sum = 0, 0, 0.0

    def setup(self, model: nn.Module, ctx: DefenseContext) -> None:
        self._steps, self._clipped, self._norm_sum = 0, 0, 0.0

    def transform_gradient(self, grads: list[torch.Tensor], ctx: DefenseContext) -> list[torch.Tensor]:
        norm = _global_norm(grads)
        self._steps += 1
        self._norm_sum += norm
        if norm > self.clip_norm:
            self._clipped += 1
            return [g * (self.clip_norm / norm) for g in grads]
        return grads

    def metrics(self) -> dict[str, float]:
        steps = self._steps
        return {"clip_norm": self.clip_norm, "clipped_fraction": self._clipped / steps if steps else 0.0,
                "mean_grad_norm": self._norm_sum / steps if steps else 0.0}


def check_no_batchnorm(model: nn.Module) -> None:
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            raise ValueError(
                f"dp-sgd: per-sample gradients are ill-defined with BatchNorm in train mode (module "
                f"{name!r} mixes samples of a batch); build the model with model.norm = 'none'")


@register
class DPSGD(Defense):
    """DP-SGD: per-sample gradient clipping to L2 norm ``clip_norm`` (B) plus Gaussian noise of
    standard deviation ``noise_multiplier * clip_norm`` (z B) on the sum, divided by the batch size.

    Reports epsilon at ``delta`` accumulated over all rounds (Opacus RDP accountant) when
    ``noise_multiplier > 0``.
    """

    name = "dp-sgd"
    STATE_KEY = "accountant"  # (k, 3) float64 rows of (noise_multiplier, sample_rate, steps)

    def __init__(self, clip_norm: float, noise_multiplier: float = 0.0, delta: float = 1e-5):
        self.clip_norm = _check_clip_norm(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        if self.noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        self.delta = float(delta)
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self._acct: RDPAccountant | None = None
        self._acct_state_id: int | None = None
        self._reset_round()

    def _reset_round(self) -> None:
        self._samples, self._clipped, self._norm_sum, self._steps = 0, 0, 0.0, 0
        self._sample_rate = 0.0

    def validate_config(self, cfg) -> None:
        check_no_batchnorm(model_for(cfg).train())

    # -- accountant state in ctx.state
    def _load_accountant(self, ctx: DefenseContext) -> RDPAccountant:
        from opacus.accountants import RDPAccountant  # here: the import costs seconds at start-up

        acct = RDPAccountant()
        hist = ctx.state.get(self.STATE_KEY)
        if hist is not None:
            acct.history = [(float(z), float(q), int(n)) for z, q, n in np.asarray(hist).reshape(-1, 3)]
        self._acct, self._acct_state_id = acct, id(ctx.state)
        return acct

    def setup(self, model: nn.Module, ctx: DefenseContext) -> None:
        check_no_batchnorm(model)
        self._reset_round()
        self._load_accountant(ctx)

    @staticmethod
    def sample_rate(ctx: DefenseContext, batch: int) -> float:
        """q = batch_size / local dataset size (1 when the dataset size is unknown: no amplification)."""
        n = int(ctx.num_examples or 0)
        if n <= 0:
            return 1.0
        bs = int(ctx.recipe.get(BATCH_SIZE, batch) or batch)
        return min(bs, n) / n

    # -- per-sample gradients
    @staticmethod
    def per_sample_gradients(model: nn.Module, loss_fn: LossFn, x: torch.Tensor,
                             y: torch.Tensor) -> list[torch.Tensor]:
        """Gradient of each sample's loss, one tensor of shape (batch, *param.shape) per trainable
        parameter, in ``model.parameters()`` order."""
        check_no_batchnorm(model)
        named = list(model.named_parameters())
        train = {n: p.detach() for n, p in named if p.requires_grad}
        rest = {**{n: p.detach() for n, p in named if not p.requires_grad},
                **{n: b.detach() for n, b in model.named_buffers()}}
        g = per_sample_gradients(model, train, rest, loss_fn, x, y)
        return [g[n] for n in train]

    def clip(self, per_sample: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per-sample clipping g_i / max(1, ||g_i|| / B); returns the clipped grads and the norms."""
        return clip_per_sample(per_sample, self.clip_norm)

    def compute_gradient(self, model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                         ctx: DefenseContext) -> list[torch.Tensor] | None:
        clipped, norms = self.clip(self.per_sample_gradients(model, loss_fn, x, y))
        b = len(y)
        grads = []
        for g in clipped:
            s = g.sum(0)
            if self.noise_multiplier > 0:
                noise = torch.randn(s.shape, generator=ctx.generator) * (self.noise_multiplier * self.clip_norm)
                s = s + noise.to(device=s.device, dtype=s.dtype)
            grads.append(s / b)
        # bookkeeping and privacy accounting (one step of the subsampled Gaussian mechanism)
        self._samples += b
        self._clipped += int((norms > self.clip_norm).sum())
        self._norm_sum += float(norms.sum())
        self._steps += 1
        if self._acct is None or self._acct_state_id != id(ctx.state):
            self._load_accountant(ctx)
        assert self._acct is not None
        self._sample_rate = self.sample_rate(ctx, b)
        self._acct.step(noise_multiplier=self.noise_multiplier, sample_rate=self._sample_rate)
        ctx.state[self.STATE_KEY] = np.asarray(self._acct.history, dtype=np.float64).reshape(-1, 3)
        return grads

    def epsilon(self) -> float:
        """Epsilon at ``delta`` spent so far over all rounds (inf without noise)."""
        if self._acct is None or not self._acct.history:
            return 0.0
        return epsilon(self._acct.history, self.delta)  # fedsim.privacy: the run's one accountant

    def privacy(self, cfg: Mapping[str, Any], key: str, previous: Defense | None) -> Mechanism:
        """Sample-level DP against the server: per round a client takes part in, its local steps, each the
        subsampled Gaussian mechanism with q = batch_size / local set size (Poisson approximation of
        fedsim's shuffled fixed-size batches), recomputed by the server from the config and the round's
        recipe exactly as the client's own accountant counts them."""
        desc = f"DP-SGD: per-sample clipping to {self.clip_norm:g}, noise multiplier {self.noise_multiplier:g}"
        if self.noise_multiplier == 0:
            return Mechanism(key, desc, "sample", reason="no noise (noise_multiplier = 0): clipping alone bounds "
                             "nothing an observer cannot see")
        z, sizes = self.noise_multiplier, []

        def events(rnd: int, client: int, conf: Mapping[str, Any]) -> list[tuple[float, float, int]]:
            if not sizes:
                sizes.extend(len(p) for p in partitions_for(cfg))
            n = sizes[client]
            recipe = Recipe.from_mapping({**cfg["train"], **recipe_of(conf)})
            steps = sum(1 for _ in iter_batches(int(cfg["seed"]), rnd, client, n, recipe))
            return [(z, min(recipe.batch_size, n) / n, steps)]

        return Mechanism(key, desc, "sample", AGAINST_SERVER, self.delta, per_participation=events,
                         notes=["Poisson subsampling assumed (q = batch size / local set size); fedsim draws "
                                "shuffled fixed-size batches, the usual approximation"])

    def metrics(self) -> dict[str, float]:
        total_steps = sum(n for _, _, n in self._acct.history) if self._acct else 0
        m = {"clip_norm": self.clip_norm, "noise_multiplier": self.noise_multiplier,
             "clipped_fraction": self._clipped / self._samples if self._samples else 0.0,
             "mean_per_sample_norm": self._norm_sum / self._samples if self._samples else 0.0,
             "sample_rate": self._sample_rate, "steps": float(self._steps), "total_steps": float(total_steps),
             "delta": self.delta}
        if self.noise_multiplier > 0:  # epsilon is infinite without noise: not reported
            m["epsilon"] = self.epsilon()
        return m
