"""Hostile clients (issue 29): every reply is checked before it is used, in one place for every channel.

A client that tampers with its own reply (a Flower mod around its training, :mod:`hostile`) through the
in-process grid and the real ClientApp: NaN, inf and 1e30 models, example counts of 1e12, -1e6 and 0,
a wrongly shaped entry from the first and from a later client, a wrong dtype, a missing and an extra
entry. Each hostile reply must be that client's recorded failure (stage, reason) and nothing else: the
global model is bit for bit the one of the same run in which that client simply fails. Under SecAgg+ a
client's masked vector is checked against the channel's settings; a run whose global model becomes
non-finite ends ``failed``, never ``completed``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hostile import TamperedEvaluation

from fedsim.app.client import client_app
from fedsim.app.runner import run_experiment
from fedsim.app.server import Server
from fedsim.components import ConfigError
from fedsim.inprocess import InProcessGrid
from fedsim.protocol import EVAL_ACCURACY, EVAL_EXAMPLES, EVAL_LOSS

HOSTILE = str(Path(__file__).with_name("hostile.py"))
BASE = ("federation.rounds=2", "train.local_steps=1")


def tamper(**params) -> list[dict]:
    return [{"name": f"{HOSTILE}:Tamper", **params}]


def run(cfg):
    """(server, final global arrays) of an in-process run without a folder."""
    server = Server(cfg, None, [], progress=False)
    box = {}
    finish = server.finish

    def keep(state, seconds, **kw):
        box["state"] = state
        return finish(state, seconds, **kw)

    server.finish = keep
    server.run(InProcessGrid(client_app, cfg["federation"]["num_clients"]))
    return server, box["state"]


_REFERENCE: dict[tuple, tuple] = {}


def reference(small_cfg, client: int, *sets: str):
    """The same run with ``client`` failing honestly (its mod raises before training): what a rejected
    reply must be equivalent to."""
    key = (client, *sets)
    if key not in _REFERENCE:
        _REFERENCE[key] = run(small_cfg(*BASE, *sets, client__flower_mods=tamper(clients=[client], what="raise")))
    return _REFERENCE[key]


CASES = [  # (client, mod parameters, extra config, what the recorded reason says)
    (1, {"what": "fill", "value": "nan"}, (), "'features.0.weight' holds 300 non-finite values (e.g. nan)"),
    (1, {"what": "fill", "value": "inf"}, (), "non-finite values (e.g. inf)"),
    (1, {"what": "fill", "value": "1e30"}, ("federation.max_update_norm=100.0",),
     "above federation.max_update_norm = 100"),
    (1, {"what": "examples", "value": "1e12"}, (), "num-examples = 1000000000000 is above the training set's size"),
    (2, {"what": "examples", "value": "1e12"}, ("federation.max_examples=5000",),
     "num-examples = 1000000000000 is above federation.max_examples = 5000"),
    (1, {"what": "examples", "value": "-1e6"}, (), "num-examples = -1000000: a client's count of examples must be"),
    (0, {"what": "shape", "entry": 0}, (),
     "'features.0.weight' is float32 [13, 1, 5, 5], the model's is float32 [12, 1, 5, 5]"),
    (3, {"what": "shape", "entry": 1}, (), "'features.0.bias' is float32 [13], the model's is float32 [12]"),
    (1, {"what": "dtype", "entry": 2}, (), "'features.3.weight' is float64 [12, 12, 5, 5], the model's is float32"),
    (1, {"what": "drop", "entry": 3}, (), "the reply's model lacks ['features.3.bias']"),
    (2, {"what": "extra"}, (), "the reply's model has unknown entries ['evil.weight']"),
]


@pytest.mark.parametrize("client,params,sets,reason", CASES,
                         ids=[f"{p['what']}-{p.get('value', p.get('entry', ''))}-client{c}" for c, p, _, _ in CASES])
def test_a_hostile_reply_is_its_clients_failure_and_changes_nothing_else(small_cfg, client, params, sets, reason):
    server, got = run(small_cfg(*BASE, *sets, client__flower_mods=tamper(clients=[client], **params)))
    ref_server, expected = reference(small_cfg, client, *sets)
    failures = server.engine.failures
    assert [(f["round"], f["client"], f["stage"]) for f in failures] == [(1, client, "train"), (2, client, "train")]
    assert all(f["reason"].startswith("invalid reply: ") and reason in f["reason"] for f in failures), failures[0]["reason"]
    assert [r["replies"] for r in server.rows] == [0, 3, 3]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))  # bit for bit: the reply was not used
    assert [r["accuracy"] for r in server.rows] == [r["accuracy"] for r in ref_server.rows]


def test_a_1e30_update_without_a_norm_bound_is_aggregated(small_cfg):
    """Finite, so not refused by the checks alone: the documented robust options are the norm bound (above)
    or a robust rule. FedMedian ignores the one outlier: the median of the four replies."""
    params = tamper(clients=[1], what="fill", value="1e30")
    _, plain = run(small_cfg("federation.rounds=1", "train.local_steps=1", client__flower_mods=params))
    assert max(float(np.abs(a).max()) for a in plain) > 1e28
    _, median = run(small_cfg("federation.rounds=1", "train.local_steps=1", 'strategy.name="flwr-fedmedian"',
                              client__flower_mods=params))
    assert max(float(np.abs(a).max()) for a in median) < 10


def test_example_counts_of_zero_fail_the_clients_not_the_server(small_cfg, tmp_path):
    """Counts summing to 0 used to end in a ZeroDivisionError; now every such reply is refused, every client
    of the round failed, and the run stops 'failed' with one line naming the count."""
    cfg = small_cfg(*BASE, client__flower_mods=tamper(clients=[0, 1, 2, 3], what="examples", value="0"))
    out = tmp_path / "zero"
    with pytest.raises(RuntimeError, match=r"all 4 sampled clients failed.*invalid reply: num-examples = 0"):
        run_experiment(cfg, out=out, progress=False)
    assert not out.exists()  # no round completed: nothing half-way


def test_a_non_finite_global_model_fails_the_run(small_cfg, tmp_path):
    """A rule (here a plugin) whose aggregate holds a NaN: the run stops 'failed' after the last finite round."""
    cfg = small_cfg("federation.rounds=3", "train.local_steps=1", strategy__name=f"{HOSTILE}:NaNRule")
    out = tmp_path / "nan"
    with pytest.raises(RuntimeError, match=r"round 1: the aggregated global model holds non-finite values in "
                                           r"'features.0.weight' \(rule 'nan-rule'\)"):
        run_experiment(cfg, out=out, progress=False)
    assert not out.exists()  # round 1 did not complete: nothing half-way


def test_config_refuses_a_norm_bound_the_channel_cannot_apply(small_cfg):
    with pytest.raises(ConfigError, match=r"federation.max_update_norm needs each client's model in plaintext"):
        small_cfg("federation.max_update_norm=1.0", 'channel.name="secagg+"', "federation.num_clients=5")
    with pytest.raises(ConfigError, match=r"federation.max_examples must be >= 1"):
        small_cfg("federation.max_examples=0")


# ------------------------------------------------------------------------------------------- SecAgg+
class TamperingGrid(InProcessGrid):
    """The client of partition ``victim`` changes its masked vector after the mod computed it."""

    def __init__(self, *args, victim: int | None, change, **kw):
        super().__init__(*args, **kw)
        self.victim, self.change = victim, change  # victim None: every client

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

        for mid in ids:
            reply = self._replies[mid]
            node = reply.metadata.src_node_id
            rec = reply.content.config_records.get(RECORD_KEY_CONFIGS) if not reply.has_error() else None
            if self.victim in (None, self.nodes[node]) and rec is not None and Key.MASKED_PARAMETERS in rec:
                self.change(reply, rec)
        return ids


def _secagg_run(small_cfg, change, victim=3):
    cfg = small_cfg("federation.rounds=1", "federation.num_clients=5", "train.local_steps=1",
                    'channel.name="secagg+"')
    server = Server(cfg, None, [], progress=False)
    server.run(TamperingGrid(client_app, 5, victim=victim, change=change))
    return server


def _wrong_shape(reply, rec):
    from flwr.common import bytes_to_ndarray, ndarray_to_bytes
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    vec = [bytes_to_ndarray(b) for b in rec[Key.MASKED_PARAMETERS]]
    vec[1] = vec[1][:2]
    rec[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(a) for a in vec]


def _huge_count(reply, rec):
    from flwr.app import MetricRecord

    reply.content["fitres.num_examples"] = MetricRecord({"num_examples": 10 ** 9})


@pytest.mark.parametrize("change,reason", [(_wrong_shape, "masked array 1 is int64 [2, 1, 5, 5], expected"),
                                           (_huge_count, "num-examples = 1000000000 is above")])
def test_secagg_a_hostile_masked_upload_is_that_clients_failure(small_cfg, change, reason):
    """The masked vector's structure and range, and the example count in the clear, are checked before
    Flower's workflow sums them: the client counts as dropped out (its masks are recovered from the
    others' shares) and the other four are aggregated."""
    server = _secagg_run(small_cfg, change)
    failures = server.engine.failures
    assert [(f["client"], f["stage"]) for f in failures] == [(3, "secagg+ collect_masked_vectors")]
    assert reason in failures[0]["reason"]
    assert server.rows[1]["replies"] == 4 and server.rows[1]["channel.contributors"] == 4


def test_secagg_uploads_are_masked(small_cfg):
    """What a client uploads is masked: Flower quantizes each value to [0, quantization_range] and adds
    masks uniform in [0, modulus_range), so about quantization/modulus of the uploaded values (2^-10 with the
    defaults) fall inside the quantization range; unmasked, all would."""
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    uploads = []

    def keep(reply, rec):
        uploads.append(np.concatenate([bytes_to_ndarray(b).ravel() for b in rec[Key.MASKED_PARAMETERS][1:]]))

    server = _secagg_run(small_cfg, keep, victim=None)
    assert server.engine.failures == [] and len(uploads) == 5
    values = np.concatenate(uploads)  # 5 x 13,426 values: ~66 expected inside, measured 0.10-0.13%
    inside = float(np.mean(values <= 2 ** 22))
    assert values.size > 60_000 and 0.25 * 2 ** -10 < inside < 4 * 2 ** -10, inside


def test_fedkl_os_keys_differ_between_runs_and_are_not_the_seeded_ones(small_cfg):
    """``key_source = "os"``: each client's key comes from the OS's randomness, not from the seed: two runs
    with the same seed give every client another key, and none is the seeded key (which the run with
    ``key_source = "seeded"`` does hold, so the comparison can see a match)."""
    from fedsim.models import keylock
    from fedsim.protocol import NODE_PARTITION_ID, STATE_DEFENSES

    def keys(source):
        cfg = small_cfg("federation.rounds=1", "train.local_steps=1", "federation.num_clients=2",
                        'model.norm="batch"',
                        defenses=[{"name": "fedkl", "key_source": source, "key_length": 64, "evaluate": "none"}])
        grid = InProcessGrid(client_app, 2)
        Server(cfg, None, [], progress=False).run(grid)
        return cfg, {int(c.node_config[NODE_PARTITION_ID]): c.state[STATE_DEFENSES]["0.key"].numpy()
                     for c in grid.contexts.values()}

    cfg, seeded = keys("seeded")
    _, first = keys("os")
    _, second = keys("os")
    for p in (0, 1):
        expected = keylock.client_key(cfg["seed"], p, 64)
        assert np.array_equal(seeded[p], expected)
        assert first[p].shape == second[p].shape == (64,)
        assert not np.array_equal(first[p], expected) and not np.array_equal(second[p], expected)
        assert not np.array_equal(first[p], second[p])
    assert not np.array_equal(first[0], first[1])


# ------------------------------------------------------------------------------------------ actor death
def _client_actors(ray_tmp: Path) -> list[int]:
    """PIDs of the ClientAppActor processes of this session's Ray (children of the raylet whose command
    line names this session's Ray folder: other Ray clusters on the machine are left alone)."""
    procs = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            procs.append((int(d.name), ppid, cmd))
    raylets = {pid for pid, _, cmd in procs if "raylet" in cmd and str(ray_tmp) in cmd}
    return sorted(pid for pid, ppid, cmd in procs if ppid in raylets and cmd.startswith("ray::ClientAppActor"))


@pytest.mark.ray
def test_a_killed_client_actor_is_restarted_and_the_run_is_unchanged(small_cfg, tmp_path, ray_tmp):
    """``kill -9`` of a Ray client actor after round 1. Flower alone puts the dead actor back into its pool,
    and most of the later messages fail on it (the run ended "completed" with most clients failing every
    round); now Ray restarts the actor and the message it was running is run again: no client fails, and
    the run ends exactly as the same run on the in-process backend."""
    import os
    import signal
    import threading
    import time

    from fedsim.reports import read_jsonl

    sets = ("federation.rounds=3", "train.local_steps=2")
    cfg = small_cfg(*sets, 'simulation.backend="ray"')
    out = tmp_path / "ray"
    killed: list[int] = []

    def kill_one() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            rows = out / "metrics.jsonl"
            actors = _client_actors(ray_tmp)
            if rows.exists() and len(rows.read_text().splitlines()) >= 2 and actors:
                os.kill(actors[0], signal.SIGKILL)
                killed.append(actors[0])
            time.sleep(0.05)

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    run_experiment(cfg, out=out, progress=False)
    killer.join(timeout=5)
    assert killed, "no client actor was found to kill"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["client_failures"] == 0, summary["failures"][:2]
    reference = run_experiment(small_cfg(*sets), out=tmp_path / "inprocess", progress=False)
    timing = {"seconds", "observer_seconds", "startup_seconds", "train_seconds"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in read_jsonl(out / "metrics.jsonl")] == \
        [{k: v for k, v in r.items() if k not in timing} for r in read_jsonl(reference / "metrics.jsonl")]


# ------------------------------------------------------------------------------------- evaluate replies
# (what, key, value, what the recorded reason says)
EVAL_CASES = [
    ("set", EVAL_LOSS, float("nan"), "eval_loss must be a finite number >= 0, got nan"),
    ("set", EVAL_LOSS, float("inf"), "eval_loss must be a finite number >= 0, got inf"),
    ("set", EVAL_LOSS, -1.0, "eval_loss must be a finite number >= 0, got -1.0"),
    ("set", EVAL_ACCURACY, float("nan"), "eval_accuracy must be a finite number, got nan"),
    ("set", EVAL_ACCURACY, 1.5, "eval_accuracy must be in [0, 1], got 1.5"),
    ("set", EVAL_ACCURACY, -0.25, "eval_accuracy must be in [0, 1], got -0.25"),
    ("set", EVAL_ACCURACY, [0.5, 0.5], "eval_accuracy must be a finite number, got [0.5, 0.5]"),
    ("set", EVAL_EXAMPLES, -5, "eval_examples = -5: a client's count of examples must be at least 1"),
    ("set", EVAL_EXAMPLES, 0, "eval_examples = 0: a client's count of examples must be at least 1"),
    ("set", EVAL_EXAMPLES, 10 ** 12, "eval_examples = 1000000000000 is above"),
    ("set", EVAL_EXAMPLES, 2.5, "eval_examples must be a positive integer, got 2.5"),
    ("drop", EVAL_LOSS, None, "the reply's metrics lack eval_loss"),
    ("drop", EVAL_ACCURACY, None, "the reply's metrics lack eval_accuracy"),
    ("drop", EVAL_EXAMPLES, None, "the reply's metrics lack eval_examples"),
    ("no-metrics", "", None, "the reply carries no metrics record"),
    ("as-text", "", None, "the reply's metrics are a ConfigRecord, not a MetricRecord"),
]
CLIENT_EVAL = ("evaluate.client_fraction=1.0", "train.local_steps=1")
CLIENT_COLUMNS = ("client_accuracy", "client_loss", "client_accuracy_min", "client_accuracy_max", "client_evaluators")


def _run_app(cfg, app):
    server = Server(cfg, None, [], progress=False)
    server.run(InProcessGrid(app, cfg["federation"]["num_clients"]))
    return server


def test_a_hostile_client_side_evaluation_is_its_clients_failure_and_changes_no_client_metric(small_cfg):
    """Client-side evaluation (each of 6 clients evaluates the global model on its own data): in rounds 1-4
    clients 1-4 answer with the 16 hostile evaluate replies (NaN, inf or negative loss, NaN accuracy or
    outside [0, 1], a list, example counts -5, 0, 10^12, 2.5, a metric missing, no metrics, metrics as
    text), clients 0 and 5 honestly. Each is that client's recorded failure in that round, and every
    client_* column of every round is the one of the same run in which those clients' evaluations simply
    fail."""
    slots = [(r, c) for r in range(1, 5) for c in range(1, 5)]
    assert len(slots) == len(EVAL_CASES)
    cfg = small_cfg(*CLIENT_EVAL, "federation.rounds=4", "federation.num_clients=6")
    hostile = _run_app(cfg, TamperedEvaluation(client_app, {s: c[:3] for s, c in zip(slots, EVAL_CASES)}))
    honest = _run_app(cfg, TamperedEvaluation(client_app, {s: ("raise", "", None) for s in slots}))
    failures = hostile.engine.failures
    assert [(f["round"], f["client"], f["stage"]) for f in failures] == \
        [(f["round"], f["client"], f["stage"]) for f in honest.engine.failures] == \
        [(r, c, "client-evaluate") for r, c in slots]
    for f, (_, _, _, reason) in zip(failures, EVAL_CASES):
        assert f["reason"].startswith("invalid reply: ") and reason in f["reason"], (reason, f["reason"])
    for got, expected in zip(hostile.rows[1:], honest.rows[1:]):
        assert {k: got[k] for k in CLIENT_COLUMNS} == {k: expected[k] for k in CLIENT_COLUMNS}
        assert got["client_evaluators"] == 2 and 0 <= got["client_accuracy"] <= 1
    assert [r["accuracy"] for r in hostile.rows] == [r["accuracy"] for r in honest.rows]


def test_a_huge_finite_evaluation_loss_does_not_overflow_the_client_loss(small_cfg):
    """A loss of 1e308 is a number (accepted): the example-weighted mean stays finite (it was computed as
    sum(loss x count) / sum(count) and overflowed to inf, written to metrics.jsonl as 'Infinity')."""
    cfg = small_cfg(*CLIENT_EVAL, "federation.rounds=1")
    server = _run_app(cfg, TamperedEvaluation(client_app, {(1, 2): ("set", EVAL_LOSS, 1e308)}))
    assert server.engine.failures == [] and server.rows[1]["client_evaluators"] == 4
    assert math.isfinite(server.rows[1]["client_loss"]) and server.rows[1]["client_loss"] > 1e306


@pytest.mark.parametrize("case", [EVAL_CASES[3], EVAL_CASES[9], EVAL_CASES[14]], ids=["nan-accuracy", "huge-count",
                                                                                   "no-metrics"])
def test_a_hostile_evaluation_for_the_server_is_its_clients_failure_and_the_next_client_evaluates(small_cfg, case):
    """Under Paillier the server cannot read the global model: a client evaluates it on the common test
    split for the server (the first contributor, client 0). A hostile reply is client 0's recorded
    failure ('evaluate') and the next client evaluates: the round's accuracy is the honest one."""
    cfg = small_cfg('data.dataset="breast-cancer"', 'model.name="mlp"', "model.hidden=[8]", "train.lr=0.05",
                    "train.local_steps=1", "federation.rounds=1", 'channel.name="paillier"', "channel.key_bits=512")
    hostile = _run_app(cfg, TamperedEvaluation(client_app, {(1, 0): case[:3]}))
    honest = _run_app(cfg, TamperedEvaluation(client_app, {(1, 0): ("raise", "", None)}))
    assert [(f["round"], f["client"], f["stage"]) for f in hostile.engine.failures] == [(1, 0, "evaluate")]
    assert hostile.engine.failures[0]["reason"].startswith("invalid reply: ") and case[3] in \
        hostile.engine.failures[0]["reason"]
    assert hostile.rows[1]["evaluated_by"] == honest.rows[1]["evaluated_by"] == "client 1"
    assert hostile.rows[1]["accuracy"] == honest.rows[1]["accuracy"] and 0 <= hostile.rows[1]["accuracy"] <= 1
    assert hostile.rows[1]["loss"] == honest.rows[1]["loss"]
