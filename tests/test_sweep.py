"""Sweeps: a config plus [[variants]] -> one table."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import child_pythonpath

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


def test_jobs_run_the_same_runs_and_a_stopped_pool_resumes(tmp_path):
    """``--jobs 2``: the runs go to two worker processes, and the results are the sequential sweep's, metric
    for metric. Ctrl-C (SIGINT to the process group, once a run is past round 2) stops the pool: exit 130,
    the runs that were running say interrupted and keep their checkpoints, the message gives the command
    that continues (with ``--jobs 2``). Continued, the runs end as in the sequential sweep."""
    rounds = 12  # light rounds of 0.1-0.2 s: the signal after round 2 comes with 9 rounds (over a second) to go
    text = (BASE.replace("rounds = 2", f"rounds = {rounds}").replace("num_clients = 3", "num_clients = 2")
            + '[[variants]]\nlabel = "plain"\n')
    p = write(tmp_path, text)
    out = tmp_path / "pool"
    cmd = [sys.executable, "-m", "fedsim", "sweep", str(p), "--seeds", "0,1", "--jobs", "2", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    signalled = threading.Event()

    def watch() -> None:  # signal once a run is past round 2 (this thread, while the reference runs below)
        deadline = time.monotonic() + 600  # a hang guard, not a speed limit
        while proc.poll() is None and time.monotonic() < deadline:
            done = [len((d / "metrics.jsonl").read_text().splitlines()) for d in out.glob("00-plain-seed*")
                    if (d / "metrics.jsonl").is_file()]
            if done and max(done) >= 3:  # rounds 0, 1, 2 recorded in one run
                os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the sweep and its workers
                signalled.set()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        ref = run_sweep(p, out=tmp_path / "ref", progress=False, seeds=[0, 1])  # while the pool starts
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    watcher.join(60)
    assert signalled.is_set(), err
    assert proc.returncode == 130, err
    assert "sweep: 2 runs on 2 worker processes" in err and "Traceback" not in err
    hint = re.search(r"continue with: (.*)$", err, re.M)
    assert hint and "--jobs 2" in hint.group(1) and f"--resume {out}" in hint.group(1), err
    states = [json.loads((d / "summary.json").read_text())["status"] for d in sorted(out.glob("00-plain-seed*"))
              if (d / "summary.json").is_file()]  # a run still starting up when stopped may have none
    assert "interrupted" in states and "completed" not in states, states
    run_sweep(p, out=out, progress=False, seeds=[0, 1])  # what the hint runs (here: in this process, one by one)
    timing = {"round_seconds"}
    rows_ref, rows_pool = read_jsonl(ref / "runs.jsonl"), read_jsonl(out / "runs.jsonl")
    assert [r["run"] for r in rows_pool] == ["00-plain-seed0", "00-plain-seed1"]
    assert all(r["status"] == "completed" for r in rows_pool)
    for a, b in zip(rows_ref, rows_pool):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    for name in ("00-plain-seed0", "00-plain-seed1"):
        wall = {"seconds", "observer_seconds", "train_seconds", "startup_seconds"}
        ma, mb = read_jsonl(ref / name / "metrics.jsonl"), read_jsonl(out / name / "metrics.jsonl")
        assert len(ma) == len(mb) == rounds + 1
        assert [{k: v for k, v in r.items() if k not in wall} for r in ma] == \
               [{k: v for k, v in r.items() if k not in wall} for r in mb]


def _job_or_death(label, cfg, seed, job_dir, progress, resume_hint, failed, run_dirs):
    """A pool job for the test below: seed 1's worker dies as a process killed by the kernel would."""
    if seed == 1:
        os._exit(9)
    run_dirs.append(job_dir)
    return {"variant": label, "status": "completed", "accuracy": 0.5, "run": job_dir.name}


def test_a_worker_that_dies_fails_its_run_with_the_reason(tmp_path):
    """A worker process that dies (out of memory, killed) fails its run, recorded with the reason; the runs
    before it keep their rows."""
    from fedsim.app.sweep_pool import run_pooled

    jobs = [(0, "v", {}, s, tmp_path / f"00-v-seed{s}") for s in (0, 1)]
    got, failed = {}, []
    signame = run_pooled(jobs, [0, 1], 1, lambda k, row, dirs: got.__setitem__(k, (row, dirs)), failed, (),
                         _job_or_death)
    assert signame is None
    assert got[0] == ({"variant": "v", "status": "completed", "accuracy": 0.5, "run": "00-v-seed0"},
                      [tmp_path / "00-v-seed0"])
    row, dirs = got[1]
    assert row["status"] == "failed" and row["run"] == "00-v-seed1" and dirs == []
    assert row["error"].startswith("worker process failed: BrokenProcessPool"), row
    assert failed == ["v (seed 1)"]


def _slow_job(label, cfg, seed, job_dir, progress, resume_hint, failed, run_dirs):
    """A pool job for the test below: a second's work that ignores signals (as a run between safe points)."""
    time.sleep(1.0)
    return {"variant": label, "status": "completed", "run": job_dir.name}


def test_a_stopped_pool_starts_no_job_it_had_already_queued(tmp_path):
    """The pool hands a worker its next job before the current one ends; after a stop that job must not
    start (it once did: a Ctrl-C stopped the running CPL attack, then the worker started the next run)."""
    from fedsim.app.sweep_pool import run_pooled

    jobs = [(0, "v", {}, s, tmp_path / f"00-v-seed{s}") for s in range(4)]
    got: dict[int, dict] = {}

    def record(k, row, dirs):
        got[k] = row
        if len(got) == 1:  # job 0 done, job 1 running, job 2 waiting in the worker's queue
            os.kill(os.getpid(), signal.SIGINT)

    assert run_pooled(jobs, [0, 1, 2, 3], 1, record, [], (), _slow_job) == "SIGINT"
    assert 0 in got and 2 not in got and 3 not in got, sorted(got)


def test_jobs_must_be_positive(capsys):
    from fedsim.app.cli import main

    assert main(["sweep", "experiments/defenses.toml", "--jobs", "0"]) == 2
    assert "--jobs expects a positive number of worker processes, got 0" in capsys.readouterr().err


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
