"""Seed 000's leakage-risk quantification, risk-balanced slicing and local random perturbation."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from torch import nn
from torch.nn import functional as F

from clients.slicing import (
    _RISK_CACHE,
    LocalRandomPerturbation,
    biased_root,
    num_perturbed,
    reservoir_sample,
)
from clients.slicing_plan import SlicingPlan, build_plan
from clients.slicing_risk import layer_risk
from fedsim.build import client_pipeline
from fedsim.defense import DefensePipeline
from fedsim.models import build_model
from fedsim.models.weights import get_weights, set_weights
from fedsim.training.local import local_train
from fedsim.training.recipe import Recipe

LENET_SIZES = [300, 12, 3600, 12, 3600, 12, 5880, 10]  # LeNet on 1x28x28, 10 classes


class TinyConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.sigmoid(self.conv(x)).flatten(1))


def _tiny(dtype=torch.float64):
    torch.manual_seed(3)
    m = TinyConv().to(dtype)
    x = torch.rand(4, 1, 6, 6, dtype=dtype)
    y = torch.tensor([0, 1, 2, 1])
    return m, x, y


def _covered(plan: SlicingPlan) -> np.ndarray:
    return np.sort(np.concatenate([plan.indices(i) for i in range(plan.num_slices)]))


# --------------------------------------------------------------------------- reservoir sampling


def test_reservoir_sample_exactly_k_distinct():
    gen = torch.Generator().manual_seed(0)
    for n, k in [(10, 3), (10, 1), (10, 10), (5, 8), (1, 1), (7, 0), (100, 37)]:
        for _ in range(20):
            pick = reservoir_sample(n, k, gen)
            assert len(pick) == min(k, n)
            assert len(set(pick)) == len(pick)
            assert all(0 <= p < n for p in pick)


def test_reservoir_sample_uniform_over_subsets():
    gen = torch.Generator().manual_seed(1234)
    n, k, draws = 6, 2, 12000
    subsets = {s: i for i, s in enumerate(itertools.combinations(range(n), k))}
    counts = np.zeros(len(subsets))
    items = np.zeros(n)
    for _ in range(draws):
        pick = reservoir_sample(n, k, gen)
        counts[subsets[tuple(sorted(pick))]] += 1
        items[pick] += 1
    assert chisquare(counts).pvalue > 1e-3
    assert chisquare(items).pvalue > 1e-3


def test_num_perturbed():
    assert num_perturbed(10, 0.3) == 3
    assert num_perturbed(10, 0.01) == 1
    assert num_perturbed(10, 1.0) == 10
    assert num_perturbed(100, 0.29) == 29


# --------------------------------------------------------------------------- risk


def _bruteforce_risk(model, x, y):
    """Row by row: d g_l[k] / d x with double backward, one autograd call per parameter entry."""
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    total = np.zeros(len(names))
    for i in range(len(y)):
        xi = x[i:i + 1].clone().requires_grad_(True)
        loss = F.cross_entropy(model(xi), y[i:i + 1])
        gs = torch.autograd.grad(loss, params, create_graph=True)
        for li, g in enumerate(gs):
            sq = 0.0
            for gk in g.reshape(-1):
                row = torch.autograd.grad(gk, xi, retain_graph=True, allow_unused=True)[0]
                sq += 0.0 if row is None else float((row ** 2).sum())
            total[li] += math.sqrt(sq)
    return dict(zip(names, total / len(y)))


def test_exact_risk_matches_bruteforce_jacobian():
    model, x, y = _tiny()
    exact = layer_risk(model, x, y, "exact")
    brute = _bruteforce_risk(model, x, y)
    assert list(exact) == list(brute)
    for n in exact:
        assert exact[n] > 0
        assert exact[n] == pytest.approx(brute[n], rel=1e-6, abs=1e-12)


def test_randomized_risk_close_to_exact_on_tiny_model():
    model, x, y = _tiny(torch.float32)
    exact = layer_risk(model, x, y, "exact")
    rand = layer_risk(model, x, y, "randomized", probes=512, generator=torch.Generator().manual_seed(7))
    for n in exact:
        assert rand[n] == pytest.approx(exact[n], rel=0.05)
    # deterministic without an explicit generator
    assert layer_risk(model, x, y, "randomized", probes=8) == layer_risk(model, x, y, "randomized", probes=8)


def test_lenet_risk_positive_and_estimators_agree():
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10)
    x = torch.rand(2, 1, 28, 28)
    y = torch.tensor([3, 7])
    exact = layer_risk(model, x, y, "exact", chunk_size=392)
    rand = layer_risk(model, x, y, "randomized", probes=128)
    assert list(exact) == [n for n, _ in model.named_parameters()]
    for n in exact:
        assert exact[n] > 0
        assert rand[n] == pytest.approx(exact[n], rel=0.1)
    # "auto": 2 samples x 784 inputs = 1568 <= 4096 Jacobian-vector products -> exact
    assert layer_risk(model, x, y, "auto", chunk_size=392) == exact


def test_risk_with_batchnorm_does_not_touch_buffers():
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10, norm="batch")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = layer_risk(model, torch.rand(2, 1, 28, 28), torch.tensor([1, 2]), "randomized", probes=4)
    assert all(v > 0 for k, v in r.items() if k.endswith("weight"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# --------------------------------------------------------------------------- slicing


def _naive_lpt(sizes, num_slices, risk):
    """One-block-at-a-time LPT reference: counts[layer, slice]."""
    b = math.gcd(*sizes)
    order = sorted(range(len(sizes)), key=lambda i: (-risk[i], i))
    loads = np.zeros(num_slices)
    counts = np.zeros((len(sizes), num_slices), dtype=int)
    for i in order:
        for _ in range(sizes[i] // b):
            k = int(np.argmin(loads))
            loads[k] += risk[i]
            counts[i, k] += 1
    return counts, loads


def _counts(plan, sizes):
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    counts = np.zeros((len(sizes), plan.num_slices), dtype=int)
    for k, a, e in plan.ranges:
        layer = int(np.searchsorted(offsets, a, side="right") - 1)
        assert e <= offsets[layer + 1], "a range crosses a layer boundary"
        counts[layer, k] += (e - a) // plan.block_size
    return counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_lpt_equals_one_by_one_greedy(seed):
    rng = np.random.default_rng(seed)
    sizes = [int(s) * 4 for s in rng.integers(1, 60, size=7)]
    risk = rng.uniform(0.01, 1.0, size=7)
    plan = build_plan(sizes, 5, risk)
    counts, loads = _naive_lpt(sizes, 5, risk)
    assert np.array_equal(_counts(plan, sizes), counts)
    np.testing.assert_allclose(plan.slice_risk, loads, rtol=1e-9)


@pytest.mark.parametrize("block_risk", ["layer", "share"])
@pytest.mark.parametrize("s", [3, 10, 32])
def test_plan_covers_every_coordinate_once_and_balances_risk(block_risk, s):
    risk = [0.0103, 0.0001, 0.0354, 0.0002, 0.0363, 0.0001, 0.0508, 0.0004]  # measured on LeNet
    plan = build_plan(LENET_SIZES, s, risk, block_risk=block_risk)
    total = sum(LENET_SIZES)
    assert plan.block_size == 2 and plan.num_slices == s and plan.total == total
    assert np.array_equal(_covered(plan), np.arange(total))
    assert plan.slice_sizes().sum() == total
    if block_risk == "layer":  # thousands of small blocks: near-perfect balance
        assert plan.slice_risk.max() / plan.slice_risk.min() <= 1.01
    else:  # one bias block carries R_l * 2 / 12 of a tiny layer: still many blocks per slice
        assert plan.slice_risk.max() / plan.slice_risk.min() <= 1.1
    # the per-slice risk recomputed from the ranges matches the plan's bookkeeping
    b = plan.block_size
    nblocks = np.array(LENET_SIZES) // b
    br = np.array(risk) if block_risk == "layer" else np.array(risk) / nblocks
    per_coord = np.repeat(br / b, LENET_SIZES)
    recomputed = [per_coord[plan.indices(i)].sum() for i in range(s)]
    np.testing.assert_allclose(recomputed, plan.slice_risk, rtol=1e-9)


def test_size_baseline_balances_counts():
    plan = build_plan(LENET_SIZES, 7, method="size")
    sizes = plan.slice_sizes()
    assert sizes.sum() == sum(LENET_SIZES)
    assert sizes.max() - sizes.min() <= plan.block_size
    assert np.array_equal(_covered(plan), np.arange(sum(LENET_SIZES)))
    assert all(len(plan.slice_ranges(i)) == 1 for i in range(7))  # contiguous slices


def test_plan_caps_slices_and_roundtrips_state():
    plan = build_plan([4, 6], 50, [1.0, 2.0])
    assert plan.num_slices == 5  # gcd 2 -> 5 blocks
    again = SlicingPlan.from_state(plan.to_state())
    assert again.digest() == plan.digest()
    flat = np.arange(10.0)
    vals = plan.gather(flat, [0, 2])
    assert np.array_equal(vals, flat[plan.indices([0, 2])])
    out = plan.scatter(torch.zeros(10), [0, 2], torch.ones(len(vals)))
    assert torch.equal(out.bool(), torch.as_tensor(plan.mask([0, 2])))


# --------------------------------------------------------------------------- the defense


@pytest.fixture(scope="module")
def lenet_bn_setup():
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10, norm="batch")
    g = torch.Generator().manual_seed(5)
    x = torch.rand(40, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (40,), generator=g)
    root = (torch.rand(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g))
    return model, get_weights(model), x, y, root


def _run(model, w0, x, y, root, pipeline, client=0, round=1, state=None):
    set_weights(model, w0)
    return local_train(model, x, y, Recipe(0.05, 10, local_steps=2), seed=11, round=round, client=client,
                       pipeline=pipeline, state=state, public_data=root)


def test_lrp_perturbs_exactly_the_chosen_slices(lenet_bn_setup):
    model, w0, x, y, root = lenet_bn_setup
    sigma, lr = 0.2, 0.05
    plain = _run(model, w0, x, y, root, None)
    lrp = LocalRandomPerturbation(slices=8, gamma=0.3, sigma=sigma, root_size=8, risk_method="randomized",
                                  probes=4)
    res = _run(model, w0, x, y, root, DefensePipeline([lrp]))
    names = list(model.state_dict())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    diff = {n: (a.astype(np.float64) - b.astype(np.float64)).reshape(-1)
            for n, a, b in zip(names, res.weights, plain.weights)}
    for n in names:  # BatchNorm buffers are never perturbed
        if n not in trainable:
            assert not diff[n].any(), n
    flat = np.concatenate([diff[n] for n in trainable])
    chosen = lrp.plan.indices(lrp.last_selected)
    assert len(lrp.last_selected) == num_perturbed(8, 0.3) == 2
    assert len(set(lrp.last_selected)) == 2
    mask = np.zeros(flat.size, dtype=bool)
    mask[chosen] = True
    assert not flat[~mask].any()
    assert np.count_nonzero(flat[mask]) == mask.sum()
    noise = flat[mask] / lr  # scale="gradient": the update gets lr * sigma
    assert abs(noise.mean()) < 4 * sigma / math.sqrt(noise.size)
    assert noise.std() == pytest.approx(sigma, rel=0.06)
    frac = mask.sum() / flat.size
    assert res.metrics["defense.0.lrp.fraction_perturbed"] == pytest.approx(frac)
    assert lrp.noise_variance() == pytest.approx(frac * (lr * sigma) ** 2)
    assert res.metrics["defense.0.lrp.slices_perturbed"] == 2


def test_lrp_update_scale_and_state_reuse(lenet_bn_setup):
    model, w0, x, y, root = lenet_bn_setup
    plain = _run(model, w0, x, y, root, None)
    lrp = LocalRandomPerturbation(slices=4, gamma=0.5, sigma=0.01, scale="update", risk="size")
    assert lrp.noise_variance() == pytest.approx(0.5 * 0.01 ** 2)  # before setup: d/s * sigma^2
    res = _run(model, w0, x, y, root, DefensePipeline([lrp]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    names = list(model.state_dict())
    flat = np.concatenate([(a.astype(np.float64) - b).reshape(-1) for n, a, b in
                           zip(names, res.weights, plain.weights) if n in trainable])
    noise = flat[lrp.plan.indices(lrp.last_selected)]
    assert noise.std() == pytest.approx(0.01, rel=0.06)
    digest = res.metrics["defense.0.lrp.plan_digest"]
    # round 2 with the persisted state: the plan is reused, not recomputed
    lrp2 = LocalRandomPerturbation(slices=4, gamma=0.5, sigma=0.01, scale="update", risk="size")
    res2 = _run(model, res.weights, x, y, root, DefensePipeline([lrp2]), round=2, state=res.state)
    assert res2.metrics["defense.0.lrp.plan_round"] == 1
    assert res2.metrics["defense.0.lrp.plan_digest"] == digest


def test_lrp_plan_identical_across_clients(lenet_bn_setup):
    model, w0, x, y, root = lenet_bn_setup
    plans, picks = [], []
    for client in (0, 1):
        _RISK_CACHE.clear()  # each client computes its own risk, as in separate processes
        lrp = LocalRandomPerturbation(slices=6, gamma=0.5, root_size=8, risk_method="randomized", probes=4)
        res = _run(model, w0, x[client * 20:(client + 1) * 20], y[client * 20:(client + 1) * 20], root,
                   DefensePipeline([lrp]), client=client)
        plans.append(res.state)
        picks.append(sorted(lrp.last_selected))
    assert set(plans[0]) == set(plans[1])
    for k in plans[0]:
        if k != "0.plan.round":
            np.testing.assert_array_equal(plans[0][k], plans[1][k])
    assert np.array_equal(plans[0]["0.plan.round"], plans[1]["0.plan.round"])


def test_lrp_per_sample_clipping_matches_manual_loop():
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10)
    x, y = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    B = 0.05
    lrp = LocalRandomPerturbation(risk="size", clip=B)
    pipe = DefensePipeline([lrp])
    from fedsim.defense import DefenseContext

    ctx = DefenseContext(1, 0, torch.Generator().manual_seed(0), tuple(model.state_dict()), {"lr": 0.1})
    lrp.setup(model, ctx)
    assert pipe.defenses[0].overrides_compute_gradient()
    got = lrp.compute_gradient(model, F.cross_entropy, x, y, ctx)
    params = list(model.parameters())
    want = [torch.zeros_like(p) for p in params]
    for i in range(len(y)):
        g = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
        norm = torch.sqrt(sum((t ** 2).sum() for t in g))
        for w, t in zip(want, g):
            w += t / max(1.0, float(norm) / B) / len(y)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert lrp.metrics()["clipped_fraction"] == 1.0
    assert lrp.noise_std() == pytest.approx(0.1 * B * 0.1)  # sigma * B * lr
    assert not LocalRandomPerturbation().overrides_compute_gradient()


def test_lrp_config_validation_and_registration():
    pipe = client_pipeline({"defenses": [{"name": "lrp", "slices": 5, "gamma": 0.2, "risk": "size"}]})
    (lrp,) = pipe.defenses  # the config entry's values reach the defense, defaults fill the rest
    assert isinstance(lrp, LocalRandomPerturbation)
    assert (lrp.slices, lrp.gamma, lrp.risk, lrp.sigma) == (5, 0.2, "size", 0.1)
    for bad in [{"slices": 0}, {"gamma": 0.0}, {"gamma": 1.5}, {"sigma": -1}, {"scale": "x"}, {"risk": "x"},
                {"clip": 0}, {"plan_from": "x"}]:
        with pytest.raises(ValueError):
            LocalRandomPerturbation(**bad)


def test_lrp_needs_public_data_for_sensitivity(lenet_bn_setup):
    model, w0, x, y, _ = lenet_bn_setup
    set_weights(model, w0)
    with pytest.raises(ValueError, match="public"):
        local_train(model, x, y, Recipe(0.05, 10, local_steps=1), seed=0, round=1, client=0,
                    pipeline=DefensePipeline([LocalRandomPerturbation()]), public_data=None)


def test_lrp_reinit_plan_ignores_the_current_weights(lenet_bn_setup):
    model, w0, x, y, root = lenet_bn_setup
    digests = []
    for shift in (0.0, 0.3):
        _RISK_CACHE.clear()
        lrp = LocalRandomPerturbation(slices=5, root_size=4, risk_method="randomized", probes=4,
                                      plan_from="reinit")
        res = _run(model, [w + shift if w.dtype.kind == "f" else w for w in w0], x, y, root,
                   DefensePipeline([lrp]))
        digests.append(res.metrics["defense.0.lrp.plan_digest"])
    assert digests[0] == digests[1]


def test_biased_root_set_table3c():
    """root_bias: that share of the root set comes from one class, the rest from the others in order."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 5, (200,), generator=g)
    assert int((y == 0).sum()) >= 20
    x = torch.arange(200, dtype=torch.float32).reshape(200, 1)
    xs, ys = biased_root(x, y, 40, 0.0)
    assert torch.equal(xs, x[:40]) and torch.equal(ys, y[:40])
    for bias in (0.25, 0.6, 1.0):
        xs, ys = biased_root(x, y, 20, bias)
        assert len(ys) == 20 and int((ys == y.min()).sum()) == round(bias * 20)
        assert torch.equal(ys, y[xs.flatten().long()])  # the samples travel with their labels
        assert len(set(xs.flatten().tolist())) == 20
    with pytest.raises(ValueError, match="root_bias"):
        client_pipeline({"defenses": [{"name": "lrp", "root_bias": 1.5}]})
