"""GRNN, the generative regression attack of seed 003 (Ren et al., chapter 3; ACM TIST 2022).

Instead of optimising dummy pixels, GRNN trains a small generator whose output is the dummy batch
(seed 003, section 3.2.2, Figure 3.2, Algorithm 1):

* one Gaussian latent vector ``v`` per image (``latent_dim``, N(0, 1), fixed for the attack);
* **image branch**: a fractionally-strided convolution (``ConvTranspose2d``, kernel 4) turns ``v``
  into 4x4 feature maps, followed by GLU; then upsampling blocks (Table 3.1: nearest-neighbour x2,
  3x3 convolution stride 1 padding 1, BatchNorm, GLU) up to the target resolution; a sigmoid maps the
  last block's output to the data range [0, 1];
* **label branch**: one fully connected layer and a softmax: the soft label of each image;
* **loss** (eq. 3.4): ``MSE(g, g_hat) + WD(g, g_hat) + alpha * TV(x_hat)`` between the observed
  (pseudo-)gradient ``g`` and the gradient ``g_hat`` of the generated batch on the global model.
  ``MSE`` is DLG's squared L2 distance summed over the matched tensors; ``WD`` is the Wasserstein
  distance between the two gradients (see ``wd`` below); ``TV`` the anisotropic total variation;
* the generator's weights are trained with RMSprop (lr 1e-4, momentum 0.99; section 3.3.1).

Resolution: the generator doubles 4 -> 8 -> ... up to the smallest power of two ``S >= max(H, W)``;
a non-power-of-two input (28x28) is the centre ``H x W`` crop of the ``S x S`` output (``fit="crop"``,
the default: the true image seen as padded to 32x32, every pixel the model sees comes straight from
the generator) or an area-resized copy of it (``fit="resize"``).

Widths: the public implementation's plan is ``S * 2^(n-1)`` channels at 4x4 for ``n`` upsampling
blocks after the first, halving per block (128, 64, 32 for 32x32); ``max_width`` caps every level.
The default cap is 16 (16, 16, 16 channels): the paper's text fixes no widths; on the sigmoid LeNet at
batch 8 (40 unseen test images, 3000 steps, inferred labels) caps of 32, 16 and 8 recovered 0.35, 0.38
and 0.23 of the images with SSIM >= 0.9 at 4.0x, 2.7x and 2.5x the floor's time per evaluation
(docs/benchmarks.md); the cap was 32 before (measured then: as many images at batch 8 as the public
plan, ``max_width=512``, at a fraction of the CPU time).

Cost per step (profiled, docs/benchmarks.md): the gradient matching is the floor's work; on top come
the generator's forward and backward, the RMSprop step over the generator's weights, the sort of the
Wasserstein term and the TV term. What makes them cheap without changing what is computed (equal up to
float rounding): the fixed target gradient is sorted once per attempt, the dummy gradient's order
comes from NumPy's argsort on the CPU (:func:`sort_last`), the stem is one matrix product, the last
upsampling block (2 output channels) runs in the sub-pixel form
(:func:`attacks.grnn_generator.upsample_conv`; the generator is in :mod:`attacks.grnn_generator`), RMSprop
steps the weights as one flat tensor whose memory the generator's parameters share
(:class:`attacks._common.FlatParameters`), and the MSE and Wasserstein terms are computed on the
gradients as one flat vector (:func:`grnn_loss`).

Labels: ``labels="idlg"`` (the default) fixes the labels inferred from the gradient
(:mod:`attacks.labels`: exact at batch 1, class counts above) and leaves the label branch unused;
``"generated"`` (the paper) takes the argmax of the label branch; ``"known"`` the threat model's labels.
Inferred labels are the stronger choice an attacker can make from what it sees (measured at batch 8,
3 victims: label accuracy 1.0 inferred vs 0.92 generated; on benchmarks/attack_strength.py's 5 victims
both 0.975, as DLG's).

Deviations from the paper, all measured (docs/benchmarks.md "Attack strength"): the label mode and
the width cap above; ``wd="w2"`` is the 1-D Wasserstein-2 distance between the entries of the two
gradients (what the paper names), whereas the public code computes ``||g - g_hat||_2`` under that name
(``wd="l2norm"``); RMSprop (lr 1e-4, momentum 0.99), alpha = 1e-3 and the loss are the paper's.
Multi-step updates: the pseudo-gradient (average of the local steps) is matched, or with
``fedavg_aware=True`` the local steps are replayed on ``num_examples`` generated images.
"""
from __future__ import annotations

import math
import time
from typing import Annotated, Sequence

import numpy as np
import torch

from fedsim import progress
from fedsim.params import OneOf, Range
from fedsim.protocol import LR

from ._common import (
    Count,
    FlatParameters,
    LayerWeights,
    Muted,
    NonNegative,
    Positive,
    RestartLog,
    Target,
    Threshold,
    choose_labels,
    finish,
    finish_group,
    generator,
    patterns,
    prepare_target,
)
from .base import Attack, AttackInput, AttackResult, register
from .gradients import assumed_schedule, flatten_gradients, simulate_update, vector_distance
from .grnn_generator import GRNNGenerator, build_generator
from .inverting import total_variation, tv_stacked

LABEL_MODES = ("generated", "idlg", "known")
WD_MODES = ("w1", "w2", "l2norm", "none")
FITS = ("crop", "resize")


# ---------------------------------------------------------------- the loss
def sort_last(a: torch.Tensor) -> torch.Tensor:
    """``torch.sort(a, dim=-1).values``, differentiable (the gradient flows to the entries' sorted places).
    On the CPU the order comes from NumPy's ``argsort`` (SIMD quicksort: 0.4 ms for GRNN's 13,426 LeNet
    gradient entries vs torch.sort's 1.4 ms on one core); the sorted values are the same, and so is the
    gradient except between exactly equal entries (which of them takes which place)."""
    if a.device.type != "cpu" or a.dtype not in (torch.float32, torch.float64):
        return torch.sort(a, dim=-1).values
    order = torch.from_numpy(np.argsort(a.detach().numpy(), axis=-1))
    return a.gather(-1, order)


def wasserstein(a: torch.Tensor, b: torch.Tensor, mode: str, b_sorted: bool = False) -> torch.Tensor:
    """Distance between two flat gradient vectors ``(..., n)`` (batched over leading dimensions).

    ``w1``/``w2``: the 1-D Wasserstein-1/-2 distance between the empirical distributions of their
    entries (sort both, compare quantiles: ``mean |a_(i) - b_(i)|`` resp. its root-mean-square);
    ``l2norm``: ``||a - b||_2``, the quantity the public GRNN code computes under the name
    "wasserstein_distance"; ``none``: 0. ``b_sorted``: ``b`` is already sorted along its last dimension
    (the target gradient is fixed, so an attack sorts it once).
    """
    if mode == "l2norm":
        return (a - b).pow(2).sum(-1).clamp_min(1e-30).sqrt()
    if mode == "none":
        return a.new_zeros(a.shape[:-1])
    sa, sb = sort_last(a), (b if b_sorted else sort_last(b))
    if mode == "w1":
        return (sa - sb).abs().mean(-1)
    return (sa - sb).pow(2).mean(-1).clamp_min(1e-30).sqrt()


def sorted_target(target: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor | None, wd: str,
                  stacked: bool = False) -> torch.Tensor | None:
    """The target gradient as :func:`grnn_loss`'s Wasserstein term compares it, sorted once (None where
    the term sorts nothing)."""
    if wd not in ("w1", "w2"):
        return None
    return torch.sort(flatten_gradients([t.detach() for t in target], weights, stacked), dim=-1).values


def grnn_loss(dummy: Sequence[torch.Tensor], target: Sequence[torch.Tensor],
              weights: Sequence[float] | torch.Tensor | None, wd: str,
              stacked: bool = False, target_sorted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(MSE + WD, MSE)`` between two gradient lists (``MSE``: the weighted squared L2 distance).

    ``stacked``: every tensor has a leading victim dimension ``A`` and ``weights`` is ``(A, L)`` or None;
    the result is then ``(A,)``. Layer weights scale the squared distance of their tensor and, by their
    square root, its entries in the Wasserstein term. Both terms are computed on the flat gradients
    (:func:`attacks.gradients.flatten_gradients`: the same values up to float rounding, a few operations
    instead of a few per tensor). ``target_sorted``: :func:`sorted_target` of ``target`` (saves sorting
    the fixed target at every step; the result is the same).
    """
    fd, ft = flatten_gradients(dummy, weights, stacked), flatten_gradients(target, weights, stacked)
    mse = vector_distance(fd, ft)  # the weighted squared distance, on the flat vectors
    if wd == "none":
        return mse, mse
    if target_sorted is not None and wd in ("w1", "w2"):
        return mse + wasserstein(fd, target_sorted, wd, b_sorted=True), mse
    return mse + wasserstein(fd, ft, wd), mse


def tv_loss(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic total variation (:func:`attacks.inverting.total_variation`) of a batch ``(B, C, H, W)``,
    or per victim of a stack ``(A, B, C, H, W)``."""
    return total_variation(x) if x.dim() == 4 else tv_stacked(x)


# ---------------------------------------------------------------- the attack
@register
class GRNN(Attack):
    """GRNN. Parameters (defaults: the strongest measured setting, see the module doc):

    * ``iterations`` (3000): RMSprop steps on the generator per attempt;
    * ``lr`` (1e-4), ``momentum`` (0.99): RMSprop, the paper's settings (3e-4 and 1e-3 measured worse);
    * ``tv`` (1e-3): weight alpha of the total-variation term (the paper: 1e-3 for LeNet, 1e-6 for
      ResNet-18);
    * ``wd`` (``"w2"``): the Wasserstein term, see :func:`wasserstein`;
    * ``latent_dim`` (128), ``max_width`` (16): generator size; ``fit`` (``"crop"``): non-power-of-two
      resolutions, see the module doc;
    * ``labels`` (``"idlg"``): see the module doc;
    * ``muted``, ``layer_weights``: as for the other attacks;
    * ``threshold`` (1e-4): squared gradient distance under which an attempt counts as converged;
      ``restarts`` (1): attempts with fresh generators and latents (each of ``iterations`` steps) while
      no attempt has converged; the attempt with the lowest final loss is returned;
    * ``fedavg_aware`` (False): replay the recipe's local SGD steps on ``num_examples`` generated
      images and match the simulated update (as Inverting Gradients' option).
    """

    name = "grnn"

    def __init__(self, iterations: Count = 3000, lr: Positive = 1e-4,
                 momentum: Annotated[float, Range(0, 1, open_high=True)] = 0.99, tv: NonNegative = 1e-3,
                 wd: Annotated[str, OneOf(*WD_MODES)] = "w2", latent_dim: Count = 128,
                 max_width: Annotated[int, Range(2)] = 16, fit: Annotated[str, OneOf(*FITS)] = "crop",
                 labels: Annotated[str, OneOf(*LABEL_MODES)] = "idlg", muted: Muted = None,
                 layer_weights: LayerWeights = None, threshold: Threshold = 1e-4, restarts: Count = 1,
                 fedavg_aware: bool = False):
        self.iterations, self.lr, self.momentum, self.tv = iterations, float(lr), float(momentum), float(tv)
        self.wd, self.latent_dim, self.max_width, self.fit = wd, latent_dim, max_width, fit
        self.labels, self.muted, self.layer_weights = labels, patterns(muted), layer_weights
        self.threshold = None if threshold is None else float(threshold)
        self.restarts, self.fedavg_aware = restarts, bool(fedavg_aware)

    def run(self, inp: AttackInput) -> AttackResult:
        t0 = time.perf_counter()
        target = prepare_target(inp, self.muted, self.layer_weights)
        n = int(inp.num_examples) if self.fedavg_aware else inp.batch_size
        y_fixed = None if self.labels == "generated" else choose_labels(self.labels, target, inp, n)
        log = RestartLog()
        for attempt in range(self.restarts):
            log.add(*self._attempt(inp, target, y_fixed, n, attempt))
            if log.done:
                break
        x, labels, trace = log.result(labels_mode=self.labels, fedavg_aware=self.fedavg_aware)
        return finish(x, labels, trace, t0)

    def _start(self, inp: AttackInput, n: int, attempt: int) -> tuple[GRNNGenerator, torch.Tensor]:
        """The attempt's generator and latents, drawn from the attacker's seed."""
        rng = generator(inp, 0x6E4 + attempt)
        gen = build_generator(self.latent_dim, inp.num_classes, inp.input_shape, rng, inp.device,
                              self.max_width, self.fit)
        z = torch.randn((n, self.latent_dim), generator=rng).to(inp.device)
        return gen, z

    def _gradient_loss(self, target: Target, x: torch.Tensor, y: torch.Tensor,
                       tsorted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fedavg_aware:
            grads, _ = target.dummy_gradients(x, y)
            return grnn_loss(grads, target.matched_grads, target.weights, self.wd, target_sorted=tsorted)
        schedule = assumed_schedule(len(x), target.recipe)
        lr = float(target.recipe[LR])
        scale = -1.0 / (lr * len(schedule))
        sim = simulate_update(target.model, x, y, lr, schedule, names=target.matched)
        return grnn_loss([sim[n] * scale for n in target.matched],
                         [target.update[n] * scale for n in target.matched], target.weights, self.wd)

    def _attempt(self, inp: AttackInput, target: Target, y_fixed: torch.Tensor | None, n: int,
                 attempt: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        module, z = self._start(inp, n, attempt)
        # with fixed labels the label branch is unused; RMSprop steps the weights as one flat tensor
        gen = FlatParameters(module, lambda name: y_fixed is None or not name.startswith("label."))
        opt = torch.optim.RMSprop([gen.flat], lr=self.lr, momentum=self.momentum)
        tsorted = None if self.fedavg_aware else sorted_target(target.matched_grads, target.weights, self.wd)
        losses: list[float] = []
        best_x, best_y, best_loss = None, None, math.inf
        converged_at = None
        for it in range(self.iterations):
            x, yp = gen(z)
            y = yp if y_fixed is None else y_fixed
            gl, mse = self._gradient_loss(target, x, y, tsorted)
            loss = gl + self.tv * tv_loss(x) if self.tv else gl
            value = float(loss.detach())
            if not math.isfinite(value):
                break
            losses.append(value)
            if value < best_loss:
                best_loss = value
                best_x = x.detach().clone()
                best_y = (yp.detach().argmax(-1) if y_fixed is None else y_fixed).clone()
            if self.threshold is not None and converged_at is None and float(mse.detach()) < self.threshold:
                converged_at = it
            progress.tick(it + 1, self.iterations, distance=float(mse.detach()))
            gen.set_grad(torch.autograd.grad(loss, gen.params))
            opt.step()
        if best_x is None:  # diverged at once: the initial generator output
            with torch.no_grad():
                x, yp = gen(z)
            best_x, best_y = x, (yp.argmax(-1) if y_fixed is None else y_fixed)
        return best_x, best_y, {"loss": losses, "iterations": len(losses), "converged_at": converged_at}

    # ---- several victims at once (attacks.batched) ----
    def batchable(self) -> bool:
        return not self.fedavg_aware  # the replay of local steps is not stacked

    STACK_MAX_BATCH = 4  # measured: stacking gains 1.3x at batch 1, loses at batch 8 (0.77x; docs/benchmarks.md)

    def run_group(self, inputs: Sequence[AttackInput]) -> list[AttackResult]:
        from .batched import StackedTarget

        if inputs[0].batch_size > self.STACK_MAX_BATCH:  # the generators' own work dominates: one by one
            return [self.run(inp) for inp in inputs]
        t0 = time.perf_counter()
        st = StackedTarget.build(inputs, self.muted, self.layer_weights)
        n = inputs[0].batch_size
        y_fixed = None if self.labels == "generated" else \
            [choose_labels(self.labels, t, inp, n) for t, inp in zip(st.targets, inputs)]
        logs = [RestartLog() for _ in inputs]
        for attempt in range(self.restarts):
            todo = [v for v, log in enumerate(logs) if not log.done]
            if not todo:
                break
            for v, res in zip(todo, self._attempt_group(inputs, st, y_fixed, n, attempt, todo)):
                logs[v].add(*res)
        out = [log.result(labels_mode=self.labels, fedavg_aware=False) for log in logs]
        return finish_group([o[0] for o in out], [o[1] for o in out], [o[2] for o in out], t0)

    def _attempt_group(self, inputs: Sequence[AttackInput], st, y_fixed: list[torch.Tensor] | None, n: int,
                       attempt: int, todo: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
        """One attempt for the victims ``todo``: each victim has its own generator (evaluated one after
        the other: a generator's convolutions are compute-bound, stacking them with ``vmap`` measured
        slower on the CPU); their outputs are stacked for one gradient-matching pass over all victims,
        and one RMSprop over all generators' weights updates each as it would alone (element-wise)."""
        from .batched import stack_tick

        dev = inputs[0].device
        starts = [self._start(inputs[v], n, attempt) for v in todo]
        fixed = torch.stack([y_fixed[v] for v in todo]).to(dev) if y_fixed is not None else None
        params = [p for g, _ in starts for name, p in g.named_parameters()
                  if fixed is None or not name.startswith("label.")]
        opt = torch.optim.RMSprop(params, lr=self.lr, momentum=self.momentum, foreach=True)
        victims = torch.tensor(todo, dtype=torch.long, device=dev)
        target, weights = st.select(victims)
        tsorted = sorted_target(target, weights, self.wd, stacked=True)

        def generate() -> tuple[torch.Tensor, torch.Tensor]:
            outs = [g(z) for g, z in starts]
            return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])

        A = len(todo)
        losses: list[list[float]] = [[] for _ in todo]
        best_loss = [math.inf] * A
        best_x = [torch.empty(0)] * A
        best_y = [torch.empty(0)] * A
        converged: list[int | None] = [None] * A
        alive = [True] * A
        for it in range(self.iterations):
            x, yp = generate()
            y = yp if fixed is None else fixed
            grads, _ = st.dummy_gradients(x, y)
            gl, mse = grnn_loss(grads, target, weights, self.wd, stacked=True, target_sorted=tsorted)
            loss = gl + self.tv * tv_loss(x) if self.tv else gl
            lv, mv = loss.detach().tolist(), mse.detach().tolist()
            for j in range(A):
                if not alive[j]:
                    continue
                if not math.isfinite(lv[j]):  # as run(): this victim's attempt ends here
                    alive[j] = False
                    continue
                losses[j].append(lv[j])
                if lv[j] < best_loss[j]:
                    best_loss[j] = lv[j]
                    best_x[j] = x[j].detach().clone()
                    best_y[j] = (yp[j].detach().argmax(-1) if fixed is None else fixed[j]).clone()
                if self.threshold is not None and converged[j] is None and mv[j] < self.threshold:
                    converged[j] = it
            if not any(alive):
                break
            stack_tick(it + 1, self.iterations, [m for m, a in zip(mv, alive) if a], sum(alive), A)
            keep = torch.tensor(alive, device=dev).float()
            grads_g = torch.autograd.grad((loss.nan_to_num(0.0) * keep).sum(), params)
            for p, g in zip(params, grads_g):
                p.grad = g
            opt.step()
        out = []
        for j in range(A):
            if not losses[j]:  # diverged at once: the initial output
                with torch.no_grad():
                    x0, y0 = starts[j][0](starts[j][1])
                best_x[j], best_y[j] = x0, (y0.argmax(-1) if fixed is None else fixed[j])
            out.append((best_x[j], best_y[j], {"loss": losses[j], "iterations": len(losses[j]),
                                               "converged_at": converged[j]}))
        return out
