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
        n, bits = ckks.parameters(ckks.load_context(data))
        assert (n, bits) == (8192, 160) and bits <= ckks.MAX_COEFF_MODULUS_BITS_128
    assert not ckks.load_context(public).has_secret_key() and ckks.load_context(private).has_secret_key()
    with pytest.raises(ValueError):  # 220 bits at N = 8192: above the 128-bit bound, SEAL refuses it
        ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 50, 50, 60])
    assert 5e-7 < ckks.error_bound() < 7e-7  # (B_clean + B_rescale) / 2**40, fedsim/crypto/ckks.py
    ckks.check_keys(public, private)
    with pytest.raises(ValueError, match="does not belong"):
        ckks.check_keys(public, ckks.make_keys()[1])
    # secret-key encryption: the public context (what the server holds) holds no key and cannot encrypt;
    # its key id makes every key's fingerprint its own
    with pytest.raises(ValueError, match="encryption"):
        ckks.encode(public, np.ones(8))
    assert ckks.fingerprint(public) != ckks.fingerprint(ckks.make_keys()[0])


def test_keys_made_before_the_key_id_still_load_check_and_encrypt():
    """Keys from before secret-key encryption (bare TenSEAL contexts, the public one holding the public key),
    as a resumed run's client state may hold them: checked, and both contexts encrypt what the private one
    decrypts."""
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=list(ckks.COEFF_MOD_BIT_SIZES))
    ctx.global_scale = 2.0 ** ckks.SCALE_BITS
    public = ctx.serialize(save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False)
    private = ctx.serialize(save_public_key=True, save_secret_key=True, save_galois_keys=False, save_relin_keys=False)
    ckks.check_keys(public, private)
    with pytest.raises(ValueError, match="does not belong"):
        ckks.check_keys(public, ckks.make_keys()[1])
    x = np.linspace(-0.5, 0.5, 100)
    for key in (public, private):
        got = ckks.decode(private, ckks.combine(public, [ckks.encode(key, x, public)], [1.0], 100), 100)
        assert np.abs(got - x).max() <= ckks.error_bound()


def test_the_weighted_mean_is_within_the_documented_error_on_random_inputs():
    public, private = ckks.make_keys()
    rng = np.random.default_rng(0)
    xs = [rng.normal(0, 0.5, 5000) for _ in range(5)]  # two ciphertexts each (4096 + 904 values)
    w = rng.random(5)
    payload = ckks.combine(public, [ckks.encode(private, x, public) for x in xs], w / w.sum(), 5000)
    err = np.abs(ckks.decode(private, payload, 5000) - sum(wi / w.sum() * x for wi, x in zip(w, xs)))
    assert 0 < err.max() <= ckks.error_bound(), err.max()


def test_the_decrypted_aggregate_is_the_plaintext_one_within_the_bound(small_cfg, tmp_path):
    plain = run_experiment(small_cfg(*TABULAR, "federation.rounds=1"), out=tmp_path / "plain", progress=False)
    expected = _flat([v.numpy() for v in torch.load(plain / "model.pt").values()])
    grid, server, state, summary = _run_inprocess(small_cfg(*TABULAR, "federation.rounds=1", *CKKS))
    assert summary["client_failures"] == 0 and server.rows[1]["evaluated_by"].startswith("client ")
    got = ckks.decode(_client_state(grid, 0)["ckks-private"], state.payload, server.engine.channel.num_values)
    err = float(np.max(np.abs(got - expected)))
    bound = server.rows[1]["channel.error_bound"]
    assert bound == ckks.error_bound() and 0 < err <= bound + 1e-7, (err, bound)  # + float32 rounding


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
            payload = ckks.encode(ckks.make_keys()[1], np.ones(num))
        elif how == "count":
            payload = ckks.encode(keys["ckks-private"], np.ones(num - 1), public)
        elif how == "truncated":
            payload = payload[:-9]
        elif how == "not-fresh":  # a combination (one level spent) replayed as a client's payload
            payload = ckks.combine(public, [payload], [1.0], num)
        elif how == "garbage":
            payload = payload[:60] + bytes(range(256)) * 4 + payload[60 + 1024:]
        rec[PAYLOAD] = payload
        return reply


def test_each_hostile_payload_is_its_clients_failure(small_cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(FLOWER_MODS, "test-tamper-ckks", TamperCkks)
    monkeypatch.setitem(FLOWER_MODS, "test-drop", Drop)
    hostile = {1: ("wrong-key", "(fingerprint)"), 2: ("count", "(count)"), 3: ("truncated", "(count)"),
               4: ("not-fresh", "(ciphertext[0])"), 5: ("garbage", "payload rejected (")}
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
    assert float(np.max(np.abs(got - expected))) <= ckks.error_bound() + 1e-7


@pytest.mark.ray
def test_ckks_fedavg_on_ray_matches_plain_fedavg(small_cfg, tmp_path):
    sets = ("federation.rounds=1", "federation.num_clients=2", "train.lr=0.05")
    plain = run_experiment(small_cfg(*sets), out=tmp_path / "plain", progress=False)
    enc = run_experiment(small_cfg(*sets, *CKKS, 'simulation.backend="ray"'), out=tmp_path / "enc", progress=False)
    a = read_jsonl(plain / "metrics.jsonl")[-1]["accuracy"]
    b = read_jsonl(enc / "metrics.jsonl")[-1]
    assert b["evaluated_by"].startswith("client ") and b["replies"] == 2
    assert abs(a - b["accuracy"]) <= 0.005, (a, b["accuracy"])
