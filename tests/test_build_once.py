"""A run builds its components once (issue 28): ``fedsim run`` validates the config by building them and
hands those to the runner and the server, which build none of their own."""
from __future__ import annotations

from pathlib import Path

from conftest import make_small_cfg, small_sets

import fedsim.build
from fedsim.app.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_fedsim_run_builds_the_components_once(tmp_path, monkeypatch):
    real = fedsim.build.build_components
    built = []
    monkeypatch.setattr(fedsim.build, "build_components", lambda cfg: built.append(cfg["name"]) or real(cfg))
    config = ROOT / "experiments" / "default.toml"
    sets = small_sets("federation.rounds=1", "federation.num_clients=2", path=config, output__dir=str(tmp_path / "runs"))
    argv = ["run", str(config), "--out", str(tmp_path / "run"), "-q",
            *(x for s in sets for x in ("--set", s))]
    assert main(argv) == 0
    assert built == ["default"]  # (the config file's name)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # rounds 0 and 1


def _count_builds(monkeypatch) -> list[str]:
    real = fedsim.build.build_components
    built: list[str] = []
    monkeypatch.setattr(fedsim.build, "build_components", lambda cfg: built.append(cfg["name"]) or real(cfg))
    return built


SWEEP = """
name = "sw"
[federation]
rounds = 1
num_clients = 2
[model]
activation = "relu"
[train]
batch_size = 8
local_steps = 1
[simulation]
backend = "inprocess"
[output]
observers = []

[[variants]]
label = "a"

[[variants]]
label = "b"
train = { lr = 0.05 }
"""


def test_a_sweep_builds_each_run_once(tmp_path, monkeypatch):
    """Checking every run up front builds its components; the run is handed those (seeded runs included:
    each seed's config is checked and built, not the variant's)."""
    from fedsim.app.sweep import run_sweep

    built = _count_builds(monkeypatch)
    p = tmp_path / "sweep.toml"
    p.write_text(SWEEP)
    out = run_sweep(p, out=tmp_path / "out", progress=False, seeds=[0, 1], only=["a"])
    assert built == ["sw-a-seed0", "sw-a-seed1"]
    assert sorted(d.name for d in out.iterdir() if d.is_dir()) == ["00-a-seed0", "00-a-seed1"]
    built.clear()
    run_sweep(p, out=tmp_path / "out2", progress=False)
    assert built == ["sw-a", "sw-b"]


def test_fedsim_attack_builds_the_components_once(tmp_path, monkeypatch):
    built = _count_builds(monkeypatch)
    argv = ["attack", "--attack", "idlg", "--out", str(tmp_path / "one"), "--quiet",
            "--set", "attack.params.idlg.iterations=2"]
    assert main(argv) == 0
    assert built == ["attack-idlg"]
    assert len((tmp_path / "one" / "leakage.jsonl").read_text().splitlines()) == 1


def test_the_client_app_builds_its_channel_and_mods_once_per_config(tmp_path, monkeypatch):
    """Every train message used to build the channel's client half and the Flower mods again; now a
    process builds them once per config (the run's messages share them), and a new config builds anew."""
    import fedsim.app.client as client
    from fedsim.app.runner import run_experiment
    from fedsim.components import FLOWER_MODS

    cfg = make_small_cfg("federation.rounds=3", "federation.num_clients=2",
                         'client.flower_mods=[{name="local-dp", clipping_norm=1.0, sensitivity=1.0, '
                         'epsilon=50.0, delta=1e-5}]', simulation__backend="inprocess")
    components = fedsim.build.build_components(cfg)
    for cache in (client._cached_channel, client._cached_train):
        cache.cache_clear()
    channels, mods = [], []
    real_channel, real_mods = client.channel_for, FLOWER_MODS.build_list
    monkeypatch.setattr(client, "channel_for", lambda c: channels.append(c["seed"]) or real_channel(c))
    monkeypatch.setattr(FLOWER_MODS, "build_list", lambda *a, **k: mods.append(1) or real_mods(*a, **k))
    run = run_experiment(cfg, out=tmp_path / "run", progress=False, components=components)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4  # 6 train and 6 evaluate messages
    assert (channels, mods) == ([cfg["seed"]], [1])
    run_experiment({**cfg, "seed": cfg["seed"] + 1}, out=tmp_path / "run2", progress=False, components=components)
    assert (channels, mods) == ([cfg["seed"], cfg["seed"] + 1], [1, 1])  # another config: built for it


def test_the_client_app_travels_by_reference():
    """Flower's Ray backend pickles the app (in a loader closure) with every message: it must arrive as the
    actor's own module-level app, not a copy of its handlers rebuilt per message."""
    import cloudpickle

    from fedsim.app.client import client_app

    payload = cloudpickle.dumps(lambda: client_app)
    assert cloudpickle.loads(payload)() is client_app
    assert len(payload) < 2000  # by value: ~14 kB of handlers and closures
