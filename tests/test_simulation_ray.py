"""One real Flower simulation on Ray through ``run_experiment`` (slow: ~10-20 s; ``-m "not ray"`` skips it)."""
from __future__ import annotations

import json
import os

import pytest

from fedsim.app.runner import run_experiment
from fedsim.reports import read_jsonl

pytestmark = pytest.mark.ray


def test_ray_simulation_reaches_observers_and_learns(small_cfg, recorder, ray_tmp, tmp_path):
    assert os.environ["RAY_TMPDIR"] == str(ray_tmp)
    n, rounds = 3, 2
    cfg = small_cfg(f"federation.num_clients={n}", f"federation.rounds={rounds}", "train.local_epochs=1",
                    "train.lr=0.1", "train.batch_size=32", 'simulation.backend="ray"', "simulation.num_cpus=1",
                    'device="cpu"')
    out = run_experiment(cfg, out=tmp_path / "run", observers=[recorder], progress=False)

    by_round = recorder.by_round()
    assert sorted(by_round) == list(range(1, rounds + 1))
    for rnd, ups in by_round.items():
        assert sorted(u.client_id for u in ups) == list(range(n)), f"round {rnd}"
        assert len({u.node_id for u in ups}) == n
        assert all(u.num_examples > 0 for u in ups)
        assert all(any((w != g).any() for w, g in zip(u.weights, u.global_weights)) for u in ups)

    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == list(range(rounds + 1))
    assert all(r["replies"] == n and r["failures"] == 0 for r in rows[1:])
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]
    assert rows[-1]["loss"] < rows[0]["loss"]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["client_failures"] == 0 and summary["clients"] == n
    # Ray's session files went to the test's temp folder, not /tmp/ray
    assert (ray_tmp / "ray").is_dir() and any((ray_tmp / "ray").glob("session_*"))


SWEEP = """
name = "reuse"
seed = 3
device = "cpu"
[federation]
rounds = 2
num_clients = 3
[data]
partition = "dirichlet"
[model]
activation = "relu"
[train]
local_steps = 2
batch_size = 16
lr = 0.05
[simulation]
backend = "ray"
num_cpus = 1
[output]
observers = []
[[variants]]
label = "a"
[[variants]]
label = "b"
train = { lr = 0.1 }
[[variants]]
label = "c"
federation = { clients_per_round = 2 }
[[variants]]
label = "d"
defenses = [{ name = "gaussian-noise", sigma = 0.001 }]
transforms = [{ name = "mp-compensation" }]
"""


def test_a_sweep_starts_ray_once_and_its_runs_share_the_actors(tmp_path):
    """Every run of a sweep uses one Ray runtime, started at most once (not at all when an earlier test of
    this process left it running), and the client actors of its first run serve the others (without the
    shared runtime: one Ray start and one actor pool per run). The shared actors give every variant
    exactly the numbers of the same variant in process: the same seed on both backends gives the same
    partitions (Dirichlet), batches, client sampling (variant c) and aggregation order, and one torch
    thread per client on both, so every round's accuracy and loss agree (measured: identical). (This
    was also a test of its own with one plain run on each backend; the sweep covers it.) Variant d is the
    compensation family's Ray run (seed 000's global update compensation, strategies/compensation.py): the
    clients' noise variances reach the server transform through Ray's messages and it compensates every
    round, as in process. A warm actor builds the defense pipeline of the config it is sent (variant d's
    noise, after three variants without defenses)."""
    from fedsim.app.ray_runtime import RUNTIME
    from fedsim.app.sweep import run_sweep

    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP)
    starts, actors = RUNTIME.ray_starts, RUNTIME.actor_starts
    ray = run_sweep(path, out=tmp_path / "ray", progress=False)
    assert RUNTIME.ray_starts - starts <= 1
    assert RUNTIME.actor_starts - actors <= (os.cpu_count() or 1)  # one pool (1 CPU per actor), not four
    inproc = run_sweep(path, ['simulation.backend="inprocess"'], out=tmp_path / "inproc", progress=False)
    names = ("00-a", "01-b", "02-c", "03-d")
    for name in names:
        a, b = read_jsonl(ray / name / "metrics.jsonl"), read_jsonl(inproc / name / "metrics.jsonl")
        assert [(r["round"], r["replies"], r["failures"]) for r in a] == [(r["round"], r["replies"], 0) for r in b]
        assert [r["accuracy"] for r in a] == pytest.approx([r["accuracy"] for r in b], abs=1e-9)
        assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)
    losses = {read_jsonl(ray / n / "metrics.jsonl")[-1]["loss"] for n in names}
    assert len(losses) == 4  # the variants differ: actors answering with a stale config would show it
    comp = read_jsonl(ray / "03-d" / "metrics.jsonl")[1:]  # compensated each round from the declared variance
    assert all(0.001 ** 2 / 3 * (1 - 1e-9) <= r["mp-compensation.variance"] <= 0.001 ** 2 for r in comp)  # sum p_i^2 s^2
    assert all(1 <= r["mp-compensation.kept"] < r["mp-compensation.w"] for r in comp)
