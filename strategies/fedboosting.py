"""FedBoosting (seed 003 §4.2, eq. 4.1-4.3 and 4.5, Alg. 2-3): cross-validated mixture weights.

``[strategy] name = "fedboosting"``. One round:

1. ``train`` (the engine's exchange): every sampled client trains and replies with its model (through
   the channel) and ``T_i``, the trained model's loss on its own training split (the rule asks for it
   with ``REPORT_TRAIN_LOSS``; Alg. 3 line 19).
2. DP fusion (eq. 4.5): for each contributing client ``i`` the server forms the mixture
   ``M_i = p_hat x_i + sum_{k != i} s_ik x_k`` through the channel's ``weighted_mean`` - homomorphically
   under the Paillier channel, so the server never sees a model. The others' shares ``s_ik`` sum to
   ``1 - p_hat``: equal (eq. 4.5 and the authors' code, ``shares = "equal"``, the default) or drawn
   afresh every round from a flat Dirichlet (``shares = "random"``), from server-only entropy
   (``secrets_from = "entropy"``, the default: no client can recompute them) or from (seed, round)
   (``"seed"``: reproducible, and recomputable by any client, which sees the seed in the config).
   ``p_hat = 1`` sends each model itself (no fusion). The fusion adds no noise: it is not differential
   privacy in the formal sense (docs/fedboosting.md).
3. ``evaluate.crossval`` (a second message type, inside the round): every contributor receives all
   ``N`` mixtures in one message (``channel.outgoing`` records suffixed ``#k``) and replies with their
   losses on its local validation split (``data.val_fraction``): column ``j`` of ``V[i, j]``.
4. Weights (``weighting = "eq4.2"``: eq. 4.2-4.3, read as in :func:`mixture_weights`; ``"inverse-loss"``:
   the authors' code, :func:`inverse_loss_weights`) and ``G = sum_i p_i x_i`` (eq. 4.1) through the
   channel's ``weighted_mean``.

A validator that fails (error reply, malformed losses) is a recorded failure (stage ``crossval``); the
weights use the validators that answered. If none answered, the round falls back to FedAvg's example
weights (``strategy.fallback = 1``). Metrics (``strategy.*``): each contributor's weight
(``weight.<partition>``, up to 32 clients), the weights' min / max / entropy (and the entropy over
``log N``: 1 = uniform, 0 = one client), every round, the V matrix's mean /
min / max and its diagonal (own split) and off-diagonal means, the training losses' mean, validators
that answered, the exchange's time.

The rule needs weighted sums only, so it runs under the plain and the Paillier channel. docs/fedboosting.md.
"""
from __future__ import annotations

import math
import os
import time
from typing import Annotated, Any, Mapping, Sequence

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from fedsim.components import STRATEGIES
from fedsim.params import OneOf, Range
from fedsim.protocol import (
    CONFIG,
    CROSS_VALIDATE,
    CROSSVAL_LOSSES,
    CROSSVAL_MODELS,
    FINAL_TRAIN_LOSS,
    REPORT_TRAIN_LOSS,
    TRAIN_LOSS,
    for_model,
)
from fedsim.replies import InvalidReply, ModelSpec, Reply
from fedsim.seams import RoundContext, WeightedSumRule
from fedsim.seeding import derive_seed

SHARES = ("equal", "random")
SECRET_SOURCES = ("entropy", "seed")
_SALT = 0xB005
MAX_WEIGHT_COLUMNS = 32


def softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def _check_losses(train_losses: Sequence[float], val_losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(train_losses, dtype=np.float64)
    v = np.asarray(val_losses, dtype=np.float64)
    n = len(t)
    if v.ndim != 2 or v.shape[0] != n or v.shape[1] < 1:
        raise ValueError(f"val_losses must be an N x J matrix with N = {n} models and J >= 1 validators, "
                         f"got shape {v.shape}")
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(v))):
        raise ValueError("train_losses and val_losses must be finite")
    return t, v


def mixture_weights(train_losses: Sequence[float], val_losses: np.ndarray, use_train_loss: bool = True) -> np.ndarray:
    """Eq. 4.2-4.3 as fedsim reads them (``weighting = "eq4.2"``, the default).

    ``val_losses[i, j]`` (eq. 4.3's ``V^{i,j}``) is model ``i``'s loss on validator ``j``'s split, for the
    ``J`` validators that answered (``J = N`` when all did); ``train_losses[i]`` is ``T^i``.

    * ``V^i = (N / J) sum_j V^{i,j}``: the thesis sums model ``i``'s validation losses over all ``N``
      clients; when only ``J < N`` answered, the sum over them is scaled up so it stays comparable.
    * ``s_i = softmax(T)_i * V^i`` (the inner softmax over the round's training losses; without
      training losses, ``use_train_loss = False`` (Fig. 4.6's ablation), ``softmax(T)`` is replaced by
      the uniform ``1/N``, so ``s_i`` is model ``i``'s mean validation loss).
    * ``p = softmax(-s)``: the printed eq. 4.2 has no sign, but the thesis wants a lower weight for a
      model that validates badly ("the validation scores of the toxic model ... will be significantly
      lower, which in turn leads to a significantly lower aggregation weight") and its ``T``, ``V`` are
      losses, so the sign goes on the outer softmax: a lower training loss and a lower validation loss
      both raise a model's weight.

    One client: ``p = [1]``. Equal training losses and equal ``V^i``: uniform ``1/N`` (example counts
    play no part, unlike FedAvg).
    """
    t, v = _check_losses(train_losses, val_losses)
    n = len(t)
    v_sum = v.sum(axis=1) * (n / v.shape[1])
    inner = softmax(t) if use_train_loss else np.full(n, 1.0 / n)
    return softmax(-(inner * v_sum))


def inverse_loss_weights(train_losses: Sequence[float], val_losses: np.ndarray,
                         use_train_loss: bool = True) -> np.ndarray:
    """The weighting of the authors' public code (``weighting = "inverse-loss"``; Rand2AI/FedBoosting,
    ``FLutils/fed_server.py``, read there, not copied): no softmax, ratios of losses.

    * ``q_i = 1 / mean_j V[i, j]``: the inverse of model ``i``'s mean validation loss over the validators
      that answered (a mean, so missing validators need no rescaling);
    * ``r_i = (1 / T_i) / sum_k (1 / T_k)``: the normalised inverse training loss (``use_train_loss =
      False``: ``r_i = 1``);
    * ``p = q * r / sum(q * r)``.

    A model with half the losses gets twice the weight (eq. 4.2's softmax gives it ``e`` to the difference
    of the losses instead: flatter for small losses, sharper for large ones). Losses are clipped at 1e-12
    (a model that fits perfectly would otherwise divide by zero). Equal losses: uniform ``1/N``.
    """
    t, v = _check_losses(train_losses, val_losses)
    q = 1.0 / np.maximum(v.mean(axis=1), 1e-12)
    if use_train_loss:
        inv_t = 1.0 / np.maximum(t, 1e-12)
        q = q * inv_t / inv_t.sum()
    return q / q.sum()


WEIGHTINGS = {"eq4.2": mixture_weights, "inverse-loss": inverse_loss_weights}
# the model's own share of its fused copy must be the largest
P_HAT = Range(0.5, 1, open_low=True, why="the model's own share of its fused copy must be the largest")


@STRATEGIES.register
class FedBoosting(WeightedSumRule):
    """Cross-validated mixture weights with DP fusion (parameters: ``p_hat`` in (0.5, 1], ``shares`` =
    equal | random, ``secrets_from`` = entropy | seed, ``weighting`` = eq4.2 | inverse-loss,
    ``use_train_loss``)."""

    name = "fedboosting"
    stateless = True  # each round's weights come from that round's replies (and (seed, round))

    def __init__(self, p_hat: Annotated[float, P_HAT] = 0.9, shares: Annotated[str, OneOf(*SHARES)] = "equal",
                 secrets_from: Annotated[str, OneOf(*SECRET_SOURCES)] = "entropy",
                 weighting: Annotated[str, OneOf(*WEIGHTINGS)] = "eq4.2", use_train_loss: bool = True):
        self.p_hat, self.shares, self.secrets_from = float(p_hat), shares, secrets_from
        self.weighting = weighting
        self.use_train_loss = bool(use_train_loss)
        self._metrics: dict[str, float] = {}
        self.last: dict[str, Any] = {}  # the last round's T, V, fusion matrix and weights (tests, docs)

    # ---- configuration ---------------------------------------------------------------------------------
    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        if not float(cfg["data"].get("val_fraction") or 0.0) > 0:
            raise ValueError("needs local validation splits for the cross-validation: set data.val_fraction > 0 "
                             "(e.g. 0.1)")

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        # derive_seed keeps 32 bits of each part: four parts carry 128 bits of server-only entropy
        self.seed_parts = ((int(cfg["seed"]),) if self.secrets_from == "seed"
                           else tuple(int.from_bytes(os.urandom(4), "little") for _ in range(4)))

    def state(self) -> dict[str, Any]:  # a resumed run keeps drawing the shares from the same secrets
        return {"seed_parts": [int(x) for x in self.seed_parts]}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.seed_parts = tuple(int(x) for x in state["seed_parts"])

    def configure_train(self, server_round: int, config: dict[str, Any]) -> None:
        config[REPORT_TRAIN_LOSS] = True

    # ---- eq. 4.5 ------------------------------------------------------------------------------------------
    def fusion_matrix(self, server_round: int, n: int) -> np.ndarray:
        """Row ``i``: the weights of mixture ``M_i`` - ``p_hat`` on model ``i``, the others' shares sum to
        ``1 - p_hat``."""
        if n == 1 or self.p_hat == 1.0:
            return np.eye(n)
        rest = 1.0 - self.p_hat
        f = np.zeros((n, n))
        rng = np.random.default_rng(derive_seed(*self.seed_parts, server_round, _SALT))
        for i in range(n):
            shares = rng.dirichlet(np.ones(n - 1)) if self.shares == "random" else np.full(n - 1, 1.0 / (n - 1))
            f[i, [k for k in range(n) if k != i]] = rest * shares
            f[i, i] = self.p_hat
        return f

    # ---- one round ----------------------------------------------------------------------------------------
    @staticmethod
    def train_loss(reply: Reply) -> float:
        m = reply.metrics
        return float(m[FINAL_TRAIN_LOSS] if FINAL_TRAIN_LOSS in m else m[TRAIN_LOSS])

    def check_reply(self, reply: Reply, model: ModelSpec) -> None:
        """The training loss the weights are computed from: a finite number."""
        key = FINAL_TRAIN_LOSS if FINAL_TRAIN_LOSS in reply.metrics else TRAIN_LOSS
        v = reply.metrics.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise InvalidReply(f"fedboosting reads the reply's {key}, which must be a finite number, got {v!r}")

    def weights(self, ctx: RoundContext, replies: list[Reply]) -> list[float]:
        n = len(replies)
        t = np.array([self.train_loss(r) for r in replies])
        parts = [r.partition for r in replies]
        self._metrics = {"train_loss_mean": float(t.mean()), "models": float(n)}
        if n == 1:  # the weight is 1 whatever the losses: no exchange
            self.last = {"T": t, "V": np.zeros((1, 0)), "fusion": np.eye(1), "weights": np.ones(1),
                         "validators": []}
            self._metrics.update(self._weight_metrics(parts, np.ones(1)), validators=0.0, fallback=0.0)
            return [1.0]
        t0 = time.perf_counter()
        fusion = self.fusion_matrix(ctx.round, n)
        shared = RecordDict({CONFIG: ConfigRecord({**dict(ctx.config.items()), CROSSVAL_MODELS: n})})
        for k in range(n):
            mixture = replies[k:k + 1] if fusion[k, k] == 1.0 else replies
            w = [1.0] if fusion[k, k] == 1.0 else list(fusion[k])
            for key, rec in ctx.channel.outgoing_to_trained(ctx.channel.weighted_mean(mixture, w)).items():
                shared[for_model(key, k)] = rec
        t1 = time.perf_counter()
        answered = ctx.send(parts, CROSS_VALIDATE, shared, None, "crossval")
        columns, validators = [], []
        for r in answered:
            losses = r.metrics.get(CROSSVAL_LOSSES)
            ok = isinstance(losses, list) and len(losses) == n and all(np.isfinite(float(x)) for x in losses)
            if not ok:
                ctx.engine.record_failure(ctx.record, ctx.round, r.node_id, "crossval",
                                          f"malformed cross-validation losses: {str(losses)[:200]}",
                                          partition=r.partition)
                continue
            columns.append([float(x) for x in losses])
            validators.append(r.partition)
        v = np.array(columns, dtype=np.float64).T if columns else np.zeros((n, 0))
        if validators:
            p = WEIGHTINGS[self.weighting](t, v, self.use_train_loss)
        else:  # nobody could validate: FedAvg's example weights
            ex = np.array([max(r.num_examples, 0) for r in replies], dtype=np.float64)
            p = ex / ex.sum() if ex.sum() > 0 else np.full(n, 1.0 / n)
        self.last = {"T": t, "V": v, "fusion": fusion, "weights": p, "validators": validators}
        self._metrics.update(self._weight_metrics(parts, p))
        self._metrics.update({"validators": float(len(validators)), "fallback": float(not validators),
                              "mixture_seconds": t1 - t0, "crossval_seconds": time.perf_counter() - t1})
        if validators:
            own = [v[i, validators.index(parts[i])] for i in range(n) if parts[i] in validators]
            off = [v[i, j] for i in range(n) for j, q in enumerate(validators) if q != parts[i]]
            self._metrics.update({"val_loss_mean": float(v.mean()), "val_loss_min": float(v.min()),
                                  "val_loss_max": float(v.max()),
                                  "val_loss_own_mean": float(np.mean(own)) if own else float("nan"),
                                  "val_loss_cross_mean": float(np.mean(off)) if off else float("nan")})
        return [float(x) for x in p]

    @staticmethod
    def _weight_metrics(parts: Sequence[int], p: np.ndarray) -> dict[str, float]:
        entropy = float(-(p * np.log(np.clip(p, 1e-300, None))).sum())
        out = {"weights_min": float(p.min()), "weights_max": float(p.max()), "weights_entropy": entropy,
               # 1: uniform weights (FedAvg's on equal-sized clients), 0: one client takes everything
               "weights_entropy_norm": entropy / math.log(len(p)) if len(p) > 1 else 1.0}
        if len(parts) <= MAX_WEIGHT_COLUMNS:
            out.update({f"weight.{q}": float(x) for q, x in zip(parts, p)})
        return out

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)
