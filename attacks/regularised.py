"""Inverting Gradients with stronger priors: the BN-statistics prior and seed 004's attack.

Two registered attacks share one optimisation loop (Inverting Gradients of Geiping et al. 2020: one
cosine distance between the dummy and the observed gradient over the matched layers, a total-variation
prior, Adam with the step divided by 10 at 3/8, 5/8 and 7/8 of the iterations, images in [0, 1]):

* ``ig-bn`` - Inverting Gradients plus the BatchNorm-statistics prior of Yin et al. 2021
  (:mod:`attacks.bn_prior`), for models with BatchNorm. ``bn_target`` picks the threat model of the
  target statistics: ``"update"`` (default: read back from the BN buffers in the client's update, exact
  for one local step; what every curious server in fedsim has, since clients return their whole state),
  ``"running"`` (the global model's running statistics, which the server sent: on a fresh model they are
  the initialisation and say nothing about the victim's batch; the default before it measured useless
  there, docs/benchmarks.md) or ``"victim"`` (the victim batch's statistics granted through
  ``AttackInput.bn_stats``: threat model "BN statistics of the victim's batch known").
* ``ig-fr`` - seed 004's attack (Liu et al., section 4.2 and appendix F): Inverting Gradients with the
  TV and BN priors (BN targets from the update by default: the statistics seed 004 assumes known, which
  fedsim's curious server reads from the BN buffers), plus

  (a) a feature-matching regulariser: the features entering the last linear layer are first recovered
  from that layer's weight and bias gradients (:mod:`attacks.features`), then the dummy batch's
  features are pulled towards them with the sign-free squared cosine
  ``mean_b (1 - cos^2(h(x_b), h*_b))`` (``feature_loss="match"``) or, for batches whose individual
  features are not identifiable, towards their span (``"span"``: mean squared sine to the span);
  ``"auto"`` uses ``match`` when the recovery solved the gradient equations, ``span`` otherwise, and
  turns the regulariser off (``trace["feature_loss"] = "off"``) for batches of ``num_classes`` or more,
  whose features the last layer's gradient cannot span;

  (b) an untrained-CNN image prior (:mod:`attacks.image_prior`): the images are the output of a
  randomly initialised U-Net on fixed random codes and the attack optimises the U-Net's weights.
  ``ig-fr`` uses a U-Net of width 8 with one convolution per block (``prior_width=8, prior_depth=1``):
  on the sigmoid LeNet at batch 4 (20 images, 2000 steps) it reconstructed as well as width 16 with
  two convolutions per block (median SSIM 0.726 vs 0.723) at about half the time per evaluation (3.0x
  vs 4.3x the floor at batch 1, 3.5x vs 7.3x at batch 8; docs/benchmarks.md).

  Appendix F also reweights the gradient cosine "by the gradients' norm"; its formula was lost in the
  seed's text. ``layer_weights="norm"`` (every parameter tensor counts equally) is our reading; it made
  reconstructions worse on the BatchNorm LeNet (MSE 0.056 vs 0.0076 at 400 iterations untrained, 0.070
  vs 0.062 trained; benchmarks/attack_priors.py), so ``ig-fr`` leaves it off by default.

Cost per step (docs/benchmarks.md "Attack speed"): the gradient cosine is computed on the gradients
as one flat vector (:meth:`attacks._common.Target.flat_distance`, equal to the per-tensor sums up to
float rounding) and Adam steps the image prior's weights as one flat tensor that the U-Net's
parameters share (:class:`attacks._common.FlatParameters`).

Both attacks match the observed update as one (average) gradient: a multi-step update is attacked as
its pseudo-gradient ``-update / (lr K)``, not replayed (``ig``'s ``fedavg_aware`` is not offered).
The paper's formulas for the reweighting and the final objective were lost in the seed's text; the
forms here follow its description and the cited originals (see docs/attacks.md).
"""
from __future__ import annotations

import math
import time
from typing import Annotated, Any, Mapping, Sequence

import torch

from fedsim import progress
from fedsim.lifecycle import preset
from fedsim.params import OneOf

from ._common import (
    ABOVE_ZERO,
    Count,
    FlatParameters,
    Init,
    Labels,
    LayerWeights,
    Muted,
    NonNegative,
    Target,
    Threshold,
    choose_labels,
    finish,
    generator,
    init_dummy,
    patterns,
    prepare_target,
)
from .base import ATTACKS, Attack, AttackInput, AttackResult, config_model, register
from .bn_prior import BN_TARGETS, BNRecorder, bn_layers, bn_loss, bn_targets
from .features import Features, reconstruct_features, span_loss, squared_cosine_loss
from .image_prior import ImagePrior
from .inverting import total_variation
from .labels import last_linear

FEATURE_LOSSES = ("auto", "match", "span")
PRIOR_WIDTH, PRIOR_DEPTH = 8, 1  # ig-fr's image prior (measured: the quality of width 16, depth 2 at half the cost)


@register
class RegularisedInvertingGradients(Attack):
    """Inverting Gradients + BN-statistics prior (``ig-bn``). Parameters:

    * ``iterations`` (2000), ``lr`` (None: 0.1 on pixels with signed Adam, 0.003 on the image prior's
      weights with plain Adam), ``tv`` (1e-2), ``init``/``pattern`` (pixel initialisation),
      ``restarts`` (1), ``layer_weights`` (None), ``muted``, ``labels`` (``"idlg"`` or ``"known"``),
      ``lr_decay`` (True), ``signed`` (True, pixels only), ``threshold`` (None): as for ``ig``;
    * ``bn_prior`` (0.1): weight of Yin et al.'s BN regulariser (0 turns it off);
      ``bn_target`` (``"update"``): ``"update"``, ``"running"`` or ``"victim"`` (module doc);
    * ``features`` (0): weight of seed 004's feature-matching regulariser; ``feature_loss``
      (``"auto"``): ``"match"``, ``"span"`` or ``"auto"``; ``feature_restarts`` (4): L-BFGS starts of
      the feature recovery;
    * ``image_prior`` (False): generate the images with an untrained U-Net; ``prior_width`` (16) its
      channels at full resolution, ``prior_depth`` (2) its convolutions per block.
    """

    name = "ig-bn"
    require_bn = True  # ig-bn is the BN prior: a model without BatchNorm is an error

    def __init__(self, iterations: Count = 2000, lr: Annotated[float | None, ABOVE_ZERO] = None, tv: NonNegative = 1e-2,
                 init: Init = "random", pattern: Count = 2, restarts: Count = 1, layer_weights: LayerWeights = None,
                 muted: Muted = None, labels: Labels = "idlg", lr_decay: bool = True, signed: bool = True,
                 threshold: Threshold = None, bn_prior: NonNegative = 0.1,
                 bn_target: Annotated[str, OneOf(*BN_TARGETS)] = "update", features: NonNegative = 0.0,
                 feature_loss: Annotated[str, OneOf(*FEATURE_LOSSES)] = "auto", feature_restarts: Count = 4,
                 image_prior: bool = False, prior_width: Count = 16, prior_depth: Annotated[int, OneOf(1, 2)] = 2):
        self.iterations, self.lr, self.tv = iterations, None if lr is None else float(lr), float(tv)
        self.init, self.pattern, self.restarts = init, pattern, restarts
        self.layer_weights, self.muted, self.labels = layer_weights, patterns(muted), labels
        self.lr_decay, self.signed = bool(lr_decay), bool(signed)
        self.threshold = None if threshold is None else float(threshold)
        self.bn_prior, self.bn_target = float(bn_prior), bn_target
        self.features, self.feature_loss, self.feature_restarts = float(features), feature_loss, feature_restarts
        self.image_prior, self.prior_width, self.prior_depth = bool(image_prior), prior_width, prior_depth

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        super().validate_config(cfg)
        model = config_model(cfg)  # None when the model is reported elsewhere (or the data are missing here)
        if model is None or not self.bn_prior:
            return
        layers = bn_layers(model)
        if not layers:
            if self.require_bn:
                raise ValueError(f"the BatchNorm-statistics prior (bn_prior = {self.bn_prior}) needs a model with "
                                 f"BatchNorm layers; this model ({type(model).__name__}) has none (use model.norm = "
                                 f"\"batch\", or attack.params.{self.name}.bn_prior = 0, or the attack 'ig')")
            return
        if self.bn_target == "update":
            cumulative = [n for n, m in layers if m.momentum is None]
            if cumulative:
                raise ValueError(f"bn_target = 'update' reads the batch statistics back from the running averages, "
                                 f"which needs a fixed BatchNorm momentum; {cumulative[0]!r} uses a cumulative average")

    # ------------------------------------------------------------------ set-up
    def _bn_setup(self, inp: AttackInput, target: Target, batch: int):
        if not self.bn_prior:
            return None
        probe = inp.global_model()
        if not bn_layers(probe):
            if not self.require_bn:
                return None
            raise ValueError(f"attack.bn_prior={self.bn_prior} needs a model with BatchNorm layers; this model "
                             f"has none (set attack.bn_prior = 0)")
        with torch.no_grad(), BNRecorder(probe) as rec:
            probe.train()
            probe(torch.zeros((batch, *inp.input_shape), device=inp.device))
            counts = dict(rec.counts)
        return bn_targets(inp, probe, self.bn_target, target.steps, counts)

    def _feature_setup(self, inp: AttackInput, target: Target, y: torch.Tensor) -> Features | None:
        if not self.features:
            return None
        w, b = last_linear(target.model)
        params = dict(target.model.named_parameters())
        if w not in target.grads:
            raise ValueError(f"attack.features needs the gradient of the last linear layer {w!r}")
        if b is None or b not in target.grads:
            raise ValueError("attack.features needs a last linear layer with a bias (its gradient fixes the "
                             "features' scale and mixing)")
        return reconstruct_features(params[w], params[b], target.grads[w], target.grads[b], y,
                                    restarts=self.feature_restarts, gen=generator(inp, 0xFEA7))

    # ------------------------------------------------------------------ run
    def run(self, inp: AttackInput) -> AttackResult:
        t0 = time.perf_counter()
        target = prepare_target(inp, self.muted, self.layer_weights)
        n = inp.batch_size
        y = choose_labels(self.labels, target, inp, n)
        bn_t = self._bn_setup(inp, target, n)
        feats = self._feature_setup(inp, target, y)
        form = self.feature_loss
        if feats is not None and form == "auto":
            form = ("match" if feats.separable and feats.residual < 1e-3 else "span") if feats.complete else "off"
        if form == "off":
            feats = None
        best: tuple[float, torch.Tensor, dict] | None = None
        spent = 0
        for attempt in range(self.restarts):
            x, trace = self._attempt(inp, target, y, n, attempt, bn_t, feats, form)
            final = min(trace["loss"]) if trace["loss"] else math.inf
            if trace["converged_at"] is not None:
                trace["converged_at"] += spent
            spent += trace["iterations"]
            if best is None or final < best[0]:
                best = (final, x, trace)
        assert best is not None
        _, x, trace = best
        trace.update(iterations=spent, attempts=self.restarts, fedavg_aware=False,
                     threat_model="curious+victim_bn_stats" if (bn_t is not None and self.bn_target == "victim")
                     else "curious")
        trace["bn_target"] = self.bn_target if bn_t is not None else None
        if self.features:
            trace["feature_loss"] = form
        if feats is not None:
            trace.update(feature_residual=feats.residual, features_separable=feats.separable)
        return finish(x, y, trace, t0)

    def _attempt(self, inp: AttackInput, target: Target, y: torch.Tensor, n: int, attempt: int,
                 bn_t: dict | None, feats: Features | None, form: str) -> tuple[torch.Tensor, dict]:
        gen = generator(inp, attempt)
        model = target.model
        hooks: list[Any] = []
        rec = BNRecorder(model) if bn_t is not None else None
        captured: dict[str, torch.Tensor] = {}
        if feats is not None:
            w_name, _ = last_linear(model)
            fc = model.get_submodule(w_name.rsplit(".", 1)[0]) if "." in w_name else model
            hooks.append(fc.register_forward_pre_hook(lambda _m, a: captured.__setitem__("h", a[0])))
        if self.image_prior:
            prior = FlatParameters(ImagePrior(inp.input_shape, n, gen, width=self.prior_width,
                                              depth=self.prior_depth).to(inp.device))
            # Adam steps the U-Net's weights as one flat tensor (the same arithmetic)
            variables, wrt, lr = [prior.flat], prior.params, self.lr if self.lr is not None else 3e-3
            images, set_grads = prior, prior.set_grad
        else:
            xv = init_dummy(self.init, (n, *inp.input_shape), gen, self.pattern).to(inp.device)
            xv = xv.clamp(0, 1).requires_grad_(True)
            variables, wrt, lr = [xv], [xv], self.lr if self.lr is not None else 0.1

            def images() -> torch.Tensor:
                return xv

            def set_grads(grads: Sequence[torch.Tensor]) -> None:
                xv.grad = grads[0].sign() if self.signed else grads[0]
        opt = torch.optim.Adam(variables, lr=lr)
        milestones = sorted({max(1, int(self.iterations * f)) for f in (3 / 8, 5 / 8, 7 / 8)})
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.1) if self.lr_decay \
            else None
        losses: list[float] = []
        parts = {"grad": 0.0, "tv": 0.0, "bn": 0.0, "feat": 0.0}
        best_x, best_loss = images().detach().clone(), math.inf
        converged_at = None
        try:
            for it in range(self.iterations):
                x = images()
                dist, _ = target.flat_distance(x, y, "cosine")
                terms = {"grad": dist}
                if self.tv:
                    terms["tv"] = self.tv * total_variation(x)
                if rec is not None:
                    terms["bn"] = self.bn_prior * bn_loss(rec.stats, bn_t)
                if feats is not None:
                    h = captured["h"]
                    fl = squared_cosine_loss(h, feats.features) if form == "match" else span_loss(h, feats.basis)
                    terms["feat"] = self.features * fl
                loss = sum(terms.values())
                grads = torch.autograd.grad(loss, wrt)
                value = float(loss.detach())
                if not math.isfinite(value):
                    break
                losses.append(value)
                if value < best_loss:
                    best_x, best_loss = x.detach().clone(), value
                    parts = {k: float(v.detach()) for k, v in terms.items()}
                if self.threshold is not None and converged_at is None and float(dist.detach()) < self.threshold:
                    converged_at = it
                progress.tick(it + 1, self.iterations, distance=float(dist.detach()))
                set_grads(grads)
                opt.step()
                if sched is not None:
                    sched.step()
                if not self.image_prior:
                    with torch.no_grad():
                        xv.clamp_(0, 1)
        finally:
            for hk in hooks:
                hk.remove()
            if rec is not None:
                rec.remove()
        return best_x, {"loss": losses, "iterations": len(losses), "converged_at": converged_at,
                        "loss_terms": parts}


FeatureReconstructionIG = ATTACKS.register(preset(
    RegularisedInvertingGradients, "ig-fr", class_name="FeatureReconstructionIG",
    attrs={"require_bn": False},  # the BN prior applies where the model has BatchNorm layers
    features=0.1, image_prior=True, prior_width=PRIOR_WIDTH, prior_depth=PRIOR_DEPTH,
    doc="""Seed 004's attack (``ig-fr``): a preset of ``ig-bn`` whose defaults turn on seed 004's parts -
    ``features`` (0.1), ``image_prior`` (True; ``prior_width`` 8, ``prior_depth`` 1), the BN prior
    (``bn_prior`` 0.1, ``bn_target="update"``) applied only where the model has BatchNorm layers. Every
    other parameter and default is ``ig-bn``'s. See the module doc."""))
