"""FedAvg through the in-process grid and the real ClientApp: aggregation, the observer seam,
sampling, determinism, failure handling and the run folder."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from flwr.app import MessageType

from fedsim.app import load_config
from fedsim.app.client import client_app
from fedsim.app.runner import run_experiment
from fedsim.app.server import run_server
from fedsim.data import partition
from fedsim.defense import DEFENSES, Defense
from fedsim.factories import dataset_for, model_for
from fedsim.inprocess import InProcessGrid
from fedsim.replies import Reply
from fedsim.reports import read_jsonl
from fedsim.rounds import sample_partitions
from fedsim.seams import PlainChannel


def _partition_sizes(cfg, scheme: str, **params) -> list[int]:
    """Client data sizes, recomputed by calling the partitioner with the scheme and parameters the test
    itself set (not through the config-to-parameter mapping the ClientApp uses)."""
    labels = dataset_for(cfg).y_train.numpy()
    return [len(p) for p in partition(labels, cfg["federation"]["num_clients"], scheme, cfg["seed"], **params)]


def _weighted_mean(updates) -> list[np.ndarray]:
    n = np.array([u.num_examples for u in updates], dtype=np.float64)
    w = n / n.sum()
    return [sum(wi * np.asarray(u.weights[j], dtype=np.float64) for wi, u in zip(w, updates))
            for j in range(len(updates[0].weights))]


def _train_messages_by_round(grid: InProcessGrid, per_round: int) -> dict[int, list]:
    """The train messages the grid pushed, grouped by round (they are pushed round after round).

    Grouped by position rather than by ``config["server-round"]``: every round's messages share one
    ConfigRecord object that the strategy updates in place, and the in-process grid keeps references
    (a real transport serialises each message when it is pushed).
    """
    train = [m for m in grid.messages_sent if m.metadata.message_type == MessageType.TRAIN]
    assert len(train) % per_round == 0
    return {i // per_round + 1: train[i:i + per_round] for i in range(0, len(train), per_round)}


# ------------------------------------------------------------------------------------ aggregation
def test_fedavg_is_example_weighted_mean(small_cfg, recorder, tmp_path):
    cfg = small_cfg("federation.rounds=1", 'data.partition="pathological"', "data.min_per_class=5",
                    "data.max_per_class=60", "train.local_steps=2")
    out = run_experiment(cfg, out=tmp_path / "run", observers=[recorder], progress=False)
    ups = sorted(recorder.by_round()[1], key=lambda u: u.client_id)
    assert [u.client_id for u in ups] == list(range(cfg["federation"]["num_clients"]))
    assert len({u.num_examples for u in ups}) > 1, "the test needs unequal client sizes"

    expected = _weighted_mean(ups)
    saved = torch.load(out / "model.pt")
    names = list(ups[0].param_names)
    assert list(saved) == names
    for name, e in zip(names, expected):
        np.testing.assert_allclose(saved[name].numpy(), e, rtol=1e-5, atol=1e-6)
    # ... and not the plain mean (so the weighting is really exercised)
    plain = [np.mean([u.weights[j] for u in ups], axis=0) for j in range(len(names))]
    assert max(float(np.abs(p - e).max()) for p, e in zip(plain, expected)) > 1e-4


def test_plain_weighted_mean_matches_flower_and_the_weighted_mean(small_cfg, recorder, tmp_path):
    """The plain channel's weighted mean over the real replies equals the example-weighted mean, and is
    bit for bit Flower's own ``aggregate_arrayrecords``; the round's train metrics are example-weighted."""
    from flwr.app import MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    cfg = small_cfg("federation.rounds=1", 'data.partition="dirichlet"', "data.alpha=0.3")
    grid = InProcessGrid(client_app, cfg["federation"]["num_clients"])
    run_server(grid, cfg, tmp_path, [recorder], progress=False)
    replies = [Reply(r, grid.nodes[r.metadata.src_node_id]) for r in grid.replies_seen
               if r.metadata.message_type == MessageType.TRAIN]
    names = list(model_for(cfg).state_dict())
    channel = PlainChannel()
    channel.setup(names, cfg)
    weights = [float(r.num_examples) for r in replies]
    got = channel.weighted_mean(replies, weights)
    flower = aggregate_arrayrecords([RecordDict({"arrays": r.message.content["arrays"],
                                                 "metrics": MetricRecord({"w": w})}) for r, w in zip(replies, weights)],
                                    "w").to_numpy_ndarrays()
    assert all(np.array_equal(g, f) and g.dtype == f.dtype for g, f in zip(got, flower))
    ups = recorder.by_round()[1]
    assert len({u.num_examples for u in ups}) > 1
    for g, e in zip(got, _weighted_mean(ups)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    # train metrics are aggregated too (example-weighted)
    n = np.array([u.num_examples for u in ups], dtype=float)
    loss = np.array([u.metrics["train_loss"] for u in ups])
    row = read_jsonl(tmp_path / "metrics.jsonl")[1]
    assert row["train_loss"] == pytest.approx(float((n * loss).sum() / n.sum()), rel=1e-6)


# ------------------------------------------------------------------------------------- observers
def test_observers_see_every_sampled_client_with_what_was_sent(small_cfg, recorder):
    cfg = small_cfg("federation.num_clients=5", "federation.clients_per_round=3", "federation.rounds=3",
                    'data.partition="dirichlet"', "data.alpha=1.0", "train.lr=0.07", "train.batch_size=8",
                    "train.local_steps=2")
    grid = InProcessGrid(client_app, cfg["federation"]["num_clients"])
    summary = run_server(grid, cfg, None, [recorder], progress=False)
    assert recorder.started and recorder.finished
    sizes = _partition_sizes(cfg, "dirichlet", alpha=1.0)
    rounds = recorder.by_round()
    assert sorted(rounds) == [1, 2, 3]
    replies = {r.metadata.reply_to_message_id: r for r in grid.replies_seen}
    k = cfg["federation"]["clients_per_round"]
    sent_by_round = _train_messages_by_round(grid, k)
    assert sorted(sent_by_round) == [1, 2, 3]
    for rnd, ups in rounds.items():
        sent = sent_by_round[rnd]
        assert len(sent) == k
        assert sorted(grid.nodes[m.metadata.dst_node_id] for m in sent) == sample_partitions(
            cfg["seed"], rnd, range(cfg["federation"]["num_clients"]), k)
        sent_by_pid = {grid.nodes[m.metadata.dst_node_id]: m for m in sent}
        assert sorted(u.client_id for u in ups) == sorted(sent_by_pid)
        for u in ups:
            msg = sent_by_pid[u.client_id]
            assert u.round == rnd
            assert u.node_id == msg.metadata.dst_node_id
            sent_arrays = msg.content["arrays"].to_numpy_ndarrays()
            assert len(u.global_weights) == len(sent_arrays)
            assert all(np.array_equal(g, s) for g, s in zip(u.global_weights, sent_arrays))
            returned = replies[msg.metadata.message_id].content["arrays"].to_numpy_ndarrays()
            assert all(np.array_equal(w, r) for w, r in zip(u.weights, returned))
            assert any(not np.array_equal(w, g) for w, g in zip(u.weights, u.global_weights))  # it trained
            assert u.num_examples == sizes[u.client_id]
            assert dict(u.recipe) == {"lr": 0.07, "batch_size": 8, "local_steps": 2}
            assert u.param_names == tuple(model_for(cfg).state_dict())
    # every round starts from the previous round's aggregate: what was sent differs between rounds
    g1, g2 = rounds[1][0].global_weights, rounds[2][0].global_weights
    assert any(not np.array_equal(a, b) for a, b in zip(g1, g2))
    assert summary["client_failures"] == 0


def test_client_update_arrays_are_read_only(small_cfg, recorder):
    cfg = small_cfg("federation.rounds=1", "federation.num_clients=2")
    run_server(InProcessGrid(client_app, 2), cfg, None, [recorder], progress=False)
    u = recorder.updates[0]
    for arrays in (u.weights, u.global_weights):
        with pytest.raises(ValueError, match="read-only"):
            arrays[0][...] = 0.0
        with pytest.raises(ValueError):
            arrays[0] += 1.0
    with pytest.raises(TypeError):
        u.recipe["lr"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        u.num_examples = 1  # type: ignore[misc]
    d = u.delta()  # fresh, writable arrays
    d[0][...] = 0.0


def test_observer_cannot_change_aggregation(small_cfg, recorder, tmp_path):
    """An observer that tries to scribble on the update is stopped, and the run is unaffected."""
    from fedsim.observers import Observer

    class Vandal(Observer):
        def __init__(self):
            self.blocked = 0

        def observe(self, update):
            for a in update.weights:
                try:
                    a[...] = 0.0
                except ValueError:
                    self.blocked += 1

    cfg = small_cfg("federation.rounds=1", "federation.num_clients=2")
    vandal = Vandal()
    out_a = run_experiment(cfg, out=tmp_path / "a", observers=[vandal, recorder], progress=False)
    out_b = run_experiment(cfg, out=tmp_path / "b", observers=[], progress=False)
    assert vandal.blocked == 2 * len(recorder.updates[0].weights)
    a, b = torch.load(out_a / "model.pt"), torch.load(out_b / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(a[k].abs().sum()) > 0 for k in a)


# -------------------------------------------------------------------------------------- sampling
def test_sample_partitions_deterministic_and_varies():
    parts = list(range(10))
    seq = [sample_partitions(5, r, parts, 3) for r in range(1, 11)]
    assert seq == [sample_partitions(5, r, parts, 3) for r in range(1, 11)]
    assert all(len(s) == 3 and len(set(s)) == 3 and set(s) <= set(parts) and s == sorted(s) for s in seq)
    assert len({tuple(s) for s in seq}) > 1, "the same clients every round"
    other = [sample_partitions(6, r, parts, 3) for r in range(1, 11)]
    assert other != seq
    assert sample_partitions(5, 1, parts, 0) == parts and sample_partitions(5, 1, parts, 10) == parts
    # only the partition ids matter, not the order they are listed in
    assert sample_partitions(5, 1, parts[::-1], 3) == seq[0]


def test_run_samples_by_seed_not_node_ids(small_cfg, recorder):
    """Sampling depends on the seed, not on Flower's (random) node ids, nor on a spare node: 7 nodes
    for 6 clients, the 7th serving no partition (as with ``flwr run`` given more SuperNodes)."""
    cfg = small_cfg("federation.num_clients=6", "federation.clients_per_round=2", "federation.rounds=4",
                    "train.local_steps=1")
    summaries = []

    def sampled(seed):
        c = dict(cfg, seed=seed)
        rec = type(recorder)()
        summaries.append(run_server(InProcessGrid(client_app, 7), c, None, [rec], progress=False))  # fresh node ids
        return [sorted(u.client_id for u in rec.by_round()[r]) for r in range(1, 5)]

    a, b, c = sampled(0), sampled(0), sampled(1)
    assert a == b
    assert a == [sample_partitions(0, r, range(6), 2) for r in range(1, 5)]
    assert len({tuple(x) for x in a}) > 1
    assert a != c
    # summary.json's counts: partitions served, nodes that answered discovery, federation.num_clients
    assert {(s["clients"], s["nodes"], s["clients_configured"]) for s in summaries} == {(6, 7, 6)}


# ----------------------------------------------------------------------------------- determinism
def _curve(path):
    return [(r["round"], r["accuracy"], r["loss"]) for r in read_jsonl(path / "metrics.jsonl")]


def test_same_seed_same_metrics_different_seed_differs(small_cfg, tmp_path):
    cfg = small_cfg('data.partition="dirichlet"', "data.alpha=0.5")
    a = _curve(run_experiment(cfg, out=tmp_path / "a", progress=False))
    b = _curve(run_experiment(cfg, out=tmp_path / "b", progress=False))
    c = _curve(run_experiment(dict(cfg, seed=cfg["seed"] + 1), out=tmp_path / "c", progress=False))
    assert len(a) == cfg["federation"]["rounds"] + 1
    assert a == b
    assert [r[2] for r in a] != [r[2] for r in c]


# -------------------------------------------------------------------------------------- failures
class _FailFor(Defense):
    """Test-only defense: raises in ``setup`` for one client."""

    name = "test-fail-for-client"

    def __init__(self, client: int = 1):
        self.client = client

    def setup(self, model, ctx):
        if ctx.client_id == self.client:
            raise RuntimeError(f"boom on client {ctx.client_id}")


@pytest.fixture
def failing_defense(monkeypatch):
    monkeypatch.setitem(DEFENSES, _FailFor.name, _FailFor)
    return _FailFor.name


def test_failing_client_is_recorded_and_run_finishes(small_cfg, recorder, failing_defense, tmp_path):
    rounds = 2
    cfg = small_cfg(f"federation.rounds={rounds}", defenses=[{"name": failing_defense, "client": 1}])
    out = run_experiment(cfg, out=tmp_path / "run", observers=[recorder], progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["client_failures"] == rounds
    assert len(summary["failures"]) == rounds
    for f, rnd in zip(summary["failures"], range(1, rounds + 1)):
        assert f["client"] == 1 and f["stage"] == "train" and f["round"] == rnd
        assert "boom on client 1" in f["reason"]
    n = cfg["federation"]["num_clients"]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == list(range(rounds + 1))
    assert all(r["replies"] == n - 1 and r["failures"] == 1 for r in rows[1:])
    assert all(sorted(u.client_id for u in ups) == [c for c in range(n) if c != 1]
               for ups in recorder.by_round().values())
    assert (out / "model.pt").exists() and (out / "report.md").exists()
    assert summary["final_accuracy"] is not None


class _FailAll(Defense):
    name = "test-fail-all"

    def setup(self, model, ctx):
        raise RuntimeError(f"boom on client {ctx.client_id}")


def test_a_round_where_every_client_fails_stops_the_run_with_the_reason(small_cfg, monkeypatch, tmp_path):
    monkeypatch.setitem(DEFENSES, _FailAll.name, _FailAll)
    cfg = small_cfg(defenses=[{"name": _FailAll.name}])
    with pytest.raises(RuntimeError, match="round 1: all 4 sampled clients failed.*boom on client"):
        run_experiment(cfg, progress=False)
    assert not any((tmp_path / "runs").glob("*"))  # nothing half-written


# ------------------------------------------------------------------------------------ run folder
def test_run_experiment_writes_the_run_folder(small_cfg, tmp_path):
    cfg = small_cfg("federation.rounds=3", "output.observers=['update-norms']", name="full")
    out = run_experiment(cfg, progress=False)
    assert out.parent == tmp_path / "runs" and out.name.startswith("full-")
    for f in ("config.toml", "metrics.jsonl", "summary.json", "accuracy.png", "report.md", "updates.jsonl",
              "model.pt"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    assert load_config(out / "config.toml") == cfg

    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert {"round", "accuracy", "loss", "seconds"} <= set(r)
        assert 0.0 <= r["accuracy"] <= 1.0 and r["loss"] > 0 and r["seconds"] >= 0
    assert all(r["replies"] == cfg["federation"]["num_clients"] for r in rows[1:])

    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] == rows[-1]["accuracy"]
    assert summary["initial_accuracy"] == rows[0]["accuracy"]
    assert summary["best_accuracy"] == max(r["accuracy"] for r in rows)
    assert summary["rounds"] == 3 and summary["client_failures"] == 0 and summary["failures"] == []

    updates = read_jsonl(out / "updates.jsonl")
    n = cfg["federation"]["num_clients"]
    assert len(updates) == 3 * n == summary["updates_observed"]
    assert sorted((u["round"], u["client"]) for u in updates) == [(r, c) for r in (1, 2, 3) for c in range(n)]
    assert all(u["update_norm"] > 0 for u in updates)

    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert re.search(r"!\[[^\]]*\]\(accuracy\.png\)", report)
    assert f"{rows[-1]['accuracy']:.4f}" in report

    saved = torch.load(out / "model.pt")
    assert list(saved) == list(model_for(cfg).state_dict())
    leftovers = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert leftovers == [], "temporary files of atomic writes left behind"


def test_a_count_every_client_reports_alike_stays_an_integer(small_cfg, tmp_path):
    """``local_steps`` is the same integer in every reply; Flower's weighted sum (value x n_i / N) made
    0.9999999999999999 of 1 step with unequal example counts. metrics.jsonl keeps the integer; a mean over
    clients that differ (train_loss) stays a weighted mean, and the report counts "1 step"."""
    cfg = small_cfg("federation.num_clients=3", "federation.rounds=1", "train.local_steps=1",
                    'data.partition="dirichlet"', "data.alpha=0.3", "seed=4")
    out = run_experiment(cfg, out=tmp_path / "run", progress=False)
    row = read_jsonl(out / "metrics.jsonl")[1]
    assert row["local_steps"] == 1 and type(row["local_steps"]) is int
    assert type(row["train_loss"]) is float
    assert "1 step;" in (out / "report.md").read_text()
