"""Membership inference: the attacks, their scores and the audit metrics (ROC AUC, TPR at low FPR).

Every attack here gives each candidate record a *score* (higher: more likely a member); :func:`roc`
turns the scores of known members and non-members into the audit researchers quote (Carlini et al.,
"Membership Inference Attacks From First Principles", S&P 2022): the ROC curve, its AUC and the true
positive rate at 0.1% and 1% false positive rate (scikit-learn's ``roc_curve`` / ``roc_auc_score``;
with n non-members the smallest measurable FPR is 1/n, and TPR at a smaller FPR is the TPR at FPR 0).

Attacks (all return scores for ``(x, y)`` candidates):

* the surrogate attack model of seed 002 / Nasr et al. (below: :func:`membership_inference`; its score is
  the attack model's logit);
* :func:`loss_scores` - the loss threshold attack (Yeom et al., CSF 2018): ``-loss(target, x)``;
* :func:`calibrated_scores` - difficulty calibration (Watson et al., ICLR 2022): ``loss(reference, x) -
  loss(target, x)``, the reference being a model that did not train on the candidates (in FL: the model
  before the round the target trained in), so that records that are easy for every model do not look like
  members;
* :func:`lira_scores` - the online likelihood-ratio attack (LiRA, Carlini et al. 2022): shadow models
  trained the way the target was, each on a random half of the candidates; for every candidate the
  logit-scaled confidence ``log p_y - log(1 - p_y)`` of the shadows that trained on it and of those that
  did not are fitted with Gaussians, and the target's confidence is scored by the log-likelihood ratio.

Surrogate attack model (seed 002, §6.4.1):

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

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedsim.lossless import Layer, forward
from fedsim.params import OneOf

FEATURES = ("last", "second", "third", "last3")




def layer_features(layers: Sequence[Layer], x: torch.Tensor, labels: torch.Tensor, num_classes: int,
                   which: str = "last", *, negative_slope: float = 0.0) -> torch.Tensor:
    """Attack-model input for every record: the chosen layer output(s) of the FC model plus the one-hot label.

    ``layers`` is whatever model the attacker holds (the true one without a defence, the perturbed one
    ``W^`` under seed 002's defence).
    """
    OneOf(*FEATURES).check("attack.features", which)
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


@torch.no_grad()
def attack_scores(model: AttackModel, features: torch.Tensor) -> torch.Tensor:
    """The attack model's logit ("member") for every record."""
    return model(features.float())


@dataclass
class MembershipResult:
    accuracy: float  # on the held-out balanced set, from the target view
    calibration_accuracy: float  # on the attacker's own training records, from the calibration view
    features: str
    audit: dict[str, Any] | None = None  # roc() of the attack model's scores on the held-out set


def membership_inference(calib: tuple[torch.Tensor, torch.Tensor], target: tuple[torch.Tensor, torch.Tensor],
                         *, features: str = "last", seed: int = 0, **train_kw) -> MembershipResult:
    """Train on ``calib = (member features, non-member features)`` and score on ``target`` (the other
    half of the members and unseen non-members), each computed by :func:`layer_features` on the model
    view the threat model gives the attacker for that step."""
    model = train_attack_model(*calib, seed=seed, **train_kw)
    audit = roc(attack_scores(model, target[0]), attack_scores(model, target[1]))
    return MembershipResult(attack_accuracy(model, *target), attack_accuracy(model, *calib), features, audit)


# ============================================================================ audit metrics
FPRS = (1e-3, 1e-2)  # the low false positive rates TPR is reported at
TPR_KEYS = {1e-3: "tpr_at_fpr_1e-3", 1e-2: "tpr_at_fpr_1e-2"}
AUDIT_COLUMNS = ("auc", *TPR_KEYS.values())


def _array(v: Any) -> np.ndarray:
    a = v.detach().cpu().double().numpy() if isinstance(v, torch.Tensor) else np.asarray(v, dtype=np.float64)
    return a.reshape(-1)


def roc(member_scores: Any, non_member_scores: Any, *, curve_points: int = 200) -> dict[str, Any]:
    """The membership audit of scores (higher = member): ROC AUC, TPR at 0.1% and 1% FPR, and the ROC curve
    (``fpr``, ``tpr``, thinned to about ``curve_points`` points for storage). scikit-learn's metrics.

    TPR at FPR x is the largest TPR of a threshold whose FPR is at most x (LiRA's convention; with n
    non-members FPRs below 1/n are met only by thresholds above every non-member)."""
    from sklearn.metrics import roc_auc_score, roc_curve

    m, n = _array(member_scores), _array(non_member_scores)
    if not len(m) or not len(n):
        raise ValueError("a membership audit needs members and non-members")
    bad = ~np.isfinite(np.concatenate([m, n]))
    if bad.any():
        raise ValueError(f"{int(bad.sum())} membership scores are not finite")
    y = np.concatenate([np.ones(len(m)), np.zeros(len(n))])
    s = np.concatenate([m, n])
    fpr, tpr, _ = roc_curve(y, s)
    out: dict[str, Any] = {"auc": float(roc_auc_score(y, s)), "members": int(len(m)), "non_members": int(len(n))}
    for x, key in TPR_KEYS.items():
        out[key] = float(tpr[fpr <= x].max())
    keep = np.unique(np.linspace(0, len(fpr) - 1, min(len(fpr), curve_points)).round().astype(int))
    out["fpr"], out["tpr"] = fpr[keep].tolist(), tpr[keep].tolist()
    return out


# ============================================================================ score attacks
def per_example_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every record (the model's logits, the true labels)."""
    return F.cross_entropy(logits.double(), y.long().to(logits.device), reduction="none").cpu()


def loss_scores(target_logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss threshold attack (Yeom et al. 2018): members have low loss."""
    return -per_example_loss(target_logits, y)


def calibrated_scores(target_logits: torch.Tensor, reference_logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Difficulty-calibrated loss (Watson et al. 2022): how much lower the record's loss is under the target
    than under a reference model that did not train on it."""
    return per_example_loss(reference_logits, y) - per_example_loss(target_logits, y)


def scaled_confidence(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """LiRA's statistic ``log p_y - log(1 - p_y)`` from logits, computed stably as ``z_y - logsumexp(z_{-y})``."""
    z = logits.double().cpu()
    y = y.long().cpu()
    zy = z.gather(1, y[:, None]).squeeze(1)
    others = z.scatter(1, y[:, None], -math.inf)
    return zy - torch.logsumexp(others, 1)


def lira_scores(target_conf: torch.Tensor, shadow_conf: torch.Tensor, shadow_in: torch.Tensor,
                *, min_std: float = 1e-3) -> torch.Tensor:
    """Online LiRA (Carlini et al. 2022): the log-likelihood ratio of each candidate's target statistic under
    Gaussians fitted to the shadow models that trained on it (``shadow_in``, ``(K, N)`` bool) and to those
    that did not. ``shadow_conf`` is ``(K, N)`` (:func:`scaled_confidence` of each shadow on each
    candidate). Means are per candidate; the standard deviation is the global one of each side (LiRA's
    choice for few shadows). Every candidate needs at least one IN and one OUT shadow."""
    conf = shadow_conf.double()
    inn = shadow_in.bool()
    if conf.shape != inn.shape or conf.dim() != 2 or conf.shape[1] != len(target_conf):
        raise ValueError(f"shadow statistics {tuple(conf.shape)}, IN mask {tuple(inn.shape)} and "
                         f"{len(target_conf)} candidates do not match")
    n_in, n_out = inn.sum(0), (~inn).sum(0)
    if int(n_in.min()) < 1 or int(n_out.min()) < 1:
        raise ValueError("every candidate needs shadow models that trained on it and shadow models that did not")
    mu_in = (conf * inn).sum(0) / n_in
    mu_out = (conf * ~inn).sum(0) / n_out
    dev_in = ((conf - mu_in) * inn)
    dev_out = ((conf - mu_out) * ~inn)
    sd_in = max(float(torch.sqrt((dev_in ** 2).sum() / max(int(inn.sum()) - 1, 1))), min_std)
    sd_out = max(float(torch.sqrt((dev_out ** 2).sum() / max(int((~inn).sum()) - 1, 1))), min_std)
    t = target_conf.double().cpu()
    log_in = -0.5 * ((t - mu_in) / sd_in) ** 2 - math.log(sd_in)
    log_out = -0.5 * ((t - mu_out) / sd_out) ** 2 - math.log(sd_out)
    return log_in - log_out


def balanced_halves(n: int, shadows: int, gen: torch.Generator) -> torch.Tensor:
    """``(shadows, n)`` IN mask of LiRA's paired design: shadows 2k and 2k+1 split a random permutation of the
    candidates in two halves, so every shadow trains on half of them and every candidate is IN for exactly
    half of the shadows (``shadows`` even, >= 2)."""
    if shadows < 2 or shadows % 2:
        raise ValueError(f"shadows must be an even number >= 2, got {shadows!r}")
    mask = torch.zeros(shadows, n, dtype=torch.bool)
    for k in range(shadows // 2):
        perm = torch.randperm(n, generator=gen)
        mask[2 * k, perm[: n // 2]] = True
        mask[2 * k + 1, perm[n // 2:]] = True
    return mask
