"""Seed 002's accuracy-lossless model perturbation as a server transform
(``[[transforms]] name = "lossless-perturbation"``; the mathematics is :mod:`fedsim.lossless`).

Every round the server

1. draws one-time secrets (``r^(1..L-1)``, ``gamma``, the public ``r^(a)`` and output partition) from a
   generator seeded by (seed, round) - or by server-only entropy, ``secrets_from = "entropy"``;
2. keeps the true model ``W`` in float64 and sends the perturbed ``W^`` (eq. 7-9): cast to the model's
   dtype in the ``ARRAYS`` record (what a client's model is loaded from) and in float64 with the public
   noise in the ``EXTRAS`` record (``fedsim.protocol.LOSSLESS_*``), where the client half
   (``clients/lossless.py``, run automatically through :meth:`client_defenses`) reads it;
3. in :meth:`after_aggregate`, ignores the rule's average of the clients' (perturbed) models and
   recovers the exact aggregated gradient from the clients' float64 terms (perturbed gradient,
   ``sigma~_s``, ``beta``), weighted with the weights the rule used (FedAvg: example counts), then
   returns ``W - lr * g`` as the next global model (Theorem 3, eq. 15).

The secrets never leave this object. What exact recovery needs is checked when the config is loaded
(:meth:`validate_config`): a fully connected ReLU/LeakyReLU model, FedSGD (``train.local_steps = 1``),
MSE with the paper's noise or cross-entropy with the shift noise, no client defense or Flower mod that
would change the gradient or the update (the recovery would silently bypass it), a weighted-sum rule,
and a channel that shows the server each reply (``requires``).
"""
from __future__ import annotations

import math
import os
from typing import Annotated, Any, Mapping, Sequence

import numpy as np
import torch
from torch.nn import functional as F

from fedsim import lossless as ll
from fedsim.components import DEFENSES, STRATEGIES, TRANSFORMS
from fedsim.defense import Defense
from fedsim.params import OneOf, Range
from fedsim.protocol import (
    EXTRAS,
    LOSSLESS_GROUPS,
    LOSSLESS_MODEL,
    LOSSLESS_R_A,
    LOSSLESS_TERMS,
    arrays_record,
)
from fedsim.replies import InvalidReply, ModelSpec
from fedsim.seams import INDIVIDUAL, PLAINTEXT_AGGREGATE, RoundContext, ServerTransform, WeightedSumRule
from fedsim.seeding import derive_seed

MODES = ("auto", "paper", "shift")
SECRET_SOURCES = ("seed", "entropy")
_SALT = 0x5EC2E7  # separates the secrets' stream from every other stream derived from the run's seed
CLIENT_DEFENSE = "lossless-client"


NoiseRange = Annotated[Sequence[float], ll.NOISE_RANGE]


def loss_name(train_loss: str) -> str:
    """``train.loss`` spelled as :mod:`fedsim.lossless` spells it."""
    return {"cross-entropy": "cross_entropy", "mse": "mse"}[train_loss]


def fc_model_spec(cfg: Mapping[str, Any]) -> ll.FCSpec:
    """The FC spec of the configured model (``ValueError`` naming ``model.name`` when unsupported).
    Builds the model without touching the global torch RNG."""
    from fedsim.factories import model_for

    with torch.random.fork_rng(devices=[]):
        model = model_for(cfg)
    try:
        return ll.fc_spec(model)
    except ValueError as exc:
        raise ValueError(f"model.name = {cfg['model']['name']!r}: {exc}") from None


# stages of a client defense that change what the client computes or sends
_STAGES = ("adapt_model", "compute_gradient", "transform_gradient", "transform_update")


def _changes_training(d: Defense) -> list[str]:
    return [s for s in _STAGES if getattr(type(d), s) is not getattr(Defense, s)]


@TRANSFORMS.register
class LosslessPerturbation(ServerTransform):
    """Seed 002's perturbation with exact recovery of the aggregated gradient (see the module docstring).

    Parameters: ``groups`` (``m``, the output partition's size; Theorem 5: a client guesses the true
    prediction with probability <= 1/m; the upload is ``m + 2`` model-sized arrays), ``mode``
    (``paper``: the paper's noise, MSE only; ``shift``: uniform output shift, the one exact mode for
    cross-entropy, which shows clients the true probabilities; ``auto``: ``paper`` for MSE, ``shift``
    for cross-entropy), the ranges of the noise (``multiplicative`` for ``r^(l)``, ``gamma``,
    ``additive`` for ``|r^(a)|``), ``secrets_from`` (``seed``: reproducible from (seed, round) - but
    every client is sent the config, seed included, so a client could recompute them; ``entropy``:
    server-only randomness, runs then agree only to the float64 rounding of the recovery) and
    ``probe`` (public root-split examples the server uses each round to measure the recovery error of
    that round's secrets; 0 = off).
    """

    name = "lossless-perturbation"
    requires = frozenset({INDIVIDUAL, PLAINTEXT_AGGREGATE})  # it reads each reply's noise terms

    def __init__(self, groups: Annotated[int, Range(1)] = 1, mode: Annotated[str, OneOf(*MODES)] = "auto",
                 multiplicative: NoiseRange = (0.1, 10.0), gamma: NoiseRange = (0.1, 10.0), additive: NoiseRange = (0.5, 1.5),
                 secrets_from: Annotated[str, OneOf(*SECRET_SOURCES)] = "seed", probe: Annotated[int, Range(0)] = 8):
        if mode == "shift" and groups != 1:
            raise ValueError(f"groups must be 1 with mode = 'shift' (a uniform shift has one group), got {groups}")
        self.groups, self.mode, self.secrets_from, self.probe = groups, mode, secrets_from, probe
        self.ranges = {k: (float(v[0]), float(v[1])) for k, v in
                       (("multiplicative", multiplicative), ("gamma", gamma), ("additive", additive))}
        self._true: list[ll.Layer] | None = None  # the true global model, float64
        self._returned: list[np.ndarray] | None = None  # what after_aggregate gave the engine
        self._round: dict[str, Any] = {}
        self._metrics: dict[str, float] = {}
        self.recovered: list[ll.Layer] | None = None  # the last recovered aggregated gradient (float64)

    # ---- config time ------------------------------------------------------------------------------
    def _mode_for(self, train_loss: str) -> str:
        if self.mode != "auto":
            return self.mode
        return "shift" if train_loss == "cross-entropy" else "paper"

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        from fedsim.data import DatasetUnavailable

        train = cfg["train"]
        if train.get("local_steps") != 1:
            raise ValueError(
                f"train.local_steps must be 1 (FedSGD), got local_steps={train.get('local_steps')!r}, "
                f"local_epochs={train.get('local_epochs')!r}: the recovery is exact only for gradients taken at "
                "the broadcast perturbed model; a local SGD step leaves the perturbed parameterisation")
        loss = train.get("loss", "cross-entropy")
        mode = self._mode_for(loss)
        if loss == "cross-entropy" and mode != "shift":
            raise ValueError(
                "mode = 'paper' cannot recover train.loss = 'cross-entropy' exactly (the client's logit gradient "
                "softmax(y + alpha r) - t is a transcendental function of the secret r; docs/lossless.md): use "
                "train.loss = 'mse' (the paper's derivation) or mode = 'shift' (exact, but clients then see the "
                "true predicted probabilities)")
        if loss == "cross-entropy" and self.groups != 1:
            raise ValueError(f"groups must be 1 with train.loss = 'cross-entropy' (only the uniform shift noise "
                             f"is exact for it), got {self.groups}")
        for i, entry in enumerate(cfg.get("defenses") or []):
            d = DEFENSES.build(entry, f"defenses[{i}]")
            stages = _changes_training(d)
            if stages:
                raise ValueError(
                    f"defenses[{i}] ({d.name}) cannot run under lossless perturbation: it changes "
                    f"{', '.join(stages)}, but the server recovers the aggregate from the lossless client's noise "
                    "terms of the plain gradient at the perturbed model, so it would be bypassed (a gradient or "
                    "update change) or would break the recovery (another gradient computation or model)")
        mods = (cfg.get("client") or {}).get("flower_mods") or []
        if mods:
            names = [m.get("name") if isinstance(m, Mapping) else m for m in mods]
            raise ValueError(f"client.flower_mods {names} cannot run under lossless perturbation: a mod around "
                             "training changes the reply's model, which the server does not use (it recovers the "
                             "aggregate from the lossless noise terms), so the mod would be silently bypassed")
        rule = STRATEGIES.lookup(cfg["strategy"]["name"], "strategy.name")
        if not issubclass(rule, WeightedSumRule):
            raise ValueError(f"strategy.name = {cfg['strategy']['name']!r} is not a weighted-sum rule: the lossless "
                             "recovery replaces the rule's aggregate by the weighted mean of the recovered "
                             "gradients, so only a rule whose aggregate is a weighted mean (e.g. fedavg) keeps "
                             "its meaning")
        try:
            spec = fc_model_spec(cfg)
        except DatasetUnavailable:
            return  # the runner reports the missing data
        n_out = spec.shapes[-1][0]
        if self.groups > n_out:
            raise ValueError(f"groups must be in [1, {n_out}] (the model's outputs), got {self.groups}")

    def client_defenses(self) -> list[dict[str, Any]]:
        return [{"name": CLIENT_DEFENSE}]

    # ---- run time -----------------------------------------------------------------------------------
    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        self.names = list(param_names)
        self.spec = fc_model_spec(cfg)
        pos = {n: i for i, n in enumerate(self.names)}
        covered = {n for pair in self.spec.names for n in pair if n is not None}
        if covered != set(self.names):
            raise ValueError(f"lossless perturbation: model entries outside its Linear layers: "
                             f"{sorted(set(self.names) - covered)}")
        self.index = [(pos[w], pos[b] if b is not None else None) for w, b in self.spec.names]
        self.lr = float(cfg["train"]["lr"])
        self.loss = loss_name(cfg["train"].get("loss", "cross-entropy"))
        self.secret_mode = self._mode_for(cfg["train"].get("loss", "cross-entropy"))
        # derive_seed takes 32 bits of each part: four parts carry 128 bits of server-only entropy
        self.seed_parts = ((int(cfg["seed"]),) if self.secrets_from == "seed"
                           else tuple(int.from_bytes(os.urandom(4), "little") for _ in range(4)))
        self._probe_data: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.probe:
            from fedsim.factories import dataset_for

            ds = dataset_for(cfg)
            n = min(self.probe, len(ds.y_root))
            self._probe_data = (ds.x_root[:n].double(), ds.y_root[:n])

    def _layers(self, arrays: Sequence[np.ndarray]) -> list[ll.Layer]:
        def t(i: int) -> torch.Tensor:
            return torch.from_numpy(np.array(arrays[i], dtype=np.float64))

        return [(t(i), t(j) if j is not None else None) for i, j in self.index]

    def _arrays(self, layers: Sequence[ll.Layer]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(self.names)
        for (i, j), (w, b) in zip(self.index, layers):
            out[i] = w.detach().cpu().numpy()
            if j is not None:
                out[j] = b.detach().cpu().numpy()
        return out  # type: ignore[return-value]

    def _secrets(self, server_round: int) -> ll.Secrets:
        gen = torch.Generator(device="cpu").manual_seed(derive_seed(*self.seed_parts, server_round, _SALT))
        lo_hi = self.ranges
        return ll.draw_secrets(self.spec.shapes, self.groups, gen, multiplicative=lo_hi["multiplicative"],
                               gamma=lo_hi["gamma"], additive=lo_hi["additive"], mode=self.secret_mode)

    def before_send(self, server_round: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        # the float64 model this transform returned last round, unless a transform outside it changed it
        same = self._returned is not None and len(arrays) == len(self._returned) and all(
            a.shape == b.shape and np.array_equal(a, b) for a, b in zip(arrays, self._returned))
        true = self._true if same and self._true is not None else self._layers(arrays)
        sec = self._secrets(server_round)
        pert, public = ll.perturb(true, sec)
        sent64 = self._arrays(pert)
        self._true = true
        self._round = {"round": server_round, "secrets": sec, "perturbed": pert, "public": public, "sent": sent64}
        return [s.astype(a.dtype) for s, a in zip(sent64, arrays)]

    def message_extras(self, server_round: int) -> dict[str, Any]:
        r = self._round
        if r.get("round") != server_round:
            raise RuntimeError(f"lossless perturbation: round {server_round}'s model was not perturbed")
        r_a, groups = r["public"].to_arrays()
        names = [f"{LOSSLESS_MODEL}{n}" for n in self.names] + [LOSSLESS_R_A, LOSSLESS_GROUPS]
        return {EXTRAS: arrays_record(names, [*r["sent"], r_a, groups])}

    def check_reply(self, reply: Any, model: ModelSpec) -> None:
        """The reply's noise terms (parsed once here, used in ``after_aggregate``)."""
        try:
            reply.extra[LOSSLESS_TERMS] = self._terms(reply)
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidReply(f"lossless perturbation: unusable noise terms: {exc}") from None

    def _terms(self, reply: Any) -> ll.ClientTerms:
        if LOSSLESS_TERMS in reply.extra:
            return reply.extra[LOSSLESS_TERMS]
        if not reply.has(EXTRAS) or LOSSLESS_TERMS not in reply.record(EXTRAS):
            raise ValueError("the reply carries no lossless noise terms")
        flat = reply.record(EXTRAS)[LOSSLESS_TERMS].numpy()
        if flat.dtype != np.float64 or flat.ndim != 1:
            raise ValueError(f"the lossless noise terms must be one float64 vector, got {flat.dtype} {flat.shape}")
        if not np.isfinite(flat).all():
            raise ValueError("the lossless noise terms hold non-finite values")
        num_groups = len(self._round["secrets"].gamma) if self.loss == "mse" else 0
        shapes = [tuple(t.shape) for w, b in self._true for t in (w, b) if t is not None]
        blocks = 1 + (num_groups + 1 if self.loss == "mse" else 0)
        sizes = [int(np.prod(s)) for s in shapes] * blocks
        if flat.size != sum(sizes):
            raise ValueError(f"expected {sum(sizes)} noise-term values ({blocks} model-sized blocks), got {flat.size}")
        parts = np.split(flat, np.cumsum(sizes)[:-1])
        arrays = [a.reshape(s) for a, s in zip(parts, shapes * blocks)]
        return ll.ClientTerms.from_arrays(arrays, self._true, num_groups, self.loss, reply.num_examples)

    def after_aggregate(self, ctx: RoundContext, aggregate: list[np.ndarray]) -> list[np.ndarray]:
        r = self._round
        if r.get("round") != ctx.round or self._true is None:
            raise RuntimeError(f"lossless perturbation: no secrets for round {ctx.round}")
        weights = ctx.weights if ctx.weights is not None else [float(x.num_examples) for x in ctx.replies]
        terms, used = [], []
        for reply, w in zip(ctx.replies, weights):
            try:
                terms.append(self._terms(reply))
                used.append(float(w))
            except (KeyError, ValueError) as exc:
                ctx.engine.record_failure(ctx.record, ctx.round, reply.node_id, "train",
                                          f"lossless perturbation: unusable noise terms: {exc}")
        if not terms:
            raise RuntimeError(f"round {ctx.round}: no reply carried usable lossless noise terms")
        agg = ll.aggregate(terms, used)
        sec = r["secrets"]
        grad = ll.recover(agg, sec)
        new = ll.sgd_step(self._true, grad, self.lr)
        self.recovered = grad
        out = [a.astype(b.dtype) for a, b in zip(self._arrays(new), aggregate)]
        self._metrics = self._round_metrics(agg, grad, terms)
        self._true, self._returned = new, out
        return out

    # ---- checkpoints: the float64 global model the next round perturbs ---------------------------------
    def state(self) -> dict[str, Any]:
        """The float64 model (``_true``) and what ``after_aggregate`` returned: without them a resumed run
        would start the next round from the float32 model and drift from the uninterrupted run."""
        if self._true is None or self._returned is None:
            return {}
        return {"true": self._arrays(self._true), "returned": [np.array(a, copy=True) for a in self._returned]}

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state:
            self._true = self._layers([np.asarray(a, dtype=np.float64) for a in state["true"]])
            self._returned = [np.asarray(a) for a in state["returned"]]

    # ---- metrics ----------------------------------------------------------------------------------------
    def _round_metrics(self, agg: ll.ClientTerms, grad: list[ll.Layer], terms: list[ll.ClientTerms]) -> dict:
        r = self._round

        def norm(layers):
            return math.sqrt(sum(float((t.double() ** 2).sum()) for w, b in layers for t in (w, b) if t is not None))

        diff = [(p - t, (pb - tb) if pb is not None else None) for (p, pb), (t, tb) in zip(r["perturbed"], self._true)]
        m = {"groups": float(len(r["secrets"].gamma)), "grad_norm": norm(grad),
             "perturbation_ratio": norm(diff) / max(norm(self._true), 1e-300),
             "terms_mb": sum(t.numel() for w, b in terms[0].grads for t in (w, b) if t is not None)
             * 8 * (1 + len(terms[0].sigma) + (1 if terms[0].beta else 0)) / 1e6}
        if self._probe_data is not None:
            m.update(self._probe_error())
        return m

    def _probe_error(self) -> dict[str, float]:
        """The recovery error of this round's secrets on a few public root examples: one client's terms
        on ``W^`` recovered with the secrets vs the gradient on the true ``W`` (float64 rounding only)."""
        r = self._round
        x, y = self._probe_data  # type: ignore[misc]
        n_out = self.spec.shapes[-1][0]
        target = F.one_hot(y, n_out).double() if self.loss == "mse" else y
        terms = ll.client_terms(r["perturbed"], r["public"], x, target, loss=self.loss,
                                negative_slope=self.spec.negative_slope)
        rec = ll.recover(terms, r["secrets"])
        ref = ll.true_gradients(self._true, x, target, loss=self.loss, negative_slope=self.spec.negative_slope)
        err = max(float((a - b).abs().max()) for (aw, ab), (bw, bb) in zip(rec, ref)
                  for a, b in ((aw, bw), (ab, bb)) if a is not None)
        scale = max(float(b.abs().max()) for bw, bb in ref for b in (bw, bb) if b is not None)
        return {"probe_error": err, "probe_rel_error": err / max(scale, 1e-300)}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)
