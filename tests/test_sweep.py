"""Sweeps: a config plus [[variants]] -> one table."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedsim.app import load_config
from fedsim.app.sweep import load_sweep, run_sweep
from fedsim.config import ConfigError
from fedsim.reports import read_jsonl

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"

BASE = """
name = "sw"
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
"""

PLAIN_AND_NOISY = """
[[variants]]
label = "plain"

[[variants]]
label = "noisy"
defenses = [{ name = "gaussian-noise", sigma = 0.5 }]
"""


def write(tmp_path, text):
    p = tmp_path / "sweep.toml"
    p.write_text(text)
    return p


def test_sweep_runs_every_variant_into_one_table(tmp_path, capsys):
    p = write(tmp_path, BASE + PLAIN_AND_NOISY)
    out = run_sweep(p, out=tmp_path / "out", progress=True)
    # progress: runs done of the total and, once one has run, an ETA
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[fedsim] sweep ")]
    assert re.fullmatch(r"\[fedsim\] sweep 1/2: plain  \[0 done in \S+\]", lines[0]), lines
    assert re.fullmatch(r"\[fedsim\] sweep 2/2: noisy  \[1 done in \S+, ETA \S+\]", lines[1]), lines
    # re-run: both complete, skipped; the skipped runs give no ETA (none ran here)
    run_sweep(p, out=tmp_path / "out", progress=True)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[fedsim] sweep ")]
    assert re.fullmatch(r"\[fedsim\] sweep 2/2: noisy  \(complete: skipped\)  \[1 done in \S+\]", lines[1]), lines
    rows = read_jsonl(out / "sweep.jsonl")
    assert [r["variant"] for r in rows] == ["plain", "noisy"]
    assert rows[0]["time_ratio"] == pytest.approx(1.0)
    assert rows[1]["accuracy"] < rows[0]["accuracy"]  # heavy noise costs accuracy
    report = (out / "report.md").read_text()
    assert "| plain |" in report and "| noisy |" in report
    for r in rows:
        assert (out / r["run"] / "summary.json").exists()


@pytest.mark.parametrize("text, message", [
    (BASE, "needs \\[\\[variants\\]\\]"),
    (BASE + "[[variants]]\nlabel = 'a'\n[[variants]]\nlabel = 'a'\n", "used twice"),
    (BASE + "[[variants]]\nlabel = 'a'\n[[variants]]\nlabel = 'b'\ntrain = { lr = -1.0 }\n",
     r"variants\[1\] \(b\): train.lr"),
    (BASE + "[[variants]]\nfederation = { rounds = 1 }\n", r"variants\[0\].label"),
    # a bad observer in the last variant: caught before the first variant runs
    (BASE + PLAIN_AND_NOISY + "[[variants]]\nlabel = 'spy'\noutput = { observers = ['spy'] }\n",
     r"variants\[2\] \(spy\): output.observers\[0\].name must be one of .*update-norms.*'spy'"),
    (BASE + PLAIN_AND_NOISY + "[[variants]]\nlabel = 'bad attack'\nattack = { name = 'idlg', victims = [9] }\n",
     r"variants\[2\] \(bad attack\): attack.victims"),
    (BASE + PLAIN_AND_NOISY + "[[variants]]\nlabel = 't'\ntransforms = [{ name = 'mp-compensation', Q = 0 }]\n",
     r"variants\[2\] \(t\): transforms\[0\]\.Q must be >= 1, got 0"),
])
def test_bad_sweeps_fail_before_anything_runs(tmp_path, text, message):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        load_sweep(p)
    with pytest.raises(ConfigError):
        run_sweep(p, out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_only_selects_variants_before_the_overrides_apply(tmp_path):
    """``--set defenses.0.sigma=...`` is wrong for a variant without defenses; with ``--only`` the
    variants left out are not resolved at all, so it applies to the selected one alone."""
    p = write(tmp_path, BASE + PLAIN_AND_NOISY)
    with pytest.raises(ConfigError, match=r"variants\[0\] \(plain\): .*defenses"):
        load_sweep(p, ["defenses.0.sigma=2.0"])
    _, variants = load_sweep(p, ["defenses.0.sigma=2.0"], only=["noisy"])
    assert [(label, cfg["defenses"][0]["sigma"]) for label, cfg in variants] == [("noisy", 2.0)]
    with pytest.raises(ConfigError, match="no such variant"):
        load_sweep(p, only=["loud"])


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_experiment_config_validates(path):
    """Each file in experiments/ loads as what it is (a sweep with [[variants]] or a single run) and
    every variant passes the full validation (strategy, defenses, attack parameters)."""
    if "[[variants]]" in path.read_text():
        base, variants = load_sweep(path)
        assert variants and all(cfg["name"].startswith(base["name"]) for _, cfg in variants)
    else:
        cfg = load_config(path)
        assert cfg["federation"]["rounds"] >= 1
