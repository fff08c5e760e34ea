"""Config validation (through the CLI: exit code 2, a message naming the key, nothing written),
``--set`` parsing and the round trip of the resolved ``config.toml``."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fedsim.app import load_config
from fedsim.app.cli import main
from fedsim.config import (
    ConfigError,
    apply_overrides,
    defaults,
    dump_toml,
    parse_value,
    with_nulls,
)

DEFAULT_TOML = Path(__file__).resolve().parents[1] / "experiments" / "default.toml"

# (id, --set list, config file text or None for experiments/default.toml, substrings the message must hold)
BAD = [
    ("unknown-section", ["foo.bar=1"], None, ["'foo'", "allowed top-level keys", "federation"]),
    ("unknown-top-level-key", ["colour=1"], None, ["'colour'", "allowed top-level keys"]),
    ("unknown-key-in-section", ["federation.round=3"], None, ["federation.round", "federation.rounds"]),
    ("unknown-key-in-file", [], "[federation]\nroundz = 3\n", ["federation.roundz", "federation.rounds"]),
    ("wrong-type-int", ['federation.rounds="three"'], None, ["federation.rounds", "an integer", "three"]),
    ("wrong-type-bool", ["data.download=1"], None, ["data.download", "true or false"]),
    ("wrong-type-number", ['train.lr="fast"'], None, ["train.lr", "a number"]),
    ("below-min", ["federation.rounds=0"], None, ["federation.rounds", ">= 1", "got 0"]),
    ("below-min-seed", ["seed=-1"], None, ["seed", ">= 0"]),
    ("zero-discovery-timeout", ["simulation.discovery_timeout=0"], None, ["simulation.discovery_timeout", "> 0"]),
    ("inf-discovery-timeout", ["simulation.discovery_timeout=inf"], None, ["simulation.discovery_timeout", "finite"]),
    ("bad-dataset", ['data.dataset="imagenet"'], None, ["data.dataset", "fmnist-small", "imagenet"]),
    ("bad-model", ['model.name="vgg"'], None, ["model.name", "lenet", "resnet18"]),
    ("bad-activation", ['model.activation="gelu"'], None, ["model.activation", "sigmoid"]),
    ("bad-strategy", ['strategy.name="krum"'], None, ["strategy.name", "fedavg"]),
    ("bad-strategy-param", ["strategy.mu=0.1"], None, ["strategy.mu", "fedavg"]),
    ("compensation-moved", ['strategy.compensation="mp"'], None,
     ["strategy.compensation", "[[transforms]]", "mp-compensation"]),
    ("feedback-not-bool", ['transforms=[{name="mp-compensation", feedback="yes"}]'], None,
     ["transforms[0].feedback", "true or false"]),
    ("bad-transform", ['transforms=[{name="magic"}]'], None, ["transforms[0].name", "mp-compensation", "magic"]),
    ("bad-transform-param", ['transforms=[{name="mp-compensation", Q=0.5}]'], None,
     ["transforms[0]", "Q", ">= 1"]),
    ("bad-channel", ['channel.name="carrier-pigeon"'], None, ["channel.name", "plain", "carrier-pigeon"]),
    ("bad-channel-param", ["channel.bits=16"], None, ["channel.bits", "plain"]),
    ("dp-sgd-with-batchnorm", ['model.norm="batch"', 'defenses=[{name="dp-sgd", clip_norm=1.0}]'], None,
     ["defenses[0] (dp-sgd)", "BatchNorm", "model.norm"]),
    ("nan-defense-param", ['defenses=[{name="gaussian-noise", sigma=nan}]'], None,
     ["defenses[0].sigma", "finite"]),
    # NaN and infinity: comparisons with NaN are false, so a range check alone would let them through
    ("nan-lr", ["train.lr=nan"], None, ["train.lr", "finite", "nan"]),
    ("nan-alpha", ["data.alpha=nan"], None, ["data.alpha", "finite"]),
    ("nan-val-fraction", ["data.val_fraction=nan"], None, ["data.val_fraction", "finite"]),
    ("nan-client-fraction", ["evaluate.client_fraction=nan"], None, ["evaluate.client_fraction", "finite"]),
    ("inf-round-timeout", ["federation.round_timeout=inf"], None, ["federation.round_timeout", "finite", "inf"]),
    ("minus-inf-momentum", ["train.momentum=-inf"], None, ["train.momentum", "finite"]),
    ("nan-rounds", ["federation.rounds=nan"], None, ["federation.rounds", "an integer"]),
    ("nan-transform-param", ['transforms=[{name="mp-compensation", Q=nan}]'], None, ["transforms[0].Q", "finite"]),
    ("nan-inside-a-list-param", ['transforms=[{name="lossless-perturbation", multiplicative=[nan, 1.0]}]'],
     None, ["transforms[0].multiplicative[0]", "finite"]),
    ("inf-attack-param", ['attack={name="dlg", params={dlg={lr=inf}}}'], None, ["attack.params.dlg.lr", "finite"]),
    ("nan-attack-threshold", ['attack={name="dlg", ssim_threshold=nan}'], None, ["attack.ssim_threshold", "finite"]),
    ("nan-flower-mod-param", ['client.flower_mods=[{name="local-dp", clipping_norm=nan, sensitivity=1.0, '
                              'epsilon=1.0, delta=1e-5}]'], None, ["client.flower_mods[0].clipping_norm", "finite"]),
    ("bad-partition", ['data.partition="shards"'], None, ["data.partition", "iid", "dirichlet", "pathological"]),
    ("steps-and-epochs", ["train.local_steps=2"], None, ["train.local_steps", "train.local_epochs", "exactly one"]),
    ("neither-steps-nor-epochs", [], "[train]\nlr = 0.1\n", ["train.local_steps", "train.local_epochs"]),
    ("clients-per-round", ["federation.num_clients=4", "federation.clients_per_round=5"], None,
     ["federation.clients_per_round", "federation.num_clients", "<="]),
    ("min-gt-max-per-class", ["data.min_per_class=60", "data.max_per_class=50"], None,
     ["data.min_per_class", "data.max_per_class", "<="]),
    ("set-without-equals", ["federation.rounds"], None, ["--set", "section.key=value"]),
    ("set-without-key", ["=3"], None, ["--set", "section.key=value"]),
    ("set-into-a-value", ["name.x=1"], None, ["name", "not a section"]),
    ("missing-file", [], "MISSING", ["does not exist", "nope.toml"]),
    ("invalid-toml", [], "federation = [\n", ["not valid TOML"]),
    ("bad-defense-name", ['defenses=[{name="magic"}]'], None, ["defenses[0].name", "gaussian-noise", "magic"]),
    ("bad-defense-param", ['defenses=[{name="prune", ratio=0.5, foo=1}]'], None,
     ["defenses[0].foo", "prune", "ratio"]),
    ("bad-defense-value", ['defenses=[{name="prune", ratio=2.0}]'], None, ["defenses[0]", "ratio", "[0, 1]"]),
    ("missing-defense-param", ['defenses=[{name="prune"}]'], None, ["defenses[0]", "needs", "ratio"]),
    ("bad-defense-index", ["defenses.0.ratio=0.5"], None, ["defenses.<index>.<param>", "0 defenses"]),
    ("defenses-not-tables", ["defenses=3"], None, ["defenses", "list of tables"]),
    ("bad-hidden", ["model.hidden=[0, 4]"], None, ["model.hidden", "positive integers"]),
    ("unknown-observer", ['output.observers=["spy"]'], None, ["output.observers", "update-norms", "spy"]),
    ("dataset-unavailable", ['data.dataset="cifar10"'], None, ["cifar10", "data.data_dir"]),
]


def _argv(tmp_path: Path, sets: list[str], file_text: str | None) -> list[str]:
    if file_text is None:
        path = str(DEFAULT_TOML)
    elif file_text == "MISSING":
        path = str(tmp_path / "nope.toml")
    else:
        path = str(tmp_path / "bad.toml")
        Path(path).write_text(file_text)
    argv = ["run", path, "--quiet", "--backend", "inprocess", "--set", f'output.dir="{tmp_path / "out"}"']
    for s in sets:
        argv += ["--set", s]
    return argv


def _run_folders(tmp_path: Path) -> list[Path]:
    """Every folder anywhere under tmp_path (a run folder would be one)."""
    return [p for p in tmp_path.rglob("*") if p.is_dir()]


@pytest.mark.parametrize("sets,file_text,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_exits_2_names_key_writes_nothing(sets, file_text, expected, tmp_path, monkeypatch, capsys):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # a relative default output.dir ("runs") would land here
    code = main(_argv(tmp_path, sets, file_text))
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("fedsim: error:")
    for s in expected:
        assert s in captured.err, f"{s!r} not in {captured.err!r}"
    assert "Traceback" not in captured.err
    assert "results in" not in captured.out
    assert _run_folders(tmp_path) == [work]
    assert list(work.iterdir()) == []


def test_cli_valid_config_writes_run_folder_and_round_trips(tmp_path, monkeypatch, capsys):
    """Positive control for the test above: the same command line with valid values does write."""
    monkeypatch.chdir(tmp_path)
    sets = ["federation.rounds=1", "federation.num_clients=3", "train.local_epochs=1", "train.batch_size=256",
            'defenses=[{name="prune", ratio=0.5}]', "model.hidden=[8]"]
    code = main(_argv(tmp_path, sets, None))
    out = capsys.readouterr()
    assert code == 0, out.err
    runs = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    assert len(runs) == 1 and runs[0].name.startswith("default-")
    assert str(runs[0]) in out.out
    expected = load_config(DEFAULT_TOML, [f'output.dir="{tmp_path / "out"}"', *sets,
                                          'simulation.backend="inprocess"'])
    assert load_config(runs[0] / "config.toml") == expected
    assert (runs[0] / "summary.json").exists()


def test_dataset_check_happens_before_the_folder(tmp_path, monkeypatch):
    """run_experiment refuses an unavailable dataset without creating output.dir/<run>."""
    from fedsim.app.runner import run_experiment
    from fedsim.data import DatasetUnavailable

    cfg = load_config(DEFAULT_TOML, [f'output.dir="{tmp_path / "out"}"', 'data.dataset="cifar10"'])
    with pytest.raises(DatasetUnavailable):
        run_experiment(cfg, progress=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ----------------------------------------------------------------------------------- --set values
@pytest.mark.parametrize("text,value", [
    ("3", 3), ("-2", -2), ("0.5", 0.5), ("1e-3", 1e-3), ("true", True), ("false", False),
    ("hello", "hello"), ('"3"', "3"), ("'quoted string'", "quoted string"), ("a=b", "a=b"),
    ("[1, 2, 3]", [1, 2, 3]), ('["a", "b"]', ["a", "b"]), ("[0.1, 2]", [0.1, 2]),
    ("{name = 'prune', ratio = 0.9}", {"name": "prune", "ratio": 0.9}),
    ("runs/my run", "runs/my run"),
])
def test_parse_value(text, value):
    got = parse_value(text)
    assert got == value and type(got) is type(value)


def test_apply_overrides_types_and_nesting():
    cfg = defaults()
    apply_overrides(cfg, ["federation.rounds=7", "train.lr=0.25", "data.download=true", "name=exp-1",
                          "model.hidden=[32, 16]", " seed = 4 ", "strategy.extra.deep=1",
                          'output.dir="out=here"'])
    assert cfg["federation"]["rounds"] == 7 and isinstance(cfg["federation"]["rounds"], int)
    assert cfg["train"]["lr"] == 0.25 and isinstance(cfg["train"]["lr"], float)
    assert cfg["data"]["download"] is True
    assert cfg["name"] == "exp-1"
    assert cfg["model"]["hidden"] == [32, 16]
    assert cfg["seed"] == 4
    assert cfg["strategy"]["extra"] == {"deep": 1}
    assert cfg["output"]["dir"] == "out=here"  # only the first '=' separates key and value


def test_set_defense_entries_by_index():
    cfg = load_config(DEFAULT_TOML, ['defenses=[{name="prune", ratio=0.5}, {name="gaussian-noise", sigma=0.1}]',
                                     "defenses.1.sigma=0.2", "defenses.0.scope='layer'"])
    assert cfg["defenses"] == [{"name": "prune", "ratio": 0.5, "scope": "layer"},
                               {"name": "gaussian-noise", "sigma": 0.2}]


def test_overrides_beat_file_and_defaults_fill_the_rest(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('name = "filed"\n[federation]\nrounds = 9\n[train]\nlocal_steps = 2\n')
    cfg = load_config(p, ["federation.rounds=3"])
    assert cfg["name"] == "filed" and cfg["federation"]["rounds"] == 3
    assert cfg["federation"]["num_clients"] == defaults()["federation"]["num_clients"]
    assert cfg["train"]["local_steps"] == 2 and cfg["train"]["local_epochs"] is None


def test_load_config_raises_config_error_directly(tmp_path):
    with pytest.raises(ConfigError, match="federation.rounds"):
        load_config(DEFAULT_TOML, ["federation.rounds=0"])
    assert issubclass(ConfigError, ValueError)


# ------------------------------------------------------------------------------------- round trip
def test_resolved_config_round_trips(tmp_path, small_cfg):
    cfg = small_cfg("model.hidden=[8, 4]", 'model.name="mlp"', 'data.dataset="breast-cancer"',
                    'defenses=[{name="gaussian-noise", sigma=0.01}, {name="prune", ratio=0.3, scope="layer"}]',
                    train__lr=1e-3, seed=12, name="round trip")
    text = dump_toml(cfg)
    assert "null" not in text.lower() and "None" not in text
    p = tmp_path / "config.toml"
    p.write_text(text)
    assert load_config(p) == cfg
    assert with_nulls(tomllib.loads(text)) == cfg
    # unset keys are dropped from the file, and come back as None
    assert cfg["data"]["data_dir"] is None and "data_dir" not in tomllib.loads(text)["data"]


def test_default_experiment_is_valid():
    cfg = load_config(DEFAULT_TOML)
    assert cfg["train"]["local_epochs"] and cfg["train"]["local_steps"] is None
    assert load_config(None, ["train.local_steps=1"])["train"]["local_steps"] == 1


CHILD = """
import json, sys
from fedsim.app.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    rc = main(argv)
    out.append([rc, sorted(m for m in ("torch", "flwr", "ray") if m in sys.modules)])
print(json.dumps(out))
"""


def test_bad_keys_and_missing_files_are_reported_before_torch_flower_or_ray_is_imported(tmp_path):
    """The first pass of validation (fedsim.config.precheck) imports nothing heavy: a typo in a key, a bad
    value of the schema, a missing config or plugin file, in a run, a sweep or an experiment, exit 2 with
    one line naming it while torch, Flower and Ray are still not imported (a fresh process)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import child_pythonpath

    cases = [(["run", "experiments/default.toml", "--set", "federation.bogus=1"], "federation.bogus"),
             (["run", str(tmp_path / "missing.toml")], "missing.toml"),
             (["run", "experiments/default.toml", "--set", 'defenses=[{name="no_such_plugin.py:Defense"}]'],
              "defenses[0].name: plugin file"),
             (["sweep", "experiments/defenses.toml", "--set", "train.lr=-1"], "train.lr must be >="),
             (["experiment", "seed004-systematic", "--quick", "--set", "data.partition=diagonal"], "data.partition")]
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps([argv for argv, _ in cases])], cwd=root,
                       env={**os.environ, "PYTHONPATH": child_pythonpath()}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.splitlines()[-1]) == [[2, []]] * len(cases)
    errors = [x for x in p.stderr.splitlines() if x.startswith("fedsim: error:")]
    assert len(errors) == len(cases)
    for line, (_, what) in zip(errors, cases):
        assert what in line, line
