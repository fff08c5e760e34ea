"""BatchNorm-statistics prior (Yin et al., "See through gradients: image batch recovery via
GradInversion", CVPR 2021, eq. 5).

A model with BatchNorm normalises each layer's input with the *batch* mean and variance in training
mode, so the statistics of the reconstructed batch at every BN layer's input should match those of
the victim's batch. The regulariser is

    R_bn(x) = sum_l  || mu_l(x) - mu_l* ||_2  +  || var_l(x) - var_l* ||_2

over the BN layers ``l`` (per-channel mean and biased variance of the layer's input, as BN computes
them in training mode). Where the targets ``mu*``/``var*`` come from is a threat-model question
(:data:`BN_TARGETS`):

* ``"running"``: the running statistics stored in the global model (``running_mean``,
  ``running_var`` buffers). The server has them: it sent them. Yin et al. use these (of a trained
  ResNet-50). They describe the data the global model has seen, not the victim's batch; in round 1 of
  an untrained model they are the initial 0 / 1.
* ``"victim"``: the victim batch's own statistics, read from :attr:`AttackInput.bn_stats`. Granted
  only under the threat model "BN statistics of the victim's batch known" (the assumption of Geiping
  et al. 2020 and of seed 004's evaluation, Huang et al. 2021 discuss it). :func:`batch_bn_stats`
  computes such a grant from the true batch; only an experiment harness that simulates this threat
  model may call it.
* ``"update"`` (``ig-bn``'s and ``ig-fr``'s default): the victim's statistics as a plain curious server
  reads them from the update itself.
  When the client returns its BN buffers (FedAvg on the whole state dict, as fedsim does), one local
  step moves ``running_mean`` to ``(1 - m) running_mean + m mu_batch`` and ``running_var`` to
  ``(1 - m) running_var + m var_batch_unbiased`` (``m`` the BN momentum), so the batch statistics are
  ``old + update / m`` - exact for one local step. After ``K`` steps the same inversion with
  ``1 - (1 - m)^K`` in place of ``m`` gives an exponentially weighted mean of the ``K`` batches'
  statistics (an approximation). FedBN-style training, which keeps BN buffers local, removes this.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .base import AttackInput

BN_TARGETS = ("running", "victim", "update")


def bn_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The BatchNorm modules of ``model`` (name, module) in registration order: every subclass of
    PyTorch's ``_BatchNorm``, so also FedKL's ``KeyLockNorm`` (batch statistics, then the key-lock's
    scale and shift), whose input statistics the prior constrains like any BatchNorm's."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]


def _moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel mean, biased variance and element count of a BN input (B, C, ...)."""
    dims = [0] + list(range(2, x.dim()))
    mean = x.mean(dim=dims)
    var = x.var(dim=dims, unbiased=False)
    return mean, var, x.numel() // x.shape[1]


class BNRecorder:
    """Forward pre-hooks that keep, for the latest forward, every BN layer's input statistics.

    ``stats[name] = (mean, var)`` (differentiable) and ``counts[name]`` the number of values per
    channel. Use as a context manager or call :meth:`remove`.
    """

    def __init__(self, model: nn.Module):
        self.stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.counts: dict[str, int] = {}
        self.names = [n for n, _ in bn_layers(model)]
        self._handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in bn_layers(model)]

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            mean, var, count = _moments(args[0])
            self.stats[name] = (mean, var)
            self.counts[name] = count
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "BNRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


@torch.no_grad()
def batch_bn_stats(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The BN-input statistics of batch ``x`` under ``model`` in training mode (mean, biased var).

    This is the grant of the threat model "BN statistics of the victim's batch known": it needs the
    victim's data, so only a harness simulating that threat model calls it (never an attack). The
    model's running buffers are left as they were.
    """
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    was_training = model.training
    model.train()
    with BNRecorder(model) as rec:
        model(x)
        out = {n: (m.detach().clone(), v.detach().clone()) for n, (m, v) in rec.stats.items()}
    model.load_state_dict(saved)
    model.train(was_training)
    return out


def _momentum(name: str, module: nn.Module) -> float:
    m = module.momentum
    if m is None:
        raise ValueError(f"attack.bn_target='update' needs a BatchNorm with a fixed momentum; "
                         f"{name!r} uses a cumulative average (momentum=None)")
    return float(m)


def bn_targets(inp: AttackInput, model: nn.Module, mode: str, steps: int = 1,
               counts: Mapping[str, int] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Target (mean, var) per BN layer name for the prior, by threat model ``mode`` (see module doc).

    ``model`` is the global model (for the layer list and momenta); ``steps`` the number of local SGD
    steps of the recipe and ``counts`` the values per channel of the victim's batch at each layer
    (needed by ``"update"`` to turn the unbiased variance of the running update into a biased one).
    """
    layers = bn_layers(model)
    if not layers:
        raise ValueError("attack.bn_prior needs a model with BatchNorm layers; this model has none")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    dev = inp.device
    if mode == "running":
        for name, _ in layers:
            try:
                mean, var = inp.global_state[f"{name}.running_mean"], inp.global_state[f"{name}.running_var"]
            except KeyError as e:
                raise ValueError(f"attack.bn_target='running' needs the running statistics of {name!r} "
                                 f"in the global state") from e
            out[name] = (mean.detach().float().to(dev), var.detach().float().to(dev))
        return out
    if mode == "victim":
        stats = inp.bn_stats
        if stats is None:
            raise ValueError("attack.bn_target='victim' but this threat model grants no BN statistics "
                             "(AttackInput.bn_stats is None)")
        for name, _ in layers:
            if name not in stats:
                raise ValueError(f"AttackInput.bn_stats lacks BN layer {name!r}")
            mean, var = stats[name]
            out[name] = (torch.as_tensor(mean).float().to(dev), torch.as_tensor(var).float().to(dev))
        return out
    if mode == "update":
        for name, module in layers:
            keys = (f"{name}.running_mean", f"{name}.running_var")
            if any(k not in inp.update or k not in inp.global_state for k in keys):
                raise ValueError(f"attack.bn_target='update' needs the running statistics of {name!r} in "
                                 f"the update (the client did not return its BN buffers)")
            m = _momentum(name, module)
            frac = 1.0 - (1.0 - m) ** int(steps)  # weight of the new batches in the running average
            mean = inp.global_state[keys[0]].double() + inp.update[keys[0]].double() / frac
            var_u = inp.global_state[keys[1]].double() + inp.update[keys[1]].double() / frac
            n = (counts or {}).get(name)
            var = var_u * (n - 1) / n if n and n > 1 else var_u
            out[name] = (mean.float().to(dev), var.clamp_min(0).float().to(dev))
        return out
    raise ValueError(f"attack.bn_target must be one of {list(BN_TARGETS)}, got {mode!r}")


def bn_loss(stats: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
            targets: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Yin et al.'s ``sum_l ||mu_l - mu_l*||_2 + ||var_l - var_l*||_2`` over the layers in ``targets``."""
    total = None
    for name, (tm, tv) in targets.items():
        mean, var = stats[name]
        term = torch.linalg.vector_norm(mean - tm) + torch.linalg.vector_norm(var - tv)
        total = term if total is None else total + term
    if total is None:
        raise ValueError("no BN layer to regularise")
    return total
