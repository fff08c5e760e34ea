"""Membership inference by a curious client from model outputs (seed 002, §6.4.1).

The paper follows Nasr et al. (S&P 2019, its ref. [23]): a *surrogate attack model* takes the final
prediction or an intermediate layer's output of a record and says "member" or "non-member". The attacker
knows half of the training set (members) and some non-members; it trains the attack model on those with
every mini-batch half members, half non-members, and is scored on the other half of the members and as
many unseen non-members (a balanced set, so blind guessing scores 0.5).

Here the attack model is a one-hidden-layer MLP (ReLU, 64 units) trained with Adam on binary
cross-entropy. Its input is the chosen layer output(s) of the model the client holds plus the record's
one-hot label (Nasr et al. also give the label), standardised with the attacker's training statistics.
The paper's four feature choices are :data:`FEATURES`: ``last`` (the prediction), ``second`` /
``third`` (the outputs of the last / second-to-last hidden layer: "second to last" and "third to last"
layers), ``last3`` (the three concatenated).

Which model produces the features is the threat model's choice and matters a great deal for the
perturbation defence (``docs/lossless.md``): a client that calibrates its attack model on the same
perturbed model it attacks faces only a fixed per-unit rescaling of the hidden outputs, which
standardisation undoes; a client whose calibration and target views come from different rounds (fresh
secrets) is left with incomparable features. :func:`membership_inference` therefore takes the two
views separately.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from fedsim.lossless import Layer, forward

FEATURES = ("last", "second", "third", "last3")


def _check_choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"attack.{key} must be one of {list(choices)}, got {value!r}")


def layer_features(layers: Sequence[Layer], x: torch.Tensor, labels: torch.Tensor, num_classes: int,
                   which: str = "last", *, negative_slope: float = 0.0) -> torch.Tensor:
    """Attack-model input for every record: the chosen layer output(s) of the FC model plus the one-hot label.

    ``layers`` is whatever model the attacker holds (the true one without a defence, the perturbed one
    ``W^`` under seed 002's defence).
    """
    _check_choice("features", which, FEATURES)
    with torch.no_grad():
        out, hidden = forward(layers, x, negative_slope=negative_slope)
        outs = [*hidden, out]  # y^(1) ... y^(L)
        need = {"last": 1, "second": 2, "third": 3, "last3": 3}[which]
        if len(outs) < need:
            raise ValueError(f"attack.features={which!r} needs a model with at least {need} layers, "
                             f"this one has {len(outs)}")
        picked = {"last": [outs[-1]], "second": [outs[-2]], "third": [outs[-3]], "last3": outs[-3:]}[which]
        onehot = F.one_hot(labels.long().to(out.device), num_classes).to(out.dtype)
        return torch.cat([*picked, onehot], dim=1).float().cpu()  # the attack model trains on the CPU


class AttackModel(nn.Module):
    """Standardise, then ``Linear(d, hidden) - ReLU - Linear(hidden, 1)``; the logit says "member"."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, hidden: int = 64):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.net = nn.Sequential(nn.Linear(len(mean), hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        z = ((f - self.mean) / self.std).clamp(-1e4, 1e4)
        return self.net(z).squeeze(1)


def train_attack_model(members: torch.Tensor, non_members: torch.Tensor, *, hidden: int = 64,
                       epochs: int = 200, lr: float = 1e-3, batch_size: int = 32, seed: int = 0) -> AttackModel:
    """Fit the attack model on the attacker's known members / non-members (features from
    :func:`layer_features`); every mini-batch is half members, half non-members (§6.4.1)."""
    for key, v, lo in (("hidden", hidden, 1), ("epochs", epochs, 1), ("batch_size", batch_size, 2)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"attack.{key} must be an integer >= {lo}, got {v!r}")
    if not lr > 0:
        raise ValueError(f"attack.lr must be > 0, got {lr!r}")
    if len(members) == 0 or len(non_members) == 0:
        raise ValueError("the attack model needs known members and known non-members")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    both = torch.cat([members, non_members]).float()
    mean, std = both.mean(0), both.std(0).clamp_min(1e-12)
    model = AttackModel(mean, std, hidden)
    with torch.no_grad():  # PyTorch's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn from our generator
        for mod in model.net:
            if isinstance(mod, nn.Linear):
                bound = 1.0 / mod.in_features ** 0.5
                for p in (mod.weight, mod.bias):
                    p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    half = batch_size // 2
    steps = max(len(members), len(non_members)) // half or 1
    for _ in range(epochs):
        pm = torch.randperm(len(members), generator=gen)
        pn = torch.randperm(len(non_members), generator=gen)
        for k in range(steps):
            im = pm[torch.arange(k * half, (k + 1) * half) % len(pm)]
            inn = pn[torch.arange(k * half, (k + 1) * half) % len(pn)]
            f = torch.cat([members[im], non_members[inn]]).float()
            y = torch.cat([torch.ones(half), torch.zeros(half)])
            loss = F.binary_cross_entropy_with_logits(model(f), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


@torch.no_grad()
def attack_accuracy(model: AttackModel, members: torch.Tensor, non_members: torch.Tensor) -> float:
    """Balanced accuracy (mean of the member and non-member hit rates); 0.5 is blind guessing."""
    hit_m = (model(members.float()) > 0).float().mean()
    hit_n = (model(non_members.float()) <= 0).float().mean()
    return float((hit_m + hit_n) / 2)


@dataclass
class MembershipResult:
    accuracy: float  # on the held-out balanced set, from the target view
    calibration_accuracy: float  # on the attacker's own training records, from the calibration view
    features: str


def membership_inference(calib: tuple[torch.Tensor, torch.Tensor], target: tuple[torch.Tensor, torch.Tensor],
                         *, features: str = "last", seed: int = 0, **train_kw) -> MembershipResult:
    """Train on ``calib = (member features, non-member features)`` and score on ``target`` (the other
    half of the members and unseen non-members), each computed by :func:`layer_features` on the model
    view the threat model gives the attacker for that step."""
    model = train_attack_model(*calib, seed=seed, **train_kw)
    return MembershipResult(attack_accuracy(model, *target), attack_accuracy(model, *calib), features)
