"""Local training: SGD on the client's data in the batch order, with the defense pipeline."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedsim.defense import DefenseContext, DefensePipeline
from fedsim.protocol import LOCAL_STEPS, NOISE_VARIANCE, TRAIN_ACCURACY, TRAIN_LOSS
from fedsim.seeding import derive_seed
from fedsim.training.batches import iter_batches
from fedsim.training.loss import loss_function
from fedsim.training.recipe import Recipe


@dataclass
class TrainResult:
    weights: list[np.ndarray]
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # the defenses' extra reply arrays


def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, recipe: Recipe, *, seed: int,
                round: int, client: int, pipeline: DefensePipeline | None = None,
                state: dict[str, np.ndarray] | None = None, device: torch.device | str = "cpu",
                public_data: tuple[torch.Tensor, torch.Tensor] | None = None,
                incoming: Mapping[str, np.ndarray] | None = None, loss: str = "cross-entropy") -> TrainResult:
    """Local SGD on the client's data following :func:`batch_schedule`, with the defense pipeline.

    Plain SGD unless the recipe sets momentum, weight decay or a proximal term (FedProx); those act
    on the gradient after the defenses' ``transform_gradient`` (they are data-independent, so a
    DP-SGD defense's guarantee is unchanged), in ``torch.optim.SGD``'s order: ``g += weight_decay * w
    + proximal_mu * (w - w_global)``, ``b = momentum * b + g``, ``w -= lr * b``.

    The model must hold the global weights on entry. Defenses may adapt it (``adapt_model``); the
    update is computed for the global model's state-dict entries only (an entry the adapted model
    lacks is returned unchanged; entries only the adapted model has are client-private and never
    returned). Returns the weights to send (global + the possibly-defended update), the training
    metrics, the defenses' new state and their extra reply arrays.

    Without defenses (``pipeline`` None or empty) no defense context, generator or hook runs: the
    result is bit-identical to running the hooks of a pipeline whose defenses do nothing.
    """
    t0 = time.perf_counter()
    device = torch.device(device)
    model.to(device).train()
    sd0 = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the global model: the update's base
    names = tuple(sd0)
    # No defense: no defense context, generator or hooks (bit-identical to running the empty pipeline's hooks)
    runner = _bind_pipeline(pipeline, seed, round, client, names, recipe, state, device, public_data, len(y),
                            incoming) if pipeline is not None and len(pipeline) else None
    if runner is not None:
        adapted = runner.adapt_model(model)
        if adapted is not model:
            model = adapted.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    if runner is not None:
        runner.setup(model)
    loss_fn = loss_function(loss)
    anchors = [p.detach().clone() for p in params] if recipe.proximal_mu else []  # w_global (FedProx)
    buffers: list[torch.Tensor | None] = [None] * len(params)  # momentum buffers (fresh every round)
    total_loss, total_correct, seen, steps = 0.0, 0, 0, 0
    for idx in iter_batches(seed, round, client, len(y), recipe):
        steps += 1
        ti = torch.as_tensor(idx)
        xb, yb = x[ti].to(device), y[ti].to(device)
        grads = runner.compute_gradient(model, loss_fn, xb, yb) if runner is not None else None
        out = None
        if grads is not None:  # the defense computed the gradient: a forward for the metrics only, which
            out = _forward_without_side_effects(model, xb)  # must not update BatchNorm statistics again
        if grads is None:
            model.zero_grad(set_to_none=True)
            out = model(xb)
            loss = loss_fn(out, yb)
            grads = list(torch.autograd.grad(loss, params))
        else:
            loss = loss_fn(out, yb)
        if runner is not None:
            grads = runner.transform_gradient(grads)
        with torch.no_grad():
            if recipe.plain_sgd:
                for p, g in zip(params, grads):
                    p.add_(g, alpha=-recipe.lr)
            else:
                step_extended(params, grads, recipe, anchors, buffers)
        total_loss += float(loss.detach()) * len(idx)
        total_correct += int((out.detach().argmax(1) == yb).sum())
        seen += len(idx)
    if runner is not None:
        runner.end_round(model)
    weights, new_state, dmetrics, extras = _outgoing(model, sd0, runner)
    metrics = {TRAIN_LOSS: total_loss / max(seen, 1), TRAIN_ACCURACY: total_correct / max(seen, 1),
               LOCAL_STEPS: steps, "train_seconds": time.perf_counter() - t0, **dmetrics}
    return TrainResult(weights, len(y), metrics, new_state, extras)


def _outgoing(model: nn.Module, sd0: Mapping[str, torch.Tensor], runner: Any
              ) -> tuple[list[np.ndarray], dict[str, np.ndarray], dict[str, float], dict[str, np.ndarray]]:
    """After the local steps: the weights to send (the global model ``sd0`` + the possibly-defended update,
    over the global model's entries: parameters and buffers, e.g. BatchNorm statistics), the defenses' new
    state, their metrics (with the declared noise variance) and their extra reply arrays."""
    names = tuple(sd0)
    sd1 = model.state_dict()
    update = [(sd1[k].detach() - sd0[k]).float() if k in sd1 else torch.zeros_like(sd0[k], dtype=torch.float32)
              for k in names]
    if runner is not None:
        update = runner.transform_update(update)
    weights = [(sd0[k].float() + u.to(sd0[k].device)).to(sd0[k].dtype).cpu().numpy()
               for k, u in zip(names, update)]
    if runner is None:
        return weights, {}, {}, {}
    new_state, dmetrics = runner.finish()
    declared = runner.pipe.noise_variance()  # per-entry variance of noise the defenses added (if declared)
    if declared is not None:
        dmetrics[NOISE_VARIANCE] = declared
    return weights, new_state, dmetrics, runner.reply_extras()


def _bind_pipeline(pipeline: DefensePipeline, seed: int, round: int, client: int, names: tuple[str, ...],
                   recipe: Recipe, state: dict[str, np.ndarray] | None, device: torch.device,
                   public_data: tuple[torch.Tensor, torch.Tensor] | None, num_examples: int,
                   incoming: Mapping[str, np.ndarray] | None) -> Any:
    """The pipeline bound to this round: its context (with the generator seeded from (seed, round,
    client)) and the defenses' sub-states."""
    gen = torch.Generator(device="cpu").manual_seed(derive_seed(seed, round, client, 0xDEF))
    ctx = DefenseContext(round, client, gen, names, recipe.to_mapping(), dict(state or {}), device, public_data,
                         num_examples=num_examples, incoming=dict(incoming or {}))
    return pipeline.run_round(ctx)


def step_extended(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], recipe: Recipe,
                  anchors: Sequence[torch.Tensor], buffers: list[torch.Tensor | None]) -> None:
    """One SGD step with weight decay, proximal term and momentum (``torch.optim.SGD``'s arithmetic,
    dampening 0, no Nesterov). ``buffers`` holds the momentum buffers and is updated in place."""
    for i, (p, g) in enumerate(zip(params, grads)):
        d = g
        if recipe.weight_decay:
            d = d.add(p, alpha=recipe.weight_decay)
        if recipe.proximal_mu:
            d = d.add(p - anchors[i], alpha=recipe.proximal_mu)
        if recipe.momentum:
            b = buffers[i]
            buffers[i] = d.clone() if b is None else b.mul_(recipe.momentum).add_(d)
            d = buffers[i]
        p.add_(d, alpha=-recipe.lr)


@torch.no_grad()
def _forward_without_side_effects(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A training-mode forward that leaves the model's buffers (BatchNorm running statistics) as they were."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    out = model(x)
    for b, saved in buffers:
        b.copy_(saved)
    return out
