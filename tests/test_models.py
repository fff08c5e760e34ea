"""The model zoo: shapes, options, initialisation, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedsim.models import build_model, builtin_models

MODELS = builtin_models()

IMAGE_MODELS = [m for m in MODELS if m != "mlp"]


def _types(model: nn.Module) -> set[type]:
    return {type(m) for m in model.modules()}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("shape,classes", [((1, 28, 28), 10), ((3, 32, 32), 100)])
def test_output_shapes_images(name, shape, classes):
    torch.manual_seed(0)
    model = build_model(name, shape, classes).eval()
    with torch.no_grad():
        out = model(torch.rand(3, *shape))
    assert out.shape == (3, classes)
    assert torch.isfinite(out).all()


def test_mlp_tabular_shapes_and_hidden():
    model = build_model("mlp", (30,), 2, hidden=[16, 8, 4])
    assert model(torch.randn(5, 30)).shape == (5, 2)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [lin.out_features for lin in linears] == [16, 8, 4, 2]
    assert linears[0].in_features == 30


def test_every_model_trains_one_step():
    # gradients reach every parameter (no detached branch)
    for name in MODELS:
        shape = (30,) if name == "mlp" else (3, 16, 16)
        model = build_model(name, shape, 10)
        x = torch.rand(2, *shape)
        loss = nn.functional.cross_entropy(model(x), torch.arange(2))
        loss.backward()
        assert all(p.grad is not None for p in model.parameters()), name


def test_lenet_defaults_to_sigmoid_and_activation_option():
    default = build_model("lenet", (1, 28, 28), 10)
    assert nn.Sigmoid in _types(default) and nn.ReLU not in _types(default)
    relu = build_model("lenet", (1, 28, 28), 10, activation="relu")
    assert nn.ReLU in _types(relu) and nn.Sigmoid not in _types(relu)
    tanh = build_model("lenet", (1, 28, 28), 10, activation="tanh")
    assert nn.Tanh in _types(tanh)
    leaky = build_model("lenet", (1, 28, 28), 10, activation="leakyrelu")
    assert nn.LeakyReLU in _types(leaky)


def test_lenet5_is_the_grnn_victim():
    """Seed 003's LeNet-5: 5x5 convolutions without padding (6, 16 channels), each with a sigmoid and 2x2
    max-pooling, fully connected 120 and 84 with sigmoids, then the classifier (28x28: 16x4x4 features;
    32x32: 16x5x5, the thesis's)."""
    for shape, flat in (((1, 28, 28), 16 * 4 * 4), ((3, 32, 32), 16 * 5 * 5)):
        model = build_model("lenet5", shape, 10)
        convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
        assert [(c.out_channels, c.kernel_size, c.padding) for c in convs] == [(6, (5, 5), (0, 0)), (16, (5, 5), (0, 0))]
        assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == 2
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        assert [(lin.in_features, lin.out_features) for lin in linears] == [(flat, 120), (120, 84), (84, 10)]
        assert sum(isinstance(m, nn.Sigmoid) for m in model.modules()) == 4 and nn.ReLU not in _types(model)


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_norm_option_adds_or_removes_batchnorm(name):
    with_bn = build_model(name, (3, 32, 32), 10, norm="batch")
    without = build_model(name, (3, 32, 32), 10, norm="none")
    assert nn.BatchNorm2d in _types(with_bn)
    assert nn.BatchNorm2d not in _types(without)
    assert any("running_mean" in k for k in with_bn.state_dict())
    assert not any("running_mean" in k for k in without.state_dict())


def test_mlp_batch_norm():
    assert nn.BatchNorm1d in _types(build_model("mlp", (30,), 2, norm="batch"))
    assert nn.BatchNorm1d not in _types(build_model("mlp", (30,), 2))


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_activation_option_everywhere(name):
    model = build_model(name, (3, 32, 32), 10, activation="tanh")
    assert nn.Tanh in _types(model) and nn.ReLU not in _types(model)


def test_width_option():
    narrow = build_model("lenet", (1, 28, 28), 10, width=4)
    wide = build_model("lenet", (1, 28, 28), 10, width=24)
    assert narrow.features[0].out_channels == 4 and wide.features[0].out_channels == 24
    assert sum(p.numel() for p in wide.parameters()) > sum(p.numel() for p in narrow.parameters())


@pytest.mark.parametrize("name,shape", [("lenet", (1, 28, 28)), ("lenet5", (1, 28, 28)), ("convnet", (3, 32, 32)),
                                        ("mlp", (30,))])
def test_uniform_init_in_range(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, 10, init="uniform")
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert float(params.min()) >= -0.5 and float(params.max()) <= 0.5
    # it really is U(-0.5, 0.5): values fill the range (PyTorch's default init is much narrower)
    assert float(params.max()) > 0.45 and float(params.min()) < -0.45
    default = torch.cat([p.detach().flatten() for p in build_model(name, shape, 10).parameters()
                         if p.dim() > 1])  # weight matrices/kernels (BatchNorm scales start at 1)
    assert float(default.abs().max()) < 0.45


def test_same_seed_same_weights():
    torch.manual_seed(3)
    a = build_model("lenet", (1, 28, 28), 10)
    torch.manual_seed(3)
    b = build_model("lenet", (1, 28, 28), 10)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("kwargs,key", [
    ({"name": "vgg"}, "model.name"),
    ({"activation": "gelu"}, "model.activation"),
    ({"norm": "layer"}, "model.norm"),
    ({"init": "xavier"}, "model.init"),
])
def test_invalid_options_name_the_key(kwargs, key):
    kw = {"name": "lenet", **kwargs}
    name = kw.pop("name")
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as exc:
        build_model(name, (1, 28, 28), 10, **kw)
    # the message lists what is allowed
    allowed = {"model.name": "lenet", "model.activation": "sigmoid", "model.norm": "batch",
               "model.init": "uniform"}[key]
    assert allowed in str(exc.value)


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_image_model_on_tabular_data_is_rejected(name):
    with pytest.raises(ValueError, match="model.name"):
        build_model(name, (30,), 2)


@pytest.mark.parametrize("name,norm", [(m, None) for m in MODELS] + [("lenet", "batch")])
def test_set_weights_writes_every_parameter_and_buffer(name, norm):
    """set_weights copies in place (the per-message fast path): every state_dict entry, buffers and
    BatchNorm's integer counter included, takes the given value, and a wrong count or shape is refused."""
    from fedsim.models.weights import get_weights, set_weights

    shape = (30,) if name == "mlp" else (1, 28, 28)
    model = build_model(name, shape, 10, norm=norm)
    rng = np.random.default_rng(0)
    target = [(rng.normal(size=w.shape) * 3).astype(w.dtype) if w.dtype.kind == "f"
              else np.full(w.shape, 7, dtype=w.dtype) for w in get_weights(model)]
    read_only = [np.frombuffer(t.tobytes(), dtype=t.dtype).reshape(t.shape) for t in target]
    set_weights(model, read_only)
    got = get_weights(model)
    assert len(got) == len(target) and all(np.array_equal(g, t) for g, t in zip(got, target))
    with pytest.raises(ValueError, match="arrays for this model"):
        set_weights(model, target[:-1])
    with pytest.raises(RuntimeError):
        set_weights(model, [t.ravel()[:-1] if i == 0 else t for i, t in enumerate(target)])


@pytest.mark.parametrize("array", [
    np.arange(24, dtype="float32").reshape(2, 3, 4),
    np.arange(6, dtype="int64")[::2],
    np.asfortranarray(np.arange(6, dtype="float64").reshape(3, 2)),
    np.array([3.5, -1.0], dtype=">f8"),
    np.zeros((0, 5), dtype="uint8"),
])
def test_encode_array_gives_flowers_own_bytes(array):
    """protocol.encode_array (header cached per dtype and shape) is byte for byte Flower's Array(ndarray)
    of the C-ordered array, and decodes to the same values."""
    from flwr.app import Array

    from fedsim.protocol import decode_array, encode_array

    for _ in range(2):  # the second call uses the cached header
        mine, flowers = encode_array(array), Array(np.ascontiguousarray(array))
        assert (mine.dtype, mine.shape, mine.stype, mine.data) == (
            flowers.dtype, flowers.shape, flowers.stype, flowers.data)
        assert np.array_equal(decode_array(mine), array) and np.array_equal(mine.numpy(), array)
