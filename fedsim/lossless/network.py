"""The networks seed 002's perturbation supports (fully connected ReLU/LeakyReLU chains, eq. 3) as lists of
``(weight, bias)`` layers: the check of a model (:func:`fc_spec`), its layers in and out, the forward pass,
the per-example quantities the proof uses, and the reference gradient of the unperturbed model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

Layer = tuple[torch.Tensor, "torch.Tensor | None"]  # (weight (n_out, n_in), bias (n_out,) or None)
LOSSES = ("mse", "cross_entropy")


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


def compute_alpha(layers: Sequence[Layer], x_flat: torch.Tensor, hidden: Sequence[torch.Tensor]) -> torch.Tensor:
    """``alpha`` of Theorem 1: the sum of the last layer's inputs, +1 for its bias column."""
    u = hidden[-1] if hidden else x_flat
    a = u.sum(1)
    return a + 1.0 if layers[-1][1] is not None else a


# ----------------------------------------------------------------------------------------- layer lists
def flat(layers: Sequence[Layer]) -> list[torch.Tensor]:
    return [t for w, b in layers for t in ((w,) if b is None else (w, b))]


def unflat(ts: Sequence[torch.Tensor], like: Sequence[Layer]) -> list[Layer]:
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


def loss_targets(loss: str, target: torch.Tensor, n_out: int, batch: int, dtype: torch.dtype,
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


def layer_grads(scalar: torch.Tensor, params: list[torch.Tensor], layers: Sequence[Layer]) -> list[Layer]:
    gs = torch.autograd.grad(scalar, params, retain_graph=True, allow_unused=True)
    gs = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(gs, params)]
    return unflat(gs, layers)


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
    t = loss_targets(loss, target, int(out.shape[1]), len(x), dt, dev)
    value = F.cross_entropy(out, t) if loss == "cross_entropy" else 0.5 * ((out - t) ** 2).sum(1).mean()
    return layer_grads(value, flat(pl), layers)


def sgd_step(layers: Sequence[Layer], grads: Sequence[Layer], lr: float) -> list[Layer]:
    """Eq. 15: ``W <- W - lr * grad`` for every layer."""
    return [(w - lr * gw, b - lr * gb if b is not None else None) for (w, b), (gw, gb) in zip(layers, grads)]
