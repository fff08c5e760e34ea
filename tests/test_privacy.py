"""Differential privacy a researcher can quote: Flower's central-DP wrappers around fedsim's rules
(strategies/dp.py), the (epsilon, delta) ledger of every DP setting (fedsim/privacy.py), and the curious
server's membership audit (attacks/membership_server.py).

In-process runs use the small federation of conftest (4 clients, ReLU LeNet, 3 local steps of 16); one run
goes through Ray."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from fedsim.app.client import client_app
from fedsim.app.server import Server
from fedsim.build import build_components
from fedsim.components import OBSERVERS
from fedsim.config import ConfigError
from fedsim.inprocess import InProcessGrid

DP_SERVER = {"name": "flwr-dp-server-fixed", "noise_multiplier": 0.0, "clipping_norm": 0.01}  # raw norms 0.02-0.035
ATTACK = {"name": "dlg", "rounds": [1], "victims": [0], "params": {"dlg": {"iterations": 2}}}
MIA = {"name": "curious-server-mia", "attacks": ["loss", "calibrated", "lira"], "shadows": 2}


def run(cfg, observers=None, out=None):
    """(server, [global model after each round], summary) of an in-process run (files in ``out`` if given)."""
    grid = InProcessGrid(client_app, cfg["federation"]["num_clients"])
    if out is not None:
        out.mkdir(parents=True)
    server = Server(cfg, out, observers, progress=False)
    states = []
    end = server.round_end

    def keep(grid, state, record, t0):
        states.append(flat(server.engine.channel.plaintext(state)))
        return end(grid, state, record, t0)

    server.round_end = keep
    summary = server.run(grid)
    return server, states, summary


def flat(arrays):
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def weighted_update(updates, transform=lambda d: d):
    """The example-weighted mean of the clients' (transformed) updates, flattened."""
    n = np.array([u.num_examples for u in updates], dtype=np.float64)
    return sum(w / n.sum() * transform(flat(u.delta())) for w, u in zip(n, updates))


def clip(d, c):
    return d * min(1.0, c / np.linalg.norm(d))


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon of a mu-GDP mechanism (Dong, Roth & Su 2022; Balle & Wang 2018): the tight
    curve every accountant's epsilon must lie above."""
    def d(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(d, 0.0, 100.0)


# --------------------------------------------------------------- server-side clipping clips, noise of sigma
def test_server_side_clipping_clips_each_update_and_the_documented_noise_reaches_the_model(small_cfg, recorder,
                                                                                           tmp_path):
    """Flower's DifferentialPrivacyServerSideFixedClipping around fedsim's fedavg. Without noise the applied
    update is exactly the example-weighted mean of the clipped updates (every raw update is longer than
    the bound), so its norm is <= the bound; with a bound no update reaches, the model minus the plain mean
    is Gaussian noise of std noise_multiplier * clipping_norm / clients (Flower's documented sigma). The
    curious server sees the raw updates either way: its round-1 membership audit is the plain run's."""
    mia = OBSERVERS.build(MIA, "mia", cfg=small_cfg("federation.rounds=1"))
    run(small_cfg("federation.rounds=1"), [recorder, mia])
    raw = recorder.by_round()[1]
    plain_mia = [r for r in mia.rows if r["client"] == "all"]
    assert min(np.linalg.norm(flat(u.delta())) for u in raw) > 2 * DP_SERVER["clipping_norm"]

    rec = type(recorder)()
    server, states, _ = run(small_cfg("federation.rounds=1", strategy=DP_SERVER), [rec])
    applied = states[1] - flat(rec.updates[0].global_weights)
    expected = weighted_update(rec.by_round()[1], lambda d: clip(d, DP_SERVER["clipping_norm"]))
    assert np.abs(applied - expected).max() < 1e-6
    assert np.linalg.norm(applied) <= DP_SERVER["clipping_norm"] * (1 + 1e-6)
    assert server.rows[1]["strategy.clipping_norm"] == DP_SERVER["clipping_norm"]

    z, big = 1.0, 1e4
    noisy = dict(DP_SERVER, noise_multiplier=z, clipping_norm=big)
    rec, mia = type(recorder)(), OBSERVERS.build(MIA, "mia", cfg=small_cfg("federation.rounds=1"))
    cfg = small_cfg("federation.rounds=1", strategy=noisy, attack=ATTACK)
    server, states, summary = run(cfg, [rec, mia, *build_components(cfg)["observers"]], out=tmp_path / "noisy")
    assert summary["leakage"][0]["attack"] == "dlg" and summary["membership"][2]["attack"] == "mia-lira"
    assert (tmp_path / "noisy" / "membership_roc.png").is_file()
    report = (tmp_path / "noisy" / "report.md").read_text()
    assert "## Privacy guarantees" in report and "## Membership inference by the curious server" in report
    noise = states[1] - flat(rec.updates[0].global_weights) - weighted_update(rec.by_round()[1])
    sigma = z * big / 4
    assert server.rows[1]["strategy.noise_std"] == pytest.approx(sigma)
    assert noise.std() == pytest.approx(sigma, rel=0.02) and abs(noise.mean()) < 5 * sigma / math.sqrt(noise.size)
    assert [r["auc"] for r in mia.rows if r["client"] == "all"] == [r["auc"] for r in plain_mia]


# --------------------------------------------------------------- every wrapper, with the curious server attacking
@pytest.mark.parametrize("strategy,mods", [
    ({"name": "flwr-dp-client-fixed", "noise_multiplier": 0.0, "clipping_norm": 0.01}, [{"name": "fixed-clipping"}]),
    ({"name": "flwr-dp-server-adaptive", "noise_multiplier": 0.0, "initial_clipping_norm": 0.03}, []),
    ({"name": "flwr-dp-client-adaptive", "noise_multiplier": 0.0, "initial_clipping_norm": 0.03},
     [{"name": "adaptive-clipping"}]),
])
def test_each_wrapper_runs_with_an_attack_and_clips_as_flower_documents(small_cfg, recorder, strategy, mods):
    """Client-side clipping: the server receives updates of norm <= the bound. Adaptive clipping (Andrew et
    al.; no noise here, so the count is exact): the next round's bound is C exp(-lr (clipped fraction -
    target quantile)), the fraction counted by Flower's mod (norm_bit) or by the server-side wrapper."""
    cfg = small_cfg("federation.rounds=2", strategy=strategy, client__flower_mods=mods, attack=ATTACK)
    server, _, summary = run(cfg, [recorder, *build_components(cfg)["observers"]])
    assert summary["client_failures"] == 0 and summary["leakage"][0]["attack"] == "dlg"
    rows, first = server.rows, recorder.by_round()[1]
    norms = [np.linalg.norm(flat(u.delta())) for u in first]
    c1 = rows[1]["strategy.clipping_norm"]
    assert c1 == strategy.get("clipping_norm", strategy.get("initial_clipping_norm"))
    if strategy["name"] == "flwr-dp-client-fixed":
        assert max(norms) <= c1 * (1 + 1e-5) and max(norms) == pytest.approx(c1, rel=1e-5)
        return
    if strategy["name"] == "flwr-dp-client-adaptive":
        bits = [u.metrics["norm_bit"] for u in first]
        assert max(norms) <= c1 * (1 + 1e-5)
    else:
        bits = [float(n > c1) for n in norms]
    frac = float(np.mean(bits))
    assert 0 < frac < 1  # the bound sits among the update norms: some clipped, some not
    assert rows[2]["strategy.clipping_norm"] == pytest.approx(c1 * math.exp(-0.2 * (frac - 0.5)), rel=1e-9)


@pytest.mark.ray
def test_central_dp_with_client_side_clipping_and_an_attack_on_ray(small_cfg, tmp_path):
    """The real Flower simulation: Flower's adaptiveclipping_mod on the Ray actors, the wrapper on the server,
    the curious server attacking; epsilon per round in metrics.jsonl."""
    from fedsim.app.runner import run_experiment
    from fedsim.reports import read_jsonl

    strategy = {"name": "flwr-dp-client-adaptive", "noise_multiplier": 0.05, "initial_clipping_norm": 0.03}
    cfg = small_cfg('simulation.backend="ray"', "federation.rounds=2", strategy=strategy,
                    client__flower_mods=[{"name": "adaptive-clipping"}], attack=ATTACK)
    out = run_experiment(cfg, out=tmp_path / "ray", progress=False)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["replies"] for r in rows[1:]] == [4, 4] and all(0 <= r["norm_bit"] <= 1 for r in rows[1:])
    eps = [r["privacy.strategy.epsilon"] for r in rows[1:]]
    assert 0 < eps[0] < eps[1]
    assert rows[2]["strategy.clipping_norm"] != rows[1]["strategy.clipping_norm"]
    assert (out / "leakage.jsonl").is_file() and "## Privacy guarantees" in (out / "report.md").read_text()


# --------------------------------------------------------------- epsilon, checked against the accountant
def test_epsilon_per_round_matches_the_accountant_computed_independently(small_cfg):
    """Central DP with fixed clipping, 3 rounds, all 4 clients each round (no amplification): round t releases
    t Gaussian mechanisms of noise multiplier z. metrics.jsonl's epsilon is Opacus's RDP accountant on that
    history, built here from the config alone, and lies above the exact epsilon of the composition (a
    sqrt(t)/z-GDP mechanism) but within 30% of it."""
    from opacus.accountants import RDPAccountant

    z = 2.0
    strategy = dict(DP_SERVER, noise_multiplier=z, clipping_norm=1.0, delta=1e-5)
    server, _, summary = run(small_cfg("federation.rounds=3", strategy=strategy))
    for t in (1, 2, 3):
        acct = RDPAccountant()
        acct.history = [(z, 1.0, t)]
        got = server.rows[t]["privacy.strategy.epsilon"]
        assert got == pytest.approx(acct.get_epsilon(delta=1e-5), rel=1e-12)
        exact = exact_gaussian_epsilon(math.sqrt(t) / z, 1e-5)
        assert exact < got < 1.3 * exact
        assert server.rows[t]["privacy.strategy.delta"] == 1e-5
    [entry] = summary["privacy"]
    assert entry["level"] == "client" and "not the server" in entry["against"]


def test_local_mechanisms_are_accounted_per_client_and_dp_sgd_as_its_clients_count(small_cfg):
    """DP-SGD: the server's ledger recomputes each client's steps and sample rate from the config and gets
    the epsilon the client's own accountant reports. LocalDpMod: noise multiplier std / clipping_norm per
    round a client takes part in, whatever sensitivity the user claimed."""
    from opacus.accountants import RDPAccountant

    from fedsim.factories import client_data, model_for
    from fedsim.protocol import train_config
    from fedsim.training.local import local_train
    from fedsim.training.recipe import Recipe

    cfg = small_cfg(model__norm="none", defenses=[{"name": "dp-sgd", "clip_norm": 1.0, "noise_multiplier": 1.1}])
    parts = build_components(cfg)
    ledger = parts["privacy"]
    x, y = client_data(cfg, 1)
    state = {}
    for rnd in (1, 2):
        res = local_train(model_for(cfg), x, y, Recipe.from_mapping(cfg["train"]), seed=cfg["seed"], round=rnd,
                          client=1, pipeline=parts["defenses"], state=state)
        state = res.state
        row = ledger.after_round(rnd, [1], train_config(cfg, rnd))
        assert row["privacy.defense.0.dp-sgd.epsilon"] == pytest.approx(res.metrics["defense.0.dp-sgd.epsilon"],
                                                                       rel=1e-12)
    mod = {"name": "local-dp", "clipping_norm": 0.5, "sensitivity": 0.1, "epsilon": 2.0, "delta": 1e-6}
    cfg = small_cfg(client__flower_mods=[mod])
    ledger = build_components(cfg)["privacy"]
    for rnd, clients in ((1, [0, 1]), (2, [1, 2]), (3, [1])):
        row = ledger.after_round(rnd, clients, train_config(cfg, rnd))
    acct = RDPAccountant()
    acct.history = [(0.1 * math.sqrt(2 * math.log(1.25 / 1e-6)) / 2.0 / 0.5, 1.0, 3)]  # client 1, three rounds
    assert row["privacy.mod.0.local-dp.epsilon"] == pytest.approx(acct.get_epsilon(delta=1e-6), rel=1e-12)
    state = ledger.state()
    again = build_components(cfg)["privacy"]
    again.load_state(state)
    assert again.row() == row
    assert any("nominal" in n for n in ledger.describe()[0]["notes"])


def test_noise_without_a_clipping_bound_gives_no_formal_guarantee(small_cfg):
    def described(**kw):
        return {d["mechanism"]: d for d in build_components(small_cfg(**kw))["privacy"].describe()}

    bounded = [{"name": "clip-update", "clip_norm": 0.1}, {"name": "gaussian-noise", "sigma": 0.01}]
    got = described(defenses=[{"name": "gaussian-noise", "sigma": 0.01}, *bounded, {"name": "laplace-noise", "scale": 0.1}])
    assert got["defense.0.gaussian-noise"]["guarantee"] == "no formal guarantee"
    assert "no clipping bound" in got["defense.0.gaussian-noise"]["reason"]
    assert got["defense.2.gaussian-noise"]["epsilon"] == 0.0 and got["defense.2.gaussian-noise"]["level"] == "client"
    assert got["defense.3.laplace-noise"]["epsilon"] is None
    bn = described(model__norm="batch", defenses=bounded)["defense.1.gaussian-noise"]
    assert bn["epsilon"] is None and "BatchNorm" in bn["reason"]
    median = {"name": "flwr-dp-server-fixed", "noise_multiplier": 1.0, "clipping_norm": 1.0,
              "rule": {"name": "flwr-fedmedian"}}
    assert "not the example-weighted mean" in described(strategy=median)["strategy"]["reason"]
    server, _, _ = run(small_cfg("federation.rounds=1", defenses=[{"name": "gaussian-noise", "sigma": 0.001}]))
    assert server.rows[1]["privacy.defense.0.gaussian-noise.epsilon"] is None
    assert server.rows[1]["privacy.defense.0.gaussian-noise.guarantee"] == "no formal guarantee"


# --------------------------------------------------------------- what is refused at config time
@pytest.mark.parametrize("sets,error", [
    ({"strategy": {"name": "flwr-dp-client-fixed", "noise_multiplier": 1.0, "clipping_norm": 1.0}},
     r'add Flower\'s mod to every client with \[\[client.flower_mods\]\] name = "fixed-clipping"'),
    ({"client__flower_mods": [{"name": "fixed-clipping"}]},
     r"client.flower_mods\[0\] \(fixed-clipping\): this mod is the client half of strategy.name = 'flwr-dp-client-fixed'"),
    ({"strategy": dict(DP_SERVER, noise_multiplier=1.0), "channel": {"name": "secagg+"}},
     r"flwr-dp-server-fixed' needs each client's model in plaintext.*channels it works with: \['plain'\]"),
    ({"strategy": {"name": "flwr-dp-client-fixed", "noise_multiplier": 1.0, "clipping_norm": 1.0},
      "client__flower_mods": [{"name": "fixed-clipping"}], "channel": {"name": "paillier"}},
     r"needs the aggregate in plaintext"),
    ({"strategy": dict(DP_SERVER, clipping_norm=0.0)}, r"strategy.clipping_norm must be in \(0, inf\)"),
    ({"strategy": dict(DP_SERVER, rule={"name": "flwr-fedadam", "eta": -1.0})}, r"strategy.rule.eta must be"),
    ({"strategy": dict(DP_SERVER, rule={"name": "flwr-dp-server-fixed"})}, r"is a central-DP wrapper itself"),
    ({"strategy": {"name": "flwr-dp-server-adaptive", "noise_multiplier": 1.0}}, r"clipped_count_stddev"),
])
def test_combinations_that_cannot_work_are_refused_naming_the_key(small_cfg, sets, error):
    with pytest.raises(ConfigError, match=error):
        small_cfg(**sets)


def test_client_side_fixed_clipping_composes_with_secure_aggregation(small_cfg):
    """The server never sees an individual update: SecAgg+ gives it the clipped clients' mean, to which
    Flower's wrapper adds the noise; accounted with the largest contributor's weight."""
    cfg = small_cfg(strategy={"name": "flwr-dp-client-fixed", "noise_multiplier": 1.0, "clipping_norm": 1.0},
                    client__flower_mods=[{"name": "fixed-clipping"}], channel={"name": "secagg+"})
    assert build_components(cfg)["rule"].requires <= {"the example-weighted mean of the client models",
                                                       "the aggregate in plaintext"}


# --------------------------------------------------------------- the privacy-utility picture
def test_compare_rows_take_the_best_formal_guarantee_and_draw_the_privacy_utility_picture(tmp_path):
    from fedsim.comparison import compare
    from fedsim.reports import write_json, write_jsonl

    def folder(name, privacy, ssim, auc):
        d = tmp_path / name
        d.mkdir()
        write_json(d / "summary.json", {"final_accuracy": 0.5, "final_loss": 1.0, "privacy": privacy,
                                        "leakage": [{"attack": "ig", "ssim": ssim, "columns": ["ssim"]}],
                                        "membership": [{"attack": "mia-lira", "auc": auc, "columns": ["auc"]}]})
        write_jsonl(d / "metrics.jsonl", [{"round": 1, "seconds": 0.1, "accuracy": 0.5}])
        return d

    both = [{"mechanism": "defense.0.dp-sgd", "level": "sample", "epsilon": 3.0},
            {"mechanism": "strategy", "level": "client", "epsilon": 2.0},
            {"mechanism": "defense.1.gaussian-noise", "level": "client", "epsilon": None}]
    rows = compare([folder("both", both, 0.1, 0.6), folder("bare", both[2:], 0.9, 0.9)], tmp_path / "out")
    assert (rows[0]["epsilon"], rows[0]["epsilon_client"], rows[0]["dp_formal"]) == (2.0, 2.0, 2)
    assert rows[1]["epsilon"] is None and rows[1]["dp_mechanisms"] == 1
    assert rows[0]["mia-lira.auc"] == 0.6 and rows[1]["ig.ssim"] == 0.9
    assert (tmp_path / "out" / "privacy_utility.png").is_file()
    assert "privacy_utility.png" in (tmp_path / "out" / "comparison.md").read_text()
