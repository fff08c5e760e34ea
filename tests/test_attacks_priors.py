"""Stronger attacks: the BN-statistics prior (``ig-bn``), seed 004's attack (``ig-fr``) and Robbing
the Fed (``robbing``, malicious server).

Victim updates come from :func:`fedsim.training.local.local_train` on real fmnist-small images (one local
SGD step on the whole batch, so the batch is known to the scorer); only the metrics see the truth.
Thresholds were measured on these seeded runs (values in comments) and set with a margin.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attacks import ATTACKS, AttackInput, build_attack
from attacks.bn_prior import BNRecorder, batch_bn_stats, bn_targets
from attacks.features import reconstruct_features, span_loss, squared_cosine_loss
from attacks.gradients import update_to_gradient
from attacks.robbing import bin_differences
from fedsim.data.registry import load_dataset
from fedsim.metrics import score_reconstruction
from fedsim.models import build_model
from fedsim.models.imprint import (
    ImprintedModel,
    build_imprinted,
    gaussian_bins,
    imprint_model,
    measurement_vector,
    quantile_bins,
)
from fedsim.training.local import local_train
from fedsim.training.recipe import Recipe

DS = load_dataset("fmnist-small")
SHAPE = DS.in_shape
BN = dict(activation="relu", norm="batch")  # with model="lenet": BatchNorm after each of the three convs


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def victim(indices, *, model="lenet", seed=0, lr=0.1, wrap=None, **model_kw) -> tuple[AttackInput, torch.Tensor,
                                                                                      torch.Tensor]:
    """One client step on ``indices`` from a seeded global model (PyTorch default init).

    ``wrap(base) -> model`` turns the base model into the one the server sends (e.g. imprinted).
    """
    torch.manual_seed(seed)
    net = build_model(model, SHAPE, 10, **model_kw)
    if wrap is not None:
        net = wrap(net)

    def model_fn():  # the architecture (the client builds the same one)
        base = build_model(model, SHAPE, 10, **model_kw)
        return build_imprinted(base, SHAPE, net.imprint.num_bins) if wrap is not None else base

    global_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    x, y = DS.x_train[list(indices)], DS.y_train[list(indices)]
    recipe = Recipe(lr=lr, batch_size=len(y), local_steps=1)
    res = local_train(net, x, y, recipe, seed=seed, round=0, client=0)
    update = {k: torch.as_tensor(w) - global_state[k] for k, w in zip(global_state, res.weights)}
    inp = AttackInput(model_fn, global_state, update, recipe.to_mapping(), SHAPE, 10, len(y), seed=seed)
    return inp, x, y


def mse_of(res, x, y) -> float:
    return score_reconstruction(res.inputs, res.labels, x, y)["mse"]


# ------------------------------------------------------------------ BN statistics
def test_bn_statistics_from_the_update_equal_the_victims():
    """One local step moves the running statistics by momentum * (batch - running): the curious server
    reads the victim batch's BN statistics back from the update ("update" target) - compare with the
    statistics computed from the true batch (the "victim" grant)."""
    inp, x, _ = victim(range(40, 44), **BN)
    truth = batch_bn_stats(inp.global_model(), x)
    assert len(truth) == 3
    model = inp.global_model()
    with torch.no_grad(), BNRecorder(model) as rec:
        model(torch.zeros_like(x))
        counts = dict(rec.counts)
    assert counts == {"features.1": 4 * 14 * 14, "features.4": 4 * 7 * 7, "features.7": 4 * 7 * 7}
    from_update = bn_targets(inp, model, "update", steps=1, counts=counts)
    for name, (mean, var) in truth.items():
        torch.testing.assert_close(from_update[name][0], mean, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(from_update[name][1], var, atol=2e-5, rtol=1e-4)
    running = bn_targets(inp, model, "running")  # the buffers the server sent, not the victim's batch
    for name, (mean, var) in running.items():
        assert torch.equal(mean, inp.global_state[f"{name}.running_mean"])
        assert torch.equal(var, inp.global_state[f"{name}.running_var"])
        assert float((mean - truth[name][0]).abs().max()) > 1e-3
    inp.bn_stats = truth
    granted = bn_targets(inp, model, "victim")
    assert all(torch.equal(granted[n][0], truth[n][0]) for n in truth)


def test_bn_prior_with_victim_statistics_improves_inverting_gradients():
    """LeNet with BatchNorm (ReLU), batch 4, 400 iterations, the same loop with and without the prior
    (weight 0.1). Measured MSE: without 0.067, 0.077; statistics read from the update (the default
    target) 0.046, 0.033; victim statistics 0.046, 0.032 (over 4 batches: 0.085 without, 0.035 with
    victim statistics). The victim-statistics target is run for one iteration only (its threat model
    recorded): test_bn_statistics_from_the_update_equal_the_victims shows the two targets agree to
    float rounding, so its reconstruction is the default's."""
    plain, upd = [], []
    for b, start in enumerate((100, 200)):
        inp, x, y = victim(range(start, start + 4), seed=b, **BN)
        plain.append(mse_of(build_attack("ig-bn", iterations=400, bn_prior=0.0).run(inp), x, y))
        res = build_attack("ig-bn", iterations=400).run(inp)  # the default target: read from the update
        assert res.trace["bn_target"] == "update" and res.trace["threat_model"] == "curious"
        upd.append(mse_of(res, x, y))
        inp.bn_stats = batch_bn_stats(inp.global_model(), x)  # the threat model's grant
        res = build_attack("ig-bn", iterations=1, bn_target="victim").run(inp)
        assert res.trace["bn_target"] == "victim" and res.trace["threat_model"] == "curious+victim_bn_stats"
    assert np.mean(upd) < 0.7 * np.mean(plain), (plain, upd)
    assert all(p < q for p, q in zip(upd, plain)), (plain, upd)
    print("bn prior MSE plain / update", plain, upd)


# ------------------------------------------------------------------ seed 004
def test_feature_recovery_from_the_last_layer():
    """The features entering the last linear layer, recovered from its weight and bias gradients:
    measured cosine 1.0000 for every sample of 4 (distinct labels) and a span error ~3e-7."""
    inp, x, y = victim(range(100, 104), **BN)
    model = inp.global_model().train()
    seen = {}
    model.fc.register_forward_pre_hook(lambda _m, a: seen.__setitem__("h", a[0].detach()))
    model(x)
    h = seen["h"]
    g = update_to_gradient(inp.update, inp.recipe, names=["fc.weight", "fc.bias"])
    order = torch.argsort(y)  # the recovery is per label slot; these labels are distinct
    feats = reconstruct_features(model.fc.weight, model.fc.bias, g["fc.weight"], g["fc.bias"], y[order])
    assert feats.separable and feats.residual < 1e-8
    cos = torch.nn.functional.cosine_similarity(feats.features, h[order], dim=1)
    assert float(cos.min()) > 0.999, cos
    assert float(squared_cosine_loss(h[order], feats.features)) < 1e-3
    assert float(squared_cosine_loss(-h[order], feats.features)) < 1e-3  # sign-free
    assert float(span_loss(h, feats.basis)) < 1e-6
    assert float(span_loss(torch.rand(4, h.shape[1], generator=torch.Generator().manual_seed(0)),
                           feats.basis)) > 0.5
    # 12 samples, 10 classes: the gradient's rank is at most 9, the regulariser turns itself off
    inp, _, y = victim(range(200, 212), **BN)
    res = build_attack("ig-fr", iterations=1).run(inp)
    assert res.trace["feature_loss"] == "off" and res.inputs.shape == (12, *SHAPE)


def test_seed004_attack_beats_inverting_gradients_on_a_bn_model():
    """Batch 4 on the BatchNorm LeNet, the same budget of 300 iterations. Measured MSE: plain IG
    0.088; ig-fr (untrained U-Net prior, feature matching, BN prior from the update) 0.0083 (about 10x
    lower; a second batch, images 200-203, measured 0.088 and 0.0092 and is left out for CI time)."""
    ig, fr = [], []
    for b, start in enumerate((100,)):
        inp, x, y = victim(range(start, start + 4), seed=b, **BN)
        ig.append(mse_of(build_attack("ig", iterations=300, lr=0.1, tv=1e-2).run(inp), x, y))
        res = build_attack("ig-fr", iterations=300).run(inp)
        assert res.inputs.shape == (4, *SHAPE) and res.trace["iterations"] == 300
        assert res.trace["feature_loss"] == "match" and res.trace["features_separable"]
        fr.append(mse_of(res, x, y))
    assert all(f < 0.5 * i for f, i in zip(fr, ig)), (ig, fr)
    print("MSE ig / ig-fr", ig, fr)


# ------------------------------------------------------------------ Robbing the Fed
def imprinted(num_bins=128):
    w = measurement_vector(SHAPE, "brightness")
    vals = DS.x_root.flatten(1) @ w  # the server's knowledge of the data: the public root split
    bins = gaussian_bins(float(vals.mean()), float(vals.std()), num_bins)
    return lambda base: imprint_model(base, bins, SHAPE), bins, w


def test_robbing_the_fed_recovers_isolated_images_exactly():
    """Batch 16, 128 brightness bins fitted to the public root split. Every image alone in its bin
    (counted here from the true images) comes back exactly: measured 12 of 16 alone, at 110-150 dB;
    the other 4 share two bins and come back as mixtures (< 20 dB)."""
    wrap, bins, w = imprinted()
    inp, x, y = victim(range(0, 16), activation="relu", wrap=wrap)
    res = build_attack("robbing").run(inp)
    assert res.trace["threat_model"] == "malicious"
    assert res.inputs.shape == (16, *SHAPE)
    sc = score_reconstruction(res.inputs, res.labels, x, y)
    psnr = np.array(sc["per_image"]["psnr"])
    m = x.flatten(1) @ w
    bin_of = (m[:, None] > bins[None]).sum(1)
    alone = (torch.bincount(bin_of)[bin_of] == 1).numpy()
    assert alone.sum() >= 10  # a property of the data and the bins: measured 12
    assert (psnr[alone] > 80).all(), psnr
    assert (psnr > 40).sum() >= 11, psnr  # "most images": measured 12 of 16
    assert sc["label_acc"] >= 0.9


def test_robbing_the_fed_on_a_batchnorm_model_and_the_model_change():
    """The imprinted ConvNet (BatchNorm) still computes nearly the base model's function (measured
    max logit change 3.4e-5) while most of 16 images come back above 40 dB (measured 13, at > 125 dB)."""
    wrap, _, _ = imprinted()
    torch.manual_seed(3)
    base = build_model("convnet", SHAPE, 10, width=8).eval()
    with torch.no_grad():
        before = base(DS.x_test[:64])
        after = wrap(base).eval()(DS.x_test[:64])
    assert float((after - before).abs().max()) < 1e-2
    inp, x, y = victim(range(16, 32), model="convnet", width=8, wrap=wrap)
    assert any(k.startswith("imprint.linear0") for k in inp.global_state)
    res = build_attack("robbing").run(inp)
    psnr = np.array(score_reconstruction(res.inputs, res.labels, x, y)["per_image"]["psnr"])
    assert (psnr > 40).sum() >= 11, psnr


def test_bin_differences_isolate_a_bin():
    """Synthetic: two inputs in separate bins and one bin with both - the differences give each alone."""
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 0.0, 1.0])
    ca, cb = 0.5, -2.0  # per-input gradient factors
    # bins 0..3: a active in 0..2, b active in 0..0
    gw = torch.stack([ca * a + cb * b, ca * a, ca * a, torch.zeros(3)])
    gb = torch.tensor([ca + cb, ca, ca, 0.0])
    dw, db = bin_differences(gw, gb)
    torch.testing.assert_close((dw[0] / db[0]).float(), b)
    torch.testing.assert_close((dw[2] / db[2]).float(), a)
    assert float(db[1]) == 0 and float(db[3]) == 0


# ------------------------------------------------------------------ parameters
def test_registered_and_bad_parameters_name_the_key():
    assert {"ig-bn", "ig-fr", "robbing"} <= set(ATTACKS)
    for name, key, value in (("ig-bn", "bn_prior", -1), ("ig-bn", "bn_target", "oracle"),
                             ("ig-fr", "features", float("nan")), ("ig-fr", "feature_loss", "l2"),
                             ("ig-fr", "image_prior", "yes"), ("ig-fr", "prior_width", 0),
                             ("ig-bn", "lr", 0), ("robbing", "tolerance", 0), ("robbing", "labels", "joint")):
        with pytest.raises(ValueError, match=rf"attack\.{key}"):
            build_attack(name, **{key: value})
    with pytest.raises(ValueError, match=r"attack\.fedavg_aware is not a parameter"):
        build_attack("ig-fr", fedavg_aware=True)
    plain, _, _ = victim(range(3), activation="relu")  # no BatchNorm, no imprint block
    with pytest.raises(ValueError, match=r"attack\.bn_prior.*BatchNorm"):
        build_attack("ig-bn", iterations=1).run(plain)
    with pytest.raises(ValueError, match="imprint block"):
        build_attack("robbing").run(plain)
    bn, _, _ = victim(range(3), **BN)
    with pytest.raises(ValueError, match=r"bn_target='victim'.*grants no BN statistics"):
        build_attack("ig-bn", iterations=1, bn_target="victim").run(bn)
    res = build_attack("ig-fr", iterations=2, bn_target="update").run(plain)  # BN prior skipped: no BN
    assert res.trace["bn_target"] is None
    again = build_attack("ig-fr", iterations=2, bn_target="update").run(plain)  # seeded: same result
    torch.testing.assert_close(res.inputs, again.inputs, rtol=0, atol=0)


def test_imprint_parameters_are_checked():
    base = build_model("lenet", SHAPE, 10)
    with pytest.raises(ValueError, match="strictly increasing"):
        imprint_model(base, torch.tensor([0.3, 0.2, 0.4]), SHAPE)
    with pytest.raises(ValueError, match="num_bins"):
        quantile_bins(torch.rand(10), 1)
    with pytest.raises(ValueError, match="measurement"):
        measurement_vector(SHAPE, "contrast")
    with pytest.raises(ValueError, match="scale"):
        imprint_model(base, torch.tensor([0.1, 0.2]), SHAPE, scale=0)
    t = quantile_bins(torch.linspace(0, 1, 101), 4)
    torch.testing.assert_close(t[1:], torch.tensor([0.25, 0.5, 0.75]))
    assert float(t[0]) < 0
    g = gaussian_bins(0.3, 0.1, 4)
    torch.testing.assert_close(g[2], torch.tensor(0.3))
    model = imprint_model(base, torch.tensor([0.1, 0.2, 0.3]), SHAPE)
    assert isinstance(model, ImprintedModel) and model.imprint.num_bins == 3
    client = build_imprinted(build_model("lenet", SHAPE, 10), SHAPE, 3)
    client.load_state_dict(model.state_dict())  # the client's architecture takes the server's weights
    x = DS.x_test[:2]
    torch.testing.assert_close(client(x), model(x))
