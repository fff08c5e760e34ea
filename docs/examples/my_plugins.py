"""A user's own fedsim plugins, in one file outside the fedsim package (docs/plugins.md).

Every name below is plugged into a run by config alone, with an import reference
``"path/to/my_plugins.py:<name>"`` (or ``"my_plugins:<name>"`` when the file's folder is on
``PYTHONPATH``); fedsim validates their parameters from their signatures, like the built-ins:

* ``SmallCNN`` - a model (``model.name``; its keyword parameters go in ``[model] params``);
* ``stripes`` - a dataset (``data.dataset``; parameters in ``[data] params``);
* ``QuantizeUpdate`` - a client defense (``[[defenses]]``);
* ``UniformAverage`` - an aggregation rule (``[strategy]``);
* ``ServerStep`` - a server transform (``[[transforms]]``): a server learning rate;
* ``RoundLog`` - an observer (``output.observers``);
* ``GrayBaseline`` - an attack for the curious server (``[attack] name``): the leakage a
  reconstruction-free guess scores, the floor every real attack should beat.

tests/test_ecosystem.py runs a federation with all seven from a copy of this file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from attacks.base import Attack, AttackInput, AttackResult
from fedsim.defense import Defense, DefenseContext
from fedsim.observers import ClientUpdate, Observer
from fedsim.params import Range
from fedsim.seams import ServerTransform, WeightedSumRule


# ---------------------------------------------------------------------------------------------- model
class SmallCNN(nn.Module):
    """Two 3x3 convolutions (``channels`` filters each) with max-pooling, then a linear classifier.

    fedsim passes ``in_shape`` (C, H, W) and ``num_classes`` because the constructor declares them."""

    def __init__(self, in_shape: Sequence[int], num_classes: int, channels: int = 8):
        super().__init__()
        if channels < 1:
            raise ValueError(f"channels must be >= 1, got {channels}")  # fedsim names the key: model.params
        c, h, w = in_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(channels * (h // 4) * (w // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))


# -------------------------------------------------------------------------------------------- dataset
def stripes(root_size: int, n_train: int = 600, n_test: int = 200, size: int = 12, noise: float = 0.3,
            seed: int = 0) -> dict[str, Any]:
    """Grey ``size`` x ``size`` images of horizontal (class 0), vertical (1) or diagonal (2) stripes
    with random phase, plus Gaussian pixel noise; values clipped to [0, 1].

    Returns the mapping fedsim accepts (x/y for train and test; fedsim holds ``root_size`` training
    images out as the public root split because no ``x_root`` is given)."""
    if n_train <= root_size:
        raise ValueError(f"n_train ({n_train}) must exceed data.root_size ({root_size})")
    rng = np.random.default_rng(seed)
    i, j = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")

    def make(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, 3, n)
        phase = rng.integers(0, 4, n)[:, None, None]
        coord = np.stack([i, j, i + j])[y]  # (n, size, size): the coordinate the stripes run across
        x = ((coord + phase) % 4 < 2).astype(np.float32)
        x = np.clip(x + noise * rng.standard_normal(x.shape).astype(np.float32), 0, 1)
        return x[:, None], y

    x_train, y_train = make(n_train)
    x_test, y_test = make(n_test)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test, "num_classes": 3,
            "class_names": ("horizontal", "vertical", "diagonal")}


# -------------------------------------------------------------------------------------------- defense
class QuantizeUpdate(Defense):
    """Rounds every parameter tensor of the outgoing update to ``levels`` evenly spaced values between
    its minimum and maximum (deterministic quantisation; BatchNorm buffers are left alone)."""

    name = "quantize-update"

    def __init__(self, levels: int = 16):
        if levels < 2:
            raise ValueError(f"levels must be an integer >= 2, got {levels}")
        self.levels = int(levels)
        self._tensors = 0

    def setup(self, model: nn.Module, ctx: DefenseContext) -> None:
        self._params = {n for n, _ in model.named_parameters()}

    def transform_update(self, update: list[torch.Tensor], ctx: DefenseContext) -> list[torch.Tensor]:
        out, self._tensors = [], 0
        for name, u in zip(ctx.param_names, update):
            lo, hi = u.min(), u.max()
            if name not in self._params or not u.is_floating_point() or hi <= lo:
                out.append(u)
                continue
            step = (hi - lo) / (self.levels - 1)
            out.append(torch.round((u - lo) / step) * step + lo)
            self._tensors += 1
        return out

    def metrics(self) -> dict[str, float]:
        return {"quantized_tensors": float(self._tensors)}


# ------------------------------------------------------------------------------------ aggregation rule
class UniformAverage(WeightedSumRule):
    """Every client counts the same, whatever its example count (a weighted-sum rule: works under
    every channel). ``min_examples``: clients with fewer examples are left out of the round's mean."""

    name = "uniform-average"
    stateless = True  # nothing carried from one round to the next (else: state() / load_state())

    def __init__(self, min_examples: Annotated[int, Range(0)] = 0):  # the limit, checked by fedsim
        self.min_examples = min_examples

    def weights(self, ctx: Any, replies: list[Any]) -> list[float]:
        w = [1.0 if r.num_examples >= self.min_examples else 0.0 for r in replies]
        return w if any(w) else [1.0] * len(replies)


# ------------------------------------------------------------------------------------ server transform
class ServerStep(ServerTransform):
    """A server learning rate: the new global model moves only ``step`` of the way from the model the
    server sent to the clients' aggregate (``step = 1``: the aggregate itself)."""

    name = "server-step"
    stateless = True  # the sent model is taken anew in every round's before_send

    def __init__(self, step: Annotated[float, Range(0, 1, open_low=True)] = 1.0):
        self.step = step
        self.sent: list[np.ndarray] | None = None

    def before_send(self, server_round: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        self.sent = [np.array(a, copy=True) for a in arrays]
        return arrays

    def after_aggregate(self, ctx: Any, aggregate: list[np.ndarray]) -> list[np.ndarray]:
        if self.sent is None:
            return aggregate
        return [s + self.step * (a - s) if np.issubdtype(a.dtype, np.floating) else a
                for s, a in zip(self.sent, aggregate)]


# -------------------------------------------------------------------------------------------- observer
class RoundLog(Observer):
    """Writes ``round_log.jsonl`` in the run folder: per round, the clients seen and the accuracy."""

    name = "round-log"

    def __init__(self, file: str = "round_log.jsonl"):
        self.file = file
        self.path: Path | None = None
        self.seen: list[int] = []

    def on_start(self, out_dir: Path | None) -> None:
        self.path = out_dir / self.file if out_dir is not None else None

    def observe(self, update: ClientUpdate) -> None:
        self.seen.append(update.client_id)

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"round": round, "clients": sorted(self.seen),
                                     "accuracy": metrics.get("accuracy")}) + "\n")
        self.seen = []


# ---------------------------------------------------------------------------------------------- attack
class GrayBaseline(Attack):
    """Returns mid-grey images (every pixel ``value``) and the most frequent label guess 0: what an
    attacker scores without looking at the update."""

    name = "gray-baseline"

    def __init__(self, value: float = 0.5):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"value must be in [0, 1], got {value}")
        self.value = float(value)

    def run(self, inp: AttackInput) -> AttackResult:
        n = inp.batch_size
        x = torch.full((n, *inp.input_shape), self.value)
        return AttackResult(x, torch.zeros(n, dtype=torch.int64), {"iterations": 0, "loss": []})
