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

import builtins
import collections
import functools
import hashlib
import io
import json
import os
import pathlib
import re
import sys
import types
import warnings

import gmpy2
import numpy as np
import pytest
import torch
from conftest import RecordingObserver
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from flwr.app import Context, RecordDict

from channels.paillier import PaillierClientChannel
from fedsim.app.client import client_app
from fedsim.app.runner import run_experiment
from fedsim.app.server import Server
from fedsim.components import FLOWER_MODS
from fedsim.config import ConfigError
from fedsim.crypto import keyexchange as kx
from fedsim.crypto import paillier as pl
from fedsim.crypto.paillier import (
    PaillierCodec,
    generate_keypair,
    parse_header,
    private_key_from_bytes,
    private_key_to_bytes,
    public_key_from_bytes,
)
from fedsim.crypto.paillier.payload import _HEAD as PAYLOAD_HEAD
from fedsim.crypto.paillier.payload import _ciphertexts as read_payload_ciphertexts
from fedsim.crypto.quantize import Quantizer, range_exponent
from fedsim.inprocess import InProcessGrid
from fedsim.protocol import CHANNEL, PAYLOAD, PAYLOADS, RANGE_EXPONENT, STATE_CHANNEL
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


def _keys(grid, partition=0):
    st = _client_state(grid, partition)
    public = public_key_from_bytes(st["paillier-public"])
    return public, private_key_from_bytes(st["paillier-private"], public)


def _codec(grid, server, clip, max_total_weight=None):
    """The test's god view: a codec holding client 0's copy of the private key, at ``clip`` (and the layout of
    ``max_total_weight``, default the channel's largest)."""
    public, private = _keys(grid)
    ch = server.engine.channel
    return PaillierCodec(public, Quantizer(bits=ch.quantizer.bits, clip=clip),
                         max_total_weight or ch.max_total_weight(server.cfg), private_key=private, packed=ch.packed,
                         slots=ch.slots)


def _decrypt_head(grid, server, state):
    """The round's decrypted combination (flat float64): the aggregate update, or the model (encrypt = model)."""
    h = parse_header(state.head)
    codec = _codec(grid, server, h.clip, h.max_total_weight)
    return codec.decode(state.head, [(server.engine.channel.num_values,)])[0], h.clip


def _global_model(grid, server, state):
    """The global model a client that never trained would decode from the server's state (initial model +
    every decrypted aggregate update, as clients add them), with client 0's keys."""
    nid = next(n for n, p in grid.nodes.items() if p == 0)
    ctx = Context(run_id=0, node_id=0, state=RecordDict({STATE_CHANNEL: grid.contexts[nid].state[STATE_CHANNEL]}),
                  node_config={"partition-id": 0}, run_config={})
    content = RecordDict(server.engine.channel.outgoing(state))
    template = dict(zip(server.names, server.initial))
    return PaillierClientChannel(server.cfg).decode(content, ctx, template)


def _flat(arrays):
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays
                           if np.issubdtype(np.asarray(a).dtype, np.floating)])


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


def _plain_round(small_cfg, tmp_path, *sets, name="plain"):
    """Plain FedAvg's first round: the new global model, and each client's update (from observers)."""
    rec = RecordingObserver()
    out = run_experiment(small_cfg(*TABULAR, "federation.rounds=1", *sets), out=tmp_path / name, observers=[rec],
                         progress=False)
    model = torch.load(out / "model.pt")
    x0 = _flat(rec.updates[0].global_weights)
    updates = [_flat(u.weights) - x0 for u in rec.updates]
    return _flat([v.numpy() for v in model.values()]) - x0, updates


@pytest.mark.parametrize("packed", [True, False])
def test_the_decrypted_aggregate_update_equals_the_plaintext_one_within_the_bound(small_cfg, tmp_path, packed):
    """issue 26: the channel encrypts updates; the decrypted aggregate update is the plaintext FedAvg update
    within the documented bound (rounding 0.5 * clip / M: example counts are exact integer weights), and the
    clip is the power of two just above the largest update entry of the round (nothing clipped)."""
    expected, updates = _plain_round(small_cfg, tmp_path)
    cfg = small_cfg(*TABULAR, "federation.rounds=1", *paillier(f"channel.packed={'true' if packed else 'false'}"))
    grid, server, state, summary = _run_inprocess(cfg)
    assert summary["client_failures"] == 0 and state.kind == "update"
    got, clip = _decrypt_head(grid, server, state)
    row = server.rows[1]
    largest = max(float(np.max(np.abs(u))) for u in updates)
    assert clip == row["channel.clip"] == 2.0 ** range_exponent(np.array([largest])) and largest <= clip < 2 * largest
    assert row["channel.clipped"] == 0
    bound = row["channel.quantization_bound"]
    assert server.engine.channel.quantizer.bits == 12  # the default for updates (at their own range)
    assert bound == pytest.approx(0.5 * clip / 2047) and row["channel.error_bound"] == pytest.approx(bound)
    assert (expected < 0).any() and (expected > 0).any()  # negative values are in the sum
    err = float(np.max(np.abs(got - expected)))
    assert 0 < err <= bound + 1e-7, (err, bound)  # + float32 rounding of the plaintext model
    # ... and the global model a client rebuilds is the plaintext global model within the same bound
    model = _flat(_global_model(grid, server, state))
    assert float(np.max(np.abs(model - (_flat(server.initial) + expected)))) <= bound + 1e-6


def test_the_precision_follows_the_updates_range(small_cfg, tmp_path):
    """Ten times the learning rate: about ten times the updates, a clip and bound that follow them (each the
    power of two just above the round's largest update entry)."""
    rows = []
    for lr in (0.05, 0.5):
        _, updates = _plain_round(small_cfg, tmp_path, f"train.lr={lr}", name=f"plain{lr}")
        cfg = small_cfg(*TABULAR, "federation.rounds=1", f"train.lr={lr}", *paillier())
        row = _run_inprocess(cfg)[1].rows[1]
        largest = max(float(np.max(np.abs(u))) for u in updates)
        assert row["channel.clip"] == 2.0 ** range_exponent(np.array([largest]))
        rows.append(row)
    assert 4 <= rows[1]["channel.clip"] / rows[0]["channel.clip"] <= 32
    assert rows[1]["channel.quantization_bound"] / rows[0]["channel.quantization_bound"] == \
        rows[1]["channel.clip"] / rows[0]["channel.clip"]


def test_model_encryption_stays_available(small_cfg, tmp_path):
    """``encrypt = "model"``: the whole model over a fixed clip (4.0), as before; within 0.5 / scale."""
    expected, _ = _plain_round(small_cfg, tmp_path)
    cfg = small_cfg(*TABULAR, "federation.rounds=1", *paillier('channel.encrypt="model"'))
    grid, server, state, summary = _run_inprocess(cfg)
    got, clip = _decrypt_head(grid, server, state)
    assert state.kind == "model" and clip == 4.0 and summary["client_failures"] == 0
    assert server.engine.channel.quantizer.bits == 16  # the default for whole models (over a fixed clip)
    err = float(np.max(np.abs(got - (expected + _flat(server.initial)))))
    assert 0 < err <= 0.5 * 4.0 / 32767 + 1e-6


def test_integer_weights_are_reduced_by_their_common_divisor_exactly():
    """Example counts become the smallest integers with the same ratios (equal counts: weights of 1, which
    the combination applies without an exponentiation); the combination decodes to the same mean, bit for
    bit, and its ciphertexts decrypt with plain ``phe`` to the reduced weights' sums of the clients'
    plaintexts. Weights that do not fit ``precision`` even reduced are rounded (eq. 4.4), as before."""
    from channels.paillier import PaillierChannel

    ch = PaillierChannel(key_bits=512, precision=4096)
    assert ch.integer_weights([200.0] * 10) == [1] * 10
    assert ch.integer_weights([200, 400, 600]) == [1, 2, 3]
    assert ch.integer_weights([3001, 2000]) == [2458, 1638]  # round(p_i * 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pk, sk = generate_keypair(512)
    codec = PaillierCodec(pk, Quantizer(bits=12, clip=0.5), 64, private_key=sk)
    rng = np.random.default_rng(3)
    payloads = [codec.encode([rng.uniform(-0.5, 0.5, 40)]) for _ in range(3)]
    full, reduced = codec.combine(payloads, [10, 20, 30]), codec.combine(payloads, ch.integer_weights([10, 20, 30]))
    np.testing.assert_array_equal(codec.decode(full, [(40,)])[0], codec.decode(reduced, [(40,)])[0])
    n = pk.n
    plain = [[sk.raw_decrypt(c) for c in read_payload_ciphertexts(p, parse_header(p))] for p in payloads]
    got = [sk.raw_decrypt(c) for c in read_payload_ciphertexts(reduced, parse_header(reduced))]
    assert got == [(m0 + 2 * m1 + 3 * m2) % n for m0, m1, m2 in zip(*plain)]


def test_a_process_decrypts_an_aggregate_once_for_all_its_clients():
    """The per-process decryption cache: the second client of a process gets the same integers (read-only)
    without decrypting; other settings or another payload decrypt again."""
    from fedsim.crypto.decoded import DecodedCache

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pk, sk = generate_keypair(512)
    codec = PaillierCodec(pk, Quantizer(bits=16, clip=0.5), 64, private_key=sk)
    xs = [np.linspace(-0.4, 0.4, 50), np.linspace(0.3, -0.2, 50)]
    agg = codec.combine([codec.encode([x]) for x in xs], [1, 3])
    cache, fp, calls = DecodedCache(size=2), pl.key_fingerprint(pk), []

    def get(payload, settings="s", key=fp):
        return cache.get(key, payload, settings, lambda: calls.append(1) or codec.decode(payload, [(50,)])[0])

    a = get(agg)
    b = get(agg)
    assert b is a and cache.hits == 1 and len(calls) == 1 and not a.flags.writeable
    np.testing.assert_array_equal(a, codec.decode(agg, [(50,)])[0])
    get(agg, "other settings")
    get(codec.encode([xs[0]]))
    assert cache.hits == 1 and len(cache.items) == 2 and len(calls) == 3  # the oldest went
    get(agg, key=b"another key")  # another key's holder decrypts for itself
    assert len(calls) == 4
    # the key objects too: made once per process from the key bytes, for every client holding them
    from channels.paillier.client import _load_keys

    pub, priv = pl.public_key_to_bytes(pk), private_key_to_bytes(sk)
    first = _load_keys(pub, priv)
    assert _load_keys(bytes(pub), bytes(priv)) is first and first[1].p == sk.p and first[0].n == pk.n


def test_the_aggregate_sent_ahead_leaves_the_models_as_they_were_and_lightens_the_next_train(small_cfg):
    """``after_round``'s ``advance`` stage: after every round but the last, the next round's clients get the
    new aggregate update and keep the new global model, so the next train messages carry no ciphertexts;
    the clients' models and every metric (but times) are those of a run without it (``channel.advance =
    false``), bit for bit."""
    from fedsim.protocol import CHANNEL_SETUP, CONFIG, SERVER_ROUND, STAGE, TRAIN

    runs = {}
    for advance in ("true", "false"):
        cfg = small_cfg(*TABULAR, "federation.rounds=3", *paillier(f"channel.advance={advance}"))
        runs[advance] = grid, server, state, summary = _run_inprocess(cfg)
        assert summary["client_failures"] == 0

    def stages(grid):
        return [(int(m.content[CONFIG][SERVER_ROUND]), str(m.content[CONFIG][STAGE])) for m in grid.messages_sent
                if m.metadata.message_type == CHANNEL_SETUP and m.content[CONFIG].get(STAGE) == "advance"]

    def carried(grid, rnd):  # ciphertexts in the train messages of round rnd
        return [len(v[PAYLOADS]) for m in grid.messages_sent if m.metadata.message_type == TRAIN
                and int(m.content[CONFIG][SERVER_ROUND]) == rnd for k, v in m.content.items() if k.startswith(CHANNEL)]

    grid, server, state, _ = runs["true"]
    assert stages(grid) == [(1, "advance")] * 4 + [(2, "advance")] * 4  # not after the last round
    assert carried(grid, 2) == carried(grid, 3) == [0] * 4  # they hold the model already
    assert carried(runs["false"][0], 2) == carried(runs["false"][0], 3) == [1] * 4
    assert all(r["channel.advance_seconds"] > 0 for r in server.rows[1:3]) and "channel.advance_seconds" not in server.rows[3]
    for a, b in zip(_global_model(grid, server, state), _global_model(*runs["false"][:3])):
        np.testing.assert_array_equal(a, b)
    timing = lambda row: {k: v for k, v in row.items() if "seconds" not in k and "obfuscators" not in k}  # noqa: E731
    assert [timing(r) for r in server.rows] == [timing(r) for r in runs["false"][1].rows]


def test_the_layout_follows_the_rounds_total_weight_and_decodes_the_same(small_cfg):
    """``round_layout``: under FedAvg the clip exchange announces the round's total weight (the example counts
    over their gcd), the clients pack at it - more values per ciphertext - and every client holds the same
    global model, bit for bit, as with the channel's largest total weight (the same exact integer sums);
    the server refuses weights above the announced total before combining."""
    from fedsim.protocol import CHANNEL_SETUP, CONFIG, ROUND_WEIGHT, STAGE

    runs = {}
    for on in ("true", "false"):
        cfg = small_cfg(*TABULAR, "federation.rounds=2", *paillier(f"channel.round_layout={on}"))
        runs[on] = grid, server, state, summary = _run_inprocess(cfg)
        assert summary["client_failures"] == 0
    grid, server, state, _ = runs["true"]
    announced = [int(m.content[CHANNEL][ROUND_WEIGHT]) for m in grid.messages_sent
                 if m.metadata.message_type == CHANNEL_SETUP and m.content[CONFIG].get(STAGE) == "encrypt"]
    ch = server.engine.channel
    assert len(announced) == 2 * 4 and all(1 <= w <= ch.precision for w in announced)
    # the total of the weights the round combined with (every client aggregated) is what was announced
    assert [server.rows[r]["channel.total_weight"] for r in (1, 2)] == [announced[0], announced[-1]]
    h, h_off = parse_header(state.head), parse_header(runs["false"][2].head)
    assert h.max_total_weight == announced[-1] < h_off.max_total_weight == ch.max_total_weight(server.cfg)
    assert h.slots > h_off.slots and h.num_ciphertexts < h_off.num_ciphertexts
    assert server.rows[2]["channel.values_per_ciphertext"] == h.slots
    for a, b in zip(_global_model(grid, server, state), _global_model(*runs["false"][:3])):
        np.testing.assert_array_equal(a, b)
    ch._mtw = 3  # a rule whose weights exceed the announced total: a clear refusal, not a wrong decode
    with pytest.raises(RuntimeError, match="largest total weight 3"):
        ch.weighted_mean([], [2.0, 3.0])


def test_packed_and_per_element_decrypt_to_the_same_aggregate(small_cfg):
    out = []
    for packed in ("true", "false"):
        cfg = small_cfg(*TABULAR, "federation.rounds=2", *paillier(f"channel.packed={packed}"))
        grid, server, state, _ = _run_inprocess(cfg)
        out.append(_global_model(grid, server, state))
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
    (("channel.key_bits=2047",), r"channel.key_bits must be an even integer in [512, 8192]"),
    (("channel.key_bits=16384",), r"channel.key_bits must be an even integer in [512, 8192]"),
    (("channel.key_bits=100000",), r"channel.key_bits must be an even integer in [512, 8192]"),
    (('channel.encrypt="gradients"',), "channel.encrypt"),
    (("channel.bits=40",), "channel.bits"),
    (("channel.clip=-1.0",), "channel.clip"),
])
def test_settings_that_could_overflow_are_refused(small_cfg, sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
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
class Drop:
    """Test-only Flower mod: the listed clients compute their reply, then drop out (no reply)."""

    def __init__(self, clients: list):
        self.clients = set(clients)

    def __call__(self, msg, context, call_next):
        reply = call_next(msg, context)
        if int(context.node_config["partition-id"]) in self.clients:
            raise ConnectionError("dropped out after computing its reply")
        return reply


def _rewrite(payload: bytes, drop_last: bool = False, **fields) -> bytes:
    """A payload with header fields replaced (and the digest recomputed, as anyone can)."""
    head = list(PAYLOAD_HEAD.unpack_from(payload, 0))
    names = ["magic", "version", "mode", "bits", "slot_bits", "slots", "key_bits", "clip", "max_total_weight",
             "total_weight", "num_values", "num_ciphertexts", "width", "fingerprint"]
    for k, v in fields.items():
        head[names.index(k)] = v
    body = payload[pl.HEADER_BYTES:]
    if drop_last:
        width = head[names.index("width")]
        body = body[:-width]
        head[names.index("num_ciphertexts")] -= 1
    h = PAYLOAD_HEAD.pack(*head)
    return h + hashlib.sha256(h + body).digest() + body


class TamperPayload:
    """Test-only Flower mod: client ``k`` replaces its payload as ``how[k]`` says (issue 29's hostile
    payloads: each valid alone, or nearly, but not what the channel expects)."""

    def __init__(self, how: dict):
        self.how = {int(k): v for k, v in how.items()}

    def __call__(self, msg, context, call_next):
        reply = call_next(msg, context)
        how = self.how.get(int(context.node_config["partition-id"]))
        if how is None:
            return reply
        rec = reply.content[CHANNEL]
        if how == "exponent":
            rec[RANGE_EXPONENT] = 99
            return reply
        payload = bytes(rec[PAYLOAD])
        h = pl.parse_header(payload)
        if how == "flip":
            payload = payload[:-40] + bytes([payload[-40] ^ 1]) + payload[-39:]
        elif how == "wrong-key":
            pk, _ = generate_keypair(512)
            payload = PaillierCodec(pk, Quantizer(bits=16, clip=0.5), h.max_total_weight).encode([np.ones(h.num_values)])
        elif how == "other-clip":
            payload = _rewrite(payload, clip=2.0)
        elif how == "total-weight-max":
            payload = _rewrite(payload, total_weight=h.max_total_weight)
        elif how == "value-bits":
            payload = _rewrite(payload, bits=h.bits - 4)
        elif how == "key-bits":
            payload = _rewrite(payload, key_bits=h.key_bits + 2)
        elif how == "count":
            payload = _rewrite(payload, drop_last=True)
        elif how == "truncated":
            payload = payload[:-7]
        elif how == "not-bytes":
            payload = "a string"
        rec[PAYLOAD] = payload
        return reply


@pytest.fixture
def test_mods(monkeypatch):
    monkeypatch.setitem(FLOWER_MODS, "test-drop", Drop)
    monkeypatch.setitem(FLOWER_MODS, "test-tamper-payload", TamperPayload)


HOSTILE = {1: ("flip", "payload rejected (digest)"), 2: ("wrong-key", "payload rejected (fingerprint)"),
           3: ("other-clip", "payload rejected (clip)"), 4: ("total-weight-max", "payload rejected (total_weight)"),
           5: ("value-bits", "payload rejected ("), 6: ("key-bits", "payload rejected (width)"),
           7: ("count", "payload rejected (count)"), 8: ("truncated", "payload rejected (count)"),
           9: ("not-bytes", "payload rejected (type)")}


def test_each_hostile_payload_is_its_clients_failure_and_the_rest_aggregate(small_cfg, tmp_path, test_mods):
    """issue 29: a payload valid alone but inconsistent with the channel (another clip, total weight at its
    maximum, other value or key bits, a wrong ciphertext count or size, another key, a flipped byte) is that
    client's recorded failure naming it; the combination never sees it and aggregates the honest clients
    (0 and 10) exactly like plain FedAvg over them. (A fixed clip: the payload travels in the train reply,
    where a Flower mod can rewrite it.)"""
    how = "{" + ", ".join(f'"{k}"={json.dumps(v[0])}' for k, v in HOSTILE.items()) + "}"
    sets = (*TABULAR, "federation.rounds=1", "federation.num_clients=11", 'data.partition="iid"')
    cfg = small_cfg(*sets, *paillier("channel.clip=0.5"),
                    f'client.flower_mods=[{{name="test-tamper-payload", how={how}}}]')
    grid, server, state, summary = _run_inprocess(cfg)
    failed = {f["client"]: f for f in summary["failures"]}
    assert sorted(failed) == sorted(HOSTILE) and all(f["round"] == 1 and f["stage"] == "train" for f in failed.values())
    for k, (_, reason) in HOSTILE.items():
        assert reason in failed[k]["reason"], (k, failed[k]["reason"])
    assert server.rows[1]["replies"] == 2
    honest = f"client.flower_mods=[{{name=\"test-drop\", clients={sorted(HOSTILE)}}}]"
    expected, _ = _plain_round(small_cfg, tmp_path, *sets[2:], honest)
    got, clip = _decrypt_head(grid, server, state)
    step = server.engine.channel.quantizer.max_int
    assert clip == 0.5 and float(np.max(np.abs(got - expected))) <= 0.5 * clip / step + 1e-7


def test_a_bad_range_exponent_or_a_dropout_fails_alone_under_the_automatic_clip(small_cfg, tmp_path, test_mods):
    sets = (*TABULAR, "federation.rounds=1")
    cfg = small_cfg(*sets, *paillier(), 'client.flower_mods=[{name="test-tamper-payload", how={"1"="exponent"}}, '
                                         '{name="test-drop", clients=[2]}]')
    grid, server, state, summary = _run_inprocess(cfg)
    failed = {f["client"]: f["reason"] for f in summary["failures"]}
    assert sorted(failed) == [1, 2] and RANGE_EXPONENT in failed[1] and "dropped out" in failed[2]
    expected, updates = _plain_round(small_cfg, tmp_path, 'client.flower_mods=[{name="test-drop", clients=[1, 2]}]')
    got, clip = _decrypt_head(grid, server, state)
    assert clip == 2.0 ** range_exponent(np.concatenate(updates))  # from the clients that answered
    assert float(np.max(np.abs(got - expected))) <= 0.5 * clip / server.engine.channel.quantizer.max_int + 1e-7


@pytest.mark.ray
def test_paillier_fedavg_on_ray_matches_plain_fedavg(small_cfg, tmp_path):
    """seed 003 Table 4.3 shape: FedAvg with the Paillier channel on the real Ray simulation against plain
    FedAvg (in-process: the two backends give identical metrics for a seed, see test_simulation_ray.py).
    The run checkpoints every round, and the server process (this one: the clients are Ray actors) never
    reads a byte of the clients' mirrored state, which holds their private keys."""
    sets = ("federation.rounds=3", "federation.num_clients=3", "train.lr=0.05")
    plain = run_experiment(small_cfg(*sets), out=tmp_path / "plain", progress=False)
    with _StateFileReads() as watch:
        enc = run_experiment(small_cfg(*sets, *paillier(), 'simulation.backend="ray"'), out=tmp_path / "enc",
                             progress=False)
    assert json.loads((enc / "summary.json").read_text())["checkpoint"] == "after every round"
    assert watch.reads == []
    a = read_jsonl(plain / "metrics.jsonl")[-1]["accuracy"]
    b = read_jsonl(enc / "metrics.jsonl")[-1]
    assert b["evaluated_by"].startswith("client ")
    assert abs(a - b["accuracy"]) <= 0.005, (a, b["accuracy"])


# ------------------------------------------------------------------------- client-state files and the server
class _StateFileReads:
    """Every opening for reading of a mirrored client-state file (``client-state/p<k>-r<r>.bin``) in this
    process while active, through ``open``/``io.open`` (``Path.read_bytes``, ``np.load``, ...) or
    ``os.open``: ``(path, client_side)``, ``client_side`` when a frame of the ClientApp (fedsim/app/client.py
    or clients/) is on the stack - in-process clients run in the server's process; on Ray any read here is
    the server's."""

    _NAME = re.compile(r"^p\d+-r\d+\.bin$")

    def __init__(self):
        self.reads: list[tuple[str, bool]] = []
        self.paused = False
        self._patch = pytest.MonkeyPatch()

    def __enter__(self):
        real_open, real_os_open = builtins.open, os.open

        def watched_open(file, mode="r", *args, **kw):
            if "r" in mode or "+" in mode:
                self._note(file)
            return real_open(file, mode, *args, **kw)

        def watched_os_open(path, flags, *args, **kw):
            if flags & os.O_ACCMODE in (os.O_RDONLY, os.O_RDWR):
                self._note(path)
            return real_os_open(path, flags, *args, **kw)

        for module, name, fn in ((builtins, "open", watched_open), (io, "open", watched_open),
                                 (os, "open", watched_os_open)):
            self._patch.setattr(module, name, fn)
        return self

    def __exit__(self, *exc):
        self._patch.undo()

    def _note(self, file):
        if self.paused or not isinstance(file, (str, bytes, os.PathLike)):
            return
        path = pathlib.Path(os.fsdecode(file))
        if path.parent.name != "client-state" or not self._NAME.match(path.name):
            return
        frame, client = sys._getframe(2), False
        while frame is not None and not client:
            where = pathlib.PurePath(frame.f_code.co_filename).parts
            client = where[-3:] == ("fedsim", "app", "client.py") or "clients" in where[-2:-1]
            frame = frame.f_back
        self.reads.append((str(path), client))

    @property
    def server_side(self) -> list[str]:
        return [p for p, client in self.reads if not client]

    @property
    def client_side(self) -> list[str]:
        return [p for p, client in self.reads if client]


def test_the_state_file_watch_sees_every_way_of_reading(tmp_path):
    """The watch the resume tests below rely on: reads through ``Path.read_bytes``, ``open``, ``np.load``'s
    ``open`` and ``os.open`` are seen (as not the client's), other files and writes are not."""
    folder = tmp_path / "client-state"
    folder.mkdir()
    state, other = folder / "p3-r12.bin", folder / "p3-r12.bin.sha256"
    state.write_bytes(b"secret")
    other.write_text("0" * 64)
    with _StateFileReads() as watch:
        state.read_bytes()
        with open(state, "rb") as fh:
            fh.read()
        os.close(os.open(state, os.O_RDONLY))
        with pytest.raises(ValueError):
            np.load(state, allow_pickle=False)
        other.read_text()
        with open(folder / "p4-r1.bin", "wb") as fh:
            fh.write(b"written, not read")
    state.read_bytes()  # after the watch
    assert watch.server_side == [str(state)] * 4 and watch.client_side == []


# ------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("channel", [paillier(), ('channel.name="ckks"',)], ids=["paillier", "ckks"])
def test_an_encrypted_run_resumes_exactly(channel, small_cfg, tmp_path, monkeypatch):
    """issue 27: interrupted in round 3 of 3, a Paillier (update chain, automatic clip) or CKKS run resumes
    from its checkpoint - the server's ciphertexts, public key and holders; the clients' keys and models from
    the client-state mirror - and ends with the uninterrupted run's metrics (Paillier: exactly; CKKS: up to
    its encryption noise, fresh in every run). The checkpoint holds no secret, and no server-side code reads
    the clients' mirrored state (their private keys): the checkpoint records the digests the clients wrote
    beside their files, and the resume check hashes the files in a separate process."""
    from test_reliability import _interrupt_in_training

    from fedsim.checkpoint import CHECKPOINT, read_checkpoint
    from fedsim.interrupt import RunInterrupted

    cfg = small_cfg(*TABULAR, "federation.rounds=3", "federation.clients_per_round=3", *channel)
    ref = run_experiment(cfg, out=tmp_path / "reference", progress=False)
    out = tmp_path / "run"
    fired = _interrupt_in_training(monkeypatch, 3)
    with _StateFileReads() as watch:
        with pytest.raises(RunInterrupted):
            run_experiment(cfg, out=out, progress=False)
        assert fired
        ckpt = read_checkpoint(out / CHECKPOINT)
        assert ckpt.round == 2 and len(ckpt.arrays) == 1 and ckpt.arrays[0].dtype == np.uint8  # ciphertexts
        st = {}
        watch.paused = True  # the test's own look into the clients' files
        for f in (out / "client-state").glob("*.bin"):  # the clients' secret keys live in their mirrored state
            st.update({k: v for k, v in _mirrored_channel_state(f).items() if "private" in k})
        watch.paused = False
        assert st and not any(v in ckpt.arrays[0].tobytes() or v in json.dumps(ckpt.components, default=str).encode()
                              for v in st.values())
        monkeypatch.undo()
        run_experiment(cfg, out=out, progress=False, resume=True)
    assert watch.server_side == [] and len(watch.client_side) >= 3  # the in-process clients restored theirs
    timing = ("seconds", "inline_obfuscators")
    rows_a, rows_b = read_jsonl(ref / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rows_a] == [r["round"] for r in rows_b] == [0, 1, 2, 3]
    for a, b in zip(rows_a, rows_b):
        keep = lambda row: {k: v for k, v in row.items() if not any(t in k for t in timing)}  # noqa: E731
        if "paillier" in channel[0]:
            assert keep(a) == keep(b)  # exact integers: the same metrics
        else:  # CKKS's fresh encryption noise (~1e-9 per value) differs from run to run, by design
            assert keep(a).keys() == keep(b).keys()
            for k, v in keep(a).items():
                assert b[k] == v if not isinstance(v, float) else b[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert all(r["failures"] == 0 for r in rows_b)


def _mirrored_channel_state(path):
    from fedsim.client_state import _deserialise

    state = _deserialise(path.read_bytes())
    return {k: bytes(v) for k, v in state[STATE_CHANNEL].items()} if STATE_CHANNEL in state else {}
