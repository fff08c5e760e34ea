"""The CKKS channel (issue 27): 128-bit parameters, the decrypted aggregate within the documented error of
the plaintext aggregate, the secret key in no message and no server object, hostile payloads as their
clients' failures, and one run on the real Ray simulation."""
from __future__ import annotations

import json

import numpy as np
import pytest
import tenseal as ts
import torch
from test_paillier_channel import TABULAR, Drop, _flat, _run_inprocess, _Walk

from fedsim.app.runner import run_experiment
from fedsim.components import FLOWER_MODS
from fedsim.crypto import ckks
from fedsim.protocol import CHANNEL, PAYLOAD, STATE_CHANNEL
from fedsim.reports import read_jsonl

CKKS = ('channel.name="ckks"',)


def test_the_parameters_are_128_bit_and_seal_enforces_it():
    public, private = ckks.make_keys()
    for data in (public, private):
        ctx = ckks.load_context(data)
        n, bits = ckks.parameters(ctx)
        assert (n, bits) == (8192, 120) and bits <= ckks.MAX_COEFF_MODULUS_BITS_128
        # the ciphertexts' modulus: one 60-bit data prime (the other is SEAL's key level, unused)
        chain = ctx.seal_context().data.first_context_data().parms().coeff_modulus()
        assert [m.bit_count() for m in chain] == [60]
    assert not ckks.load_context(public).has_secret_key() and ckks.load_context(private).has_secret_key()
    with pytest.raises(ValueError):  # 220 bits at N = 8192: above the 128-bit bound, SEAL refuses it
        ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 50, 50, 60])
    # the capacity from SEAL's prime q: W X 2**40 + W (1/2 + 21) < q/2 for W <= MAX_WEIGHT
    assert ckks.capacity(public) == ckks.CAPACITY == 2 ** 19 - 1
    assert ckks.max_abs(4096 + 10) == 90 and ckks.max_abs(1) == int(ckks.CAPACITY / 2 ** 0.5)
    with pytest.raises(ValueError, match="no room"):
        ckks.max_abs(ckks.CAPACITY)
    # (6 sigma sqrt(N) + 6 sqrt(N/12)) / 2**40 plus the FFTs' 2 (log2 N + 1) N 2**-53 sqrt(2) X: fedsim/crypto/ckks.py
    assert 1.7e-9 < ckks.error_bound(0) < 1.8e-9 and 4.9e-9 < ckks.error_bound(90) < 5.1e-9
    ckks.check_keys(public, private)
    with pytest.raises(ValueError, match="does not belong"):
        ckks.check_keys(public, ckks.make_keys()[1])
    # secret-key encryption: the public context (what the server holds) holds no key and cannot encrypt;
    # its key id makes every key's fingerprint its own
    with pytest.raises(ValueError, match="encryption"):
        ckks.encode(public, np.ones(8), public)
    assert ckks.fingerprint(public) != ckks.fingerprint(ckks.make_keys()[0])


def test_keys_of_the_earlier_parameters_are_refused_with_a_clear_error():
    """Keys made before the one-prime parameters (60/40/60 bits; with or without a key id), as an earlier
    run's checkpoint holds them: refused when loaded (a resumed run stops at start with this message)."""
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 40, 60],
                     encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC)
    bare = ctx.serialize(save_public_key=False, save_secret_key=False, save_galois_keys=False, save_relin_keys=False)
    for old in (bare, b"FSCKKEY1" + bytes(32) + bare, b"FSCKKEY2" + bytes(32) + bare):
        with pytest.raises(ValueError, match="60/60"):
            ckks.load_context(old)


def test_the_weighted_mean_is_within_the_documented_error_on_random_inputs():
    public, private = ckks.make_keys()
    rng = np.random.default_rng(0)
    xs = [rng.normal(0, 0.5, 10000) for _ in range(5)]  # two ciphertexts each (8192 + 1808 values)
    parsed = [ckks.verify(public, ckks.encode(private, x, public, 90), 10000) for x in xs]
    for w in ([int(v) for v in rng.integers(0, 800, 5)], [1, 1, 1, 1, 1], [0, 0, 3, 0, 0]):
        got = ckks.decode(private, ckks.combine_read(public, parsed, w, 10000), 10000, 90)
        err = np.abs(got - sum(wi * x for wi, x in zip(w, xs)) / sum(w))
        assert 0 < err.max() <= ckks.error_bound(90), (w, err.max())
    # at the capacity, W = 4106 and X = 90: every slot at (X, X) - all slots equal, the largest coefficients -,
    # at (-X, X), or alternating
    x_max, sign = ckks.max_abs(4106), np.where(np.arange(4096) % 2, 1.0, -1.0)
    edge = [np.full(8192, float(x_max)), np.repeat([-1.0, 1.0], 4096) * x_max, np.tile(sign, 2) * x_max]
    payloads = [ckks.encode(private, x, public, x_max) for x in edge]
    for w in ([4106, 0, 0], [0, 4106, 0], [0, 0, 4106], [4000, 100, 6]):
        got = ckks.decode(private, ckks.combine(public, payloads, w, 8192), 8192, x_max)
        assert np.abs(got - sum(wi * x for wi, x in zip(w, edge)) / sum(w)).max() <= ckks.error_bound(x_max)
    with pytest.raises(ValueError, match="exceeds the channel's bound 90"):
        ckks.encode(private, np.array([0.0, 90.5]), public, 90)
    with pytest.raises(ValueError, match="integers"):
        ckks.combine_read(public, parsed[:2], [0.5, 0.5], 10000)


def test_the_decrypted_aggregate_is_the_plaintext_one_within_the_bound(small_cfg, tmp_path):
    plain = run_experiment(small_cfg(*TABULAR, "federation.rounds=1"), out=tmp_path / "plain", progress=False)
    expected = _flat([v.numpy() for v in torch.load(plain / "model.pt").values()])
    grid, server, state, summary = _run_inprocess(small_cfg(*TABULAR, "federation.rounds=1", *CKKS))
    assert summary["client_failures"] == 0 and server.rows[1]["evaluated_by"].startswith("client ")
    got = ckks.decode(_client_state(grid, 0)["ckks-private"], state.payload, server.engine.channel.num_values)
    err = float(np.max(np.abs(got - expected)))
    bound = server.rows[1]["channel.error_bound"]  # FedAvg's example counts: exact integer weights
    assert bound == pytest.approx(ckks.error_bound(server.engine.channel.max_abs), rel=1e-9)
    assert 0 < err <= bound + 1e-7, (err, bound)  # + the plaintext model's float32 rounding


def _client_state(grid, partition):
    nid = next(n for n, p in grid.nodes.items() if p == partition)
    return {k: bytes(v) for k, v in grid.contexts[nid].state[STATE_CHANNEL].items()}


def test_a_process_decrypts_each_global_model_once_for_all_its_clients(small_cfg, monkeypatch):
    """fedsim.crypto.decoded: the in-process grid runs all 4 clients in one process; round 2's 4 train
    messages and round 1's evaluator carry the same combined payload, decrypted once; round 2's evaluator
    decrypts the new one. Every decryption goes through ``ckks.decode``, counted here."""
    calls = []
    real = ckks.decode
    monkeypatch.setattr(ckks, "decode", lambda *a: calls.append(a[1]) or real(*a))
    grid, server, state, summary = _run_inprocess(small_cfg(*TABULAR, "federation.rounds=2", *CKKS))
    assert summary["client_failures"] == 0
    carried = [bytes(m.content[CHANNEL][PAYLOAD]) for m in grid.messages_sent
               if m.has_content() and CHANNEL in m.content and PAYLOAD in m.content[CHANNEL]]
    assert len(carried) >= 5 and len(set(carried)) == 2  # 4 train messages and 2 evaluations, 2 payloads
    assert sorted(calls) == sorted(set(carried)) and calls[-1] == state.payload


def test_no_message_and_no_server_object_holds_the_secret_key(small_cfg, recorder):
    grid, server, state, _ = _run_inprocess(small_cfg(*TABULAR, "federation.rounds=2", *CKKS), [recorder])
    secret_ctx = _client_state(grid, 0)["ckks-private"]
    assert all(_client_state(grid, p)["ckks-private"] == secret_ctx for p in range(4))  # delivered
    public = _client_state(grid, 0)["ckks-public"]
    # the secret context's bytes beyond the public context's (the secret key), in 64-byte pieces
    secrets_ = [secret_ctx] + [secret_ctx[i:i + 64] for i in range(len(public), len(secret_ctx) - 64, 4096)]
    secrets_ += [_client_state(grid, p)["x25519-private"] for p in range(4)]
    walks = {"messages": _Walk(*[m.content for m in grid.messages_sent if m.has_content()]),
             "replies": _Walk(*[m.content for m in grid.replies_seen if m.has_content()]),
             "server objects": _Walk(server, recorder.updates, state)}
    assert walks["server objects"].values and state.payload in walks["server objects"].values
    assert any(public in v for v in walks["messages"].values + walks["replies"].values if isinstance(v, bytes))
    for where, walk in walks.items():
        for item in walk.values:
            if isinstance(item, bytes):
                assert not any(s in item for s in secrets_), f"a secret in {where}"
    # the context the server works with is the public one; any TenSEAL context reachable from it is public
    assert not ckks.load_context(server.engine.channel.public_bytes).has_secret_key()
    assert not any(o.has_secret_key() for o in walks["server objects"]._keep if isinstance(o, ts.Context))
    # positive control: the search finds the secret where it lives, in a client's Flower state
    assert any(secret_ctx in v for v in _Walk(next(iter(grid.contexts.values())).state).values
               if isinstance(v, bytes))


class TamperCkks:
    """Test-only Flower mod: client ``k`` replaces its CKKS payload as ``how[k]`` says."""

    def __init__(self, how: dict):
        self.how = {int(k): v for k, v in how.items()}

    def __call__(self, msg, context, call_next):
        reply = call_next(msg, context)
        how = self.how.get(int(context.node_config["partition-id"]))
        if how is None:
            return reply
        rec = reply.content[CHANNEL]
        payload = bytes(rec[PAYLOAD])
        keys = {k: bytes(v) for k, v in context.state[STATE_CHANNEL].items()}
        public = keys["ckks-public"]
        num = int.from_bytes(payload[5:13], "big")
        if how == "wrong-key":
            other = ckks.make_keys()
            payload = ckks.encode(other[1], np.ones(num), other[0])
        elif how == "count":
            payload = ckks.encode(keys["ckks-private"], np.ones(num - 1), public)
        elif how == "truncated":
            payload = payload[:-9]
        elif how == "combination":  # a combination (total weight 2) passed off as a client's payload
            payload = ckks.combine(public, [payload, payload], [1, 1], num)
        elif how == "garbage":
            payload = payload[:60] + bytes(range(256)) * 4 + payload[60 + 1024:]
        rec[PAYLOAD] = payload
        return reply


def test_each_hostile_payload_is_its_clients_failure(small_cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(FLOWER_MODS, "test-tamper-ckks", TamperCkks)
    monkeypatch.setitem(FLOWER_MODS, "test-drop", Drop)
    hostile = {1: ("wrong-key", "(fingerprint)"), 2: ("count", "(count)"), 3: ("truncated", "(count)"),
               4: ("combination", "(weight)"), 5: ("garbage", "payload rejected (")}
    how = "{" + ", ".join(f'"{k}"={json.dumps(v[0])}' for k, v in hostile.items()) + "}"
    sets = (*TABULAR, "federation.rounds=1", "federation.num_clients=7", 'data.partition="iid"')
    grid, server, state, summary = _run_inprocess(
        small_cfg(*sets, *CKKS, f'client.flower_mods=[{{name="test-tamper-ckks", how={how}}}]'))
    failed = {f["client"]: f["reason"] for f in summary["failures"]}
    assert sorted(failed) == sorted(hostile)
    for k, (_, reason) in hostile.items():
        assert "payload rejected" in failed[k] and reason in failed[k], (k, failed[k])
    plain = run_experiment(small_cfg(*sets, f"client.flower_mods=[{{name=\"test-drop\", clients={sorted(hostile)}}}]"),
                           out=tmp_path / "plain", progress=False)
    expected = _flat([v.numpy() for v in torch.load(plain / "model.pt").values()])
    got = ckks.decode(_client_state(grid, 0)["ckks-private"], state.payload, server.engine.channel.num_values)
    assert float(np.max(np.abs(got - expected))) <= ckks.error_bound(server.engine.channel.max_abs) + 1e-7


@pytest.mark.ray
def test_ckks_fedavg_on_ray_matches_plain_fedavg(small_cfg, tmp_path):
    sets = ("federation.rounds=1", "federation.num_clients=2", "train.lr=0.05")
    plain = run_experiment(small_cfg(*sets), out=tmp_path / "plain", progress=False)
    enc = run_experiment(small_cfg(*sets, *CKKS, 'simulation.backend="ray"'), out=tmp_path / "enc", progress=False)
    a = read_jsonl(plain / "metrics.jsonl")[-1]["accuracy"]
    b = read_jsonl(enc / "metrics.jsonl")[-1]
    assert b["evaluated_by"].startswith("client ") and b["replies"] == 2
    assert abs(a - b["accuracy"]) <= 0.005, (a, b["accuracy"])
