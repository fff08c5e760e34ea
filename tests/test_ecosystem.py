"""The ecosystem: Flower's strategies as rules, plugins by config, seeds in sweeps, comparison, progress,
exports, training options (momentum, weight decay, LR schedules, FedProx), client-side evaluation.

Expected values are recomputed here from what the server intercepted (``RecordingObserver``), the
written run folders or plain torch, never read back from the code under test.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RecordingObserver, child_pythonpath, make_small_cfg
from scipy import stats

from fedsim.app.cli import main as cli_main
from fedsim.components import ConfigError
from fedsim.reports import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "my_plugins.py"


def plugin_cfg(*sets, **overrides):
    """make_small_cfg without the small settings' model.activation (a user's model takes none)."""
    from conftest import small_sets

    from fedsim.app import load_config

    return load_config(None, [s for s in small_sets(*sets, **overrides) if not s.startswith("model.activation=")])


def run_inprocess(cfg, out, observers):
    from fedsim.app.client import client_app
    from fedsim.app.runner import node_count
    from fedsim.app.server import run_server
    from fedsim.inprocess import InProcessGrid

    grid = InProcessGrid(client_app, node_count(cfg))
    summary = run_server(grid, cfg, out, observers, progress=False)
    return grid, summary


def final_model(out: Path) -> list[np.ndarray]:
    sd = torch.load(out / "model.pt")
    return [v.numpy().astype(np.float64) for v in sd.values()]


# =============================================================================== Flower's strategies
def flat(ws):
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in ws])


def weighted_mean(W, n):
    return sum(w * k for w, k in zip(W, n)) / sum(n)


def krum_scores(W, f):
    d = np.array([[np.sum((a - b) ** 2) for b in W] for a in W])
    k = max(1, len(W) - f - 2)
    return [np.sort(np.delete(row, i))[:k].sum() for i, row in enumerate(d)]


class Expect:
    """The next global model from (model sent x, client models W, example counts n), kept across rounds
    for the stateful rules. Everything is on flattened float64 vectors."""

    def __init__(self, name, p):
        self.name, self.p = name, p
        self.m = self.v = self.mom = None

    def __call__(self, x, W, n):
        p, name = self.p, self.name
        if name in ("flwr-fedavg", "flwr-fedprox"):
            return weighted_mean(W, n)
        if name == "flwr-fedmedian":
            return np.median(np.stack(W), axis=0)
        if name == "flwr-fedtrimmedavg":
            return stats.trim_mean(np.stack(W), p["beta"], axis=0)
        if name == "flwr-krum":
            return W[int(np.argmin(krum_scores(W, p["num_malicious_nodes"])))]
        if name == "flwr-multikrum":
            sel = np.argsort(krum_scores(W, p["num_malicious_nodes"]))[:p["num_nodes_to_select"]]
            return weighted_mean([W[i] for i in sel], [n[i] for i in sel])
        if name == "flwr-bulyan":
            f = p["num_malicious_nodes"]
            theta, beta = len(W) - 2 * f, len(W) - 4 * f
            sel = np.stack([W[i] for i in np.argsort(krum_scores(W, f))[:theta]])
            med = np.median(sel, axis=0)
            closest = np.argsort(np.abs(sel - med), axis=0, kind="stable")[:beta]
            return np.take_along_axis(sel, closest, axis=0).mean(0)
        if name == "flwr-fedavgm":
            pg = x - weighted_mean(W, n)
            self.mom = pg if self.mom is None else p["server_momentum"] * self.mom + pg
            return x - p["server_learning_rate"] * self.mom
        delta = weighted_mean(W, n) - x  # the FedOpt family (Reddi et al. 2021)
        b1 = p.get("beta_1", 0.0)
        self.m = (1 - b1) * delta if self.m is None else b1 * self.m + (1 - b1) * delta
        v0 = np.zeros_like(delta) if self.v is None else self.v
        if name == "flwr-fedadagrad":
            self.v = v0 + delta ** 2
        elif name == "flwr-fedyogi":
            self.v = v0 - (1 - p["beta_2"]) * delta ** 2 * np.sign(v0 - delta ** 2)
        else:  # adam
            self.v = p["beta_2"] * v0 + (1 - p["beta_2"]) * delta ** 2
        eta = p["eta"]
        if name == "flwr-fedadam":  # Flower's bias correction uses round + 1
            t = self.round + 1.0
            eta = eta * np.sqrt(1 - p["beta_2"] ** t) / (1 - b1 ** t)
        return x + eta * self.m / (np.sqrt(self.v) + p["tau"])


STRATEGY_CASES = [
    ("flwr-fedavg", {}, 4),
    ("flwr-fedprox", {"proximal_mu": 0.5}, 4),
    ("flwr-fedavgm", {"server_learning_rate": 0.7, "server_momentum": 0.9}, 4),
    ("flwr-fedadam", {"eta": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}, 4),
    ("flwr-fedyogi", {"eta": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}, 4),
    ("flwr-fedadagrad", {"eta": 0.01, "tau": 1e-3}, 4),
    ("flwr-fedmedian", {}, 4),
    ("flwr-fedtrimmedavg", {"beta": 0.25}, 4),
    ("flwr-krum", {"num_malicious_nodes": 1}, 5),
    ("flwr-multikrum", {"num_malicious_nodes": 1, "num_nodes_to_select": 3}, 5),
    ("flwr-bulyan", {"num_malicious_nodes": 1}, 7),
]


@pytest.mark.parametrize("name,params,clients", STRATEGY_CASES, ids=[c[0] for c in STRATEGY_CASES])
def test_flower_strategy_runs_two_rounds_and_aggregates_like_its_definition(tmp_path, monkeypatch, name, params,
                                                                           clients):
    """Each of Flower's Message-API strategies, wrapped as an aggregation rule, runs 2 rounds on the
    in-process grid; the model after each round equals the rule's definition recomputed from the
    client models the server intercepted (dirichlet split: unequal example counts). A client defense
    (Gaussian noise) and the curious server (a 2-iteration DLG on client 0 in round 2) are on: under
    every rule the curious server is shown each client's defended update and attacks its victim."""
    from attacks.curious import CuriousServer

    sets = [f'strategy.name="{name}"', *(f"strategy.{k}={v}" for k, v in params.items())]
    cfg = make_small_cfg(*sets, federation__num_clients=clients, data__partition="dirichlet", data__alpha=1.0,
                         train__local_steps=2, defenses=[{"name": "gaussian-noise", "sigma": 0.01}],
                         attack={"name": "dlg", "rounds": [2], "victims": [0], "max_images": 1,
                                 "params": {"dlg": {"iterations": 2}}})
    seen = []
    observe = CuriousServer.observe
    monkeypatch.setattr(CuriousServer, "observe", lambda self, u: (seen.append(u), observe(self, u))[1])
    rec = RecordingObserver()
    grid, summary = run_inprocess(cfg, tmp_path / "run", [rec, CuriousServer.from_config(cfg)])
    by_round = rec.by_round()
    assert sorted(by_round) == [1, 2] and all(len(us) == clients for us in by_round.values())
    assert [(u.round, u.client_id) for u in seen] == [(u.round, u.client_id) for u in rec.updates]
    assert all(a is b for a, b in zip(seen, rec.updates))  # the very updates the rule aggregated
    (leak,) = read_jsonl(tmp_path / "run" / "leakage.jsonl")
    assert (leak["round"], leak["client"], leak["attack"], leak["iterations"]) == (2, 0, "dlg", 2)
    assert summary["leakage"][0]["attacks_run"] == 1
    expect = Expect(name, params)
    for r in (1, 2):
        us = sorted(by_round[r], key=lambda u: u.client_id)
        x = flat(us[0].global_weights)
        expect.round = r
        want = expect(x, [flat(u.weights) for u in us], [u.num_examples for u in us])
        got = flat(by_round[2][0].global_weights) if r == 1 else flat(final_model(tmp_path / "run"))
        scale = np.abs(want - x).max()
        assert scale > 0  # the round moved the model
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()),
                                   err_msg=f"{name} round {r}")
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["strategy.skipped"] for r in rows[1:]] == [0.0, 0.0]
    for r in rows[1:]:  # the defense noised every client's update (empirical std over all entries ~ sigma)
        assert r["defense.0.gaussian-noise.empirical_std"] == pytest.approx(0.01, rel=0.05)
    assert summary["final_accuracy"] is not None
    if name == "flwr-fedprox":  # Flower's configure_train adds the key; every train message carries it
        from fedsim.protocol import CONFIG, PROXIMAL_MU, TRAIN

        sent = [m for m in grid.messages_sent if m.metadata.message_type == TRAIN]
        assert sent and all(m.content[CONFIG][PROXIMAL_MU] == 0.5 for m in sent)


def test_flower_rules_are_validated_and_refused_where_they_cannot_work():
    with pytest.raises(ConfigError, match=r"strategy.eta must be in \(0, inf\), got 0"):
        make_small_cfg('strategy.name="flwr-fedadam"', "strategy.eta=0")
    with pytest.raises(ConfigError, match=r"strategy.beta must be in \[0, 0.5\)"):
        make_small_cfg('strategy.name="flwr-fedtrimmedavg"', "strategy.beta=0.6")
    with pytest.raises(ConfigError, match=r"strategy.eta_l is not a parameter of strategy 'flwr-fedadam'"):
        make_small_cfg('strategy.name="flwr-fedadam"', "strategy.eta_l=0.1")
    with pytest.raises(ConfigError, match=r"strategy.proximal_mu must be a number, got 'x'"):
        make_small_cfg('strategy.name="flwr-fedprox"', 'strategy.proximal_mu="x"')
    with pytest.raises(ConfigError, match=r"Bulyan with num_malicious_nodes = 1 needs at least 4f \+ 3 = 7"):
        make_small_cfg('strategy.name="flwr-bulyan"', "strategy.num_malicious_nodes=1")
    with pytest.raises(ConfigError, match=r"needs each client's model in plaintext.*channel 'paillier'"):
        make_small_cfg('strategy.name="flwr-krum"', 'channel.name="paillier"')


def test_curious_server_and_defenses_work_under_a_flower_rule(tmp_path):
    """The interception point is before aggregation whatever the rule: iDLG recovers a FedSGD update
    under FedMedian (measured PSNR > 60 dB), and a defense (pruning) still reaches the rule."""
    cfg = make_small_cfg('strategy.name="flwr-fedmedian"', "federation.rounds=1", "train.local_steps=1",
                         "train.batch_size=1", 'model.activation="sigmoid"', 'model.init="uniform"',
                         attack={"name": "idlg", "victims": [0], "params": {"idlg": {"iterations": 200}}})
    from fedsim.app import build_components

    _, summary = run_inprocess(cfg, tmp_path / "a", build_components(cfg)["observers"])
    assert summary["leakage"][0]["psnr"] > 30
    cfg = make_small_cfg('strategy.name="flwr-krum"', "federation.num_clients=5", "federation.rounds=1",
                         defenses=[{"name": "prune", "ratio": 0.9}])
    rec = RecordingObserver()
    run_inprocess(cfg, tmp_path / "b", [rec])
    zeros = [float(np.mean(np.concatenate([d.ravel() for d in u.delta()]) == 0)) for u in rec.updates]
    assert min(zeros) > 0.85  # 90% of the update pruned (measured 0.90 on every client)


@pytest.mark.ray
def test_a_flower_rule_and_a_file_plugin_model_run_on_ray(tmp_path):
    """Ray actors import the user's model from the file named in the config (an absolute path by
    then), and FedAdam aggregates: the same results as the in-process grid (one torch thread in both;
    measured identical accuracies)."""
    from fedsim.app.runner import run_experiment

    plug = tmp_path / "plug" / "my_plugins.py"
    plug.parent.mkdir()
    shutil.copy(EXAMPLE, plug)
    sets = ['strategy.name="flwr-fedadam"', "strategy.eta=0.01", f'model.name="{plug}:SmallCNN"',
            "model.params.channels=4", "federation.num_clients=3"]
    cfg_ray = plugin_cfg(*sets, simulation__backend="ray", output__dir=str(tmp_path / "runs"))
    ray_dir = run_experiment(cfg_ray, out=tmp_path / "ray", progress=False)
    cfg_ip = plugin_cfg(*sets, simulation__backend="inprocess", output__dir=str(tmp_path / "runs"))
    ip_dir = run_experiment(cfg_ip, out=tmp_path / "ip", progress=False)
    ray_rows, ip_rows = read_jsonl(ray_dir / "metrics.jsonl"), read_jsonl(ip_dir / "metrics.jsonl")
    assert [r["round"] for r in ray_rows] == [0, 1, 2] and all(r["replies"] == 3 for r in ray_rows[1:])
    for a, b in zip(ray_rows, ip_rows):
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=0.01)
    summary = json.loads((ray_dir / "summary.json").read_text())
    assert summary["startup_seconds"] > 0 and summary["round_seconds"] > 0
    assert summary["seconds"] >= summary["startup_seconds"] + summary["round_seconds"]


# =============================================================================== plugins by config
PLUGIN_TOML = """
name = "plug"
[federation]
rounds = 3
num_clients = 4
[data]
dataset = "{plug}:stripes"
partition = "dirichlet"
alpha = 1.0
root_size = 20
params = {{ n_train = 500, noise = 0.3 }}
[model]
name = "{plug}:SmallCNN"
params = {{ channels = 6 }}
[train]
lr = 0.1
batch_size = 16
local_steps = 10
[strategy]
name = "{plug}:UniformAverage"
[[defenses]]
name = "{plug}:QuantizeUpdate"
levels = 8
[simulation]
backend = "inprocess"
[output]
observers = ["{plug}:RoundLog"]
[attack]
name = "{plug}:GrayBaseline"
victims = [0]
"""


@pytest.fixture
def plugin_file(tmp_path):
    d = tmp_path / "outside"
    d.mkdir()
    shutil.copy(EXAMPLE, d / "my_plugins.py")
    return d / "my_plugins.py"


def test_own_model_dataset_defense_rule_transform_observer_and_attack_from_a_file_through_config_alone(
        tmp_path, plugin_file, monkeypatch):
    """docs/examples/my_plugins.py, copied outside the package, plugs into a run by config alone
    (relative references, resolved against the working directory)."""
    from fedsim.app import load_config
    from fedsim.app.runner import run_experiment

    monkeypatch.chdir(plugin_file.parent)
    (plugin_file.parent / "exp.toml").write_text(PLUGIN_TOML.format(plug="my_plugins.py"))
    cfg = load_config("exp.toml", [f'output.dir="{tmp_path / "runs"}"'])
    assert cfg["model"]["name"] == f"{plugin_file}:SmallCNN"  # made absolute for other processes
    run = run_experiment(cfg, out=tmp_path / "run", progress=False)
    rows = read_jsonl(run / "metrics.jsonl")
    # the dataset: 3 classes of stripes, 480 training images split among 4 clients
    from fedsim.factories import dataset_for, partitions_for

    ds = dataset_for(cfg)
    assert ds.num_classes == 3 and tuple(ds.in_shape) == (1, 12, 12) and len(ds.y_root) == 20
    assert sum(len(p) for p in partitions_for(cfg)) == 480
    # the model learns it: chance is 1/3; measured 0.92 after 3 rounds
    assert rows[-1]["accuracy"] > 0.6
    sd = torch.load(run / "model.pt")
    assert [tuple(v.shape) for v in sd.values()][0] == (6, 1, 3, 3)  # channels = 6 from model.params
    # the defense ran on every client: at most 8 distinct values per parameter tensor of each update
    assert rows[1]["defense.0.quantize-update.quantized_tensors"] == 6.0
    # the rule and the transform: round 2's global model moves half-way (ServerStep, step 0.5) from
    # round 1's global model to the unweighted mean of round 1's client models (UniformAverage)
    rec = RecordingObserver()
    cfg2 = json.loads(json.dumps(cfg))
    cfg2["federation"]["rounds"] = 2
    cfg2["transforms"] = [{"name": f"{plugin_file}:ServerStep", "step": 0.5}]
    run_inprocess(cfg2, tmp_path / "run2", [rec])
    r1 = sorted(rec.by_round()[1], key=lambda u: u.client_id)
    assert len({u.num_examples for u in r1}) > 1  # unequal clients: a weighted mean would differ
    g1 = flat(r1[0].global_weights)
    want = g1 + 0.5 * (sum(flat(u.weights) for u in r1) / len(r1) - g1)
    np.testing.assert_allclose(flat(rec.by_round()[2][0].global_weights), want, atol=1e-6)
    for u in r1:
        for d, name in zip(u.delta(), u.param_names):
            levels = np.sum(np.diff(np.unique(d)) > 1e-5) + 1  # values within float rounding count once
            assert levels <= 8, name
    # the observer wrote its file, the attack its rows
    log = read_jsonl(run / "round_log.jsonl")
    assert [r["round"] for r in log] == [0, 1, 2, 3] and log[1]["clients"] == [0, 1, 2, 3]
    leak = read_jsonl(run / "leakage.jsonl")
    assert len(leak) == 1 and leak[0]["attack"].endswith("my_plugins.py:GrayBaseline")
    assert leak[0]["ssim"] < 0.2  # a grey guess recovers nothing (measured 0.005)


@pytest.mark.parametrize("sets,message", [
    (["model.params.channels=0"], r"model.params \(.*SmallCNN\): channels must be >= 1, got 0"),
    (["model.params.width=3"], r"model.params.width is not a parameter of model .*SmallCNN.*allowed: \['channels'\]"),
    (['model.params.channels="many"'], r"model.params.channels must be an integer, got 'many'"),
    (['model.activation="tanh"'], r"model.activation applies to the built-in models only"),
    (["data.params.n_train=10"], r"data.params \(.*stripes\): n_train \(10\) must exceed data.root_size \(20\)"),
    (['data.dataset="nowhere.py:load"'], r"data.dataset: plugin file '.*/nowhere.py' does not exist"),
    (['model.name="my_plugins.py:Nothing"'], r"model.name: cannot import .*AttributeError"),
    (['defenses=[{name="my_plugins.py:SmallCNN"}]'], r"defenses\[0\].name: .* must name a subclass of "
                                                       r"fedsim.defense.Defense"),
    (['model.name="lenet"'], r"model.params is for your own model; the built-in 'lenet' takes"),
    (['model.name="nope"'], r"model.name must be one of \[.*'lenet'.*\] or an import reference"),
])
def test_plugin_errors_name_the_key(plugin_file, monkeypatch, sets, message):
    from fedsim.app import load_config
    from fedsim.app.runner import run_experiment

    monkeypatch.chdir(plugin_file.parent)
    (plugin_file.parent / "exp.toml").write_text(PLUGIN_TOML.format(plug="my_plugins.py"))
    with pytest.raises(ConfigError, match=message):
        cfg = load_config("exp.toml", sets)
        run_experiment(cfg, out=plugin_file.parent / "never", progress=False)  # builder errors surface here


def test_entry_point_plugins_register_by_name(tmp_path, monkeypatch):
    """An installed package's ``fedsim.plugins`` entry point is imported by load_plugins; what it
    registers is usable by name (here a model, with a fake installed distribution on sys.path)."""
    import fedsim.app as app
    from fedsim.components import MODELS

    pkg = tmp_path / "site"
    (pkg / "tinyplug").mkdir(parents=True)
    (pkg / "tinyplug" / "__init__.py").write_text(textwrap.dedent("""
        from torch import nn
        from fedsim.components import MODELS

        @MODELS.register(name="tiny-linear")
        def build(in_shape, num_classes, bias: bool = True):
            n = 1
            for d in in_shape:
                n *= d
            return nn.Sequential(nn.Flatten(), nn.Linear(n, num_classes, bias=bias))
    """))
    dist = pkg / "tinyplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tinyplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedsim.plugins]\ntiny = tinyplug\n")
    monkeypatch.syspath_prepend(str(pkg))
    try:
        assert "tiny" in app.load_entry_points()
        cfg = plugin_cfg('model.name="tiny-linear"', "model.params.bias=false", "federation.rounds=1")
        _, summary = run_inprocess(cfg, tmp_path / "run", [])
        sd = torch.load(tmp_path / "run" / "model.pt")
        assert list(sd) == ["1.weight"] and summary["final_accuracy"] > 0.3  # measured 0.62
    finally:
        MODELS.remove("tiny-linear")
        sys.modules.pop("tinyplug", None)


# =============================================================================== sweeps, comparison
SWEEP = """
name = "sw"
seeds = [0, 1]
[federation]
rounds = 2
num_clients = 3
[model]
activation = "relu"
[train]
lr = 0.05
batch_size = 16
local_steps = 3
[simulation]
backend = "inprocess"
[output]
observers = []
[attack]
name = "dlg"
victims = [0]
max_images = 1
params = { dlg = { iterations = 2 } }

[[variants]]
label = "plain"

[[variants]]
label = "noisy"
defenses = [{ name = "gaussian-noise", sigma = 0.3 }]
"""


def test_sweep_over_two_seeds_reports_mean_and_std_and_compare_reads_it_back(tmp_path, capsys, monkeypatch):
    p = tmp_path / "sweep.toml"
    p.write_text(SWEEP)
    import fedsim.reports
    from fedsim.app.sweep import run_sweep

    figures = {}  # comparison.png's figure, kept to read back what it draws
    save = fedsim.reports.save_figure
    monkeypatch.setattr(fedsim.reports, "save_figure",
                        lambda fig, path, *a, **k: (figures.__setitem__(Path(path), fig), save(fig, path, *a, **k))[1])
    out = run_sweep(p, out=tmp_path / "sw", progress=False)
    runs = read_jsonl(out / "runs.jsonl")
    assert [(r["variant"], r["seed"]) for r in runs] == [("plain", 0), ("plain", 1), ("noisy", 0), ("noisy", 1)]
    rows = read_jsonl(out / "sweep.jsonl")
    assert [r["variant"] for r in rows] == ["plain", "noisy"]
    for row in rows:
        dirs = [out / x for x in row["runs"]]
        assert [d.name for d in dirs] == [f"{row['runs'][0][:-6]}-seed0", f"{row['runs'][0][:-6]}-seed1"]
        accs = [json.loads((d / "summary.json").read_text())["final_accuracy"] for d in dirs]
        seeds = [tomllib_seed(d) for d in dirs]
        assert seeds == [0, 1] and accs[0] != accs[1]  # the seed changed the run
        assert row["accuracy"] == pytest.approx(statistics.mean(accs))
        assert row["accuracy_std"] == pytest.approx(statistics.stdev(accs))
        assert row["n"] == 2 and row["seeds"] == [0, 1]
    report = (out / "report.md").read_text()
    plain = rows[0]
    assert f"| plain | {plain['accuracy']:.3f} ± {plain['accuracy_std']:.3f} |" in report
    assert "accuracy_std" in (out / "sweep.csv").read_text().splitlines()[0]
    assert (out / "comparison.png").stat().st_size > 10_000
    # comparison.png: accuracy vs round per variant (mean over the seeds' metrics.jsonl, a band of ± std) ...
    curves, scatter = figures[out / "comparison.png"].axes
    for row, line in zip(rows, curves.get_lines(), strict=True):
        acc = np.array([[m["accuracy"] for m in read_jsonl(out / x / "metrics.jsonl")] for x in row["runs"]])
        assert line.get_label() == f"{row['variant']} (n=2)"
        np.testing.assert_allclose(line.get_xydata(), np.c_[np.arange(3), acc.mean(0)])
    assert len(curves.collections) == 2  # the two ± std bands
    # ... and the privacy-utility scatter: per variant, (final accuracy, DLG's SSIM) of the rows, with
    # error bars of one standard deviation over the seeds on both axes
    assert "SSIM" in scatter.get_ylabel() and "dlg" in scatter.get_title()
    bars = scatter.containers
    assert len(bars) == len(rows) == 2
    for row, bar in zip(rows, bars):
        assert row["dlg.ssim_std"] > 0 and row["accuracy_std"] > 0
        np.testing.assert_allclose(bar.lines[0].get_xydata(), [[row["accuracy"], row["dlg.ssim"]]])
        (xerr,), (yerr,) = (seg.get_segments() for seg in bar.lines[2])
        np.testing.assert_allclose(xerr[:, 0], [row["accuracy"] - row["accuracy_std"],
                                                row["accuracy"] + row["accuracy_std"]])
        np.testing.assert_allclose(yerr[:, 1], [row["dlg.ssim"] - row["dlg.ssim_std"],
                                                row["dlg.ssim"] + row["dlg.ssim_std"]])
    ssims = [[json.loads((out / x / "summary.json").read_text())["leakage"][0]["ssim"] for x in row["runs"]]
             for row in rows]
    assert [r["dlg.ssim"] for r in rows] == pytest.approx([statistics.mean(s) for s in ssims])
    # fedsim compare on the sweep folder and on one run folder
    cmp_dir = tmp_path / "cmp"
    assert cli_main(["compare", str(out), str(out / rows[1]["runs"][0]), "--out", str(cmp_dir)]) == 0
    cmp_rows = list(__import__("csv").DictReader(open(cmp_dir / "comparison.csv")))
    assert [r["variant"] for r in cmp_rows] == ["plain", "noisy", rows[1]["runs"][0]]
    assert float(cmp_rows[0]["accuracy"]) == pytest.approx(plain["accuracy"])
    assert float(cmp_rows[0]["accuracy_std"]) == pytest.approx(plain["accuracy_std"])
    single = json.loads((out / rows[1]["runs"][0] / "summary.json").read_text())
    assert float(cmp_rows[2]["accuracy"]) == pytest.approx(single["final_accuracy"])
    assert (cmp_dir / "comparison.png").exists() and "± " in (cmp_dir / "comparison.md").read_text()
    assert "| plain |" in capsys.readouterr().out
    assert cli_main(["compare", str(tmp_path / "nothing-here")]) == 2


def test_compare_warns_when_the_runs_differ_in_length_seed_or_dataset(small_cfg, tmp_path, capsys, caplog):
    """A 2-round run beside a 1-round run of another seed: one warning line each for the length and the
    seeds (on stderr and in comparison.md), none for the dataset they share; runs that match: none."""
    import logging

    from fedsim.app.runner import run_experiment

    caplog.set_level(logging.WARNING, logger="fedsim")
    a = run_experiment(small_cfg("federation.rounds=2", "seed=0"), out=tmp_path / "a", progress=False)
    b = run_experiment(small_cfg("federation.rounds=1", "seed=1"), out=tmp_path / "b", progress=False)
    assert cli_main(["compare", str(a), str(b), "--out", str(tmp_path / "ab")]) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert err == ["[fedsim] warning: compare: the compared runs differ in length (rounds): a: 2; b: 1",
                   "[fedsim] warning: compare: the compared runs differ in seeds: a: 0; b: 1"]
    md = (tmp_path / "ab" / "comparison.md").read_text()
    assert "differ in length (rounds): a: 2; b: 1" in md and "differ in seeds" in md and "dataset" not in md
    c = tmp_path / "c"  # run a's folder with another dataset in its config
    shutil.copytree(a, c)
    (c / "config.toml").write_text((a / "config.toml").read_text().replace('"fmnist-small"', '"mnist"'))
    assert cli_main(["compare", str(a), str(c), "--out", str(tmp_path / "ac")]) == 0
    assert [x for x in capsys.readouterr().err.splitlines() if "warning" in x] == [
        "[fedsim] warning: compare: the compared runs differ in dataset: a: fmnist-small; c: mnist"]
    twin = tmp_path / "twin"
    shutil.copytree(a, twin)
    assert cli_main(["compare", str(a), str(twin), "--out", str(tmp_path / "aa")]) == 0
    assert "warning" not in capsys.readouterr().err


def tomllib_seed(run_dir: Path) -> int:
    import tomllib

    return tomllib.loads((run_dir / "config.toml").read_text())["seed"]


def test_sweep_seed_errors(tmp_path):
    from fedsim.app.sweep import load_sweep, run_sweep

    p = tmp_path / "s.toml"
    p.write_text(SWEEP.replace("seeds = [0, 1]", "seeds = [1, 1]"))
    with pytest.raises(ConfigError, match=r"seeds must be a non-empty list of distinct integers >= 0, got \[1, 1\]"):
        load_sweep(p)
    p.write_text(SWEEP)
    with pytest.raises(ConfigError, match=r"--seeds must be a non-empty list"):
        run_sweep(p, out=tmp_path / "o", progress=False, seeds=[-1])


# =============================================================================== progress, CLI
def test_attack_command_shows_progress_while_it_runs_and_stops_on_ctrl_c(tmp_path):
    """`fedsim attack` in a subprocess: iteration lines (with the gradient distance) arrive on stderr
    while the process is still running, not only at the end; Ctrl-C (SIGINT) in the middle of the attack
    ends it at once with exit 130, one line and no traceback (the attack would otherwise run for minutes).
    "At once" is counted in iterations (a line per iteration: none after the process's own notice of the
    signal), not in seconds, so a loaded machine does not fail it. Running to the end is checked
    in-process (tests/test_curious.py)."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "FEDSIM_PROGRESS_INTERVAL": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "fedsim", "attack", "--attack", "idlg", "--out",
                             str(tmp_path / "a"), "--set", "attack.params.idlg.iterations=100000",
                             "--set", "attack.params.idlg.patience=100000", "--set", "attack.params.idlg.threshold=0.0"],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    live, lines = 0, []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "attack idlg: client 0, round 1  it " in line and "distance" in line and proc.poll() is None:
                live += 1
                if live == 3:
                    break
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=600)  # a hang guard (measured 1.6 s; 30 s on a 10x loaded machine)
        print(f"stopped {time.monotonic() - t0:.1f} s after the signal")
    finally:
        if proc.poll() is None:
            proc.kill()
    lines += err.splitlines(keepends=True)
    assert live == 3, "".join(lines)  # iteration lines arrive while the attack runs
    assert any("round   1/1" in x for x in lines)
    assert proc.returncode == 130, "".join(lines[-20:])
    assert "Traceback" not in err and "fedsim: interrupted by SIGINT" in err, err
    assert "stopped after" in err  # the attack's progress says it was stopped, not done
    noticed = next(i for i, x in enumerate(lines) if "SIGINT: stopping the attack" in x)
    later = [x for x in lines[noticed:] if "attack idlg: client 0, round 1  it " in x and "stopped after" not in x]
    assert later == [], later  # no iteration after the process saw the signal
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["status"] == "interrupted"


def test_quiet_and_default_progress(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[federation]\nrounds = 2\nnum_clients = 2\n[simulation]\nbackend = "inprocess"\n'
                   '[train]\nlocal_steps = 1\n')
    assert cli_main(["run", str(cfg), "--out", str(tmp_path / "q"), "--quiet"]) == 0
    assert "[fedsim] round" not in capsys.readouterr().err
    assert cli_main(["run", str(cfg), "--out", str(tmp_path / "l"), "--seed", "3", "--device", "cpu",
                     "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "round   1/2" in err and "ETA" in err and "start-up took" in err
    import tomllib

    written = tomllib.loads((tmp_path / "l" / "config.toml").read_text())
    assert written["seed"] == 3 and written["device"] == "cpu" and written["simulation"]["threads"] == 1


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_verbose_lets_flower_and_ray_logs_through(tmp_path, monkeypatch, caplog, capsys, verbose):
    """``fedsim run`` hides Flower's and Ray's own logs (Flower's logger at ERROR; ``ray.init`` told to log
    at ERROR, which sets Ray's logger, and to send no worker logs to the driver); ``--verbose`` lets them
    through. Ray is never started: Flower's ``run_simulation`` is replaced by a probe that records what
    the engine would start with, logs as Flower would, and stops."""
    import logging

    import flwr.simulation

    from fedsim import progress

    class Probe(Exception):
        pass

    seen = {}

    def probe(*, backend_config, **kwargs):
        seen["flwr"] = logging.getLogger("flwr").getEffectiveLevel()
        seen["init"] = backend_config["init_args"]
        logging.getLogger("flwr").info("flwr says: starting the simulation engine")
        raise Probe

    monkeypatch.setattr(flwr.simulation, "run_simulation", probe)
    monkeypatch.setattr(progress, "_level", progress.level())  # main() sets the process-wide level
    cfg = tmp_path / "c.toml"
    cfg.write_text('[federation]\nrounds = 1\nnum_clients = 2\n[train]\nlocal_steps = 1\n')
    argv = ["run", str(cfg), "--out", str(tmp_path / "run"), "--backend", "ray"]
    try:
        assert cli_main(argv + (["--verbose"] if verbose else [])) == 1
    finally:
        for name in ("flwr", "ray"):  # back to the test session's quiet logs
            logging.getLogger(name).setLevel(logging.ERROR)
    flwr_lines = [r for r in caplog.records if r.name == "flwr" and "flwr says" in r.getMessage()]
    if verbose:
        assert seen["flwr"] == logging.INFO
        assert seen["init"]["logging_level"] == "INFO" and seen["init"]["log_to_driver"] is True
        assert len(flwr_lines) == 1
    else:
        assert seen["flwr"] == logging.ERROR
        assert seen["init"]["logging_level"] == "ERROR" and seen["init"]["log_to_driver"] is False
        assert flwr_lines == []
    assert not (tmp_path / "run").exists()  # the probe stopped it before round 1: nothing half-way kept
    err = capsys.readouterr().err  # one line; the traceback only with --verbose
    assert "fedsim: the run failed before completing a round: Probe (nothing written" in err
    assert ("Traceback" in err) == verbose


def test_help_and_version_do_not_import_torch():
    code = ("import sys\nfrom fedsim.app.cli import build_parser\np = build_parser()\n"
            "try:\n    p.parse_args(['--version'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": child_pythonpath()}, timeout=600)
    assert res.stdout.strip().splitlines() == ["fedsim 0.1.0", "False"], res.stdout + res.stderr


# =============================================================================== run files and timing
def test_startup_apart_from_rounds_csv_tensorboard_and_client_evaluation(tmp_path):
    from fedsim.app import build_components
    from fedsim.export import read_events
    from fedsim.factories import client_data, model_for
    from fedsim.models.weights import set_weights
    from fedsim.training.evaluation import evaluate

    cfg = make_small_cfg("evaluate.client_fraction=1.0", 'output.observers=["tensorboard"]', "federation.rounds=2")
    out = tmp_path / "run"
    _, summary = run_inprocess(cfg, out, build_components(cfg)["observers"])
    rows = read_jsonl(out / "metrics.jsonl")
    # timing: round 0 is the initial evaluation only; start-up and rounds are reported apart
    assert rows[0]["startup_seconds"] >= 0 and summary["startup_seconds"] == rows[0]["startup_seconds"]
    assert summary["round_seconds"] == pytest.approx(sum(r["seconds"] for r in rows[1:]))
    assert summary["seconds"] >= summary["startup_seconds"] + summary["round_seconds"]
    # CSV next to JSONL: the same values
    import csv

    from fedsim.export import csv_text

    csv_rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [float(r["accuracy"]) for r in csv_rows] == [r["accuracy"] for r in rows]
    # appended round by round, the header grew when round 1 brought the client-evaluation columns
    assert "client_accuracy" not in rows[0] and "client_accuracy" in rows[1]
    assert (out / "metrics.csv").read_text() == csv_text(rows)
    # TensorBoard: decode the event file with protobuf (a schema built here) and compare
    Event = _event_class()
    events = [Event.FromString(b) for b in read_events(next((out / "tensorboard").glob("events.out.tfevents.*")))]
    assert events[0].file_version == "brain.Event:2"
    acc = {e.step: v.simple_value for e in events[1:] for v in e.summary.value if v.tag == "accuracy"}
    assert acc == pytest.approx({r["round"]: r["accuracy"] for r in rows}, abs=1e-6)
    # client-side evaluation (every client): the final model on each client's own data, weighted
    model = model_for(cfg)
    set_weights(model, final_model(out))
    accs, ns = [], []
    for p in range(cfg["federation"]["num_clients"]):
        x, y = client_data(cfg, p)
        accs.append(evaluate(model, x, y)[1])
        ns.append(len(y))
    last = rows[-1]
    assert last["client_evaluators"] == 4
    assert last["client_accuracy"] == pytest.approx(np.average(accs, weights=ns), abs=1e-6)
    assert last["client_accuracy_min"] == pytest.approx(min(accs), abs=1e-6)


def _event_class():
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="fedsim_test_event.proto", package="fedsimtest")
    v = fdp.message_type.add(name="Value")
    v.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    v.field.add(name="simple_value", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL)
    s = fdp.message_type.add(name="Summary")
    s.field.add(name="value", number=1, type=F.TYPE_MESSAGE, type_name=".fedsimtest.Value", label=F.LABEL_REPEATED)
    e = fdp.message_type.add(name="Event")
    e.field.add(name="wall_time", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    e.field.add(name="step", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    e.field.add(name="file_version", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    e.field.add(name="summary", number=5, type=F.TYPE_MESSAGE, type_name=".fedsimtest.Summary",
                label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("fedsimtest.Event"))


# =============================================================================== training options
def test_momentum_weight_decay_and_proximal_term_match_torch_sgd():
    """local_train with momentum, weight decay and FedProx's proximal term = torch.optim.SGD on
    loss + mu/2 ||w - w0||^2 over the same batches."""
    from fedsim.models import build_model
    from fedsim.training.batches import batch_schedule
    from fedsim.training.local import local_train
    from fedsim.training.recipe import Recipe

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(40, 1, 28, 28, generator=g), torch.randint(0, 10, (40,), generator=g)
    torch.manual_seed(1)
    net = build_model("lenet", (1, 28, 28), 10, activation="tanh")
    ref = build_model("lenet", (1, 28, 28), 10, activation="tanh")
    ref.load_state_dict(net.state_dict())
    w0 = [p.detach().clone() for p in ref.parameters()]
    recipe = Recipe(lr=0.05, batch_size=8, local_steps=4, momentum=0.9, weight_decay=1e-3, proximal_mu=0.3)
    res = local_train(net, x, y, recipe, seed=0, round=1, client=0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for idx in batch_schedule(0, 1, 0, 40, recipe):
        ti = torch.as_tensor(idx)
        opt.zero_grad()
        prox = sum(((p - a) ** 2).sum() for p, a in zip(ref.parameters(), w0))
        (torch.nn.functional.cross_entropy(ref(x[ti]), y[ti]) + 0.3 / 2 * prox).backward()
        opt.step()
    for a, b in zip(res.weights, ref.state_dict().values()):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-6)
    assert not np.allclose(res.weights[0], local_train(build_model("lenet", (1, 28, 28), 10, activation="tanh"),
                                                        x, y, Recipe(0.05, 8, 4), seed=0, round=1,
                                                        client=0).weights[0])


def test_attack_side_knows_momentum_and_weight_decay():
    """One local step: the gradient is recovered exactly from the update despite momentum and weight
    decay; several steps: the replay with momentum/weight decay/proximal term reproduces the update."""
    from attacks.gradients import assumed_schedule, simulate_update, update_to_gradient
    from fedsim.models import build_model
    from fedsim.training.local import local_train
    from fedsim.training.recipe import Recipe

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
    torch.manual_seed(0)
    net = build_model("lenet", (1, 28, 28), 10, activation="sigmoid")
    sd0 = {k: v.clone() for k, v in net.state_dict().items()}
    one = Recipe(lr=0.1, batch_size=8, local_steps=1, momentum=0.9, weight_decay=0.01)
    res = local_train(net, x, y, one, seed=0, round=1, client=0)
    upd = {k: torch.as_tensor(w) - sd0[k] for k, w in zip(sd0, res.weights)}
    net.load_state_dict(sd0)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    true = dict(zip([n for n, _ in net.named_parameters()], torch.autograd.grad(loss, list(net.parameters()))))
    got = update_to_gradient(upd, one.to_mapping(), names=list(true), global_state=sd0)
    for n in true:
        torch.testing.assert_close(got[n], true[n], atol=2e-6, rtol=1e-4)
    # several steps, replayed exactly (the true batches, in the assumed order)
    many = Recipe(lr=0.1, batch_size=4, local_steps=3, momentum=0.5, weight_decay=0.01, proximal_mu=0.2)
    sched = assumed_schedule(8, many.to_mapping())
    net.load_state_dict(sd0)
    sim = simulate_update(net, x, y, 0.1, sched, momentum=0.5, weight_decay=0.01, proximal_mu=0.2,
                          create_graph=False)
    ref = build_model("lenet", (1, 28, 28), 10, activation="sigmoid")
    ref.load_state_dict(sd0)
    w0 = [p.detach().clone() for p in ref.parameters()]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5, weight_decay=0.01)
    for idx in sched:
        opt.zero_grad()
        prox = sum(((p - a) ** 2).sum() for p, a in zip(ref.parameters(), w0))
        (torch.nn.functional.cross_entropy(ref(x[idx]), y[idx]) + 0.1 * prox).backward()
        opt.step()
    for (n, p), a in zip(ref.named_parameters(), w0):
        torch.testing.assert_close(sim[n], (p - a).detach(), atol=2e-6, rtol=1e-4)


def test_lr_schedule_reaches_clients_and_attacker(tmp_path):
    from fedsim.protocol import CONFIG, LR, TRAIN
    from fedsim.training.schedule import scheduled_lr

    t = {"lr": 0.1, "lr_schedule": "step", "lr_gamma": 0.5, "lr_step_rounds": 2}
    assert [scheduled_lr(t, r, 6) for r in range(1, 7)] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    assert scheduled_lr({**t, "lr_schedule": "exponential"}, 3, 6) == pytest.approx(0.025)
    cos = {"lr": 0.1, "lr_schedule": "cosine", "lr_min": 0.01}
    assert [scheduled_lr(cos, r, 5) for r in (1, 3, 5)] == pytest.approx([0.1, 0.055, 0.01])
    cfg = make_small_cfg('train.lr_schedule="exponential"', "train.lr_gamma=0.5", "federation.rounds=3")
    rec = RecordingObserver()
    grid, _ = run_inprocess(cfg, None, [rec])
    lrs = sorted({(m.content[CONFIG]["server-round"], m.content[CONFIG][LR]) for m in grid.messages_sent
                  if m.metadata.message_type == TRAIN})
    assert lrs == [(1, 0.05), (2, 0.025), (3, 0.0125)]
    assert {u.round: u.recipe["lr"] for u in rec.updates} == {1: 0.05, 2: 0.025, 3: 0.0125}
    with pytest.raises(ConfigError, match=r"train.momentum must be in \[0, 1\), got 1.0"):
        make_small_cfg("train.momentum=1.0")


def test_metrics_csv_grows_by_whole_lines_and_is_rewritten_only_for_new_columns(tmp_path):
    """CsvLog appends a round's line to the same file; a row with a new column rewrites the file (new
    header); a fresh CsvLog (a resumed run) rewrites it once. The file always equals write_csv's."""
    import os

    from fedsim.export import CsvLog, csv_text

    path = tmp_path / "metrics.csv"
    log, rows, inodes = CsvLog(path), [], []
    for row in [{"round": 0, "accuracy": 0.1, "startup_seconds": 2.0}, {"round": 1, "accuracy": 0.2},
                {"round": 2, "accuracy": 0.3, "note": "a,b"}, {"round": 3, "accuracy": float("nan")}]:
        rows.append(row)
        log.append(rows)
        inodes.append(os.stat(path).st_ino)
        assert path.read_text() == csv_text(rows)
    assert log.rewrites == 2  # round 0 and the new column of round 2
    assert inodes[0] == inodes[1] and inodes[2] == inodes[3] and inodes[1] != inodes[2]  # appends: same file
    resumed = CsvLog(path)
    rows.append({"round": 4, "accuracy": 0.5})
    resumed.append(rows)
    assert resumed.rewrites == 1 and path.read_text() == csv_text(rows)
