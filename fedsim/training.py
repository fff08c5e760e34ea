"""Local training, evaluation, seeding and the deterministic batch schedule.

The batch schedule is a pure function of (seed, round, client): the client uses it to order its
local mini-batches, and the curious server's *scorer* (never the attack) re-creates it to know which
samples a victim trained on. Nothing travels from client to attacker but the update itself.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedsim.defense import DefenseContext, DefensePipeline
from fedsim.protocol import NOISE_VARIANCE, TRAIN_ACCURACY, TRAIN_LOSS


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else CPU; ``cpu``/``cuda``/``cuda:N`` are taken as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine; use 'auto' or 'cpu'")
    return dev


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers (stable across processes and platforms)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint32)
               .astype(np.uint64).dot(np.array([1, 2**32], dtype=np.uint64)) & np.uint64(2**63 - 1))


@dataclass(frozen=True)
class Recipe:
    """The local training recipe the server configures (and therefore knows)."""

    lr: float
    batch_size: int
    local_steps: int | None = None  # exactly this many SGD steps (FedSGD: 1) ...
    local_epochs: int | None = None  # ... or this many passes over the local data

    def __post_init__(self):
        if (self.local_steps is None) == (self.local_epochs is None):
            raise ValueError("set exactly one of train.local_steps and train.local_epochs")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "Recipe":
        steps, epochs = m.get("local_steps"), m.get("local_epochs")
        return cls(float(m["lr"]), int(m["batch_size"]), int(steps) if steps not in (None, 0) else None,
                   int(epochs) if epochs not in (None, 0) else None)

    def to_mapping(self) -> dict[str, Any]:
        d: dict[str, Any] = {"lr": self.lr, "batch_size": self.batch_size}
        if self.local_steps is not None:
            d["local_steps"] = self.local_steps
        else:
            d["local_epochs"] = self.local_epochs
        return d


def iter_batches(seed: int, round: int, client: int, n: int, recipe: Recipe) -> Iterator[np.ndarray]:
    """Positions (into the client's local data) of each local mini-batch, in training order, drawn lazily:
    memory stays bounded by one permutation of the local data for any ``local_steps``/``local_epochs``.

    ``local_steps`` mode draws full batches of ``min(batch_size, n)`` from successive shuffles
    (drop-last), so every step sees the same batch size; ``local_epochs`` mode keeps the last
    partial batch of each epoch, as a DataLoader would.
    """
    rng = np.random.default_rng(derive_seed(seed, round, client, 0xBA7C))
    bs = min(recipe.batch_size, n)
    if recipe.local_steps is not None:
        done = 0
        while done < recipe.local_steps:
            perm = rng.permutation(n)
            for k in range(n // bs):
                yield perm[k * bs:(k + 1) * bs]
                done += 1
                if done == recipe.local_steps:
                    return
    else:
        for _ in range(recipe.local_epochs or 0):
            perm = rng.permutation(n)
            for k in range(0, n, bs):
                yield perm[k:k + bs]


def batch_schedule(seed: int, round: int, client: int, n: int, recipe: Recipe) -> list[np.ndarray]:
    """:func:`iter_batches` as a list (for callers that index it; the client trains from the iterator)."""
    return list(iter_batches(seed, round, client, n, recipe))


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """All parameters and buffers (state_dict order) as NumPy arrays."""
    return [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]


def set_weights(model: nn.Module, weights: Sequence[np.ndarray]) -> None:
    sd = model.state_dict()
    if len(weights) != len(sd):
        raise ValueError(f"expected {len(sd)} arrays for this model, got {len(weights)}")
    model.load_state_dict({k: torch.as_tensor(np.asarray(w)).reshape(v.shape).to(v.dtype)
                           for (k, v), w in zip(sd.items(), weights)}, strict=True)


def param_names(model: nn.Module) -> list[str]:
    return list(model.state_dict().keys())


@dataclass
class TrainResult:
    weights: list[np.ndarray]
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # the defenses' extra reply arrays


LOSSES = ("cross-entropy", "mse")


def mse_onehot(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error between the outputs and the one-hot targets (mean over batch and classes)."""
    return F.mse_loss(logits, F.one_hot(y, logits.shape[-1]).to(logits.dtype))


def loss_function(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``train.loss``: ``cross-entropy`` (default) or ``mse`` on one-hot targets (seed 002's derivation)."""
    if name == "cross-entropy":
        return F.cross_entropy
    if name == "mse":
        return mse_onehot
    raise ValueError(f"train.loss must be one of {list(LOSSES)}, got {name!r}")


def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, recipe: Recipe, *, seed: int,
                round: int, client: int, pipeline: DefensePipeline | None = None,
                state: dict[str, np.ndarray] | None = None, device: torch.device | str = "cpu",
                public_data: tuple[torch.Tensor, torch.Tensor] | None = None,
                incoming: Mapping[str, np.ndarray] | None = None, loss: str = "cross-entropy") -> TrainResult:
    """Plain SGD on the client's data following :func:`batch_schedule`, with the defense pipeline.

    The model must hold the global weights on entry. Defenses may adapt it (``adapt_model``); the
    update is computed for the global model's state-dict entries only (an entry the adapted model
    lacks is returned unchanged; entries only the adapted model has are client-private and never
    returned). Returns the weights to send (global + the possibly-defended update), the training
    metrics, the defenses' new state and their extra reply arrays.
    """
    t0 = time.perf_counter()
    device = torch.device(device)
    model.to(device).train()
    pipeline = pipeline or DefensePipeline([])
    sd0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = tuple(sd0)
    gen = torch.Generator(device="cpu").manual_seed(derive_seed(seed, round, client, 0xDEF))
    ctx = DefenseContext(round, client, gen, names, recipe.to_mapping(), dict(state or {}), device, public_data,
                         num_examples=len(y), incoming=dict(incoming or {}))
    runner = pipeline.run_round(ctx)
    adapted = runner.adapt_model(model)
    if adapted is not model:
        model = adapted.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    runner.setup(model)
    loss_fn = loss_function(loss)
    total_loss, total_correct, seen, steps = 0.0, 0, 0, 0
    for idx in iter_batches(seed, round, client, len(y), recipe):
        steps += 1
        ti = torch.as_tensor(idx)
        xb, yb = x[ti].to(device), y[ti].to(device)
        grads = runner.compute_gradient(model, loss_fn, xb, yb)
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
        grads = runner.transform_gradient(grads)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(g, alpha=-recipe.lr)
        total_loss += float(loss.detach()) * len(idx)
        total_correct += int((out.detach().argmax(1) == yb).sum())
        seen += len(idx)
    runner.end_round(model)
    # update over the global entries (parameters and buffers, e.g. BatchNorm statistics)
    sd1 = model.state_dict()
    update = [(sd1[k].detach() - sd0[k]).float() if k in sd1 else torch.zeros_like(sd0[k], dtype=torch.float32)
              for k in names]
    update = runner.transform_update(update)
    weights = [(sd0[k].float() + u.to(sd0[k].device)).to(sd0[k].dtype).cpu().numpy()
               for k, u in zip(names, update)]
    new_state, dmetrics = runner.finish()
    declared = pipeline.noise_variance()  # per-entry variance of noise the defenses added (if declared)
    if declared is not None:
        dmetrics[NOISE_VARIANCE] = declared
    metrics = {TRAIN_LOSS: total_loss / max(seen, 1), TRAIN_ACCURACY: total_correct / max(seen, 1),
               "local_steps": float(steps), "train_seconds": time.perf_counter() - t0, **dmetrics}
    return TrainResult(weights, len(y), metrics, new_state, runner.reply_extras())


@torch.no_grad()
def _forward_without_side_effects(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A training-mode forward that leaves the model's buffers (BatchNorm running statistics) as they were."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    out = model(x)
    for b, saved in buffers:
        b.copy_(saved)
    return out


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device | str = "cpu",
             batch_size: int = 1000) -> tuple[float, float]:
    """(loss, accuracy) of the model on (x, y)."""
    device = torch.device(device)
    model.to(device).eval()
    total_loss, correct = 0.0, 0
    for k in range(0, len(y), batch_size):
        xb, yb = x[k:k + batch_size].to(device), y[k:k + batch_size].to(device)
        out = model(xb)
        total_loss += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    n = max(len(y), 1)
    return total_loss / n, correct / n
