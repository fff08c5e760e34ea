"""The Paillier channel end to end (issue 10): through the real ClientApp (in-process grid) and once
through the real Ray simulation. Small keys keep the suite fast (they warn; 2048 bits is the default).

What is asserted: the decrypted aggregate equals the plaintext FedAvg aggregate within the quantizer's
bound (packed and per-element, unequal weights, negative values); overflow-prone settings are refused;
the private key's integers (p, q and phe's derived values, as bytes and strings), its serialisation,
the X25519 private keys and shared secrets and the HKDF-derived AES keys appear in no message and in no
server-side object (searched by a walker that is tested itself and must reach a floor of values); observers get ciphertexts only and the curious server says it attacked
nothing; a client that drops out after encrypting, a corrupted payload and a wrong-key payload are
recorded failures while the round aggregates the rest.
"""
from __future__ import annotations

import collections
import functools
import json
import types
import warnings

import gmpy2
import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fedsim.app.client import client_app
from fedsim.app.runner import run_experiment
from fedsim.app.server import Server
from fedsim.components import FLOWER_MODS
from fedsim.config import ConfigError
from fedsim.crypto import keyexchange as kx
from fedsim.crypto.paillier import (
    PaillierCodec,
    generate_keypair,
    private_key_from_bytes,
    private_key_to_bytes,
    public_key_from_bytes,
)
from fedsim.crypto.quantize import Quantizer
from fedsim.inprocess import InProcessGrid
from fedsim.protocol import CHANNEL, PAYLOAD, STATE_CHANNEL
from fedsim.reports import read_jsonl

pytestmark = pytest.mark.filterwarnings("ignore:.*key.*:UserWarning")

TABULAR = ('data.dataset="breast-cancer"', 'model.name="mlp"', "model.hidden=[8]", "train.lr=0.05",
           "train.batch_size=16", "train.local_steps=3", "federation.num_clients=4", 'data.partition="dirichlet"',
           "data.alpha=0.5", "data.root_size=20")


def paillier(*extra):
    return ('channel.name="paillier"', "channel.key_bits=512", *extra)


def _client_state(grid, partition):
    nid = next(n for n, p in grid.nodes.items() if p == partition)
    return {k: bytes(v) for k, v in grid.contexts[nid].state[STATE_CHANNEL].items()}


def _decrypt(grid, server, state, names_shapes):
    """The test's god view: decrypt the server's ciphertext global model with client 0's key."""
    st = _client_state(grid, 0)
    public = public_key_from_bytes(st["paillier-public"])
    private = private_key_from_bytes(st["paillier-private"], public)
    ch = server.engine.channel
    codec = PaillierCodec(public, ch.quantizer, ch.max_total_weight(server.cfg), private_key=private,
                          packed=ch.packed, slots=ch.slots)
    return codec.decode(state.payload, [s for _, s in names_shapes]), ch.quantizer


def _run_inprocess(cfg, observers=()):
    grid = InProcessGrid(client_app, cfg["federation"]["num_clients"])
    server = Server(cfg, None, list(observers), progress=False)
    state_box = {}
    orig = server.finish

    def finish(state, seconds):
        state_box["state"] = state
        return orig(state, seconds)

    server.finish = finish
    summary = server.run(grid)
    return grid, server, state_box["state"], summary


@pytest.mark.parametrize("packed", [True, False])
def test_decrypted_aggregate_equals_the_plaintext_weighted_mean(small_cfg, tmp_path, packed):
    plain_cfg = small_cfg(*TABULAR, "federation.rounds=1")
    plain = run_experiment(plain_cfg, out=tmp_path / "plain", progress=False)
    expected = torch.load(plain / "model.pt")
    cfg = small_cfg(*TABULAR, "federation.rounds=1", *paillier(f"channel.packed={'true' if packed else 'false'}"))
    grid, server, state, summary = _run_inprocess(cfg)
    names_shapes = [(k, tuple(v.shape)) for k, v in expected.items()]
    got, quantizer = _decrypt(grid, server, state, names_shapes)
    assert summary["client_failures"] == 0
    flat_e = np.concatenate([expected[k].numpy().ravel() for k, _ in names_shapes]).astype(np.float64)
    flat_g = np.concatenate([g.ravel() for g in got])
    assert (flat_e < 0).any() and (flat_e > 0).any()  # negative values are in the sum
    # integer example counts are used as they are: the only error is rounding, 0.5 / scale (+ float32)
    bound = quantizer.step_error + 1e-6
    assert np.max(np.abs(flat_g - flat_e)) <= bound, (np.max(np.abs(flat_g - flat_e)), bound)
    assert np.max(np.abs(flat_g - flat_e)) > 0  # it really went through the quantizer


def test_packed_and_per_element_decrypt_to_the_same_aggregate(small_cfg):
    out = []
    for packed in ("true", "false"):
        cfg = small_cfg(*TABULAR, "federation.rounds=1", *paillier(f"channel.packed={packed}"))
        grid, server, state, _ = _run_inprocess(cfg)
        out.append(_decrypt(grid, server, state, [(k, a.shape) for k, a in zip(server.names, server.initial)])[0])
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_the_run_folder_says_who_evaluated_and_holds_no_plaintext_model(small_cfg, tmp_path):
    cfg = small_cfg(*TABULAR, "federation.rounds=2", *paillier())
    out = run_experiment(cfg, out=tmp_path / "run", progress=False)
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[0]["evaluated_by"] == "server"  # the public initial model
    assert all(r["evaluated_by"].startswith("client ") and 0 <= r["accuracy"] <= 1 for r in rows[1:])
    assert all(r["channel.payload_bytes"] > 0 and r["channel.encrypt_seconds_mean"] >= 0 for r in rows[1:])
    assert not (out / "model.pt").exists()


@pytest.mark.parametrize("sets,message", [
    (("channel.key_bits=512", "channel.precision=2147483648"), "channel.precision"),
    (("channel.key_bits=512", "channel.slots=40"), "channel.slots"),
    (("channel.key_bits=256",), "channel.key_bits"),
    (("channel.bits=40",), "channel.bits"),
    (("channel.clip=-1.0",), "channel.clip"),
])
def test_settings_that_could_overflow_are_refused(small_cfg, sets, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        small_cfg('channel.name="paillier"', *sets)


def test_small_keys_warn_once_through_the_fedsim_log(small_cfg, capsys):
    """The key-size warning is a fedsim log record (not a Python warning with a source line); the CLI's
    handler prints it as one line however often the config is validated (load, runner, server)."""
    import logging

    from fedsim.progress import OnceToStderr

    log, handler = logging.getLogger("fedsim"), OnceToStderr()
    level, installed = log.level, [h for h in log.handlers if isinstance(h, OnceToStderr)]
    for h in installed:  # the CLI's handler, if a test before this one ran the CLI here
        log.removeHandler(h)
    log.addHandler(handler)
    log.setLevel(logging.WARNING)  # the test session keeps fedsim's log at ERROR
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no raw Python warning
            small_cfg(*paillier())
            small_cfg(*paillier())
    finally:
        log.removeHandler(handler)
        for h in installed:
            log.addHandler(h)
        log.setLevel(level)
    lines = [x for x in capsys.readouterr().err.splitlines() if "below 2048" in x]
    assert lines and lines[0].startswith("[fedsim] warning: channel.key_bits = ") and len(lines) == 1


def test_transforms_that_need_plaintext_are_refused_under_paillier(small_cfg):
    with pytest.raises(ConfigError, match=r"mp-compensation.*'paillier'"):
        small_cfg(*paillier(), 'transforms=[{name="mp-compensation"}]')


# --------------------------------------------------------------------------------- secrets stay home
_OPAQUE_SECRETS = (X25519PrivateKey, AESGCM)  # C objects that hide key material from a walker


class _Walk:
    """Everything reachable from some roots, as searchable values: bytes (bytes, str, arrays, tensors,
    X25519 public keys) and ints (gmpy2's mpz included). It follows containers, mappings and anything
    with ``items()``, instance ``__dict__`` and ``__slots__`` of any module, bound methods' ``__self__``
    and closures' cells; no depth limit (an explicit stack). It does not enter classes, modules or a
    function's globals. Objects that could hide key material opaquely (an X25519 private key, an AESGCM
    cipher) are collected in ``opaque``."""

    def __init__(self, *roots):
        self.seen: set[int] = set()
        self.values: list = []
        self.opaque: list = []
        self._keep: list = []  # ids stay valid while the walk runs
        for r in roots:
            self._walk(r)

    def _walk(self, root):
        stack = [root]
        while stack:
            obj = stack.pop()
            if id(obj) in self.seen or obj is None or isinstance(obj, (bool, float, complex, type, types.ModuleType)):
                continue
            self.seen.add(id(obj))
            self._keep.append(obj)
            if isinstance(obj, (bytes, bytearray, memoryview)):
                self.values.append(bytes(obj))
            elif isinstance(obj, str):
                self.values.append(obj.encode())
            elif isinstance(obj, (int, type(gmpy2.mpz(0)))):
                self.values.append(int(obj))
            elif isinstance(obj, np.ndarray):
                self.values.append(obj.tobytes())
                if obj.dtype == object:
                    stack.extend(obj.ravel().tolist())
            elif isinstance(obj, np.generic):
                self.values.append(obj.tobytes())
            elif isinstance(obj, torch.Tensor):
                self.values.append(obj.detach().cpu().numpy().tobytes())
            elif isinstance(obj, X25519PublicKey):
                self.values.append(obj.public_bytes_raw())
            elif isinstance(obj, _OPAQUE_SECRETS):
                self.opaque.append(obj)
            elif isinstance(obj, types.MethodType):
                stack += [obj.__self__, obj.__func__]
            elif isinstance(obj, types.FunctionType):
                stack += [c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None]
                stack += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
            elif isinstance(obj, functools.partial):
                stack += [obj.func, *obj.args, *obj.keywords.values()]
            else:
                items = getattr(obj, "items", None)
                if callable(items):
                    try:
                        for k, v in list(items()):
                            stack += [k, v]
                    except Exception:  # noqa: BLE001 - an items() that needs arguments is not a mapping
                        pass
                elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
                    stack.extend(obj)
                if hasattr(obj, "__dict__"):
                    stack.extend(vars(obj).values())
                for klass in type(obj).__mro__:
                    for name in getattr(klass, "__slots__", ()):
                        if isinstance(name, str) and hasattr(obj, name):
                            stack.append(getattr(obj, name))


def _message_values(messages):
    return _Walk(*[m.content for m in messages if m.has_content()])


def test_the_secret_search_reaches_every_kind_of_place():
    """The walker itself: values hidden in an mpz, a closure, a bound method, __slots__, a deque, a
    foreign module's object and 30 levels down are all found; an opaque key object is reported."""
    secret = 2**200 + 12345

    class Slotted:
        __slots__ = ("x",)

        def __init__(self, x):
            self.x = x

    def closure(v):
        return lambda: v

    deep = {"v": gmpy2.mpz(secret)}
    for _ in range(30):
        deep = {"next": deep}
    roots = [deep, closure(b"in-a-closure"), Slotted(b"in-slots"), collections.deque([b"in-a-deque"]),
             types.SimpleNamespace(x=b"in-a-namespace"), closure(Slotted(None)).__call__,
             X25519PrivateKey.generate()]
    walk = _Walk(roots)
    assert secret in walk.values
    for b in (b"in-a-closure", b"in-slots", b"in-a-deque", b"in-a-namespace"):
        assert b in walk.values
    assert len(walk.opaque) == 1


def test_no_message_and_no_server_object_holds_the_private_key_or_a_shared_secret(small_cfg, recorder):
    cfg = small_cfg(*TABULAR, "federation.rounds=2", *paillier())
    grid, server, state, _ = _run_inprocess(cfg, [recorder])
    n_clients = cfg["federation"]["num_clients"]
    st0 = _client_state(grid, 0)
    public = public_key_from_bytes(st0["paillier-public"])
    private = private_key_from_bytes(st0["paillier-private"], public)
    # every integer of the private key (p, q and what phe derives from them), in every encoding
    secret_ints = [int(v) for k, v in vars(private).items() if k != "public_key"]
    assert int(private.p) in secret_ints and int(private.q) in secret_ints and len(secret_ints) >= 7
    secrets_ = [private_key_to_bytes(private), st0["x25519-private"]]
    for v in secret_ints:
        be = v.to_bytes((v.bit_length() + 7) // 8, "big")
        secrets_ += [be, be[::-1], str(v).encode(), format(v, "x").encode()]
    # the X25519 shared secrets and the HKDF-derived AES keys of every delivery (holder: client 0)
    holder = X25519PrivateKey.from_private_bytes(st0["x25519-private"])
    run = server.engine.channel.run_tag
    for part in range(1, n_clients):
        st = _client_state(grid, part)
        assert st["paillier-private"] == st0["paillier-private"]  # delivered
        secrets_.append(st["x25519-private"])
        peer = X25519PrivateKey.from_private_bytes(st["x25519-private"]).public_key().public_bytes_raw()
        secrets_.append(holder.exchange(X25519PublicKey.from_public_bytes(peer)))
        info = kx.context(run, "client-0", f"client-{part}", kx.public_bytes(holder), peer)
        aes = kx.derive_key(holder, peer, info)
        secrets_.append(aes)
        # the key the test derived is the one that sealed the box the server relayed
        boxes = [b for b in _message_values(grid.messages_sent).values if isinstance(b, bytes)
                 and b.startswith(b"FSK1")]
        assert any(_opens(b, aes, info) for b in boxes)
    msgs = _message_values(grid.messages_sent)
    replies = _message_values(grid.replies_seen)
    server_side = _Walk(server, recorder.updates, state)
    # floors, so that a broken walker cannot pass vacuously (measured with 4 clients and 2 rounds: 65 and
    # 49 values in messages and replies; server-side 381 objects, 192 values; 39 secret strings)
    assert len(msgs.values) > 50 and len(replies.values) > 40
    assert len(server_side.seen) > 300 and len(server_side.values) > 150 and len(secrets_) >= 39
    # ... and positive controls: the walk reaches the public key's n, the ciphertext global model
    # and the client payloads the server combined
    assert int(public.n) in server_side.values and state.payload in server_side.values
    assert all(u.payload in server_side.values for u in recorder.updates)
    for walk, where in ((msgs, "messages"), (replies, "replies"), (server_side, "server objects")):
        assert not walk.opaque, f"an opaque key object in {where}: {walk.opaque}"
        ints = {v for v in walk.values if isinstance(v, int)}
        assert not ints & set(secret_ints), where
        for item in walk.values:
            if isinstance(item, bytes):
                for s in secrets_:
                    assert s not in item, f"a secret in {where}"
    # positive control: the same search finds the key where it does live, in a client's Flower state
    client_side = _Walk(next(iter(grid.contexts.values())).state)
    assert any(private_key_to_bytes(private) in b for b in client_side.values if isinstance(b, bytes))
    # ... while the public key and ciphertexts did travel
    n_bytes = int(public.n).to_bytes((int(public.n).bit_length() + 7) // 8, "big")
    assert any(n_bytes in b for b in msgs.values + replies.values if isinstance(b, bytes))


def _opens(box, key, info):
    try:
        AESGCM(key).decrypt(box[4:16], box[16:], info)
        return True
    except Exception:  # noqa: BLE001
        return False


def test_observers_get_ciphertexts_and_the_curious_server_attacks_nothing(small_cfg, recorder, tmp_path):
    cfg = small_cfg("federation.rounds=1", "federation.num_clients=3", *paillier(),
                    attack={"name": "idlg", "rounds": [1], "victims": [0, 1]})
    out = run_experiment(cfg, out=tmp_path / "run", progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["leakage"] == [] and "ciphertexts only" in summary["leakage_note"]
    assert "ciphertexts only" in (out / "report.md").read_text()
    cfg2 = small_cfg("federation.rounds=1", "federation.num_clients=3", *paillier())
    run_experiment(cfg2, out=tmp_path / "rec", observers=[recorder], progress=False)
    for u in recorder.updates:
        assert u.kind == "ciphertext" and u.weights == () and isinstance(u.payload, bytes) and u.payload


# ------------------------------------------------------------------------------------------- failures
class DropAfterEncrypting:
    """Test-only Flower mod: the client encrypts its model, then drops out (no reply)."""

    def __init__(self, client: int = 1):
        self.client = client

    def __call__(self, msg, context, call_next):
        reply = call_next(msg, context)
        if int(context.node_config["partition-id"]) == self.client:
            assert PAYLOAD in reply.content[CHANNEL]  # it did encrypt
            raise ConnectionError(f"client {self.client} dropped out after encrypting")
        return reply


class TamperPayload:
    """Test-only Flower mod: flips a ciphertext byte, or re-encrypts under a stranger's key."""

    def __init__(self, client: int = 1, how: str = "flip"):
        self.client, self.how = client, how

    def __call__(self, msg, context, call_next):
        reply = call_next(msg, context)
        if int(context.node_config["partition-id"]) == self.client:
            rec = reply.content[CHANNEL]
            payload = bytearray(rec[PAYLOAD])
            if self.how == "flip":
                payload[-40] ^= 0x01
            else:
                pk, _ = generate_keypair(512)
                payload = bytearray(PaillierCodec(pk, Quantizer(bits=16, clip=4.0), 8).encode([np.ones(3)]))
            rec[PAYLOAD] = bytes(payload)
        return reply


@pytest.fixture
def test_mods(monkeypatch):
    monkeypatch.setitem(FLOWER_MODS, "test-drop-after-encrypting", DropAfterEncrypting)
    monkeypatch.setitem(FLOWER_MODS, "test-tamper-payload", TamperPayload)


@pytest.mark.parametrize("mod,reason", [
    ({"name": "test-drop-after-encrypting"}, "dropped out after encrypting"),
    ({"name": "test-tamper-payload", "how": "flip"}, "payload rejected (digest)"),
    ({"name": "test-tamper-payload", "how": "wrong-key"}, "payload rejected (fingerprint)"),
])
def test_a_failed_client_is_recorded_and_the_rest_aggregate(small_cfg, tmp_path, test_mods, mod, reason):
    mods = f"client.flower_mods=[{{{', '.join(f'{k}={json.dumps(v)}' for k, v in mod.items())}}}]"
    cfg = small_cfg(*TABULAR, "federation.rounds=1", *paillier(), mods)
    grid, server, state, summary = _run_inprocess(cfg)
    assert [(f["round"], f["client"]) for f in summary["failures"]] == [(1, 1)]
    assert reason in summary["failures"][0]["reason"]
    # the aggregate is the plaintext mean of clients 0, 2, 3
    drop = small_cfg(*TABULAR, "federation.rounds=1", 'client.flower_mods=[{name="test-drop-after-encrypting"}]')
    plain = run_experiment(drop, out=tmp_path / "plain", progress=False)
    expected = torch.load(plain / "model.pt")
    got, quantizer = _decrypt(grid, server, state, [(k, tuple(v.shape)) for k, v in expected.items()])
    err = max(float(np.max(np.abs(g - expected[k].numpy()))) for g, k in zip(got, expected))
    assert err <= quantizer.step_error + 1e-6


@pytest.mark.ray
def test_paillier_fedavg_on_ray_matches_plain_fedavg(small_cfg, tmp_path):
    """seed 003 Table 4.3 shape: FedAvg with the Paillier channel on the real Ray simulation against plain
    FedAvg (in-process: the two backends give identical metrics for a seed, see test_simulation_ray.py)."""
    sets = ("federation.rounds=3", "federation.num_clients=3", "train.lr=0.05")
    plain = run_experiment(small_cfg(*sets), out=tmp_path / "plain", progress=False)
    enc = run_experiment(small_cfg(*sets, *paillier(), 'simulation.backend="ray"'), out=tmp_path / "enc",
                         progress=False)
    a = read_jsonl(plain / "metrics.jsonl")[-1]["accuracy"]
    b = read_jsonl(enc / "metrics.jsonl")[-1]
    assert b["evaluated_by"].startswith("client ")
    assert abs(a - b["accuracy"]) <= 0.005, (a, b["accuracy"])
