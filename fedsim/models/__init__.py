"""Model zoo used by the papers: DLG/CPL LeNet, GRNN's LeNet-5, seed 000's ConvNet, CIFAR ResNets, ResNet-18, MLP.

Every constructor takes the input shape and the number of classes, plus ``activation``
(sigmoid / tanh / relu / leakyrelu) and ``norm`` (none / batch) where the papers vary them.
Build by name with :func:`build_model`.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from fedsim import components as _components

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "leakyrelu": lambda: nn.LeakyReLU(0.2),
}
NORMS = ("none", "batch")


def _act(name: str) -> nn.Module:
    return ACTIVATIONS[name]()


def _norm2d(norm: str, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if norm == "batch" else nn.Identity()


class LeNet(nn.Module):
    """The LeNet of DLG (Zhu et al. 2019), used by iDLG, CPL and GRNN.

    Three 5x5 convolutions (12 channels, strides 2, 2, 1) and one fully connected layer;
    sigmoid activations by default, which makes it twice differentiable everywhere.
    """

    def __init__(self, in_shape: Sequence[int], num_classes: int, activation: str = "sigmoid",
                 norm: str = "none", width: int = 12):
        super().__init__()
        c, h, w = in_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 5, padding=2, stride=2), _norm2d(norm, width), _act(activation),
            nn.Conv2d(width, width, 5, padding=2, stride=2), _norm2d(norm, width), _act(activation),
            nn.Conv2d(width, width, 5, padding=2, stride=1), _norm2d(norm, width), _act(activation),
        )
        with torch.no_grad():
            n = self.features(torch.zeros(1, c, h, w)).numel()
        self.fc = nn.Linear(n, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))


class LeNet5(nn.Module):
    """LeNet-5 with max-pooling, the victim of seed 003's GRNN experiments (thesis ch. 3, the GRNN code's
    ``LeNet``): two 5x5 convolutions without padding (6 and 16 channels), each followed by the activation
    and 2x2 max-pooling, then fully connected layers of 120 and 84 units with the activation, and the
    classifier. Sigmoid by default (the thesis replaces every ReLU by a sigmoid, as DLG does); build it
    with ``init="uniform"`` for the U(-0.5, 0.5) weights the thesis's attacks use. 28x28 inputs give
    16x4x4 features before the first fully connected layer (the thesis: 32x32, 16x5x5).
    """

    def __init__(self, in_shape: Sequence[int], num_classes: int, activation: str = "sigmoid", norm: str = "none"):
        super().__init__()
        c, h, w = in_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 6, 5), _norm2d(norm, 6), _act(activation), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), _norm2d(norm, 16), _act(activation), nn.MaxPool2d(2),
        )
        with torch.no_grad():
            n = self.features(torch.zeros(1, c, h, w)).numel()
        self.classifier = nn.Sequential(nn.Linear(n, 120), _act(activation), nn.Linear(120, 84), _act(activation))
        self.fc = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.classifier(self.features(x).flatten(1)))


class ConvNet(nn.Module):
    """Seed 000's ConvNet: eight 3x3 convolutions and one fully connected layer.

    Channel plan (w, 2w, 2w, 4w, 4w, 4w, 4w, 4w) with max-pooling after convolutions 4, 6 and 8,
    as in the ConvNet of Geiping et al. that seed 000 evaluates. ``width`` defaults to 16 so that
    CPU simulations stay fast; the papers use 64.
    """

    def __init__(self, in_shape: Sequence[int], num_classes: int, activation: str = "relu",
                 norm: str = "batch", width: int = 16):
        super().__init__()
        c, h, w = in_shape
        plan = [w_ * width for w_ in (1, 2, 2, 4, 4, 4, 4, 4)]
        layers: list[nn.Module] = []
        prev = c
        for i, ch in enumerate(plan):
            layers += [nn.Conv2d(prev, ch, 3, padding=1), _norm2d(norm, ch), _act(activation)]
            if i in (3, 5, 7):
                layers.append(nn.MaxPool2d(2))
            prev = ch
        self.features = nn.Sequential(*layers)
        with torch.no_grad():
            n = self.features(torch.zeros(1, c, h, w)).numel()
        self.fc = nn.Linear(n, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, activation: str, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=norm == "none")
        self.bn1 = _norm2d(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=norm == "none")
        self.bn2 = _norm2d(norm, cout)
        self.act1 = _act(activation)
        self.act2 = _act(activation)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=norm == "none"),
                                          _norm2d(norm, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act2(out + self.shortcut(x))


class ResNet(nn.Module):
    """Residual network for small images.

    ``depth`` 20 or 32 gives the CIFAR ResNets of He et al. (three stages of 16/32/64 channels,
    (depth-2)/6 blocks each); ``depth=18`` gives ResNet-18 (four stages of 64..512 channels,
    two blocks each) with a 3x3 stem for 32x32 inputs.
    """

    def __init__(self, in_shape: Sequence[int], num_classes: int, depth: int = 20,
                 activation: str = "relu", norm: str = "batch"):
        super().__init__()
        c = in_shape[0]
        if depth == 18:
            widths, blocks = (64, 128, 256, 512), (2, 2, 2, 2)
        elif depth in (20, 32, 44, 56):
            n = (depth - 2) // 6
            widths, blocks = (16, 32, 64), (n, n, n)
        else:
            raise ValueError(f"ResNet depth must be 18, 20, 32, 44 or 56, got {depth}")
        self.stem = nn.Sequential(nn.Conv2d(c, widths[0], 3, padding=1, bias=norm == "none"),
                                  _norm2d(norm, widths[0]), _act(activation))
        stages: list[nn.Module] = []
        prev = widths[0]
        for i, (wd, nb) in enumerate(zip(widths, blocks)):
            for j in range(nb):
                stride = 2 if (i > 0 and j == 0) else 1
                stages.append(_BasicBlock(prev, wd, stride, activation, norm))
                prev = wd
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))


class MLP(nn.Module):
    """Fully connected network for tabular data (and flattened images)."""

    def __init__(self, in_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (64, 32),
                 activation: str = "relu", norm: str = "none"):
        super().__init__()
        n_in = 1
        for d in in_shape:
            n_in *= int(d)
        layers: list[nn.Module] = [nn.Flatten()]
        prev = n_in
        for h in hidden:
            layers += [nn.Linear(prev, h)]
            if norm == "batch":
                layers.append(nn.BatchNorm1d(h))
            layers.append(_act(activation))
            prev = h
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


_components.MODELS.base = nn.Module  # a reference in model.name names an nn.Module subclass (or a function of yours)
BUILTIN_ONLY = ("activation", "norm", "width", "hidden")  # [model] keys of the built-in models


class BuiltinModel:
    """A built-in model in :data:`fedsim.components.MODELS` (the one registry of models, beside the
    users' own): configured by ``[model]`` ``activation`` / ``norm`` / ``width`` / ``hidden``, not by
    ``params``. ``image``: it needs image inputs (C, H, W)."""

    def __init__(self, build: Callable[..., nn.Module], image: bool = True):
        self.build, self.image = build, image

    def __call__(self, in_shape: Sequence[int], num_classes: int, *, width: int | None, hidden: Sequence[int] | None,
                 **kw: Any) -> nn.Module:
        return self.build(in_shape, num_classes, width=width, hidden=hidden, **kw)


def _register_builtins() -> None:
    from fedsim.components import MODELS

    for name, entry in (
        ("lenet", BuiltinModel(lambda s, c, width, hidden, **kw: LeNet(s, c, width=width or 12, **kw))),
        ("lenet5", BuiltinModel(lambda s, c, width, hidden, **kw: LeNet5(s, c, **kw))),
        ("convnet", BuiltinModel(lambda s, c, width, hidden, **kw: ConvNet(s, c, width=width or 16, **kw))),
        *((n, BuiltinModel(lambda s, c, width, hidden, depth=int(n[6:]), **kw: ResNet(s, c, depth=depth, **kw)))
          for n in ("resnet20", "resnet32", "resnet18")),
        ("mlp", BuiltinModel(lambda s, c, width, hidden, **kw: MLP(s, c, hidden=tuple(hidden) if hidden else (64, 32),
                                                                  **kw), image=False)),
    ):
        MODELS.add(name, entry)


_register_builtins()


def builtin_models() -> list[str]:
    """The built-in model names, in registration order."""
    from fedsim.components import MODELS

    return [n for n, e in MODELS.items() if isinstance(e, BuiltinModel)]


def is_builtin_model(name: Any) -> bool:
    from fedsim.components import MODELS

    return isinstance(name, str) and isinstance(MODELS.get(name), BuiltinModel)


def build_plugin_model(name: str, in_shape: Sequence[int], num_classes: int,
                       params: Mapping[str, Any] | None = None) -> nn.Module:
    """A user's model: ``name`` is registered in :data:`fedsim.components.MODELS` or an import reference
    (``"mypkg.models:SmallCNN"``, ``"path/to/file.py:build"``) to an ``nn.Module`` subclass or a
    function returning one. It receives ``in_shape`` and ``num_classes`` when it declares them, and
    ``[model] params`` (validated against its keyword parameters)."""
    from fedsim.components import MODELS
    from fedsim.references import is_reference

    if name not in MODELS.names() and not is_reference(name):
        raise ValueError(f"model.name must be one of {MODELS.names()} or an import "
                         f"reference ('module:attribute' or 'path/file.py:attribute'), got {name!r}")
    model = MODELS.build_named(name, dict(params or {}), "model.params", name_where="model.name",
                               in_shape=tuple(in_shape), num_classes=int(num_classes))
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.name {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(name: str, in_shape: Sequence[int], num_classes: int, *, activation: str | None = None,
                norm: str | None = None, init: str = "default", width: int | None = None,
                hidden: Sequence[int] | None = None, params: Mapping[str, Any] | None = None) -> nn.Module:
    """Build a model by name. ``activation``/``norm`` default to what the papers use for that model.

    ``init="uniform"`` re-initialises every weight and bias from U(-0.5, 0.5), the initialisation DLG
    uses to make its LeNet easy to invert; ``"default"`` keeps PyTorch's. A name that is not a
    built-in model is a user's model (:func:`build_plugin_model`, parameters in ``params``).
    """
    if not is_builtin_model(name):
        given = [k for k, v in (("activation", activation), ("norm", norm), ("width", width),
                                ("hidden", hidden)) if v is not None]
        if given:
            raise ValueError(f"model.{given[0]} applies to the built-in models only; give your model's own "
                             f"parameters in model.params")
        model = build_plugin_model(name, in_shape, num_classes, params)
        _initialise(model, init)
        return model
    if params:
        raise ValueError(f"model.params is for a user's own model; the built-in {name!r} takes "
                         f"{list(BUILTIN_ONLY)} in [model]")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"model.activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if norm is not None and norm not in NORMS:
        raise ValueError(f"model.norm must be one of {list(NORMS)}, got {norm!r}")
    kw: dict = {}
    if activation is not None:
        kw["activation"] = activation
    if norm is not None:
        kw["norm"] = norm
    from fedsim.components import MODELS

    entry = MODELS[name]
    if entry.image and len(in_shape) != 3:
        raise ValueError(f"model.name {name!r} needs image data (C, H, W), got input shape {tuple(in_shape)}")
    model = entry(in_shape, num_classes, width=width, hidden=hidden, **kw)
    _initialise(model, init)
    return model


def _initialise(model: nn.Module, init: str) -> None:
    if init == "uniform":
        with torch.no_grad():
            for p in model.parameters():
                p.uniform_(-0.5, 0.5)
    elif init != "default":
        raise ValueError(f"model.init must be 'default' or 'uniform', got {init!r}")
