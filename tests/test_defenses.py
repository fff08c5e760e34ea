"""Each client defense does what it says (noise, clipping, DP-SGD, pruning, compression, PLD, dropout)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from torch.nn import functional as F

from clients.clipping import DPSGD, ClipGradient, ClipUpdate
from clients.noise import GaussianNoise, LaplaceNoise
from clients.pruning import PLD, Compress, GradDropout, Prune
from fedsim.build import client_pipeline
from fedsim.defense import DefenseContext
from fedsim.models import build_model
from fedsim.models.weights import param_names
from fedsim.training.local import local_train
from fedsim.training.recipe import Recipe


def _model(norm: str = "none", hidden=(64,), n_in: int = 20, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", (n_in,), 3, norm=norm, hidden=hidden)


def _ctx(model, *, state=None, seed: int = 0, num_examples: int = 0, batch_size: int = 8) -> DefenseContext:
    return DefenseContext(round=1, client_id=0, generator=torch.Generator().manual_seed(seed),
                          param_names=tuple(param_names(model)),
                          recipe={"lr": 0.1, "batch_size": batch_size, "local_steps": 1},
                          state={} if state is None else state, num_examples=num_examples)


def _zero_update(model) -> list[torch.Tensor]:
    return [torch.zeros_like(v, dtype=torch.float32) for v in model.state_dict().values()]


def _random_update(model, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(v.shape, generator=g) for v in model.state_dict().values()]


def _param_mask(model) -> list[bool]:
    params = dict(model.named_parameters())
    return [k in params for k in model.state_dict()]


def _data(n: int = 32, n_in: int = 20, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, n_in, generator=g), torch.randint(0, 3, (n,), generator=g)


# ----------------------------------------------------------------------------------------- noise


@pytest.mark.parametrize("kw,std", [({"variance": 1e-2}, 0.1), ({"sigma": 0.05}, 0.05)])
def test_gaussian_noise_std_and_only_parameters(kw, std):
    model = _model(norm="batch", hidden=(200,), n_in=100)
    d = GaussianNoise(**kw)
    ctx = _ctx(model)
    d.setup(model, ctx)
    out = d.transform_update(_zero_update(model), ctx)
    pm = _param_mask(model)
    noise = torch.cat([o.reshape(-1) for o, p in zip(out, pm, strict=True) if p])
    assert noise.numel() > 20000
    assert abs(float(noise.std()) / std - 1) < 0.03
    assert abs(float(noise.mean())) < 4 * std / math.sqrt(noise.numel())
    for k, o, p in zip(model.state_dict(), out, pm, strict=True):
        if not p:  # BN running stats and num_batches_tracked are untouched
            assert torch.count_nonzero(o) == 0, k
    assert d.noise_variance() == pytest.approx(std ** 2)
    assert d.metrics()["noise_std"] == pytest.approx(std)
    assert d.metrics()["empirical_std"] == pytest.approx(std, rel=0.03)


def test_noise_buffers_option_never_touches_integer_buffers():
    model = _model(norm="batch", hidden=(16,))
    d = GaussianNoise(sigma=0.1, include_buffers=True)
    ctx = _ctx(model)
    d.setup(model, ctx)
    out = dict(zip(model.state_dict(), d.transform_update(_zero_update(model), ctx), strict=True))
    assert torch.count_nonzero(out["body.2.running_mean"]) > 0
    assert torch.count_nonzero(out["body.2.num_batches_tracked"]) == 0


@pytest.mark.parametrize("kw,b", [({"scale": 0.05}, 0.05), ({"variance": 2 * 0.03 ** 2}, 0.03)])
def test_laplace_noise_std_and_shape(kw, b):
    model = _model(hidden=(200,), n_in=100)
    d = LaplaceNoise(**kw)
    ctx = _ctx(model)
    d.setup(model, ctx)
    noise = torch.cat([o.reshape(-1) for o in d.transform_update(_zero_update(model), ctx)]).double()
    assert abs(float(noise.std()) / (math.sqrt(2) * b) - 1) < 0.03
    # E|X| = b for Laplace (a Gaussian of the same std would give 0.80 * sqrt(2) b = 1.13 b)
    assert abs(float(noise.abs().mean()) / b - 1) < 0.03
    assert d.noise_variance() == pytest.approx(2 * b * b)
    assert d.metrics()["noise_std"] == pytest.approx(math.sqrt(2) * b)


def test_noise_is_reproducible_from_ctx_generator():
    model = _model(hidden=(8,))
    outs = []
    for seed in (3, 3, 4):
        d, ctx = GaussianNoise(sigma=1.0), _ctx(model, seed=seed)
        d.setup(model, ctx)
        outs.append(d.transform_update(_zero_update(model), ctx)[0])
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


# ----------------------------------------------------------------------------------------- clipping


def test_clip_update_bounds_norm():
    model = _model(norm="batch", hidden=(16,))
    upd = _random_update(model, 0)
    pm = _param_mask(model)
    norm = math.sqrt(sum(float((u ** 2).sum()) for u, p in zip(upd, pm, strict=True) if p))
    d = ClipUpdate(clip_norm=norm / 4)
    ctx = _ctx(model)
    d.setup(model, ctx)
    out = d.transform_update(upd, ctx)
    new = math.sqrt(sum(float((o ** 2).sum()) for o, p in zip(out, pm, strict=True) if p))
    assert new == pytest.approx(norm / 4, rel=1e-5)
    for o, u, p in zip(out, upd, pm, strict=True):
        if p:
            assert torch.allclose(o, u / 4, atol=1e-6)  # a scaling, not a per-entry clamp
        else:
            assert torch.equal(o, u)
    assert d.metrics()["clipped"] == 1.0
    big = ClipUpdate(clip_norm=norm * 2)
    big.setup(model, ctx)
    assert all(torch.equal(a, b) for a, b in zip(big.transform_update(upd, ctx), upd, strict=True))


def test_clip_gradient_bounds_each_step():
    model = _model(hidden=(16,))
    d = ClipGradient(clip_norm=0.5)
    ctx = _ctx(model)
    d.setup(model, ctx)
    grads = [torch.randn(p.shape) for p in model.parameters()]
    out = d.transform_gradient(grads, ctx)
    assert math.sqrt(sum(float((g ** 2).sum()) for g in out)) == pytest.approx(0.5, rel=1e-5)
    assert d.metrics()["clipped_fraction"] == 1.0


# ----------------------------------------------------------------------------------------- DP-SGD


def _manual_per_sample(model, x, y) -> list[list[torch.Tensor]]:
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(len(y)):
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        out.append([g.detach() for g in torch.autograd.grad(loss, params)])
    return out


def test_dp_sgd_per_sample_clipping_matches_manual_loop():
    model = _model(hidden=(32,))
    x, y = _data(12)
    manual = _manual_per_sample(model, x, y)
    norms = torch.tensor([math.sqrt(sum(float((g ** 2).sum()) for g in gs)) for gs in manual])
    clip = float(norms.median())
    d = DPSGD(clip_norm=clip, noise_multiplier=0.0)
    ctx = _ctx(model, num_examples=100, batch_size=12)
    d.setup(model, ctx)
    # the per-sample gradients torch.func gives equal the manual per-sample loop
    ps = d.per_sample_gradients(model, F.cross_entropy, x, y)
    for j, g in enumerate(ps):
        assert torch.allclose(g, torch.stack([m[j] for m in manual]), atol=1e-6)
    clipped, got_norms = d.clip(ps)
    assert torch.allclose(got_norms.float(), norms, rtol=1e-5)
    clipped_norms = torch.sqrt(sum((c.reshape(len(y), -1) ** 2).sum(1) for c in clipped))
    assert (clipped_norms <= clip * (1 + 1e-5)).all()
    # with noise 0, the batch gradient is the mean of the clipped per-sample gradients
    grads = d.compute_gradient(model, F.cross_entropy, x, y, ctx)
    factors = [min(1.0, clip / float(n)) for n in norms]
    for j, g in enumerate(grads):
        expect = sum(f * m[j] for f, m in zip(factors, manual, strict=True)) / len(y)
        assert torch.allclose(g, expect, atol=1e-6)
    m = d.metrics()
    assert m["clipped_fraction"] == pytest.approx(float((norms > clip).float().mean()))
    assert 0 < m["clipped_fraction"] < 1
    assert m["mean_per_sample_norm"] == pytest.approx(float(norms.mean()), rel=1e-5)
    assert "epsilon" not in m  # no noise: no finite epsilon


def test_dp_sgd_noise_scale():
    model = _model(hidden=(64,))
    x, y = _data(16)
    clean = DPSGD(clip_norm=1.0).compute_gradient(model, F.cross_entropy, x, y, _ctx(model))
    noisy = DPSGD(clip_norm=1.0, noise_multiplier=2.0).compute_gradient(model, F.cross_entropy, x, y, _ctx(model))
    diff = torch.cat([(a - b).reshape(-1) for a, b in zip(noisy, clean, strict=True)])
    assert abs(float(diff.std()) / (2.0 * 1.0 / 16) - 1) < 0.1


def test_dp_sgd_rejects_batchnorm_in_train_mode():
    model = _model(norm="batch", hidden=(16,)).train()
    d = DPSGD(clip_norm=1.0)
    with pytest.raises(ValueError, match="BatchNorm"):
        d.setup(model, _ctx(model))
    x, y = _data(4)
    with pytest.raises(ValueError, match="BatchNorm"):
        d.compute_gradient(model, F.cross_entropy, x, y, _ctx(model))


def test_dp_sgd_accountant_accumulates_over_rounds_via_state():
    x, y = _data(40)
    recipe = Recipe(lr=0.1, batch_size=8, local_steps=3)
    pipe = client_pipeline({"defenses": [{"name": "dp-sgd", "clip_norm": 1.0, "noise_multiplier": 1.1, "delta": 1e-5}]})
    state, eps = {}, []
    for rnd in range(1, 4):
        model = _model(hidden=(16,))
        res = local_train(model, x, y, recipe, seed=0, round=rnd, client=0, pipeline=pipe, state=state)
        state = res.state
        m = res.metrics
        assert m["defense.0.dp-sgd.sample_rate"] == pytest.approx(8 / 40)
        assert m["defense.0.dp-sgd.total_steps"] == 3 * rnd
        eps.append(m["defense.0.dp-sgd.epsilon"])
        ref = RDPAccountant()
        ref.history = [(1.1, 8 / 40, 3 * rnd)]
        assert eps[-1] == pytest.approx(ref.get_epsilon(delta=1e-5), rel=1e-9)
    assert all(math.isfinite(e) and e > 0 for e in eps)
    assert eps[0] < eps[1] < eps[2]


# ----------------------------------------------------------------------------------------- pruning


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.8, 0.9, 1.0])
def test_prune_global_exact_sparsity_keeps_largest(ratio):
    model = _model(norm="batch", hidden=(32,))
    upd = _random_update(model, 1)
    d = Prune(ratio=ratio)
    ctx = _ctx(model)
    d.setup(model, ctx)
    out = d.transform_update(upd, ctx)
    pm = _param_mask(model)
    flat_in = torch.cat([u.reshape(-1) for u, p in zip(upd, pm, strict=True) if p])
    flat_out = torch.cat([o.reshape(-1) for o, p in zip(out, pm, strict=True) if p])
    n = flat_in.numel()
    assert int((flat_out == 0).sum()) == round(ratio * n)
    kept = flat_out != 0
    if 0 < ratio < 1:
        assert float(flat_in[kept].abs().min()) >= float(flat_in[~kept].abs().max())
        assert torch.equal(flat_out[kept], flat_in[kept])
    for o, u, p in zip(out, upd, pm, strict=True):
        if not p:
            assert torch.equal(o, u)
    assert d.metrics()["sparsity"] == pytest.approx(round(ratio * n) / n)


def test_prune_per_layer_exact_and_ties():
    model = _model(hidden=(32,))
    upd = [torch.ones_like(u) for u in _random_update(model, 2)]  # all ties
    d = Prune(ratio=0.25, scope="layer")
    ctx = _ctx(model)
    d.setup(model, ctx)
    for o in d.transform_update(upd, ctx):
        assert int((o == 0).sum()) == round(0.25 * o.numel())


# ----------------------------------------------------------------------------------------- compression


def test_compress_error_feedback_loses_nothing():
    model = _model(norm="batch", hidden=(32,))
    d = Compress(ratio=0.9)
    pm = _param_mask(model)
    state: dict[str, np.ndarray] = {}
    sent_sum = [torch.zeros_like(u) for u in _zero_update(model)]
    raw_sum = [torch.zeros_like(u) for u in _zero_update(model)]
    prev_residual = None
    for rnd in range(4):
        upd = _random_update(model, 10 + rnd)
        ctx = _ctx(model, state=state)
        d.setup(model, ctx)
        out = d.transform_update(upd, ctx)
        state = ctx.state
        n = sum(o.numel() for o, p in zip(out, pm, strict=True) if p)
        assert sum(int((o != 0).sum()) for o, p in zip(out, pm, strict=True) if p) == n - round(0.9 * n)
        if prev_residual is not None:  # the selection used update + residual, not the raw update
            plain, pc = Compress(ratio=0.9), _ctx(model)
            plain.setup(model, pc)
            assert any(not torch.equal(a, b) for a, b in zip(out, plain.transform_update(upd, pc), strict=True))
        prev_residual = {k: v.copy() for k, v in state.items()}
        for i in range(len(out)):
            sent_sum[i] += out[i]
            raw_sum[i] += upd[i]
    for i, k in enumerate(model.state_dict()):
        total = sent_sum[i] + (torch.as_tensor(state[f"residual.{k}"]) if pm[i] else 0)
        assert torch.allclose(total, raw_sum[i], atol=1e-5), k
        if not pm[i]:
            assert f"residual.{k}" not in state and torch.equal(sent_sum[i], raw_sum[i])
    assert d.metrics()["residual_norm"] > 0


# ----------------------------------------------------------------------------------------- PLD


def test_pld_touches_only_last_linear():
    model = _model(hidden=(32, 16))
    upd = _random_update(model, 3)
    d = PLD(ratio=0.6)
    ctx = _ctx(model)
    d.setup(model, ctx)
    out = d.transform_update(upd, ctx)
    names = list(model.state_dict())
    assert set(d.selected_names(ctx)) == {"fc.weight", "fc.bias"}
    fc_n = 0
    fc_zero = 0
    for k, o, u in zip(names, out, upd, strict=True):
        if k.startswith("fc."):
            fc_n += u.numel()
            fc_zero += int((o == 0).sum())
        else:
            assert torch.equal(o, u), k
    assert fc_zero == round(0.6 * fc_n)


def test_pld_layer_patterns():
    model = _model(hidden=(32, 16))
    upd = _random_update(model, 4)
    d = PLD(ratio=0.5, layers=["body.1.*"])
    ctx = _ctx(model)
    d.setup(model, ctx)
    out = d.transform_update(upd, ctx)
    for k, o, u in zip(model.state_dict(), out, upd, strict=True):
        assert torch.equal(o, u) != k.startswith("body.1."), k
    with pytest.raises(ValueError, match="match no parameter"):
        PLD(ratio=0.5, layers=["nothing.*"]).transform_update(upd, ctx)


# ----------------------------------------------------------------------------------------- dropout


def test_grad_dropout_fraction():
    d = GradDropout(p=0.3)
    ctx = DefenseContext(1, 0, torch.Generator().manual_seed(0), (), {})
    grads = [torch.ones(200, 300), torch.ones(50_000)]
    out = d.transform_gradient(grads, ctx)
    zeros = sum(int((o == 0).sum()) for o in out) / sum(o.numel() for o in out)
    assert abs(zeros - 0.3) < 0.01
    assert d.metrics()["dropped_fraction"] == pytest.approx(zeros)
    assert all(set(torch.unique(o).tolist()) <= {0.0, 1.0} for o in out)
    r = GradDropout(p=0.3, rescale=True).transform_gradient(grads, ctx)
    assert abs(float(torch.cat([o.reshape(-1) for o in r]).mean()) - 1.0) < 0.02


# ----------------------------------------------------------------------------------------- config


def test_client_pipeline_errors():
    with pytest.raises(ValueError, match=r"defenses\[0\]\.name"):
        client_pipeline({"defenses": [{"name": "no-such-defense"}]})
    with pytest.raises(ValueError, match=r"defenses\[1\]\.sigmaa"):
        client_pipeline({"defenses": [{"name": "prune", "ratio": 0.5}, {"name": "gaussian-noise", "sigmaa": 0.1}]})
    with pytest.raises(ValueError, match=r"defenses\[0\].*ratio"):
        client_pipeline({"defenses": [{"name": "compress"}]})
    with pytest.raises(ValueError, match=r"defenses\[0\].*exactly one"):
        client_pipeline({"defenses": [{"name": "gaussian-noise"}]})
    with pytest.raises(ValueError, match=r"defenses\[0\].*ratio"):
        client_pipeline({"defenses": [{"name": "prune", "ratio": 1.5}]})
    with pytest.raises(ValueError, match="only one defense may compute gradients"):
        client_pipeline({"defenses": [{"name": "dp-sgd", "clip_norm": 1.0}, {"name": "dp-sgd", "clip_norm": 2.0}]})
    (pld,) = client_pipeline({"defenses": [{"name": "pld", "ratio": 0.6, "layers": ["fc.*"]}]}).defenses  # the entry's values
    assert (type(pld).__name__, pld.ratio, pld.layers, pld.scope) == ("PLD", 0.6, ["fc.*"], "global")


# ----------------------------------------------------------------------------------------- end to end


def _sent(model0_sd, weights):
    return [torch.as_tensor(w).float() - v.float() for v, w in zip(model0_sd.values(), weights, strict=True)]


def test_local_train_two_defenses_metrics_and_state_round_trip():
    x, y = _data(32)
    recipe = Recipe(lr=0.5, batch_size=8, local_steps=2)
    pipe = client_pipeline({"defenses": [{"name": "compress", "ratio": 0.8}, {"name": "gaussian-noise", "sigma": 0.0}]})
    sd0 = _model(hidden=(16,)).state_dict()
    state: dict[str, np.ndarray] = {}
    sent_total = raw_total = None
    for rnd in (1, 2):
        res = local_train(_model(hidden=(16,)), x, y, recipe, seed=0, round=rnd, client=0, pipeline=pipe,
                          state=state)
        raw = local_train(_model(hidden=(16,)), x, y, recipe, seed=0, round=rnd, client=0)
        assert any(k.startswith("defense.0.compress.") for k in res.metrics)
        assert any(k.startswith("defense.1.gaussian-noise.") for k in res.metrics)
        assert res.metrics["defense.0.compress.sent_fraction"] == pytest.approx(0.2, abs=0.01)
        assert set(res.state) == {f"0.residual.{k}" for k in sd0}
        sent, r = _sent(sd0, res.weights), _sent(sd0, raw.weights)
        sent_total = sent if sent_total is None else [a + b for a, b in zip(sent_total, sent, strict=True)]
        raw_total = r if raw_total is None else [a + b for a, b in zip(raw_total, r, strict=True)]
        state = res.state
    for k, s, r in zip(sd0, sent_total, raw_total, strict=True):
        assert torch.allclose(s + torch.as_tensor(state[f"0.residual.{k}"]), r, atol=1e-5), k


# ------------------------------------------------------------------------ Flower's own mods (local DP)
def test_flower_local_dp_mod_wraps_training_and_clips_plus_noises_the_update(tmp_path):
    """[[client.flower_mods]] runs Flower's LocalDpMod around the ClientApp's train handler. Clipping and
    noise are checked apart: with negligible noise every update norm equals the clipping norm (the
    plain updates are 10x longer); with a clipping norm no update reaches, the returned model minus the
    plain one is Flower's Gaussian noise of std sensitivity * sqrt(2 ln(1.25 / delta)) / epsilon (within
    5% over ~13k entries)."""
    from conftest import RecordingObserver, make_small_cfg

    from fedsim.app.runner import run_experiment

    def updates(extra, label):
        cfg = make_small_cfg("federation.rounds=1", f"output.dir='{tmp_path}'", **extra)
        rec = RecordingObserver()
        run_experiment(cfg, out=tmp_path / label, observers=[rec], progress=False)
        return sorted(rec.updates, key=lambda u: u.client_id)

    def norm(u):
        return float(np.sqrt(sum((d.astype(np.float64) ** 2).sum() for d in u.delta())))

    def mod(clip, b):
        return {"client__flower_mods": [{"name": "local-dp", "clipping_norm": clip, "sensitivity": b,
                                         "epsilon": 1.0, "delta": 1e-5}]}

    plain = updates({}, "plain")
    clip = 0.002  # the plain updates here have norms of 0.02 and more
    assert min(norm(u) for u in plain) > 10 * clip  # so that clipping acts
    clipped = updates(mod(clip, 1e-9), "clipped")
    assert all(norm(u) == pytest.approx(clip, rel=1e-3) for u in clipped), [norm(u) for u in clipped]
    b = 1e-3
    noised = updates(mod(1e6, b), "noised")
    for p, n in zip(plain, noised):
        diff = np.concatenate([(w.astype(np.float64) - v.astype(np.float64)).ravel()
                               for w, v in zip(n.weights, p.weights)])
        assert diff.size > 10_000
        std = b * np.sqrt(2 * np.log(1.25 / 1e-5)) / 1.0
        assert diff.std() == pytest.approx(std, rel=0.05)
        assert abs(diff.mean()) < 5 * std / np.sqrt(diff.size)


def test_flower_local_dp_noise_is_a_function_of_seed_round_and_client(tmp_path):
    """Flower's LocalDpMod draws from NumPy's global generator, which nothing seeds in a Ray actor: fedsim
    seeds it per (seed, round, client) just before the draw. Here something else consumes that generator
    between the rounds (as another client or library would in an actor): round 2's noisy models stay the
    same; without the seeding they differ."""
    from conftest import RecordingObserver, make_small_cfg

    from fedsim.app.runner import run_experiment

    class Consumer(RecordingObserver):
        def on_round_end(self, round, metrics):
            super().on_round_end(round, metrics)
            np.random.random(1000)

    mod = {"client__flower_mods": [{"name": "local-dp", "clipping_norm": 1e6, "sensitivity": 1e-3,
                                    "epsilon": 1.0, "delta": 1e-5}]}
    got = []
    for label, rec in (("a", RecordingObserver()), ("b", Consumer())):
        cfg = make_small_cfg("federation.rounds=2", f"output.dir='{tmp_path}'", **mod)
        run_experiment(cfg, out=tmp_path / label, observers=[rec], progress=False)
        got.append(sorted(rec.by_round()[2], key=lambda u: u.client_id))
    for a, b in zip(*got, strict=True):
        for x, y in zip(a.weights, b.weights, strict=True):
            np.testing.assert_array_equal(x, y)


def test_flower_mod_config_errors_name_the_key():
    from fedsim.app import load_config
    from fedsim.config import ConfigError

    with pytest.raises(ConfigError, match=r"client\.flower_mods\[0\]\.name"):
        load_config(None, ["client.flower_mods=[{name='nope'}]", "train.local_steps=1"])
    with pytest.raises(ConfigError, match=r"client\.flower_mods\[0\] \(local-dp\) needs"):
        load_config(None, ["client.flower_mods=[{name='local-dp', clipping_norm=1.0}]", "train.local_steps=1"])


def test_a_defense_computing_the_gradient_updates_batchnorm_statistics_once_per_step():
    """With per-sample clipping the gradient comes from the defense and local_train runs one more
    forward for its metrics; BatchNorm's running statistics must still move once per step, exactly as
    in plain training (same initial model, same batch, one step)."""
    from fedsim.app import load_config
    from fedsim.factories import client_data, model_for
    from fedsim.training.recipe import Recipe

    cfg = load_config(None, ['model.norm="batch"', "train.local_steps=1", "train.batch_size=8",
                             "federation.num_clients=4"])
    x, y = client_data(cfg, 0)
    out = []
    for entries in ([], [{"name": "clip-gradient", "clip_norm": 1.0}]):
        torch.manual_seed(0)
        model = model_for(cfg)
        names = list(model.state_dict())
        res = local_train(model, x, y, Recipe.from_mapping(cfg["train"]), seed=0, round=1, client=0,
                          pipeline=client_pipeline({"defenses": entries}))
        out.append({n: w for n, w in zip(names, res.weights) if "running_" in n})
    assert out[0] and all(np.array_equal(out[0][k], out[1][k]) for k in out[0])
