"""Local training, evaluation, seeding and the deterministic batch schedule.

The batch schedule is a pure function of (seed, round, client): the client uses it to order its
local mini-batches, and the curious server's *scorer* (never the attack) re-creates it to know which
samples a victim trained on. Nothing travels from client to attacker but the update itself.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedsim.defense import DefenseContext, DefensePipeline
from fedsim.protocol import (
    BATCH_SIZE,
    LOCAL_EPOCHS,
    LOCAL_STEPS,
    LR,
    MOMENTUM,
    NOISE_VARIANCE,
    PROXIMAL_MU,
    TRAIN_ACCURACY,
    TRAIN_LOSS,
    WEIGHT_DECAY,
)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads (``simulation.threads``; 0 keeps torch's setting). On a
    shared machine one thread is often several times faster than torch's default of one per core."""
    if n <= 0:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else CPU; ``cpu``/``cuda``/``cuda:N`` are taken as given.

    A CUDA device is put in deterministic, full-precision mode (:func:`deterministic_cuda`) before it is
    returned, so a seed gives the same numbers on a GPU as it does on a CPU: run to run, bit for bit."""
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available on this machine; use 'auto' or 'cpu'")
    if dev.type == "cuda":
        deterministic_cuda()
    return dev


def deterministic_cuda() -> None:
    """Same seed, same metrics on a GPU (the project's determinism rule), and float32 as on a CPU.

    By default cuDNN picks convolution algorithms by timing them and several CUDA kernels (convolution
    and scatter backward passes) add with atomics, so two runs of one seed differ in the last bits and
    then everywhere; TF32 tensor cores round float32 products to 10 mantissa bits, which is enough to
    cap a gradient-inversion attack's PSNR. This turns all of that off, for the whole process: cuDNN's
    deterministic algorithms, no autotuning, torch's deterministic implementations (with a warning for
    an op that has none) and cuBLAS's fixed workspace, and no TF32. Idempotent; costs speed, not results.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS first starts
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers (stable across processes and platforms)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint32)
               .astype(np.uint64).dot(np.array([1, 2**32], dtype=np.uint64)) & np.uint64(2**63 - 1))


@dataclass(frozen=True)
class Recipe:
    """The local training recipe the server configures (and therefore knows, and an attacker replays).

    Plain SGD by default. ``momentum`` (heavy ball, as ``torch.optim.SGD``: ``b = momentum * b + g``,
    ``w -= lr * b``, the buffer starting at zero every round), ``weight_decay`` (``g += weight_decay *
    w``) and ``proximal_mu`` (FedProx's proximal term: ``g += proximal_mu * (w - w_global)``) change
    what an update is: with any of them on, ``-update / lr`` is no longer the sum of the data
    gradients (see ``attacks.gradients`` for what the attacks assume).
    """

    lr: float
    batch_size: int
    local_steps: int | None = None  # exactly this many SGD steps (FedSGD: 1) ...
    local_epochs: int | None = None  # ... or this many passes over the local data
    momentum: float = 0.0
    weight_decay: float = 0.0
    proximal_mu: float = 0.0

    def __post_init__(self):
        if (self.local_steps is None) == (self.local_epochs is None):
            raise ValueError("set exactly one of train.local_steps and train.local_epochs")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"train.momentum must be in [0, 1), got {self.momentum!r}")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.proximal_mu < 0:
            raise ValueError(f"proximal mu must be >= 0, got {self.proximal_mu!r}")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "Recipe":
        """From ``[train]`` or a train message's recipe keys (``fedsim.protocol.recipe_of``)."""
        steps, epochs = m.get(LOCAL_STEPS), m.get(LOCAL_EPOCHS)
        return cls(float(m[LR]), int(m[BATCH_SIZE]), int(steps) if steps not in (None, 0) else None,
                   int(epochs) if epochs not in (None, 0) else None, float(m.get(MOMENTUM) or 0.0),
                   float(m.get(WEIGHT_DECAY) or 0.0), float(m.get(PROXIMAL_MU) or 0.0))

    def to_mapping(self) -> dict[str, Any]:
        """The recipe keys (momentum, weight decay and proximal mu only when set)."""
        d: dict[str, Any] = {LR: self.lr, BATCH_SIZE: self.batch_size}
        if self.local_steps is not None:
            d[LOCAL_STEPS] = self.local_steps
        else:
            d[LOCAL_EPOCHS] = self.local_epochs
        for key, v in ((MOMENTUM, self.momentum), (WEIGHT_DECAY, self.weight_decay), (PROXIMAL_MU, self.proximal_mu)):
            if v:
                d[key] = v
        return d

    @property
    def plain_sgd(self) -> bool:
        return not (self.momentum or self.weight_decay or self.proximal_mu)


LR_SCHEDULES = ("constant", "step", "exponential", "cosine")


def scheduled_lr(train: Mapping[str, Any], server_round: int, rounds: int) -> float:
    """The clients' learning rate in ``server_round`` under ``train.lr_schedule`` (rounds count from 1).

    ``constant``: ``lr``; ``step``: ``lr * lr_gamma ** floor((round - 1) / lr_step_rounds)``;
    ``exponential``: ``lr * lr_gamma ** (round - 1)``; ``cosine``: from ``lr`` in round 1 to ``lr_min`` in
    the last round, ``lr_min + (lr - lr_min) * (1 + cos(pi * (round - 1) / (rounds - 1))) / 2``.
    The server sends the round's rate with every train message, so the clients and an attacker that
    reads the recipe use the same one.
    """
    lr = float(train["lr"])
    kind = train.get("lr_schedule") or "constant"
    r = max(int(server_round), 1) - 1
    if kind == "constant":
        return lr
    gamma = float(train.get("lr_gamma", 0.5))
    if kind == "step":
        return lr * gamma ** (r // max(int(train.get("lr_step_rounds", 10)), 1))
    if kind == "exponential":
        return lr * gamma ** r
    if kind == "cosine":
        lo = float(train.get("lr_min", 0.0))
        span = max(int(rounds) - 1, 1)
        return lo + (lr - lo) * (1 + math.cos(math.pi * min(r, span) / span)) / 2
    raise ValueError(f"train.lr_schedule must be one of {list(LR_SCHEDULES)}, got {kind!r}")


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
    """Copy ``weights`` (state_dict order) into the model's parameters and buffers in place (what
    ``load_state_dict`` does for fedsim's models, without its per-key bookkeeping: this runs for every
    client message)."""
    sd = model.state_dict()
    if len(weights) != len(sd):
        raise ValueError(f"expected {len(sd)} arrays for this model, got {len(weights)}")
    with torch.no_grad():
        for v, w in zip(sd.values(), weights):
            v.copy_(torch.as_tensor(np.asarray(w)).reshape(v.shape))


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
    """Seed 002's eq. 13 on one-hot targets: ``1/2 ||y - onehot(t)||^2`` per example (summed over the
    classes), averaged over the batch - the loss ``fedsim.lossless`` derives its exact recovery for."""
    d = logits - F.one_hot(y, logits.shape[-1]).to(logits.dtype)
    return 0.5 * (d * d).sum(1).mean()


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
    # update over the global entries (parameters and buffers, e.g. BatchNorm statistics)
    sd1 = model.state_dict()
    update = [(sd1[k].detach() - sd0[k]).float() if k in sd1 else torch.zeros_like(sd0[k], dtype=torch.float32)
              for k in names]
    if runner is not None:
        update = runner.transform_update(update)
    weights = [(sd0[k].float() + u.to(sd0[k].device)).to(sd0[k].dtype).cpu().numpy()
               for k, u in zip(names, update)]
    new_state: dict[str, np.ndarray] = {}
    dmetrics: dict[str, float] = {}
    extras: dict[str, np.ndarray] = {}
    if runner is not None:
        new_state, dmetrics = runner.finish()
        declared = runner.pipe.noise_variance()  # per-entry variance of noise the defenses added (if declared)
        if declared is not None:
            dmetrics[NOISE_VARIANCE] = declared
        extras = runner.reply_extras()
    metrics = {TRAIN_LOSS: total_loss / max(seen, 1), TRAIN_ACCURACY: total_correct / max(seen, 1),
               LOCAL_STEPS: steps, "train_seconds": time.perf_counter() - t0, **dmetrics}
    return TrainResult(weights, len(y), metrics, new_state, extras)


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


@torch.no_grad()
def source_accuracies(model: nn.Module, ds: Any, device: torch.device | str = "cpu") -> list[float]:
    """The model's accuracy on each source's share of the test set (``ds.test_sources``, in the order of
    ``ds.source_names``); empty for a dataset without test sources."""
    if ds.test_sources is None or not ds.source_names:
        return []
    out = []
    for s in range(len(ds.source_names)):
        idx = torch.nonzero(ds.test_sources == s).flatten()
        out.append(evaluate(model, ds.x_test[idx], ds.y_test[idx], device)[1] if len(idx) else float("nan"))
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
