"""Hostile configs and plugins (docs/failures.md "Hostile configs and plugins", docs/plugins.md "What a
reference may name"): each gives one line naming the key or file, exit 2 (a bad input) or 1 (a failure at
run time), no traceback, and nothing written; an import reference never runs code the user did not ask
for."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fedsim.app.cli import main

PLUGINS = '''
import numpy as np
import torch
from shutil import rmtree  # imported, not defined here: a reference to it is refused
from torch import nn


def not_a_module(in_shape, num_classes):
    return 42


def raises_when_built(in_shape, num_classes):
    raise RuntimeError("boom when built")


class RaisesInForward(nn.Module):
    def __init__(self, in_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(int(np.prod(in_shape)), num_classes)

    def forward(self, x):
        raise RuntimeError("boom in forward")


class WrongLogits(nn.Module):
    def __init__(self, in_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(int(np.prod(in_shape)), num_classes + 1)

    def forward(self, x):
        return self.fc(x.flatten(1))


class FailsLater(nn.Module):
    """Passes the check on two inputs, then raises: in the server's first evaluation."""
    calls = 0

    def __init__(self, in_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(int(np.prod(in_shape)), num_classes)

    def forward(self, x):
        FailsLater.calls += 1
        if FailsLater.calls > 1:
            raise RuntimeError("boom later")
        return self.fc(x.flatten(1))


def strings(root_size):
    return {"x_train": ["a"] * 300, "y_train": [0] * 300, "x_test": ["b"] * 3, "y_test": [0] * 3}


def two_labels_each(root_size):
    return {"x_train": np.zeros((300, 1, 4, 4), np.float32), "y_train": np.zeros((300, 2), np.int64),
            "x_test": np.zeros((3, 1, 4, 4), np.float32), "y_test": np.zeros(3, np.int64)}


def raises_when_loaded(root_size):
    raise KeyError("boom when loaded")


def nan_images(root_size):
    x = np.zeros((300, 1, 4, 4), np.float32)
    x[7, 0, 1, 2] = np.nan
    return {"x_train": x, "y_train": np.arange(300) % 2, "x_test": x[:3] * 0, "y_test": np.zeros(3, np.int64)}


def tiny(root_size, n: int = 300):
    g = np.random.default_rng(0)
    return {"x_train": g.random((n, 1, 8, 8), np.float32), "y_train": g.integers(0, 2, n),
            "x_test": g.random((20, 1, 8, 8), np.float32), "y_test": g.integers(0, 2, 20)}
'''


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """``fedsim ARGS`` in-process from an empty working directory holding ``plugins.py`` (and
    ``bad_import.py``); returns (exit code, stderr, stdout)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "plugins.py").write_text(PLUGINS)
    (work / "bad_import.py").write_text('raise RuntimeError("boom at import")\n')
    (work / "base.toml").write_text(BASE)
    monkeypatch.chdir(work)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.err, out.out

    return run


BASE = """name = "h"
[federation]
rounds = 1
num_clients = 2
[train]
local_steps = 1
batch_size = 8
[simulation]
backend = "inprocess"
[output]
observers = []
"""
OURS = ("plugins.py", "bad_import.py", "base.toml")


def _written(work: Path) -> list[str]:
    """What the command left in the working directory besides the test's own files."""
    return sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.name not in OURS
                  and "__pycache__" not in p.parts)


def _run(cli, *sets: str) -> tuple[int, str]:
    argv = ["run", "base.toml", "--quiet"]
    for s in sets:
        argv += ["--set", s]
    code, err, _ = cli(*argv)
    return code, err


def _one_line(err: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err


# ------------------------------------------------------------------------- code execution from a config
REFUSED = [
    ('model.name="os:system"', 'model.params={command="touch PWNED"}', "names Python's standard library"),
    ('data.dataset="subprocess:call"', 'data.params={args="touch PWNED"}', "names Python's standard library"),
    ('model.name="builtins:eval"', 'model.params={source="open(\'PWNED\', \'w\')"}', "standard library"),
    ('data.dataset="shutil:rmtree"', 'data.params={path="."}', "names Python's standard library"),
    ('model.name="this:s"', "seed=0", "names Python's standard library"),  # not even imported (it prints)
    (f'data.dataset="{Path(__import__("shutil").__file__)}:rmtree"', 'data.params={path="."}',
     "is part of Python's standard library"),
    (f'model.name="{Path(__import__("torch").serialization.__file__)}:save"', "seed=0",
     "is part of an installed package"),
    ('model.name="torch:save"', "seed=0", "is a function of an installed package"),
    ('data.dataset="plugins.py:rmtree"', 'data.params={path="."}', "is a function of Python's standard library"),
    ('client.flower_mods=[{name="subprocess:Popen", args="touch PWNED", shell=true}]', "seed=0",
     "names Python's standard library"),
    ('model.name="plugins.py:np.save"', "seed=0", "must name a subclass of torch.nn.Module or a function"),
]


@pytest.mark.parametrize("ref,params,expected", REFUSED, ids=[r[0].split('"')[1] for r in REFUSED])
def test_an_import_reference_runs_nothing_it_was_not_clearly_asked_for(cli, ref, params, expected):
    sys.modules.pop("this", None)
    code, err = _run(cli, ref, params)
    assert code == 2 and err.startswith("fedsim: error: ") and expected in err, err
    _one_line(err)
    assert "this" not in sys.modules
    assert _written(Path.cwd()) == []  # no PWNED, no run folder, nothing removed (our files are still there)
    assert all((Path.cwd() / f).is_file() for f in OURS)


def test_a_report_figure_reference_is_held_to_the_same_rule(tmp_path):
    from fedsim.components import FIGURES, ConfigError
    from fedsim.tables import check_figures

    with pytest.raises(ConfigError, match=r"report.figures\[0\].draw: 'shutil:rmtree' names Python's standard"):
        check_figures([{"title": "t", "draw": "shutil:rmtree"}], "report.figures")
    # the experiments' own figures are registered: accepted also when experiments/ is an installed package
    ok = check_figures([{"title": "t", "draw": "experiments.fedboosting_table:draw"}], "report.figures")
    assert FIGURES.lookup(ok[0]["draw"], "draw") is FIGURES["fedboosting-table"]


def test_what_a_reference_may_name(tmp_path, monkeypatch):
    """The positive side of the rule: a component class from an installed package, a function of the
    user's own file or of a module on PYTHONPATH, a registered function."""
    import numpy as np
    from torch import nn

    import fedsim.models  # noqa: F401  (sets MODELS.base = nn.Module)
    from fedsim.components import DATASETS, MODELS, ConfigError

    assert MODELS.lookup("torch.nn:Linear", "model.name") is nn.Linear  # an nn.Module subclass: anywhere
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "data.py").write_text("def load(root_size):\n    return {}\n")
    (tmp_path / "own.py").write_text("def load(root_size):\n    return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert DATASETS.lookup("mylab.data:load", "data.dataset").__module__ == "mylab.data"
    assert DATASETS.lookup(f"{tmp_path / 'own.py'}:load", "data.dataset").__name__ == "load"

    with pytest.raises(ConfigError, match=r"'numpy:load' is a function of an installed package \(numpy.load\)"):
        DATASETS.lookup("numpy:load", "data.dataset")
    DATASETS.register(np.load, name="hostile-test-registered")  # what a plugin's decorator does
    try:  # registered: accepted by reference too, wherever it lives
        assert DATASETS.lookup("numpy:load", "data.dataset") is np.load
    finally:
        DATASETS.remove("hostile-test-registered")


# ------------------------------------------------------------------------------------- plugins failing
PLUGIN_FAILURES = [
    ('model.name="bad_import.py:Net"', "model.name: cannot import", "(RuntimeError: boom at import)"),
    ('model.name="plugins.py:not_a_module"', "model.name", "returned int, not a torch.nn.Module"),
    ('model.name="plugins.py:raises_when_built"', "model.params", "building it raised RuntimeError: boom when built"),
    ('model.name="plugins.py:RaisesInForward"', "model.name", "raised RuntimeError: boom in forward"),
    ('model.name="plugins.py:WrongLogits"', "model.name", "returned (2, 11); fedsim needs logits of shape"),
    ('data.dataset="plugins.py:strings"', "data.dataset", "x_train must be a numeric array or tensor"),
    ('data.dataset="plugins.py:two_labels_each"', "data.dataset", "y_train must be one label per example (N,)"),
    ('data.dataset="plugins.py:raises_when_loaded"', "data.params", "building it raised KeyError: 'boom when loaded'"),
    ('data.dataset="plugins.py:nan_images"', "data.dataset", "x_train holds 1 non-finite values (NaN or infinity)"),
]


@pytest.mark.parametrize("ref,key,expected", PLUGIN_FAILURES, ids=[r[0].split(":")[-1][:-1] for r in PLUGIN_FAILURES])
def test_a_failing_plugin_is_one_line_naming_the_key(cli, ref, key, expected):
    code, err = _run(cli, ref)
    assert code == 2 and err.startswith(f"fedsim: error: {key}") and expected in err, err
    _one_line(err)
    assert _written(Path.cwd()) == []


def test_a_plugin_failing_at_run_time_is_one_line_and_leaves_nothing_half_way(cli):
    code, err = _run(cli, 'model.name="plugins.py:FailsLater"')
    assert code == 1, err
    assert err.startswith("fedsim: the run failed before completing a round: RuntimeError: boom later "
                          "(nothing written; --verbose shows the traceback)")
    _one_line(err)
    assert _written(Path.cwd()) == []


# --------------------------------------------------------------------- values the config decides
@pytest.mark.parametrize("sets,expected", [
    (['channel.name="paillier"', "channel.key_bits=2047"], "channel.key_bits must be an even integer in [512, 8192]"),
    (['channel.name="paillier"', "channel.key_bits=100000"], "channel.key_bits must be an even integer in [512, 8192]"),
    (['defenses=[{name="fedkl", key_length=100000000000}]'],
     "defenses[0].key_length must be in [1, 65536], got 100000000000 (the thesis uses 1024"),
    (['transforms=[{name="lossless-perturbation", multiplicative=[1e-300, 1e300]}]', 'model.name="mlp"',
      'train.loss="mse"'], "transforms[0].multiplicative must lie in [1e-06, 1e+06]"),
    (['attack={name="ig-bn"}'], "attack.name 'ig-bn': the BatchNorm-statistics prior (bn_prior = 0.1) needs a "
                                "model with BatchNorm layers; this model (LeNet) has none"),
    (["model.imprint_bins=16", 'attack={name="robbing"}', "data.root_size=200"],
     "attack.name 'robbing': it needs the server transform [[transforms]] name = 'robbing-imprint'"),
], ids=["paillier-key-bits-odd", "paillier-key-bits-huge", "fedkl-key-length-1e11", "lossless-range-1e300", "ig-bn-without-batchnorm", "robbing-without-imprint"])
def test_values_the_config_decides_are_refused_when_it_is_loaded(cli, sets, expected):
    code, err = _run(cli, *sets)
    assert code == 2 and expected in err, err
    _one_line(err)
    assert _written(Path.cwd()) == []


def test_fedsim_attack_refuses_ig_bn_without_batchnorm_and_writes_nothing(cli):
    code, err, _ = cli("attack", "--attack", "ig-bn", "--out", "a", "-q")
    assert code == 2 and "attack.name 'ig-bn'" in err and "BatchNorm" in err, err
    _one_line(err)
    assert _written(Path.cwd()) == []


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "empty-folder-given"])
def test_a_failing_attack_leaves_nothing_half_way(cli, existing):
    """`fedsim attack` whose run fails (here the model raises after the config check): exit 1, one line,
    and the output folder is removed - or emptied again when it was an empty folder of the user's."""
    if existing:
        Path("a").mkdir()
    code, err, _ = cli("attack", "--attack", "dlg", "--model", "plugins.py:FailsLater", "--set",
                       "attack.params.dlg.iterations=2", "--out", "a", "-q")
    assert code == 1 and err.startswith("fedsim: the attack failed before completing a round: RuntimeError: "
                                        "boom later (nothing written"), err
    _one_line(err)
    assert _written(Path.cwd()) == (["a"] if existing else [])


# ------------------------------------------------------------------------------------------- compare
@pytest.fixture
def two_runs(cli):
    """Two small run folders (made once per test, in-process: seconds)."""
    for name in ("r1", "r2"):
        code, err, _ = cli("run", "base.toml", "-q", "--set", 'data.dataset="plugins.py:tiny"', "--set",
                           'model.name="mlp"', "--set", "model.hidden=[4]", "--set", "data.root_size=10", "--out", name)
        assert code == 0, err
    return Path("r1"), Path("r2")


def test_compare_names_the_file_it_cannot_read_and_writes_nothing(cli, two_runs):
    r1, r2 = two_runs
    Path("existing.txt").write_text("mine\n")
    code, err, _ = cli("compare", str(r1), str(r2), "--out", "existing.txt")
    assert code == 2 and err == "fedsim: error: --out 'existing.txt' exists and is not a folder\n", err
    assert Path("existing.txt").read_text() == "mine\n"

    (r2 / "summary.json").write_text("{broken")
    code, err, _ = cli("compare", str(r1), str(r2), "--out", "c")
    assert code == 2 and err.startswith("fedsim: error: r2/summary.json is not valid JSON ("), err
    _one_line(err)
    (r2 / "summary.json").write_text(json.dumps([1, 2]))
    code, err, _ = cli("compare", str(r1), str(r2), "--out", "c")
    assert code == 2 and "r2/summary.json must hold a JSON object" in err, err
    with (r1 / "metrics.jsonl").open("a") as fh:
        fh.write('{"round": 2, "accuracy"\n')
    code, err, _ = cli("compare", str(r1), "--out", "c")
    assert code == 2 and err.startswith("fedsim: error: r1/metrics.jsonl: line 3 is not valid JSON ("), err
    _one_line(err)
    code, err, _ = cli("compare", str(r1))  # the default output folder is made only once the runs are read
    assert code == 2
    assert not Path("c").exists() and not Path("runs").exists()
