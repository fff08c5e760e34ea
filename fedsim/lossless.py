"""Seed 002's accuracy-lossless model perturbation (Yang et al., WWW 2022) for fully connected ReLU nets.

The honest server hides the global model from honest-but-curious clients with one-time secret noise,
the clients train on the perturbed model and send back their perturbed gradient plus a few noise terms,
and the server removes the noise from the *aggregate* with its secrets, obtaining exactly the true
aggregated gradient (Theorems 1-3). Nothing here knows about Flower; see ``docs/lossless.md`` for the
reconstructed equations, the protocol messages and the measured results.

Network (eq. 3, with biases): ``L`` layers ``(W^(l), b^(l))``, ``y^(l) = act(W^(l) y^(l-1) + b^(l))``
for ``l < L`` with ``act`` = ReLU (or LeakyReLU: all Theorem 1 needs is ``act(r z) = r act(z)`` for
``r > 0``), ``y^(L) = W^(L) y^(L-1) + b^(L)``. A bias is treated as one more column of ``W`` whose input
is the constant 1 (never scaled).

Server secrets of one round (:func:`draw_secrets`): positive vectors ``r^(l)`` (``l < L``), a partition
``I_1..I_m`` of the ``n_L`` outputs and one ``gamma_s`` per group (``gamma_i = gamma_s`` for ``i in I_s``).
Public: the additive vector ``r^(a)`` (pairwise distinct, non-zero) and the partition.

Perturbation (eq. 7-9), :func:`perturb`::

    W^(1)^ = r^(1)_i W_ij                         b^(1)^ = r^(1)_i b_i
    W^(l)^ = r^(l)_i / r^(l-1)_j W_ij   (1<l<L)    b^(l)^ = r^(l)_i b_i
    W^(L)^ = W_ij / r^(L-1)_j + gamma_i r^(a)_i    b^(L)^ = b_i + gamma_i r^(a)_i

Theorem 1: ``y^(l)^ = r^(l) o y^(l)`` for hidden layers and ``y^(L)^ = y^(L) + alpha r`` with
``r = gamma o r^(a)`` and ``alpha = sum_j y^(L-1)^_j (+1 for the bias column)``, which the client can
compute (``alpha >= 1`` with a ReLU and a last-layer bias).

Theorem 2 (MSE ``L = 1/2 ||y^ - t||^2``), per example and layer, with ``g^ = y^(L)^ - t``::

    dL^/dW^ = (1/R) o dL/dW + sum_i r_i sigma_i - v beta,    v = r.r
    sigma_i = alpha d y^(L)^_i/dW^ + g^_i d alpha/dW^,      beta = alpha d alpha/dW^

Proof: ``g^ = g + alpha r`` and ``dy^/dW^ = dy/dW^ + r dalpha/dW^``, so ``g^.dy^/dW^ = g.dy/dW^ +
alpha r.dy^/dW^ + (g^.r - alpha v) dalpha/dW^``, and ``g.dy/dW^ = (1/R) o dL/dW`` because ``W`` is an
element-wise affine function of ``W^`` with slope ``1/R``. The client sends the batch means of
``dL^/dW^``, of ``sigma~_s = sum_{i in I_s} r^(a)_i sigma_i`` (``s = 1..m``) and of ``beta``
(:func:`client_terms`); each ``sigma~_s`` is the gradient of the scalar
``mean_b[ sg(alpha_b) sum_{i in I_s} r^(a)_i y^_bi + sg(sum_{i in I_s} r^(a)_i g^_bi) alpha_b ]`` and
``beta`` that of ``mean_b alpha_b^2 / 2`` (``sg`` = stop-gradient), so one ordinary backward pass each.

Recovery (eq. 14-15, Theorem 3), :func:`recover`, for the example-weighted means over clients::

    grad W = R o ( grad^ - sum_s gamma_s sigma~_s + v beta )

which is exact because every term is linear in the per-client means and the secrets are shared by all
clients of the round.

Softmax cross-entropy. With ``L^ = CE(y^, t)`` the client's logit gradient is
``softmax(y + alpha r) - t`` instead of ``softmax(y) - t``: a transcendental function of the secret
``r``. For ``r`` not proportional to the all-ones vector the true aggregate cannot be recovered from
batch aggregates of fixed size (see ``docs/lossless.md``: as a function of ``gamma`` the true
last-layer gradient is a sum of per-example logistic functions with distinct poles, so any exact
formula must see per-example data), and :func:`client_terms` refuses that configuration. The one exact
configuration is the uniform shift (``draw_secrets(..., mode="shift")``: ``m = 1``, ``r^(a) = 1``):
softmax is shift invariant and ``(softmax - t).1 = 0``, so ``dL^/dW^ = (1/R) o dL/dW`` with no noise
terms at all - but then the client sees the true predicted probabilities (no prediction privacy; the
weights and hidden activations stay perturbed).

Numerics: the noise terms are large and cancel in :func:`recover`; use float64 end to end (the default
dtype of the secrets; the perturbed weights come out in that dtype). Recovery is exact only for
FedSGD (one gradient per client per round at the broadcast ``W^``; several mini-batches at the same
``W^`` may be averaged): a local SGD step on ``W^`` leaves the perturbed parameterisation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

Layer = tuple[torch.Tensor, "torch.Tensor | None"]  # (weight (n_out, n_in), bias (n_out,) or None)
LOSSES = ("mse", "cross_entropy")
MODES = ("paper", "shift")

__all__ = [
    "ClientTerms", "FCSpec", "LOSSES", "Layer", "MODES", "PublicNoise", "Secrets", "aggregate",
    "check_supported", "client_terms", "draw_secrets", "fc_spec", "forward", "get_layers", "layer_shapes",
    "perturb", "recover", "set_layers", "sgd_step", "true_gradients",
]


# ----------------------------------------------------------------------------------- supported models
@dataclass(frozen=True)
class FCSpec:
    """A supported model: state-dict names of each layer's (weight, bias or None) and the activation."""

    names: tuple[tuple[str, str | None], ...]
    negative_slope: float  # 0.0 = ReLU; LeakyReLU's slope otherwise
    shapes: tuple[tuple[int, int], ...]


_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)
_CONV_TYPES = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
               nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)


def _leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if not list(m.children())]


def fc_spec(model: nn.Module) -> FCSpec:
    """Check that ``model`` is a chain ``[Flatten] Linear act Linear act ... Linear`` with ReLU (or
    LeakyReLU, one slope) activations and return its layer names; raise ``ValueError`` saying why not.

    The check looks at the leaf modules in registration order, then runs the model on a random probe
    and compares it with :func:`forward` on the extracted layers, which catches forwards that do not
    follow the registration order (skip connections, custom reshapes).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"lossless perturbation needs a torch nn.Module, got {type(model).__name__}")
    leaves = [(n or "<model>", m) for n, m in _leaf_modules(model)]
    linears: list[tuple[str, nn.Linear]] = []
    slopes: list[float] = []
    expect_act = False
    for name, mod in leaves:
        if isinstance(mod, nn.Linear):
            if expect_act:
                raise ValueError(f"model is not supported by lossless perturbation: Linear '{name}' follows "
                                 f"Linear '{linears[-1][0]}' without a ReLU in between")
            linears.append((name, mod))
            expect_act = True
        elif isinstance(mod, (nn.ReLU, nn.LeakyReLU)):
            if not expect_act:
                raise ValueError(f"model is not supported by lossless perturbation: activation '{name}' is not "
                                 "directly after a Linear layer")
            slopes.append(float(mod.negative_slope) if isinstance(mod, nn.LeakyReLU) else 0.0)
            expect_act = False
        elif isinstance(mod, nn.Flatten):
            if linears:
                raise ValueError(f"model is not supported by lossless perturbation: Flatten '{name}' after the "
                                 "first Linear layer")
        elif isinstance(mod, nn.Identity) or (isinstance(mod, nn.Dropout) and mod.p == 0):
            continue
        elif isinstance(mod, _CONV_TYPES):
            raise ValueError(f"model is not supported by lossless perturbation: {type(mod).__name__} '{name}'; "
                             "only fully connected nn.Linear layers are (the noise of eq. 7-9 is defined "
                             "for fully connected ReLU networks)")
        elif isinstance(mod, _NORM_TYPES):
            raise ValueError(f"model is not supported by lossless perturbation: {type(mod).__name__} '{name}' "
                             "normalises away the per-unit scaling r^(l) (Theorem 1 needs every hidden "
                             "layer to commute with positive per-unit scaling)")
        elif isinstance(mod, nn.Dropout):
            raise ValueError(f"model is not supported by lossless perturbation: Dropout '{name}' with "
                             f"p={mod.p} (random masks are not part of the client computation)")
        else:
            raise ValueError(f"model is not supported by lossless perturbation: {type(mod).__name__} '{name}' "
                             "is not positively homogeneous (Theorem 1 needs act(r z) = r act(z) for r > 0: "
                             "only ReLU and LeakyReLU)")
    if not linears:
        raise ValueError("model is not supported by lossless perturbation: it has no nn.Linear layer")
    if not expect_act:
        raise ValueError("model is not supported by lossless perturbation: its output passes through an "
                         "activation; the last layer must be a plain Linear (eq. 3)")
    if len(set(slopes)) > 1:
        raise ValueError(f"model is not supported by lossless perturbation: mixed activation slopes {slopes}")
    own = {id(p) for _, m in linears for p in m.parameters()}
    stray = [n for n, p in model.named_parameters() if id(p) not in own]
    if stray:
        raise ValueError(f"model is not supported by lossless perturbation: parameters outside its Linear "
                         f"layers: {stray}")
    prefix = {id(m): n for n, m in model.named_modules()}
    names = tuple((f"{prefix[id(m)]}.weight".lstrip("."), f"{prefix[id(m)]}.bias".lstrip(".")
                   if m.bias is not None else None) for _, m in linears)
    shapes = tuple((int(m.out_features), int(m.in_features)) for _, m in linears)
    for k in range(1, len(shapes)):
        if shapes[k][1] != shapes[k - 1][0]:
            raise ValueError(f"model is not supported by lossless perturbation: Linear '{linears[k][0]}' takes "
                             f"{shapes[k][1]} inputs but the previous layer gives {shapes[k - 1][0]}")
    spec = FCSpec(names, slopes[0] if slopes else 0.0, shapes)
    _probe(model, spec)
    return spec


def _probe(model: nn.Module, spec: FCSpec) -> None:
    p = next(model.parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn((4, spec.shapes[0][1]), generator=gen, dtype=torch.float64).to(p.device, p.dtype)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            got = model(x)
    except Exception as e:  # noqa: BLE001 - any failure means the forward is not the plain chain
        raise ValueError(f"model is not supported by lossless perturbation: its forward fails on flat inputs "
                         f"of {spec.shapes[0][1]} features ({type(e).__name__}: {e})") from e
    finally:
        model.train(was_training)
    want, _ = forward(get_layers(model, spec), x, negative_slope=spec.negative_slope)
    if got.shape != want.shape or not torch.allclose(got.to(want.dtype), want, rtol=1e-4, atol=1e-5):
        raise ValueError("model is not supported by lossless perturbation: its forward is not the plain chain "
                         "Linear-act-...-Linear of its layers (skip connection or custom forward?)")


def check_supported(model: nn.Module) -> FCSpec:
    """Alias of :func:`fc_spec`: return the spec of a supported model, raise ``ValueError`` otherwise."""
    return fc_spec(model)


def get_layers(model: nn.Module, spec: FCSpec | None = None, dtype: torch.dtype | None = None) -> list[Layer]:
    """Detached copies of the model's ``(weight, bias)`` pairs (in ``dtype`` when given)."""
    spec = spec or fc_spec(model)
    sd = dict(model.named_parameters())
    out: list[Layer] = []
    for wn, bn in spec.names:
        w = sd[wn].detach().clone()
        b = sd[bn].detach().clone() if bn is not None else None
        if dtype is not None:
            w = w.to(dtype)
            b = b.to(dtype) if b is not None else None
        out.append((w, b))
    return out


def set_layers(model: nn.Module, layers: Sequence[Layer], spec: FCSpec | None = None) -> None:
    """Copy ``layers`` into the model's parameters (cast to their dtype)."""
    spec = spec or fc_spec(model)
    sd = dict(model.named_parameters())
    with torch.no_grad():
        for (wn, bn), (w, b) in zip(spec.names, layers, strict=True):
            sd[wn].copy_(w.to(sd[wn].dtype))
            if bn is not None:
                sd[bn].copy_(b.to(sd[bn].dtype))


def layer_shapes(layers: Sequence[Layer]) -> list[tuple[int, int]]:
    return [(int(w.shape[0]), int(w.shape[1])) for w, _ in layers]


# ----------------------------------------------------------------------------------------- network
def forward(layers: Sequence[Layer], x: torch.Tensor, *,
            negative_slope: float = 0.0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output of the FC network (eq. 3/10) and the hidden-layer outputs ``y^(1..L-1)``.

    ``x`` is flattened to ``(B, n_0)`` and cast to the layers' dtype.
    """
    h = x.reshape(len(x), -1).to(layers[0][0].dtype)
    hidden: list[torch.Tensor] = []
    L = len(layers)
    for k, (w, b) in enumerate(layers):
        z = F.linear(h, w, b)
        if k == L - 1:
            return z, hidden
        h = F.leaky_relu(z, negative_slope) if negative_slope else F.relu(z)
        hidden.append(h)
    raise ValueError("forward needs at least one layer")


def _alpha(layers: Sequence[Layer], x_flat: torch.Tensor, hidden: Sequence[torch.Tensor]) -> torch.Tensor:
    """``alpha`` of Theorem 1: the sum of the last layer's inputs, +1 for its bias column."""
    u = hidden[-1] if hidden else x_flat
    a = u.sum(1)
    return a + 1.0 if layers[-1][1] is not None else a


# ----------------------------------------------------------------------------------------- secrets
@dataclass(frozen=True)
class PublicNoise:
    """What the server sends along with the perturbed model (not secret).

    ``r_a``: the additive vector ``r^(a)``, shape ``(n_L,)``; ``groups``: int64 ``(n_L,)``, the group
    ``s`` in ``[0, m)`` of every output (the partition ``I_1..I_m``, which the client needs to form
    ``sigma~_s``).
    """

    r_a: torch.Tensor
    groups: torch.Tensor

    @property
    def num_groups(self) -> int:
        return int(self.groups.max()) + 1

    @property
    def shift_invariant(self) -> bool:
        """True when the additive output noise is a uniform shift (``m = 1`` and ``r^(a)`` constant)."""
        return self.num_groups == 1 and bool((self.r_a == self.r_a[0]).all())

    def to_arrays(self) -> list[np.ndarray]:
        return [self.r_a.detach().cpu().numpy().copy(), self.groups.detach().cpu().numpy().copy()]

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray]) -> PublicNoise:
        r_a, groups = arrays
        return cls(torch.as_tensor(np.asarray(r_a)).clone(), torch.as_tensor(np.asarray(groups)).long().clone())


@dataclass(frozen=True)
class Secrets:
    """The server's one-time noise of one round. Never send this object (only ``public``)."""

    r: tuple[torch.Tensor, ...]  # r^(1..L-1), positive, shapes (n_l,)
    gamma: torch.Tensor  # (m,) gamma_{I_s}
    public: PublicNoise

    @property
    def num_groups(self) -> int:
        return int(self.gamma.numel())

    @property
    def r_out(self) -> torch.Tensor:
        """The vector ``r = gamma o r^(a)`` of Theorem 1, shape ``(n_L,)``."""
        return self.gamma[self.public.groups] * self.public.r_a

    @property
    def v(self) -> torch.Tensor:
        r = self.r_out
        return (r * r).sum()

    def scale(self, layer: int, num_layers: int, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Multiplicative noise ``R^(l)`` of eq. 8 for the weight ``(n_l, n_{l-1})`` and the bias ``(n_l,)``."""
        n_out, n_in = shape
        dt = self.gamma.dtype
        row = self.r[layer] if layer < num_layers - 1 else torch.ones(n_out, dtype=dt)
        col = 1.0 / self.r[layer - 1] if layer > 0 else torch.ones(n_in, dtype=dt)
        return row[:, None] * col[None, :], row


# bounds of the noise ranges (multiplicative, gamma, additive): each end in [1e-6, 1e6] and high / low at
# most 1e6. The recovery's float64 error grows with (high / low)^2 (docs/lossless.md "Numerics": 1e-5
# relative at [1e-3, 1e3]); far outside, the perturbed model overflows float32 on its way to the clients
RANGE_BOUNDS = (1e-6, 1e6)
MAX_RANGE_RATIO = 1e6


def check_range(key: str, value: Any) -> tuple[float, float]:
    """A noise range ``[low, high]`` as floats; ValueError naming ``key`` unless finite, positive,
    ``low <= high``, within :data:`RANGE_BOUNDS` and ``high / low <=`` :data:`MAX_RANGE_RATIO`."""
    ok = (isinstance(value, (tuple, list)) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))
    if not ok or not (0 < value[0] <= value[1]):
        raise ValueError(f"{key} must be a pair [low, high] of finite numbers with 0 < low <= high, got {value!r}")
    lo, hi = float(value[0]), float(value[1])
    if lo < RANGE_BOUNDS[0] or hi > RANGE_BOUNDS[1] or hi / lo > MAX_RANGE_RATIO:
        raise ValueError(f"{key} must lie in [{RANGE_BOUNDS[0]:g}, {RANGE_BOUNDS[1]:g}] with high / low <= "
                         f"{MAX_RANGE_RATIO:g} (the recovery's float64 error grows with (high / low)^2; "
                         f"docs/lossless.md), got {value!r}")
    return lo, hi


def _log_uniform(n: int, lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))


def _signs(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1


def draw_secrets(shapes: Sequence[tuple[int, int]], m: int, generator: torch.Generator, *,
                 multiplicative: tuple[float, float] = (0.1, 10.0), gamma: tuple[float, float] = (0.1, 10.0),
                 additive: tuple[float, float] = (0.5, 1.5), mode: str = "paper",
                 dtype: torch.dtype = torch.float64) -> Secrets:
    """Draw one round's secrets for a network with weight shapes ``shapes`` ((n_l, n_{l-1}) per layer).

    * ``r^(l)_i`` (``l < L``) ~ log-uniform on ``multiplicative`` (default [0.1, 10]): positive as
      Theorem 1 requires; log-uniform so that a unit is as likely to be shrunk as grown by any factor.
      The paper allows arbitrarily large values; the range trades hiding of per-unit scale against the
      float64 cancellation in :func:`recover` (error grows with ``(max r / min r)^2``, measured in
      ``docs/lossless.md``).
    * partition: the ``n_L`` outputs are randomly permuted and cut into ``m`` groups of (almost) equal
      size; ``m`` trades prediction privacy (Theorem 5: a client guesses the arg-max with probability
      <= 1/m) against upload size (``m`` extra gradient-sized terms).
    * ``gamma_s`` = random sign x log-uniform on ``gamma`` (default [0.1, 10]).
    * ``r^(a)_i`` = random sign x uniform on ``additive`` (default [0.5, 1.5]), redrawn until its
      components are pairwise distinct (paper, §4.1) and non-zero.

    ``mode="shift"`` (needed for cross-entropy): ``m`` must be 1 and ``r^(a)`` is all ones, so the output
    noise is a uniform shift ``alpha gamma 1`` that softmax ignores (see the module docstring).
    The draw uses only ``generator`` (CPU), so the same seed gives the same secrets.
    """
    if mode not in MODES:
        raise ValueError(f"lossless.mode must be one of {list(MODES)}, got {mode!r}")
    shapes = [(int(a), int(b)) for a, b in shapes]
    if not shapes:
        raise ValueError("lossless perturbation needs at least one layer shape")
    for k in range(1, len(shapes)):
        if shapes[k][1] != shapes[k - 1][0]:
            raise ValueError(f"layer {k} takes {shapes[k][1]} inputs but layer {k - 1} gives {shapes[k - 1][0]}")
    n_out = shapes[-1][0]
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= n_out:
        raise ValueError(f"lossless.groups (m) must be an integer in [1, {n_out}] (the number of outputs), "
                         f"got {m!r}")
    if mode == "shift" and m != 1:
        raise ValueError(f"lossless.groups (m) must be 1 with mode='shift', got {m}")
    if not isinstance(generator, torch.Generator):
        raise ValueError("draw_secrets needs a torch.Generator (explicit seeding)")
    mlo, mhi = check_range("lossless.multiplicative", multiplicative)
    glo, ghi = check_range("lossless.gamma", gamma)
    alo, ahi = check_range("lossless.additive", additive)
    r = tuple(_log_uniform(n, mlo, mhi, generator) for n, _ in shapes[:-1])
    perm = torch.randperm(n_out, generator=generator)
    groups = torch.empty(n_out, dtype=torch.int64)
    for s, chunk in enumerate(torch.tensor_split(perm, m)):
        groups[chunk] = s
    g = _signs(m, generator) * _log_uniform(m, glo, ghi, generator)
    if mode == "shift":
        r_a = torch.ones(n_out, dtype=torch.float64)
    else:
        for _ in range(100):
            r_a = _signs(n_out, generator) * (alo + (ahi - alo) * torch.rand(n_out, generator=generator,
                                                                          dtype=torch.float64))
            d = (r_a[:, None] - r_a[None, :]).abs() + torch.eye(n_out, dtype=torch.float64)
            if bool((d > 1e-9 * ahi).all()):
                break
        else:  # pragma: no cover - needs a degenerate range
            raise ValueError(f"lossless.additive {additive!r} cannot give {n_out} pairwise distinct values")
    return Secrets(tuple(v.to(dtype) for v in r), g.to(dtype), PublicNoise(r_a.to(dtype), groups))


# -------------------------------------------------------------------------------------- perturbation
def perturb(layers: Sequence[Layer], secrets: Secrets) -> tuple[list[Layer], PublicNoise]:
    """Eq. 7-9: the perturbed layers (in the secrets' dtype) and the public noise to send with them."""
    L = len(layers)
    if len(secrets.r) != L - 1:
        raise ValueError(f"secrets are for {len(secrets.r) + 1} layers, the model has {L}")
    if int(layers[-1][0].shape[0]) != int(secrets.public.r_a.numel()):
        raise ValueError(f"secrets are for {secrets.public.r_a.numel()} outputs, the model has "
                         f"{layers[-1][0].shape[0]}")
    dt = secrets.gamma.dtype
    out: list[Layer] = []
    for k, (w, b) in enumerate(layers):
        dev = w.device
        Rw, Rb = secrets.scale(k, L, tuple(w.shape))
        if k < L - 1 and Rw.shape[0] != w.shape[0]:
            raise ValueError(f"secrets do not fit layer {k}: r^({k + 1}) has {Rw.shape[0]} entries, the layer "
                             f"{w.shape[0]} units")
        wh = Rw.to(dev) * w.to(dt)
        bh = Rb.to(dev) * b.to(dt) if b is not None else None
        if k == L - 1:
            ra = secrets.r_out.to(dev)
            wh = wh + ra[:, None]
            bh = bh + ra if bh is not None else None
        out.append((wh, bh))
    return out, secrets.public


# -------------------------------------------------------------------------------------- client side
@dataclass
class ClientTerms:
    """What a client returns (all batch means over its examples):

    * ``grads[l]`` = ``nabla F(W^(l), D_k)``, the perturbed gradient (weight, bias);
    * ``sigma[s][l]`` = ``sigma~_{k,s}^(l)``, ``s = 0..m-1`` (empty for cross-entropy);
    * ``beta[l]`` = ``beta_k^(l)`` (identically zero for the last layer; empty for cross-entropy).
    """

    grads: list[Layer]
    sigma: list[list[Layer]]
    beta: list[Layer]
    loss: str
    num_examples: int

    def to_arrays(self) -> list[np.ndarray]:
        """Flat list: grads, then sigma group 0..m-1, then beta, each as W1, b1, W2, b2, ... (no None)."""
        out: list[np.ndarray] = []
        for block in [self.grads, *self.sigma, *([self.beta] if self.beta else [])]:
            out.extend(t.detach().cpu().numpy().copy() for t in _flat(block))
        return out

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray], like: Sequence[Layer], num_groups: int, loss: str,
                    num_examples: int) -> ClientTerms:
        """Inverse of :meth:`to_arrays`; ``like`` gives the layer structure (e.g. the model's layers)."""
        if loss not in LOSSES:
            raise ValueError(f"lossless.loss must be one of {list(LOSSES)}, got {loss!r}")
        per = len(_flat(like))
        blocks = 1 + (num_groups + 1 if loss == "mse" else 0)
        if len(arrays) != per * blocks:
            raise ValueError(f"expected {per * blocks} arrays ({blocks} blocks of {per}), got {len(arrays)}")
        ts = [torch.as_tensor(np.asarray(a)) for a in arrays]
        parts = [_unflat(ts[i * per:(i + 1) * per], like) for i in range(blocks)]
        if loss == "mse":
            return cls(parts[0], parts[1:1 + num_groups], parts[-1], loss, int(num_examples))
        return cls(parts[0], [], [], loss, int(num_examples))


def _flat(layers: Sequence[Layer]) -> list[torch.Tensor]:
    return [t for w, b in layers for t in ((w,) if b is None else (w, b))]


def _unflat(ts: Sequence[torch.Tensor], like: Sequence[Layer]) -> list[Layer]:
    out, i = [], 0
    for w, b in like:
        tw = ts[i].reshape(w.shape)
        i += 1
        tb = None
        if b is not None:
            tb = ts[i].reshape(b.shape)
            i += 1
        out.append((tw, tb))
    return out


def _targets(loss: str, target: torch.Tensor, n_out: int, batch: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    if loss == "mse":
        t = target.to(device, dtype)
        if t.ndim == 1 and n_out == 1:
            t = t[:, None]
        if tuple(t.shape) != (batch, n_out):
            raise ValueError(f"MSE targets must have shape ({batch}, {n_out}), got {tuple(target.shape)}")
        return t
    if target.dtype in (torch.int64, torch.int32):
        if tuple(target.shape) != (batch,):
            raise ValueError(f"class labels must have shape ({batch},), got {tuple(target.shape)}")
        return target.to(device).long()
    t = target.to(device, dtype)
    if tuple(t.shape) != (batch, n_out) or not torch.allclose(t.sum(1), torch.ones_like(t[:, 0])):
        raise ValueError(f"soft cross-entropy targets must be probability rows of shape ({batch}, {n_out})")
    return t


def _grad(scalar: torch.Tensor, params: list[torch.Tensor], layers: Sequence[Layer]) -> list[Layer]:
    gs = torch.autograd.grad(scalar, params, retain_graph=True, allow_unused=True)
    gs = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(gs, params)]
    return _unflat(gs, layers)


def client_terms(perturbed: Sequence[Layer], public: PublicNoise, x: torch.Tensor, target: torch.Tensor, *,
                 loss: str = "mse", negative_slope: float = 0.0) -> ClientTerms:
    """A client's reply (§4.2): ordinary forward/backward on the perturbed model plus the noise terms.

    ``loss="mse"``: ``1/2 ||y^ - t||^2`` per example (eq. 13), ``target`` float ``(B, n_L)``; returns the
    mean perturbed gradient, ``m`` terms ``sigma~_s`` and ``beta`` (``m + 2`` backward passes).
    ``loss="cross_entropy"``: mean softmax cross-entropy, ``target`` int64 labels ``(B,)`` or probability
    rows; only exact for shift-invariant noise (``public.shift_invariant``), otherwise ``ValueError``.
    Computed in the dtype of ``perturbed`` (use float64).
    """
    if loss not in LOSSES:
        raise ValueError(f"lossless.loss must be one of {list(LOSSES)}, got {loss!r}")
    if loss == "cross_entropy" and not public.shift_invariant:
        raise ValueError(
            "lossless.loss='cross_entropy' cannot be recovered exactly with the paper's additive noise "
            "(r^(a) with distinct components or m > 1): the client's logit gradient softmax(y + alpha r) - t is "
            "a transcendental function of the secret r, so the true aggregate is not a fixed combination of "
            "batch aggregates. Use loss='mse' (the paper's derivation) or draw_secrets(..., mode='shift') "
            "(exact, but the predicted probabilities are then visible to clients)")
    L = len(perturbed)
    n_out = int(perturbed[-1][0].shape[0])
    if n_out != int(public.r_a.numel()):
        raise ValueError(f"public noise is for {public.r_a.numel()} outputs, the model has {n_out}")
    if len(x) == 0:
        raise ValueError("client_terms needs at least one example")
    dt, dev = perturbed[0][0].dtype, perturbed[0][0].device
    params_layers = [(w.detach().clone().requires_grad_(True),
                      b.detach().clone().requires_grad_(True) if b is not None else None) for w, b in perturbed]
    params = _flat(params_layers)
    xf = x.reshape(len(x), -1).to(dev, dt)
    t = _targets(loss, target, n_out, len(x), dt, dev)
    out, hidden = forward(params_layers, xf, negative_slope=negative_slope)
    if loss == "cross_entropy":
        grads = _grad(F.cross_entropy(out, t), params, perturbed)
        return ClientTerms(grads, [], [], loss, len(x))
    diff = out - t
    grads = _grad(0.5 * (diff * diff).sum(1).mean(), params, perturbed)
    alpha = _alpha(params_layers, xf, hidden)
    a0 = alpha.detach()
    r_a, groups = public.r_a.to(dev, dt), public.groups.to(dev)
    sigma = []
    for s in range(public.num_groups):
        ra_s = torch.where(groups == s, r_a, torch.zeros_like(r_a))
        c_s = (diff.detach() * ra_s).sum(1)
        sigma.append(_grad((a0 * (out * ra_s).sum(1) + c_s * alpha).mean(), params, perturbed))
    if L > 1:
        beta = _grad(0.5 * (alpha * alpha).mean(), params, perturbed)
    else:  # alpha is a function of the input only
        beta = [(torch.zeros_like(w), torch.zeros_like(b) if b is not None else None) for w, b in perturbed]
    return ClientTerms(grads, sigma, beta, loss, len(x))


# -------------------------------------------------------------------------------------- server side
def aggregate(terms: Sequence[ClientTerms], weights: Sequence[float] | None = None) -> ClientTerms:
    """Eq. 14: the weighted mean of the clients' terms (default weights: their example counts)."""
    if not terms:
        raise ValueError("aggregate needs at least one client's terms")
    loss = terms[0].loss
    if any(t.loss != loss for t in terms) or any(len(t.sigma) != len(terms[0].sigma) for t in terms):
        raise ValueError("clients' terms differ in loss or number of groups")
    w = [float(t.num_examples) for t in terms] if weights is None else [float(v) for v in weights]
    if len(w) != len(terms) or any(not math.isfinite(v) or v < 0 for v in w) or sum(w) <= 0:
        raise ValueError(f"aggregation weights must be {len(terms)} non-negative numbers with a positive sum, "
                         f"got {w}")
    tot = sum(w)

    def mean(blocks: Sequence[Sequence[Layer]]) -> list[Layer]:
        flats = [_flat(b) for b in blocks]
        avg = [sum(wi / tot * f[i] for wi, f in zip(w, flats)) for i in range(len(flats[0]))]
        return _unflat(avg, blocks[0])

    grads = mean([t.grads for t in terms])
    sigma = [mean([t.sigma[s] for t in terms]) for s in range(len(terms[0].sigma))]
    beta = mean([t.beta for t in terms]) if terms[0].beta else []
    return ClientTerms(grads, sigma, beta, loss, sum(t.num_examples for t in terms))


def recover(agg: ClientTerms, secrets: Secrets) -> list[Layer]:
    """Eq. 14-15 / Theorem 3: the true aggregated gradient from the aggregated terms and the secrets."""
    L = len(agg.grads)
    if len(secrets.r) != L - 1:
        raise ValueError(f"secrets are for {len(secrets.r) + 1} layers, the terms for {L}")
    if agg.loss == "cross_entropy":
        if not secrets.public.shift_invariant:
            raise ValueError("cross-entropy terms can only be recovered with shift-invariant secrets "
                             "(draw_secrets(..., mode='shift'))")
    elif len(agg.sigma) != secrets.num_groups or len(agg.beta) != L:
        raise ValueError(f"MSE terms need {secrets.num_groups} sigma groups and {L} beta layers, got "
                         f"{len(agg.sigma)} and {len(agg.beta)}")
    v = secrets.v
    out: list[Layer] = []
    for k, (gw, gb) in enumerate(agg.grads):
        dev, dt = gw.device, gw.dtype
        Rw, Rb = (t.to(dev, dt) for t in secrets.scale(k, L, tuple(gw.shape)))
        gw = gw.clone()
        gb = gb.clone() if gb is not None else None
        if agg.loss == "mse":
            for s in range(secrets.num_groups):
                g_s = secrets.gamma[s].to(dev, dt)
                sw, sb = agg.sigma[s][k]
                gw = gw - g_s * sw
                if gb is not None:
                    gb = gb - g_s * sb
            bw, bb = agg.beta[k]
            gw = gw + v.to(dev, dt) * bw
            if gb is not None:
                gb = gb + v.to(dev, dt) * bb
        out.append((Rw * gw, Rb * gb if gb is not None else None))
    return out


# ------------------------------------------------------------------------------- reference / helpers
def true_gradients(layers: Sequence[Layer], x: torch.Tensor, target: torch.Tensor, *, loss: str = "mse",
                   negative_slope: float = 0.0) -> list[Layer]:
    """Mean gradient on the unperturbed model (the quantity :func:`recover` must reproduce)."""
    if loss not in LOSSES:
        raise ValueError(f"lossless.loss must be one of {list(LOSSES)}, got {loss!r}")
    dt, dev = layers[0][0].dtype, layers[0][0].device
    pl = [(w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
           if b is not None else None) for w, b in layers]
    out, _ = forward(pl, x.to(dev), negative_slope=negative_slope)
    t = _targets(loss, target, int(out.shape[1]), len(x), dt, dev)
    value = F.cross_entropy(out, t) if loss == "cross_entropy" else 0.5 * ((out - t) ** 2).sum(1).mean()
    return _grad(value, _flat(pl), layers)


def sgd_step(layers: Sequence[Layer], grads: Sequence[Layer], lr: float) -> list[Layer]:
    """Eq. 15: ``W <- W - lr * grad`` for every layer."""
    return [(w - lr * gw, b - lr * gb if b is not None else None) for (w, b), (gw, gb) in zip(layers, grads)]
