"""Stronger attacks: GRNN, the attacks' strongest defaults, all victims of a round at once.

Victims are produced the realistic way (:func:`fedsim.training.local.local_train`, one FedSGD step on
fmnist-small images, DLG's sigmoid LeNet with U(-0.5, 0.5) init); the victims of a round share the
global model. Thresholds were measured on these seeded runs (values in comments) and set with a margin;
``benchmarks/attack_strength.py`` has the full measurement (docs/benchmarks.md).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attacks import AttackInput, build_attack
from attacks._common import FlatParameters, box_penalty, generator, init_dummy, prepare_target
from attacks.base import group_inputs
from attacks.batched import BatchedLBFGS, StackedTarget
from attacks.grnn import grnn_loss, sort_last, sorted_target, wasserstein
from attacks.grnn_generator import GRNNGenerator, build_generator, upsample_conv
from fedsim.data.registry import load_dataset
from fedsim.metrics import score_reconstruction
from fedsim.models import build_model
from fedsim.training.batches import batch_schedule
from fedsim.training.local import local_train
from fedsim.training.recipe import Recipe

DS = load_dataset("fmnist-small")
SHAPE = DS.in_shape


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_round(batches, *, model_seed=0, model="lenet", init="uniform", **model_kw):
    """The victims of one round: one global model, one FedSGD update per batch of image indices."""
    def model_fn():
        return build_model(model, SHAPE, 10, **model_kw)

    torch.manual_seed(model_seed)
    net = build_model(model, SHAPE, 10, init=init, **model_kw)
    global_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    out = []
    for c, idx in enumerate(batches):
        x, y = DS.x_train[list(idx)], DS.y_train[list(idx)]
        net.load_state_dict(global_state)
        recipe = Recipe(lr=0.1, batch_size=len(y), local_steps=1)
        res = local_train(net, x, y, recipe, seed=model_seed, round=0, client=c)
        update = {k: torch.as_tensor(w) - global_state[k] for k, w in zip(global_state, res.weights)}
        first = torch.as_tensor(batch_schedule(model_seed, 0, c, len(y), recipe)[0])
        inp = AttackInput(model_fn, global_state, update, recipe.to_mapping(), SHAPE, 10, len(y), seed=c)
        out.append((inp, x[first], y[first]))
    return out


def scores(results, victims):
    return [score_reconstruction(r.inputs, r.labels, x, y, ssim_threshold=0.9) for r, (_, x, y) in
            zip(results, victims)]


# ------------------------------------------------------------------ GRNN pieces
def test_generator_shapes_and_resolution_handling():
    g = torch.Generator().manual_seed(0)
    gen = build_generator(16, 10, (1, 28, 28), g, torch.device("cpu"), max_width=8)
    with torch.no_grad():
        x, y = gen(torch.randn(3, 16, generator=g))
    assert x.shape == (3, 1, 28, 28) and y.shape == (3, 10)
    assert float(x.min()) >= 0 and float(x.max()) <= 1
    torch.testing.assert_close(y.sum(-1), torch.ones(3))
    assert gen.side == 32 and len(gen.ups) == 3  # 4 -> 8 -> 16 -> 32, centre 28x28 crop
    # "crop": the output is the centre of the 32x32 image the generator draws
    with torch.no_grad():
        h = torch.nn.functional.glu(gen.stem(torch.randn(2, 16, generator=g)[:, :, None, None]), dim=1)
    assert h.shape[-1] == 4
    gen_r = build_generator(16, 10, (3, 20, 20), g, torch.device("cpu"), max_width=8, fit="resize")
    assert gen_r(torch.randn(2, 16))[0].shape == (2, 3, 20, 20)
    # the default plan of the public implementation, capped by max_width
    assert [u.conv.in_channels for u in GRNNGenerator(8, 10, (3, 32, 32), max_width=512).ups] == [128, 64, 32]
    assert [u.conv.in_channels for u in GRNNGenerator(8, 10, (3, 32, 32), max_width=32).ups] == [32, 32, 32]
    # seeded: same generator from the same seed, no global RNG use
    state = torch.random.get_rng_state()
    a = build_generator(16, 10, (1, 28, 28), torch.Generator().manual_seed(5), torch.device("cpu"))
    b = build_generator(16, 10, (1, 28, 28), torch.Generator().manual_seed(5), torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_generator_fast_forms_compute_the_reference_function():
    """The speed-ups of GRNN's step compute what the plain operations do (docs/benchmarks.md)."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(7)
    # nearest x2 + 3x3 convolution in the sub-pixel form, values and gradients
    for co in (2, 6, 32):
        x = torch.randn(3, 5, 6, 7, generator=g, requires_grad=True)
        w = torch.randn(co, 5, 3, 3, generator=g, requires_grad=True)
        ref = F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), w, padding=1)
        fast = upsample_conv(x, w)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
        up = torch.randn(ref.shape, generator=g)
        for a, b in zip(torch.autograd.grad(ref, [x, w], up), torch.autograd.grad(fast, [x, w], up)):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    # the generator (stem as a matrix product, sub-pixel last block) against its modules applied plainly
    gen = build_generator(16, 10, (1, 28, 28), g, torch.device("cpu"), max_width=8)
    z = torch.randn(4, 16, generator=g)
    h = F.glu(gen.stem(z[:, :, None, None]), dim=1)
    for u in gen.ups:
        h = F.glu(u.bn(u.conv(F.interpolate(h, scale_factor=2.0, mode="nearest"))), dim=1)
    torch.testing.assert_close(gen(z)[0], torch.sigmoid(h)[:, :, 2:30, 2:30], rtol=1e-5, atol=1e-6)
    # the NumPy order gives torch.sort's values and gradient (distinct entries)
    a = torch.randn(2, 500, generator=g, requires_grad=True)
    up = torch.randn(2, 500, generator=g)
    ref, fast = torch.sort(a, dim=-1).values, sort_last(a)
    assert torch.equal(ref, fast)
    assert torch.equal(*(torch.autograd.grad(v, a, up)[0] for v in (ref, fast)))
    # one flat tensor under RMSprop moves every weight as RMSprop over the separate tensors does
    def image_branch(gen):
        return [p for n, p in gen.named_parameters() if not n.startswith("label.")]

    def fresh():
        return build_generator(16, 10, (1, 28, 28), torch.Generator().manual_seed(1), torch.device("cpu"), max_width=8)

    plain, flat = fresh(), FlatParameters(fresh(), lambda n: not n.startswith("label."))
    opts = [torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9) for ps in (image_branch(plain), [flat.flat])]
    for _ in range(3):
        ps = image_branch(plain)
        for p, gr in zip(ps, torch.autograd.grad(plain(z)[0].pow(2).sum(), ps)):
            p.grad = gr
        flat.set_grad(torch.autograd.grad(flat(z)[0].pow(2).sum(), flat.params))
        for opt in opts:
            opt.step()
    moved = torch.cat([p.detach().flatten() for p in image_branch(plain)])
    torch.testing.assert_close(flat.flat.detach(), moved)  # the flat tensor moved as the separate weights
    torch.testing.assert_close(flat(z)[0], plain(z)[0])  # and the module runs on it
    assert not torch.equal(moved, torch.cat([p.detach().flatten() for p in image_branch(fresh())]))


def test_wasserstein_distances():
    a = torch.tensor([0.0, 1.0, 2.0, 3.0])
    b = torch.tensor([3.0, 2.0, 1.0, 0.0])  # same values, permuted: same distribution
    assert float(wasserstein(a, b, "w1")) == 0.0 and float(wasserstein(a, b, "w2")) < 1e-6
    assert float(wasserstein(a, b, "l2norm")) == pytest.approx(math.sqrt(9 + 1 + 1 + 9))
    c = a + 0.5  # a shift moves every quantile by 0.5
    assert float(wasserstein(a, c, "w1")) == pytest.approx(0.5)
    assert float(wasserstein(a, c, "w2")) == pytest.approx(0.5)
    stacked = wasserstein(torch.stack([a, a]), torch.stack([b, c]), "w1")
    assert stacked.shape == (2,) and stacked.tolist() == pytest.approx([0.0, 0.5])
    # the attack sorts the fixed target once (sorted_target); the loss and its gradient are unchanged
    g = torch.Generator().manual_seed(3)
    target = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    weights = [1.0, 0.25]
    for w in (None, weights):
        for wd in ("w1", "w2"):
            dummy = [torch.randn(4, 3, generator=g, requires_grad=True), torch.randn(5, generator=g, requires_grad=True)]
            ref, _ = grnn_loss(dummy, target, w, wd)
            fast, _ = grnn_loss(dummy, target, w, wd, target_sorted=sorted_target(target, w, wd))
            torch.testing.assert_close(fast, ref)
            for a_, b_ in zip(torch.autograd.grad(ref, dummy), torch.autograd.grad(fast, dummy)):
                torch.testing.assert_close(a_, b_)


def test_grnn_large_batch_and_multistep_updates():
    """Batch 256 (the paper's largest) runs end to end; a multi-step update is attacked as its average
    gradient or, FedAvg-aware, by replaying the local steps on num_examples generated images."""
    (victim,) = make_round([range(256)])
    res = build_attack("grnn", iterations=1).run(victim[0])
    assert res.inputs.shape == (256, *SHAPE) and res.labels.shape == (256,)
    assert len(res.trace["loss"]) == 1 and math.isfinite(res.trace["loss"][0])
    # label counts inferred from the gradient (measured 249/256)
    assert score_reconstruction(res.inputs, res.labels, victim[1], victim[2])["label_acc"] > 0.9

    torch.manual_seed(0)
    net = build_model("lenet", SHAPE, 10, init="uniform")
    gs = {k: v.detach().clone() for k, v in net.state_dict().items()}
    x, y = DS.x_train[:6], DS.y_train[:6]
    recipe = Recipe(lr=0.05, batch_size=3, local_steps=4)
    out = local_train(net, x, y, recipe, seed=0, round=0, client=0)
    update = {k: torch.as_tensor(w) - gs[k] for k, w in zip(gs, out.weights)}
    inp = AttackInput(lambda: build_model("lenet", SHAPE, 10), gs, update, recipe.to_mapping(), SHAPE, 10, 6)
    plain = build_attack("grnn", iterations=3).run(inp)
    aware = build_attack("grnn", iterations=3, fedavg_aware=True).run(inp)
    assert plain.inputs.shape == (3, *SHAPE) and aware.inputs.shape == (6, *SHAPE)
    assert aware.trace["fedavg_aware"] and all(math.isfinite(v) for v in aware.trace["loss"])
    assert not build_attack("grnn", fedavg_aware=True).batchable()


def test_grnn_parameters_validate():
    for key, bad in (("iterations", 0), ("lr", 0), ("momentum", 1.0), ("wd", "emd"), ("fit", "stretch"),
                     ("labels", "joint"), ("latent_dim", 0), ("max_width", 1), ("restarts", 0)):
        with pytest.raises(ValueError, match=rf"attack\.{key}"):
            build_attack("grnn", **{key: bad})
    for key, bad in (("iterations", 0), ("warm", 0), ("restarts", 0), ("labels", "joint"), ("alpha", -1.0),
                     ("max_width", 1), ("lr", 0), ("box", -1.0)):
        with pytest.raises(ValueError, match=rf"attack\.{key}"):
            build_attack("strongest", **{key: bad})


# ------------------------------------------------------------------ batched machinery
def test_batched_lbfgs_matches_torch_lbfgs():
    """Per-row state: each of 4 problems follows torch.optim.LBFGS (history 5, so the history wraps)
    step for step; the last one starts at its optimum (zero gradient: torch does not move)."""
    g = torch.Generator().manual_seed(0)
    n, V = 12, 4
    mats = [torch.randn(n, n, generator=g) / n ** 0.5 for _ in range(V)]
    A = [m @ m.T + 0.5 * torch.eye(n) for m in mats]
    b = [torch.randn(n, generator=g) for _ in range(V - 1)] + [torch.zeros(n)]

    def f(v, x):
        extra = 0.1 * torch.log(torch.cosh(x)).sum()  # non-quadratic, curvature changes along the path
        return 0.5 * x @ A[v] @ x - b[v] @ x + extra

    x0 = torch.randn(V, n, generator=g)
    x0[V - 1] = 0.0
    ref = []
    for v in range(V):
        x = x0[v].clone().requires_grad_(True)
        opt = torch.optim.LBFGS([x], lr=1.0, max_iter=1, history_size=5, tolerance_grad=0.0, tolerance_change=0.0)
        path = []
        for _ in range(40):
            def closure(opt=opt, v=v, x=x):
                opt.zero_grad()
                loss = f(v, x)
                loss.backward()
                return loss
            opt.step(closure)
            path.append(x.detach().clone())
        ref.append(torch.stack(path))
    opt = BatchedLBFGS(V, n, 1.0, 5)
    x, path = x0.clone(), []
    for _ in range(40):
        xx = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(sum(f(v, xx[v]) for v in range(V)), xx)
        x = x + opt.direction(grad)
        path.append(x.clone())
    path = torch.stack(path, 1)
    for v in range(V):  # measured max deviation 4e-6 (float32 summation order)
        torch.testing.assert_close(path[v], ref[v], atol=5e-5, rtol=1e-4)
    assert float(path[V - 1].abs().max()) == 0.0


@pytest.mark.parametrize("model", ["lenet", "convnet"])
def test_stacked_gradients_equal_each_victims_own(model):
    kw = {} if model == "lenet" else {"init": "default", "width": 4}
    victims = make_round([range(0, 3), range(3, 6), range(6, 9)], model=model, **kw)
    inputs = [v[0] for v in victims]
    st = StackedTarget.build(inputs)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(3, 3, *SHAPE, generator=g)
    y = torch.randint(0, 10, (3, 3), generator=g)
    grads, logits = st.dummy_gradients(x, y)
    for v, inp in enumerate(inputs):
        t = prepare_target(inp)
        own, own_logits = t.dummy_gradients(x[v], y[v])
        for a, b in zip(grads, own):
            torch.testing.assert_close(a[v], b, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(logits[v], own_logits, atol=1e-4, rtol=1e-4)
        for a, n in zip(st.grads, t.matched):  # and the targets are each victim's pseudo-gradient
            assert torch.equal(a[v], t.grads[n])


def test_grouping_by_global_model():
    r0 = make_round([[1], [2]], model_seed=0)
    r1 = make_round([[3]], model_seed=1)
    r4 = make_round([range(4, 8)], model_seed=0)
    inputs = [r0[0][0], r1[0][0], r0[1][0], r4[0][0]]
    assert group_inputs(inputs) == [[0, 2], [1], [3]]  # other model / other batch size run apart
    assert group_inputs(inputs, max_group=1) == [[0], [1], [2], [3]]


def test_run_many_matches_one_by_one():
    """Stacked victims give the results of one-by-one runs. The first iterations agree to float rounding
    (L-BFGS without line search amplifies rounding by ~10x per 5 steps, so long trajectories drift
    apart); the converged reconstructions agree. Element-wise optimisers (IG's Adam, GRNN's RMSprop)
    follow the one-by-one run throughout. A victim of another global model is attacked apart."""
    victims = make_round([[11], [52]]) + make_round([[134]], model_seed=1)  # a stack of two is a stack
    inputs = [v[0] for v in victims]
    attack = build_attack("idlg", iterations=250)
    many = attack.run_many(inputs)
    one = [attack.run(i) for i in inputs]
    for a, b, s_a, s_b in zip(one, many, scores(one, victims), scores(many, victims)):
        np.testing.assert_allclose(a.trace["loss"][:5], b.trace["loss"][:5], rtol=1e-4)
        assert torch.equal(a.labels, b.labels)
        assert s_a["ssim"] > 0.99 and abs(s_a["ssim"] - s_b["ssim"]) < 1e-3, (s_a["ssim"], s_b["ssim"])
    assert [r.trace.get("group_size") for r in many] == [2, 2, None]
    torch.testing.assert_close(one[2].inputs, many[2].inputs)  # the lone victim ran with run()

    pairs = make_round([range(20, 22), range(22, 24)])
    inputs = [v[0] for v in pairs]
    # (attack, parameters, tolerance on the loss curve and on the images): measured deviations
    # IG 2e-5 / 1.4e-3, GRNN 2e-6 / 3e-6, joint-label DLG after 4 L-BFGS steps 5e-5 / 1.3e-5
    for name, params, rtol, atol in (("ig", {"iterations": 60}, 1e-3, 5e-3),
                                     ("grnn", {"iterations": 25, "max_width": 16}, 1e-3, 5e-3),
                                     ("dlg", {"iterations": 4}, 1e-3, 5e-3)):
        attack = build_attack(name, **params)
        many = attack.run_many(inputs)
        for inp, b in zip(inputs, many):
            a = attack.run(inp)
            np.testing.assert_allclose(a.trace["loss"], b.trace["loss"], rtol=rtol)
            torch.testing.assert_close(a.inputs, b.inputs, atol=atol, rtol=0)
            assert torch.equal(a.labels, b.labels)


def test_box_penalty_enters_the_loss_alone_and_stacked():
    """``box`` (DLG/CPL; the ``strongest`` preset's polish) adds ``box * sum(relu(x - 1)^2 + relu(-x)^2)``
    to the loss, not to the watched distance: from a N(0, 1) start (values outside [0, 1]) the first loss
    is the unboxed one plus exactly that; the stacked run gives the one-by-one loss curve."""
    assert float(box_penalty(torch.tensor([[-0.5, 0.5, 1.2]]), (0.0, 1.0))) == pytest.approx(0.29)
    stacked = box_penalty(torch.tensor([[[2.0]], [[0.5]]]), (0.0, 1.0), stacked=True)
    assert stacked.tolist() == [1.0, 0.0] and float(box_penalty(torch.tensor([-3.0]), None)) == 0.0
    pairs = make_round([range(20, 22), range(22, 24)])
    inputs = [v[0] for v in pairs]
    x0 = init_dummy("randn", (2, *SHAPE), generator(inputs[0], 0))  # attempt 0's start, as DLG draws it
    assert float(box_penalty(x0, (0.0, 1.0))) > 1.0
    plain = build_attack("cpl", iterations=4, init="randn").run(inputs[0])
    attack = build_attack("cpl", iterations=4, init="randn", box=0.5)
    boxed = attack.run(inputs[0])
    assert boxed.trace["loss"][0] == pytest.approx(plain.trace["loss"][0] + 0.5 * float(box_penalty(x0, (0.0, 1.0))),
                                                   rel=1e-5)
    assert boxed.trace["loss"][-1] != pytest.approx(plain.trace["loss"][-1], rel=1e-3)  # it steers the steps
    many = attack.run_many(inputs)
    assert many[0].trace.get("group_size") == 2
    for inp, b in zip(inputs, many):
        np.testing.assert_allclose(attack.run(inp).trace["loss"], b.trace["loss"], rtol=1e-3)


def test_run_many_falls_back_where_not_stacked():
    victims = make_round([[5], [6]])
    inputs = [v[0] for v in victims]
    attack = build_attack("idlg", iterations=5, line_search="strong_wolfe")
    assert not attack.batchable()
    res = attack.run_many(inputs)
    assert all("group_size" not in r.trace for r in res)
    torch.testing.assert_close(res[1].inputs, attack.run(inputs[1]).inputs)
    with pytest.raises(ValueError, match="max_group"):
        attack.run_many(inputs, max_group=0)


# ------------------------------------------------------------------ strength
@pytest.mark.slow
def test_grnn_beats_dlg_at_batch_8():
    """Seed 003 Table 3.6's direction: at batch 8 GRNN's generator reconstructs where DLG's pixel
    optimisation does not.

    ``slow`` (``make test-slow``): 3,000 iterations at batch 8, the longest test of the suite (678 s on a
    loaded 2-core machine, CI's size). The claim is measured on more victims at the attacks' defaults by
    ``benchmarks/attack_strength.py`` (docs/benchmarks.md, "Attack strength": ASR at batch 8 GRNN 0.46,
    DLG 0.21) and at full scale by ``fedsim experiment seed003-grnn``; ``make test`` keeps GRNN's pieces
    (generator, loss, label inference, stacking) and the combined preset built on its generator
    (test_strongest_recovers_a_small_batch).

    This variant gives both 1500 iterations (GRNN's cost more CPU); at their
    default 3000 GRNN recovered 4/8 images of this batch with SSIM >= 0.9 and DLG 1/8 (the benchmark
    has 10 victims). Measured here: GRNN SSIM 0.84 0.82 0.82 0.89 0.64 0.90 0.90 0.46 (mean 0.78, 6 of
    8 >= 0.8), joint-label DLG 0.80 0.54 0.58 0.68 0.54 0.85 0.67 0.39 (mean 0.63, 2 >= 0.8); labels
    8/8 for both (GRNN infers them, DLG optimises them). GRNN's label accuracy >= DLG's rests on that
    inference (``labels="idlg"``, the default); the paper's label branch (``labels="generated"``) does
    worse than DLG at batch 8 (docs/attacks.md)."""
    (victim,) = make_round([range(200, 208)])
    grnn = build_attack("grnn", iterations=1500).run(victim[0])
    dlg = build_attack("dlg", iterations=1500).run(victim[0])
    s_grnn, s_dlg = scores([grnn, dlg], [victim, victim])
    g, d = np.asarray(s_grnn["per_image"]["ssim"]), np.asarray(s_dlg["per_image"]["ssim"])
    assert g.mean() > d.mean() + 0.08, (g, d)
    assert (g >= 0.8).sum() >= 5 and (g >= 0.8).sum() >= (d >= 0.8).sum() + 2, (g, d)
    assert s_grnn["label_acc"] >= s_dlg["label_acc"] and s_grnn["label_acc"] >= 0.875


@pytest.mark.slow
def test_strongest_defaults_recover_a_majority_at_batch_4():
    """iDLG at its defaults (a budget of 3000 L-BFGS iterations, patience 100, up to 4 starts) recovers
    the batch: measured SSIM 0.998 0.998 0.997 1.000 (on 10 unseen test batches of 4 the benchmark
    measured the share in docs/benchmarks.md); the budget before the strongest defaults (300
    iterations) does not: measured SSIM 0.77 0.41 0.70 0.86 (mean 0.68).

    ``slow`` (``make test-slow``): about 2,500 L-BFGS iterations at batch 4 (measured: converged at 684,
    then polished until the patience ran out at 2,486), 468 s on a loaded CI-size machine. Stopping at
    the threshold (685 iterations) is no quick substitute: SSIM 0.87 0.75 0.81 0.95. The claim at the
    defaults is measured by ``benchmarks/attack_strength.py`` (docs/benchmarks.md, "Attack strength":
    iDLG ASR 1.00 at batch 4); ``make test`` keeps the quick checks that batch-4 gradient matching recovers images
    (tests/test_attacks.py::test_dlg_batch4_recognisable) and that the combined preset recovers a small
    batch (test_strongest_recovers_a_small_batch)."""
    (victim,) = make_round([range(300, 304)])
    strong = build_attack("idlg").run(victim[0])
    old = build_attack("idlg", iterations=300, restarts=1, patience=None).run(victim[0])
    s_strong, s_old = scores([strong, old], [victim, victim])
    assert sum(s >= 0.9 for s in s_strong["per_image"]["ssim"]) >= 3, s_strong["per_image"]["ssim"]
    assert s_strong["label_acc"] == 1.0 and strong.trace["iterations"] <= 3000
    assert s_old["ssim"] < s_strong["ssim"] - 0.2, (s_old["ssim"], s_strong["ssim"])


def test_grnn_stacks_small_batches_only():
    """GRNN stacks victims with batches of at most 4 images (measured faster) and runs larger ones one by
    one (stacked it measured 0.77x at batch 8), with the same results either way."""
    from attacks.grnn import GRNN

    attack = build_attack("grnn", iterations=2, max_width=8)
    big = [v[0] for v in make_round([range(0, GRNN.STACK_MAX_BATCH + 1), range(10, GRNN.STACK_MAX_BATCH + 11)])]
    res = attack.run_many(big)
    assert all("group_size" not in r.trace for r in res)
    torch.testing.assert_close(res[0].inputs, attack.run(big[0]).inputs)
    small = [v[0] for v in make_round([range(0, 2), range(10, 12)])]
    assert [r.trace.get("group_size") for r in attack.run_many(small)] == [2, 2]


# ------------------------------------------------------------------ progress and stopping of stacked loops
def test_stacked_attacks_report_progress_and_stop_when_asked(monkeypatch, capsys):
    """Every stacked loop (batched L-BFGS, IG's and GRNN's stacks) reports each iteration to the open
    progress task - the iteration, the lowest gradient distance in the stack, the victims - and stops
    within one iteration when the run's stop is requested (what Ctrl-C does on Ray, where the signal
    handler runs in another thread)."""
    import threading
    import time

    from fedsim import progress
    from fedsim.interrupt import RunInterrupted, StopSignal

    monkeypatch.setattr(progress, "_level", progress.NORMAL)
    monkeypatch.setenv("FEDSIM_PROGRESS_INTERVAL", "0")  # a line per iteration
    inputs = [v[0] for v in make_round([[5], [6]])]
    for name, params in (("idlg", {"iterations": 4, "patience": None, "threshold": None}),
                         ("ig", {"iterations": 4}), ("grnn", {"iterations": 4, "max_width": 8})):
        capsys.readouterr()
        with progress.task(f"attack {name}", total=4):
            res = build_attack(name, **params).run_many(inputs)
        assert [r.trace["group_size"] for r in res] == [2, 2]
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(f"[fedsim] attack {name}  it ")]
        for it in (1, 2, 3, 4):
            assert any(f"it {it}/4  min distance " in ln and "victims 2/2" in ln for ln in lines), (name, lines)
        assert "done in" in lines[-1]

    # the stop is requested from another thread (as Ray's signal handler does) during iteration 3; the loop
    # must end at its next safe point - counted in iterations, not seconds (robust to a loaded machine)
    stop = StopSignal()
    attack = build_attack("idlg", iterations=10**6, patience=None, threshold=None)  # minutes if not stopped
    ticks: list[int] = []
    tick = progress.tick

    def counting(done, *a, **k):
        ticks.append(done)
        if done == 3:
            t = threading.Thread(target=stop.request, args=("SIGINT",))
            t.start()
            t.join()
        tick(done, *a, **k)  # a safe point: raises RunInterrupted once the stop is requested

    monkeypatch.setattr(progress, "tick", counting)
    t0 = time.perf_counter()
    with stop.watching(), progress.task("attack idlg", total=10**6):
        with pytest.raises(RunInterrupted, match="SIGINT"):
            attack.run_many(inputs)
    assert ticks == [1, 2, 3]  # no iteration after the one in which the stop was requested
    print(f"stopped after {time.perf_counter() - t0:.2f} s")  # measured 0.52 s (reported, not asserted)


def test_strongest_recovers_a_small_batch():
    """The combined preset (attacks.strongest: label counts from the gradient, GRNN's generator as the start
    of L-BFGS on the pixels) recovers a batch of 2 within a small budget: measured SSIM 0.9994 and 0.9998
    after 100 generator steps and 199 L-BFGS iterations with the box term (gradient distance 1.1e-5;
    without it, box=0: 0.998 and 0.999, distance 2.3e-4; about 8 CPU seconds; the benchmark measures it
    at its defaults)."""
    (victim,) = make_round([range(600, 602)], model_seed=5)
    res = build_attack("strongest", iterations=300, warm=100).run(victim[0])
    (s,) = scores([res], [victim])
    assert s["label_acc"] == 1.0 and min(s["per_image"]["ssim"]) >= 0.95, s["per_image"]["ssim"]
    rounds = res.trace["rounds"]
    assert res.trace["iterations"] <= 300 and rounds[0]["generator"] == 100 and rounds[0]["polish"] > 0
