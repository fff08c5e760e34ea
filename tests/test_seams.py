"""The server side's seams (fedsim/seams.py): a transform composes with any aggregation rule, a new
channel plugs in without touching the rule, impossible combinations are refused at config time, and
the typed round record reaches metrics.jsonl. Every run goes through the real ClientApp."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MessageType

from fedsim.app.runner import run_experiment
from fedsim.compensation import compensate_with_info
from fedsim.components import CHANNELS, DEFENSES, STRATEGIES, TRANSFORMS
from fedsim.config import ConfigError
from fedsim.defense import Defense
from fedsim.inprocess import InProcessGrid
from fedsim.protocol import ARRAYS, EXTRAS, STATE_DEFENSES, arrays_record
from fedsim.reports import read_jsonl
from fedsim.seams import (
    INDIVIDUAL,
    PLAINTEXT_AGGREGATE,
    WEIGHTED_SUM,
    AggregationRule,
    ClientChannel,
    PlainChannel,
    ServerChannel,
    ServerTransform,
)

LRP = {"name": "lrp", "slices": 10, "gamma": 0.3, "sigma": 0.5}


class UniformMean(AggregationRule):
    """Test-only rule: the plain (unweighted) mean of the client models."""

    name = "test-uniform-mean"
    stateless = True

    def aggregate(self, ctx, replies):
        ctx.weights = [1.0] * len(replies)
        return [np.mean([r.arrays[j] for r in replies], axis=0).astype(replies[0].arrays[j].dtype)
                for j in range(len(replies[0].arrays))]


class ScaledClientChannel(ClientChannel):
    name = "test-scaled"

    def decode(self, content, context, template):
        return content[ARRAYS].to_numpy_ndarrays()

    def encode(self, arrays, param_names, context):
        return {ARRAYS: arrays_record(param_names, [a * 2 for a in arrays])}


class ScaledChannel(PlainChannel):
    """Test-only channel: the client sends 2x its model, the server halves the combination."""

    name = "test-scaled"
    client = ScaledClientChannel
    combined: list[dict] = []  # spy: what each weighted_mean call got (the replies as they arrived)

    def weighted_mean(self, replies, weights):
        ScaledChannel.combined.append({r.partition: [np.array(a) for a in r.arrays] for r in replies})
        return [a / 2 for a in super().weighted_mean(replies, weights)]

    def client_view(self, reply):
        return {"kind": "individual", "weights": lambda: [a / 2 for a in reply.arrays]}


class SumsOnlyChannel(ServerChannel):
    """Test-only: a channel that gives the server weighted sums but no plaintext (never run)."""

    name = "test-sums-only"
    client = ClientChannel
    stateless = True
    provides = frozenset({WEIGHTED_SUM})


@pytest.fixture
def test_components(monkeypatch):
    monkeypatch.setitem(STRATEGIES, UniformMean.name, UniformMean)
    monkeypatch.setitem(CHANNELS, ScaledChannel.name, ScaledChannel)
    monkeypatch.setitem(CHANNELS, SumsOnlyChannel.name, SumsOnlyChannel)


def _global_after_round_1(run_dir, names):
    saved = torch.load(run_dir / "model.pt")
    return [saved[k].numpy().astype(np.float64) for k in names]


@pytest.mark.parametrize("rule", ["fedavg", "test-uniform-mean"])
def test_compensation_transform_wraps_any_rule(rule, small_cfg, recorder, tmp_path, test_components):
    """global_1 = global_0 + compensate(rule's aggregate - global_0, sum_i p_i^2 sigma_i^2) with the
    rule's own weights p_i (example counts for FedAvg, uniform for the test rule), recomputed here."""
    cfg = small_cfg("federation.rounds=1", 'data.partition="pathological"', "data.min_per_class=5",
                    "data.max_per_class=40", f'strategy.name="{rule}"', "train.local_steps=2",
                    'transforms=[{name="mp-compensation"}]', defenses=[LRP])
    run_dir = run_experiment(cfg, out=tmp_path / rule, observers=[recorder], progress=False)
    ups = sorted(recorder.by_round()[1], key=lambda u: u.client_id)
    n = np.array([u.num_examples for u in ups], dtype=np.float64)
    assert len(set(n)) > 1, "unequal client sizes make the two rules differ"
    p = n / n.sum() if rule == "fedavg" else np.full(len(ups), 1 / len(ups))
    names = list(ups[0].param_names)
    glob = [np.asarray(a, dtype=np.float64) for a in ups[0].global_weights]
    agg = [sum(pi * np.asarray(u.weights[j], dtype=np.float64) for pi, u in zip(p, ups)) for j in range(len(names))]
    var = float(np.sum(p ** 2 * np.array([u.metrics["noise_variance"] for u in ups])))
    flat = np.concatenate([(a - g).reshape(-1) for a, g in zip(agg, glob)])  # the LeNet has no buffers
    expected, info = compensate_with_info(flat, var, 6.0, "band")
    assert 0 < info["kept"] < info["w"]
    got = np.concatenate([(s - g).reshape(-1) for s, g in zip(_global_after_round_1(run_dir, names), glob)])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    row = read_jsonl(run_dir / "metrics.jsonl")[1]
    assert row["mp-compensation.variance"] == pytest.approx(var, rel=1e-9)
    assert row["mp-compensation.kept"] == info["kept"]


def test_a_new_channel_plugs_in_and_gives_the_same_aggregate(small_cfg, recorder, tmp_path, test_components,
                                                             monkeypatch):
    """The scaled channel carries 2x each client's model (its client half encoded them, its server half
    combined them), FedAvg is untouched, and the aggregate is the plain channel's (bit for bit: scaling
    by 2 is exact in floating point)."""
    from conftest import RecordingObserver

    monkeypatch.setattr(ScaledChannel, "combined", [])
    plain_seen = RecordingObserver()
    cfg = small_cfg("federation.rounds=2", 'data.partition="dirichlet"', "data.alpha=0.5")
    plain = run_experiment(cfg, out=tmp_path / "plain", observers=[plain_seen], progress=False)
    scaled_cfg = small_cfg("federation.rounds=2", 'data.partition="dirichlet"', "data.alpha=0.5",
                           'channel.name="test-scaled"')
    scaled = run_experiment(scaled_cfg, out=tmp_path / "scaled", observers=[recorder], progress=False)
    a, b = torch.load(plain / "model.pt"), torch.load(scaled / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["accuracy"] for r in read_jsonl(plain / "metrics.jsonl")] == \
        [r["accuracy"] for r in read_jsonl(scaled / "metrics.jsonl")]
    # the scaled channel was used: its server half combined every round's replies, and each reply that
    # crossed the wire is exactly 2x the model the same client trained in the plain run
    assert len(ScaledChannel.combined) == 2
    for rnd, combined in enumerate(ScaledChannel.combined, start=1):
        plain_models = {u.client_id: u.weights for u in plain_seen.by_round()[rnd]}
        assert sorted(combined) == sorted(plain_models) and combined
        for client, sent in combined.items():
            assert all(np.array_equal(s, 2 * w) for s, w in zip(sent, plain_models[client], strict=True))
    # the observers got the decoded (halved) models: the plain run's client models
    plain_models = {u.client_id: u.weights for u in plain_seen.by_round()[1]}
    for u in recorder.by_round()[1]:
        assert all(np.array_equal(w, p) for w, p in zip(u.weights, plain_models[u.client_id], strict=True))


def test_impossible_combinations_are_refused_at_config_time(small_cfg, test_components):
    with pytest.raises(ConfigError, match=r"transforms\[0\] \(mp-compensation\) needs the aggregate in plaintext"
                                          r".*'test-sums-only'.*channels it works with: .*'plain'"):
        small_cfg('channel.name="test-sums-only"', 'transforms=[{name="mp-compensation"}]')
    with pytest.raises(ConfigError, match=r"strategy.name = 'test-uniform-mean' needs each client's model in "
                                          r"plaintext.*'test-sums-only'"):
        small_cfg('channel.name="test-sums-only"', 'strategy.name="test-uniform-mean"')
    small_cfg('channel.name="test-sums-only"')  # FedAvg is a weighted sum: fine with it
    assert {INDIVIDUAL, PLAINTEXT_AGGREGATE} <= PlainChannel.provides


def test_round_record_reaches_metrics(small_cfg, tmp_path):
    cfg = small_cfg("federation.rounds=2", "federation.num_clients=5", "federation.clients_per_round=3")
    rows = read_jsonl(run_experiment(cfg, out=tmp_path / "r", progress=False) / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["replies"] == 3 and r["failures"] == 0 and r["evaluated_by"] == "server"
        assert r["train_loss"] > 0 and "partition-id" not in r and "num-examples" not in r


# ------------------------------------------------------------------------------- client-side seams
class EchoTransform(ServerTransform):
    """Test-only: sends the round number to the clients' echo defense and checks what comes back."""

    name = "test-echo"
    stateless = True

    def message_extras(self, server_round):
        return {EXTRAS: arrays_record(["echo.x"], [np.array([float(server_round)])])}

    def client_defenses(self):
        return [{"name": "test-echo-client", "factor": 3.0}]

    def after_aggregate(self, ctx, aggregate):
        self._sum = float(sum(r.record(EXTRAS)["echo.y"].numpy()[0] for r in ctx.replies))
        return aggregate

    def metrics(self):
        return {"echo_sum": self._sum}


class EchoClient(Defense):
    name = "test-echo-client"

    def __init__(self, factor: float = 1.0):
        self.factor = factor

    def reply_extras(self, ctx):
        return {"echo.y": ctx.incoming["echo.x"] * self.factor}


class PrivateCounter(Defense):
    """Test-only: adapts the model with a client-private buffer that counts the rounds it trained."""

    name = "test-private-counter"

    def adapt_model(self, model, ctx):
        start = float(ctx.state.get("count", np.zeros(1))[0])
        model.register_buffer("secret_counter", torch.tensor([start + 1.0]))
        return model

    def end_round(self, model, ctx):
        ctx.state["count"] = model.state_dict()["secret_counter"].numpy().copy()


def test_transform_extras_reach_the_clients_defense_and_come_back(small_cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(TRANSFORMS, EchoTransform.name, EchoTransform)
    monkeypatch.setitem(DEFENSES, EchoClient.name, EchoClient)
    cfg = small_cfg("federation.rounds=2", 'transforms=[{name="test-echo"}]')
    rows = read_jsonl(run_experiment(cfg, out=tmp_path / "r", progress=False) / "metrics.jsonl")
    n = cfg["federation"]["num_clients"]
    assert [r["test-echo.echo_sum"] for r in rows[1:]] == [3.0 * 1 * n, 3.0 * 2 * n]


def test_client_private_entries_stay_in_flowers_context_and_never_leave(small_cfg, monkeypatch):
    """Through the real ClientApp over 3 rounds: the adapted model's extra entry is kept in each
    node's Context.state (it counts 3 rounds) and no reply carries it."""
    from fedsim.app.client import client_app
    from fedsim.app.server import run_server

    monkeypatch.setitem(DEFENSES, PrivateCounter.name, PrivateCounter)
    cfg = small_cfg("federation.rounds=3", defenses=[{"name": PrivateCounter.name}])
    grid = InProcessGrid(client_app, cfg["federation"]["num_clients"])
    run_server(grid, cfg, None, [], progress=False)
    replies = [r for r in grid.replies_seen if r.metadata.message_type == MessageType.TRAIN]
    assert len(replies) == 3 * cfg["federation"]["num_clients"]
    for r in replies:
        for rec in r.content.array_records.values():
            assert not any("secret" in k for k in rec.keys())
    for ctx in grid.contexts.values():
        state = ctx.state[STATE_DEFENSES]
        assert isinstance(state, ArrayRecord) and state["0.count"].numpy().tolist() == [3.0]


NEGATED_CHANNEL = '''
"""A user's channel in a file: models travel negated both ways (exact in floating point)."""
from fedsim.protocol import ARRAYS, arrays_record, decode_arrays
from fedsim.seams import ClientChannel, PlainChannel


class NegatedClient(ClientChannel):
    name = "negated"
    decoded = []  # spy: one entry per model this client half decoded, per reply it encoded
    encoded = []

    def decode(self, content, context, template):
        NegatedClient.decoded.append(1)
        return [-a for a in decode_arrays(content[ARRAYS])]

    def encode(self, arrays, param_names, context):
        NegatedClient.encoded.append(1)
        return {ARRAYS: arrays_record(param_names, [-a for a in arrays])}


class NegatedChannel(PlainChannel):
    name = "negated"
    client = NegatedClient

    def outgoing(self, state):
        return {ARRAYS: arrays_record(self.names, [-a for a in state])}

    def check_reply(self, reply, model):
        super().check_reply(reply, model)
        reply.arrays = [-a for a in reply.arrays]


class NoClientHalf(PlainChannel):
    name = "no-client-half"
    client = None
'''


def test_a_channel_given_by_import_reference_runs_both_halves(small_cfg, tmp_path):
    """A channel in the user's own file, named only by import reference (registered nowhere): the server
    builds its half from ``channel.name``, every client builds the client half that server half names (the
    models cross the wire negated; a client using the plain half instead would train on the negated model),
    and the run equals the plain channel's bit for bit. A channel that names no client half is refused at
    config load, naming the key."""
    from fedsim.components import ConfigError
    from fedsim.references import resolve_reference

    plugin = tmp_path / "negated_channel.py"
    plugin.write_text(NEGATED_CHANNEL)
    ref = f"{plugin}:NegatedChannel"
    plain = run_experiment(small_cfg("federation.rounds=1"), out=tmp_path / "plain", progress=False)
    negated = run_experiment(small_cfg("federation.rounds=1", f'channel.name="{ref}"'), out=tmp_path / "negated",
                             progress=False)
    a, b = torch.load(plain / "model.pt"), torch.load(negated / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["accuracy"] for r in read_jsonl(plain / "metrics.jsonl")] == \
        [r["accuracy"] for r in read_jsonl(negated / "metrics.jsonl")]
    client = resolve_reference(f"{plugin}:NegatedClient", "test")
    assert resolve_reference(ref, "test").client is client
    sampled = small_cfg("federation.rounds=1")["federation"]
    n = sampled["clients_per_round"] or sampled["num_clients"]
    assert len(client.encoded) == n and len(client.decoded) >= n  # every sampled client used this half
    with pytest.raises(ConfigError, match=r"channel.name: NoClientHalf names no client half"):
        small_cfg(f'channel.name="{plugin}:NoClientHalf"')
