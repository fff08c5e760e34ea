"""Seed 000 (Wang et al., INFOCOM 2022) end to end: LRP perturbation + global update compensation in
a real (in-process) federation, the attacks against it, and what the strategy's compensation does.

All runs go through ``run_experiment`` with ``simulation.backend = "inprocess"`` (the real ClientApp,
strategy, observers and curious server) and are seeded. The numbers in the docstrings were measured
on these exact configs (see docs/seed000.md for the full grids, two seeds).

Paper vs. measurement. Fig. 2 / Table II claim that LRP without compensation loses (all) accuracy
and that compensation restores it to within ~2 points of no defense. With this repository's
compensation (fedsim/compensation.py: flat update -> v x w matrix, Marchenko-Pastur band) that does
not reproduce at any noise level we tried: at the paper's sigma = 0.1, which defeats the attacks,
FedAvg already averages the LRP noise away (no compensation needed), and the compensation removes
most of the *signal* (it keeps 1-3 of 47 directions per round) and costs accuracy; carrying the
removed part into the next round (``compensation_feedback``) gives that accuracy back but does no
better than no compensation. The tests below
pin what was measured; ``test_paper_fig2_claim`` states the paper's claim and is a strict xfail, so
it turns into a failure the day the claim starts to hold (then update docs/seed000.md).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fedsim.app.runner
from fedsim.app.runner import run_experiment
from fedsim.compensation import aggregate_noise_variance, compensate_with_info, matrix_shape
from fedsim.config import ConfigError
from fedsim.reports import read_jsonl

LRP = {"name": "lrp", "slices": 10, "gamma": 0.3, "sigma": 0.1}  # the paper's GIA setting, var 1e-2, 30%

# FedSGD in the attacks' worst case (one sample per batch, one local step) on the tanh LeNet
FEDSGD = ("federation.num_clients=30", "federation.rounds=28", "train.lr=0.1", "train.batch_size=1",
          "train.local_steps=1", 'model.activation="tanh"', 'data.partition="iid"')


def _accuracy(run_dir) -> float:
    """Mean test accuracy over the last 5 rounds (one FedSGD round moves it by a few points)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return float(np.mean([r["accuracy"] for r in rows[-5:]]))


COMP = 'transforms=[{name="mp-compensation"}]'
COMP_EF = 'transforms=[{name="mp-compensation", feedback=true}]'


class _Capture:
    """Wraps the runner's ``build_components`` (a run builds its components once, there) to keep the
    compensation transform the run uses."""

    def __init__(self) -> None:
        self.transforms: list = []
        self._orig = fedsim.app.runner.build_components

    def __call__(self, *a, **kw):
        parts = self._orig(*a, **kw)
        self.transforms.append(parts["transforms"][0] if parts["transforms"] else None)
        return parts


def _rows(run_dir) -> dict[int, dict]:
    return {r["round"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}


# ------------------------------------------------------------------------------------ (a) accuracy
def _make(*sets, **kw):
    from conftest import make_small_cfg

    return make_small_cfg(*sets, **kw)


@pytest.fixture(scope="module")
def accuracy_runs(tmp_path_factory):
    """no defense / LRP / LRP + compensation (without and with error feedback), 30 clients x 28 FedSGD
    rounds, seed 0 (~20 s on a quiet machine; 28 rounds, not the 40 measured before 2026-11-26, to keep the
    suite within its time: every assertion below holds at both, with the numbers in the docstrings)."""
    out = tmp_path_factory.mktemp("seed000-acc")
    runs = {}
    for label, extra, defenses in (("none", (), []), ("lrp", (), [LRP]), ("lrp+comp", (COMP,), [LRP]),
                                   ("lrp+comp+ef", (COMP_EF,), [LRP])):
        cfg = _make(*FEDSGD, *extra, defenses=defenses, output__dir=str(out))
        run_dir = run_experiment(cfg, out=out / label, progress=False)
        runs[label] = {"acc": _accuracy(run_dir), "rows": _rows(run_dir), "model": torch.load(run_dir / "model.pt")}
    return runs


def test_lrp_without_compensation_keeps_accuracy(accuracy_runs):
    """At the noise that defeats the attacks (test_attack_fails_on_lrp), plain FedAvg averages the LRP
    noise away. Measured (mean of the last 5 rounds): no defense 0.524, LRP 0.527 (seed 1: 0.554 / 0.549;
    at 40 rounds 0.637 / 0.636, seed 1 0.626 / 0.625; 50 clients x 60 rounds: 0.744 / 0.738 and
    0.728 / 0.730)."""
    none, lrp = accuracy_runs["none"]["acc"], accuracy_runs["lrp"]["acc"]
    assert none > 0.4, none  # the federation learns at all (chance is 0.1)
    assert abs(lrp - none) <= 0.03, (none, lrp)
    # ... while LRP really perturbed training: every round's clients declared noise, and the final model
    # is another one (an LRP that did nothing would reproduce the undefended run exactly)
    rows = accuracy_runs["lrp"]["rows"]
    assert all(rows[r]["noise_variance"] > 0 for r in rows if r > 0)
    a, b = accuracy_runs["none"]["model"], accuracy_runs["lrp"]["model"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-3


def test_compensation_costs_accuracy_at_the_papers_noise(accuracy_runs):
    """The strategy's MP compensation at sigma = 0.1 keeps only a few of the w = 47 directions of the
    reshaped update in the early rounds (noise and weak signal directions alike are cut) and training
    slows.
    Measured: LRP + compensation 0.152 vs LRP 0.527 (seed 1: 0.417 vs 0.549; at 40 rounds 0.383 vs 0.636,
    seed 1 0.524 vs 0.625; 50 clients x 60 rounds: 0.638 vs 0.738 and 0.656 vs 0.730)."""
    lrp, comp = accuracy_runs["lrp"]["acc"], accuracy_runs["lrp+comp"]["acc"]
    assert comp <= lrp - 0.08, (lrp, comp)
    rows = accuracy_runs["lrp+comp"]["rows"]
    kept = [rows[r]["mp-compensation.kept"] for r in sorted(rows) if r > 0]
    # the matrix the flat update is reshaped into: w = round(sqrt(n / Q)) for the LeNet's n parameters
    n = sum(v.numel() for v in accuracy_runs["none"]["model"].values())
    assert rows[1]["mp-compensation.w"] == matrix_shape(n, 6.0)[1]
    # what this guards: the compensation acts in every round (some directions removed, some kept); it
    # is not skipped and does not zero the update. (Measured: 2-6 of 47 kept in rounds 1-18, 12 by 28.)
    assert all(1 <= k < rows[1]["mp-compensation.w"] for k in kept), kept


def test_error_feedback_gives_back_what_compensation_cost(accuracy_runs):
    """Carrying what the projection removed into the next round (eq. 6's accumulated error) turns the
    lost signal into a delayed one. Measured: LRP + compensation + feedback 0.511 vs 0.152 without
    feedback and 0.527 for LRP alone (seed 1: 0.552 / 0.417 / 0.549; at 40 rounds 0.634 / 0.383 / 0.636,
    seed 1 0.624 / 0.524 / 0.625; 50 clients x 60 rounds, seeds 0 / 1: 0.734 / 0.718 vs 0.638 / 0.656
    and 0.738 / 0.730)."""
    lrp, comp, ef = (accuracy_runs[k]["acc"] for k in ("lrp", "lrp+comp", "lrp+comp+ef"))
    assert ef >= comp + 0.10, (comp, ef)
    assert abs(ef - lrp) <= 0.03, (lrp, ef)


@pytest.mark.xfail(strict=True, reason="seed 000 Fig. 2 does not reproduce with fedsim/compensation.py: "
                   "uncompensated LRP keeps its accuracy, compensation loses it (docs/seed000.md)")
def test_paper_fig2_claim(accuracy_runs):
    """Seed 000 Fig. 2 / Table II: compensated LRP within 2 points of no defense while uncompensated
    LRP is clearly worse."""
    none, lrp = accuracy_runs["none"]["acc"], accuracy_runs["lrp"]["acc"]
    comp = max(accuracy_runs[k]["acc"] for k in ("lrp+comp", "lrp+comp+ef"))
    assert comp >= none - 0.02 and lrp <= none - 0.10, (none, lrp, comp)


# ------------------------------------------------------------------------------------- (b) attacks
ATTACK_SETS = ("federation.num_clients=4", "federation.rounds=1", "train.lr=0.1", "train.batch_size=1",
               "train.local_steps=1", 'model.activation="tanh"')
ATTACK = {"name": ["idlg", "ig"], "rounds": [1], "victims": [0, 1], "seed": 0,
          "params": {"idlg": {"iterations": 300}, "ig": {"iterations": 400}}}


def _leakage(tmp_path, label, defenses, attack) -> dict[str, dict]:
    cfg = _make(*ATTACK_SETS, defenses=defenses, attack=attack, output__dir=str(tmp_path))
    run_dir = run_experiment(cfg, out=tmp_path / label, progress=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {row["attack"]: row for row in summary["leakage"]}


def _muted(attack: dict, patterns: list[str]) -> dict:
    a = json.loads(json.dumps(attack))
    for p in a["params"].values():
        p["muted"] = patterns
    return a


def test_attack_fails_on_lrp_but_succeeds_on_pld_with_fc_muted(tmp_path):
    """Table I / II direction, batch-1 FedSGD round 1 (the paper's worst case), two victims.
    Measured mean SSIM (PSNR): LRP sigma 0.1 -> iDLG 0.071 (5.9 dB), IG 0.239 (10.2 dB; victims 0.18
    and 0.30); PLD (fc pruned 80%) with fc.* muted in the attack -> iDLG 1.000 (98 dB), IG 0.997
    (45.6 dB). For reference: no defense 1.000 / 0.995, PLD attacked naively 0.944 / 0.975.
    IG runs 400 steps: here it has converged by ~100 (2026-11-26, torch 2.14: LRP 0.220 / 0.221 / 0.221
    and PLD muted 0.998 / 1.000 / 1.000 at 100 / 400 / 1000 steps), so the budget does not decide it."""
    lrp = _leakage(tmp_path, "lrp", [LRP], ATTACK)
    pld_muted = _leakage(tmp_path, "pld-muted", [{"name": "pld", "ratio": 0.8}], _muted(ATTACK, ["fc.*"]))
    for name in ("idlg", "ig"):
        assert lrp[name]["attacks_run"] == 2
        assert lrp[name]["ssim"] < 0.35 and lrp[name]["success_content"] == 0.0, (name, lrp[name])
        assert pld_muted[name]["ssim"] > 0.9 and pld_muted[name]["success_content"] == 1.0, (name, pld_muted[name])


def test_attacker_side_compensation_does_not_restore_the_attack(tmp_path):
    """§V-C abuse: the curious server compensates the single victim update (its declared noise
    variance) before attacking. Measured mean SSIM: iDLG 0.079, IG 0.147 (0.071 / 0.239 without it)."""
    attack = {**ATTACK, "compensate": True}
    rows = _leakage(tmp_path, "lrp-abuse", [LRP], attack)
    for name in ("idlg", "ig"):
        assert rows[name]["ssim"] < 0.35 and rows[name]["success_content"] == 0.0, (name, rows[name])


# -------------------------------------------------------------------- (c) compensation in strategy
def test_strategy_applies_compensation_with_the_aggregate_noise_variance(tmp_path, recorder):
    """One round, clients of unequal size (pathological partition): the strategy's noise variance is
    sum_i p_i^2 sigma_i^2 over the replies, each sigma_i^2 = fraction_perturbed * (lr * sigma)^2 is
    what the client's lrp declares, and the new global model is global + compensate(FedAvg update)."""
    lr = 0.05
    cfg = _make("federation.num_clients=4", "federation.rounds=1", f"train.lr={lr}", "train.local_steps=2",
                'data.partition="pathological"', "data.min_per_class=5", "data.max_per_class=40",
                COMP, defenses=[{**LRP, "sigma": 0.5}], output__dir=str(tmp_path))
    run_dir = run_experiment(cfg, out=tmp_path / "run", observers=[recorder], progress=False)
    ups = sorted(recorder.by_round()[1], key=lambda u: u.client_id)
    n = np.array([u.num_examples for u in ups], dtype=np.float64)
    assert len(ups) == 4 and len(set(n)) > 1, "the test needs unequal client sizes"

    # each client's declared variance is its realised perturbed fraction times (lr * sigma)^2
    variances = []
    for u in ups:
        m = u.metrics
        frac = m["defense.0.lrp.fraction_perturbed"]
        assert 0 < frac < 1
        assert m["defense.0.lrp.noise_std"] == pytest.approx(lr * 0.5)
        assert m["noise_variance"] == pytest.approx(frac * (lr * 0.5) ** 2, rel=1e-9)
        variances.append(m["noise_variance"])
    p = n / n.sum()
    expected_var = float(np.sum(p ** 2 * np.array(variances)))
    assert expected_var == pytest.approx(aggregate_noise_variance(n, variances), rel=1e-12)
    assert expected_var != pytest.approx(float(np.mean(variances)) / len(ups), rel=1e-3)  # weights matter

    comp = _rows(run_dir)[1]
    assert comp["mp-compensation.variance"] == pytest.approx(expected_var, rel=1e-9)
    assert comp["mp-compensation.noise_var"] == pytest.approx(expected_var, rel=1e-9)
    assert 0 < comp["mp-compensation.kept"] < comp["mp-compensation.w"]  # some directions were removed

    # the saved global model is the compensated FedAvg update, recomputed here independently
    names = list(ups[0].param_names)
    glob = [np.asarray(a, dtype=np.float64) for a in ups[0].global_weights]
    mean = [sum(pi * np.asarray(u.weights[j], dtype=np.float64) for pi, u in zip(p, ups))
            for j in range(len(names))]
    flat = np.concatenate([(m - g).reshape(-1) for m, g in zip(mean, glob)])  # LeNet: no buffers
    comp_flat, info = compensate_with_info(flat, expected_var, 6.0, "band")
    assert info["kept"] == comp["mp-compensation.kept"]
    saved = torch.load(run_dir / "model.pt")
    got = np.concatenate([saved[k].numpy().astype(np.float64).reshape(-1) - g.reshape(-1)
                          for k, g in zip(names, glob)])
    np.testing.assert_allclose(got, comp_flat, rtol=1e-4, atol=1e-6)
    assert np.linalg.norm(got - flat) > 0.1 * np.linalg.norm(flat)  # and it is not the plain FedAvg mean


def test_paper_variance_formula_option(tmp_path, recorder):
    """``variance = "paper"``: the strategy uses seed 000's printed sigma_hat^2 = m (d/s) sum_i eps_i sigma^2,
    recomputed here from each client's realised perturbed share d/s and sigma, and compensates with it."""
    lr, sigma = 0.05, 0.5
    cfg = _make("federation.num_clients=4", "federation.rounds=1", f"train.lr={lr}", "train.local_steps=2",
                'data.partition="pathological"', "data.min_per_class=5", "data.max_per_class=40",
                'transforms=[{name="mp-compensation", variance="paper"}]', defenses=[{**LRP, "sigma": sigma}],
                output__dir=str(tmp_path))
    run_dir = run_experiment(cfg, out=tmp_path / "run", observers=[recorder], progress=False)
    ups = sorted(recorder.by_round()[1], key=lambda u: u.client_id)
    n = np.array([u.num_examples for u in ups], dtype=np.float64)
    eps = n / n.sum()
    ds = np.array([u.metrics["defense.0.lrp.fraction_perturbed"] for u in ups])
    paper = len(ups) * float(np.sum(eps * ds * (lr * sigma) ** 2))
    comp = _rows(run_dir)[1]
    assert comp["mp-compensation.variance"] == pytest.approx(paper, rel=1e-9)
    assert comp["mp-compensation.noise_var"] == pytest.approx(paper, rel=1e-9)
    mean_rule = aggregate_noise_variance(n, [u.metrics["noise_variance"] for u in ups])
    assert paper > 5 * mean_rule  # the printed formula is m^2 x larger for equal clients (here 4 unequal ones)
    with pytest.raises(ConfigError, match="variance must be one of"):
        _make('transforms=[{name="mp-compensation", variance="exact"}]')


def test_error_feedback_carries_what_compensation_removed(tmp_path, recorder):
    """``compensation_feedback``: round r applies compensate(FedAvg update_r + residual_{r-1}) and keeps
    residual_r = (FedAvg update_r + residual_{r-1}) - applied_r, so that the applied updates plus the
    last residual add up to the plain FedAvg updates exactly."""
    cfg = _make("federation.num_clients=4", "federation.rounds=3", "train.lr=0.05", "train.local_steps=2",
                COMP_EF, defenses=[{**LRP, "sigma": 0.5}], output__dir=str(tmp_path))
    cap = _Capture()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fedsim.app.runner, "build_components", cap)
        run_dir = run_experiment(cfg, out=tmp_path / "run", observers=[recorder], progress=False)
    transform = cap.transforms[-1]
    rows = _rows(run_dir)
    by_round = recorder.by_round()
    names = list(by_round[1][0].param_names)

    def flat(arrays) -> np.ndarray:
        return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])

    saved = torch.load(run_dir / "model.pt")
    globals_ = [flat(by_round[r][0].global_weights) for r in (1, 2, 3)] + [flat([saved[k] for k in names])]
    residual = np.zeros_like(globals_[0])
    raw_total = np.zeros_like(globals_[0])
    for r in (1, 2, 3):
        ups = by_round[r]
        n = np.array([u.num_examples for u in ups], dtype=np.float64)
        raw = sum(p * flat(u.weights) for p, u in zip(n / n.sum(), ups)) - globals_[r - 1]
        var = rows[r]["mp-compensation.variance"]
        applied, info = compensate_with_info(raw + residual, var, 6.0, "band")
        assert 0 < info["kept"] < info["w"]  # the projection removed something every round
        np.testing.assert_allclose(globals_[r] - globals_[r - 1], applied, rtol=1e-4, atol=1e-6)
        residual = raw + residual - applied
        raw_total += raw
        reported = rows[r]["mp-compensation.residual_norm"]
        assert reported == pytest.approx(np.linalg.norm(residual), rel=1e-4)
    np.testing.assert_allclose(flat(transform.residual), residual, rtol=1e-4, atol=1e-6)
    assert np.linalg.norm(residual) > 0.1 * np.linalg.norm(raw_total)
    np.testing.assert_allclose(globals_[3] - globals_[0] + flat(transform.residual), raw_total,
                               rtol=1e-4, atol=1e-5)


def test_compensation_is_skipped_without_declared_noise(small_cfg):
    with_comp = _rows(run_experiment(small_cfg("federation.rounds=1", COMP), progress=False))[1]
    without = _rows(run_experiment(small_cfg("federation.rounds=1", defenses=[LRP]), progress=False))[1]
    assert {k: v for k, v in with_comp.items() if k.startswith("mp-compensation.")} == {"mp-compensation.skipped": 1.0}
    assert not any(k.startswith("mp-compensation.") for k in without)
