"""Checkpoints of a run (resume) and the mirror of the clients' state.

At the end of every round the server writes ``checkpoint.npz`` into the run folder, atomically
(temporary file, fsync, rename): the round, the global model, the state of the aggregation rule, the
channel, every server transform and every observer (their ``state()``), the server process's RNG
positions (Python, NumPy, torch), the recorded client failures and the run's elapsed time. It is an
``.npz`` read with ``allow_pickle=False``: arrays plus one JSON document, never pickled objects.

Client state (defense residuals, accountants, channel keys) lives in Flower's per-node
``Context.state``, inside the simulation engine. To resume exactly, the ClientApp *mirrors* it: when
the server's message names a mirror folder (``fedsim.protocol.STATE_MIRROR``, set only for runs that
checkpoint), a client whose state is not empty writes it, after a successful ``train`` (or channel
setup) in round ``r``, to ``<run>/client-state/p<partition>-r<r>.bin`` (Flower's own RecordDict
serialisation). The checkpoint of round ``r`` stands for, per partition, the newest file of a round
``<= r``; the server deletes the older ones after each checkpoint and, before resuming, the files of
rounds after the checkpoint. In a resumed run the server's messages carry ``RESUMED_AT``: a client
whose context has not been restored yet loads its newest file first. The mirror needs the run folder
to be reachable from the client processes (always true for the local Ray cluster and the in-process
backend; with ``simulation.ray_address`` the folder must be on a file system the cluster shares).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

CHECKPOINT = "checkpoint.npz"
CLIENT_STATE = "client-state"
FORMAT = 1

# config keys that do not change a run's results: a run may be resumed with other values
VOLATILE_KEYS = ("simulation.backend", "simulation.num_cpus", "simulation.num_gpus", "simulation.ray_address",
                 "simulation.discovery_timeout", "output.dir")


class CheckpointError(ValueError):
    """A checkpoint or client-state file cannot be read (the message names the file)."""


# ============================================================================ config identity
def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def identity_items(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config's keys that fix the run's results (everything but :data:`VOLATILE_KEYS`)."""
    return {k: v for k, v in _flat(cfg).items() if k not in VOLATILE_KEYS and v is not None}


def config_identity(cfg: Mapping[str, Any]) -> str:
    """A hash of the result-relevant config: two configs with the same identity give the same run."""
    text = json.dumps(identity_items(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def config_differences(a: Mapping[str, Any], b: Mapping[str, Any], limit: int = 4) -> list[str]:
    """``key (a vs b)`` for the result-relevant keys where two configs differ."""
    fa, fb = identity_items(a), identity_items(b)
    keys = sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))
    return [f"{k} ({fa.get(k)!r} vs {fb.get(k)!r})" for k in keys[:limit]] + (
        [f"... {len(keys) - limit} more"] if len(keys) > limit else [])


# ============================================================================ packing state trees
def pack(tree: Any, arrays: dict[str, np.ndarray]) -> Any:
    """A JSON-able copy of ``tree``: arrays (NumPy or torch) go to ``arrays`` and are referenced by key."""
    if isinstance(tree, np.ndarray) or (hasattr(tree, "detach") and hasattr(tree, "cpu")):
        key = f"a{len(arrays)}"
        arrays[key] = np.ascontiguousarray(tree.detach().cpu().numpy() if hasattr(tree, "detach") else tree)
        return {"__nd__": key}
    if isinstance(tree, Mapping):
        for k in tree:
            if not isinstance(k, str):
                raise TypeError(f"state keys must be strings, got {k!r}")
        return {k: pack(v, arrays) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return {"__tuple__": [pack(v, arrays) for v in tree]}
    if isinstance(tree, list):
        return [pack(v, arrays) for v in tree]
    if isinstance(tree, np.generic):
        return tree.item()
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise TypeError(f"cannot checkpoint a {type(tree).__name__} (use arrays, numbers, strings, lists, dicts)")


def unpack(tree: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {"__nd__"}:
            return np.array(arrays[tree["__nd__"]])
        if set(tree) == {"__tuple__"}:
            return tuple(unpack(v, arrays) for v in tree["__tuple__"])
        return {k: unpack(v, arrays) for k, v in tree.items()}
    if isinstance(tree, list):
        return [unpack(v, arrays) for v in tree]
    return tree


# ============================================================================ RNG positions
def rng_state() -> dict[str, Any]:
    """The server process's global RNG positions (Python, NumPy legacy, torch CPU and CUDA)."""
    import torch

    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                           "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    import torch

    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(torch.as_tensor(np.asarray(state["torch"], dtype=np.uint8)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(np.asarray(s, dtype=np.uint8)) for s in state["cuda"]])


# ============================================================================ the checkpoint file
@dataclass
class Checkpoint:
    """What a run needs to continue after ``round`` exactly as if it had not stopped."""

    round: int
    identity: str
    arrays: list[np.ndarray]  # the global model after ``round`` (state-dict order)
    components: dict[str, Any] = field(default_factory=dict)  # rule, channel, transforms, observers
    rng: dict[str, Any] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the run up to this checkpoint (all sessions)
    resumed: list[int] = field(default_factory=list)  # rounds earlier sessions resumed from


def write_checkpoint(path: str | Path, ckpt: Checkpoint) -> None:
    """Write atomically (temporary file in the same folder, fsync, rename)."""
    from fedsim.reports import atomic_write_bytes

    arrays: dict[str, np.ndarray] = {}
    # every checkpoint holds every failure of the run so far: each distinct reason (up to 2,000 characters
    # of traceback, usually the same for a client failing round after round, or for every timed-out
    # node) is stored once and the failures refer to it by index
    reasons: dict[str, int] = {}
    failures = [{**f, "reason": reasons.setdefault(f["reason"], len(reasons))} if isinstance(f.get("reason"), str)
                else f for f in ckpt.failures]
    meta = {"format": FORMAT, "round": int(ckpt.round), "identity": ckpt.identity,
            "components": pack(ckpt.components, arrays), "rng": pack(ckpt.rng, arrays),
            "failures": failures, "failure_reasons": list(reasons), "seconds": float(ckpt.seconds),
            "resumed": list(ckpt.resumed), "global": len(ckpt.arrays)}
    for i, a in enumerate(ckpt.arrays):
        arrays[f"global.{i}"] = np.ascontiguousarray(a)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue(), durable=True)


def read_checkpoint(path: str | Path) -> Checkpoint:
    p = Path(path)
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("__meta__").tobytes().decode())
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {p} has format {meta.get('format')!r}; this fedsim reads {FORMAT}")
        glob = [arrays.pop(f"global.{i}") for i in range(int(meta["global"]))]
        reasons = meta.get("failure_reasons", [])
        failures = [{**f, "reason": reasons[f["reason"]]} if reasons and isinstance(f.get("reason"), int) else f
                    for f in meta.get("failures", [])]
        return Checkpoint(round=int(meta["round"]), identity=str(meta["identity"]), arrays=glob,
                          components=unpack(meta["components"], arrays), rng=unpack(meta["rng"], arrays),
                          failures=failures, seconds=float(meta.get("seconds", 0.0)),
                          resumed=[int(r) for r in meta.get("resumed", [])])
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - OSError, zipfile.BadZipFile, bad JSON, missing keys: name the file
        raise CheckpointError(f"checkpoint {p} cannot be read ({type(exc).__name__}: {exc})") from exc


# ============================================================================ what can be checkpointed
def resume_blocker(channel: Any, rule: Any, transforms: Sequence[Any], observers: Sequence[Any]) -> str | None:
    """Why a run with these components cannot be checkpointed and resumed exactly, or None if it can.

    The global model must be readable by the server (the channel provides the plaintext aggregate) or
    the channel must save it in its own form (``checkpoint_arrays``, e.g. ciphertexts), a
    channel with a setup exchange must restore its state (``load_state``), and every component and
    observer must report its state (``state()`` returning a dict; an observer's default is None)."""
    from fedsim.seams import PLAINTEXT_AGGREGATE, ServerChannel

    if PLAINTEXT_AGGREGATE not in type(channel).provides and \
            type(channel).checkpoint_arrays is ServerChannel.checkpoint_arrays:
        return (f"channel {channel.name!r} keeps the global model from the server and cannot save it "
                "(no checkpoint_arrays())")
    if type(channel).handshake is not ServerChannel.handshake and \
            type(channel).load_state is ServerChannel.load_state:
        return f"channel {channel.name!r} has a setup exchange but no load_state() to restore it"
    for kind, comp in (("strategy", rule), ("channel", channel), *(("transform", t) for t in transforms),
                       *(("observer", o) for o in observers)):
        try:
            st = comp.state()
        except NotImplementedError:
            st = None
        if not isinstance(st, dict):
            return f"{kind} {getattr(comp, 'name', type(comp).__name__)!r} cannot report its state (state())"
    return None


# ============================================================================ client-state mirror
_MIRROR_FILE = re.compile(r"^p(\d+)-r(\d+)\.bin$")


def mirror_file(folder: str | Path, partition: int, round: int) -> Path:
    return Path(folder) / f"p{int(partition)}-r{int(round)}.bin"


def _serialise(state: Any) -> bytes:
    from flwr.common.serde import recorddict_to_proto

    return recorddict_to_proto(state).SerializeToString()


def _deserialise(data: bytes) -> Any:
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    proto = ProtoRecordDict()
    proto.ParseFromString(data)
    return recorddict_from_proto(proto)


def save_client_state(state: Any, folder: str | Path, partition: int, round: int) -> bool:
    """Mirror a client's ``Context.state`` (a RecordDict) after round ``round``; returns whether a file
    was written. A client that never had state writes nothing; once it has mirrored, it always does
    (so a state that became empty is mirrored too)."""
    from flwr.app import ConfigRecord, RecordDict

    from fedsim.protocol import STATE_MIRROR_MARK
    from fedsim.reports import atomic_write_bytes

    content = RecordDict({k: v for k, v in state.items() if k != STATE_MIRROR_MARK})
    if not list(content.keys()) and STATE_MIRROR_MARK not in state:
        return False
    atomic_write_bytes(mirror_file(folder, partition, round), _serialise(content))
    state[STATE_MIRROR_MARK] = ConfigRecord({"round": int(round)})
    return True


def restore_client_state(state: Any, folder: str | Path, partition: int, upto: int) -> bool:
    """In a resumed run, load a client's newest mirrored state of a round ``<= upto`` into its (fresh)
    ``Context.state``, once. Returns whether the context was restored by this call."""
    from flwr.app import ConfigRecord

    from fedsim.protocol import STATE_MIRROR_MARK

    if STATE_MIRROR_MARK in state:  # restored (or mirrored) already in this session
        return False
    best = newest_client_states(folder, upto).get(int(partition))
    if best is not None:
        path = mirror_file(folder, partition, best)
        try:
            loaded = _deserialise(path.read_bytes())
        except Exception as exc:  # noqa: BLE001 - name the file
            raise CheckpointError(f"client state {path} cannot be read ({type(exc).__name__}: {exc})") from exc
        for k in list(state.keys()):
            del state[k]
        for k, v in loaded.items():
            state[k] = v
    state[STATE_MIRROR_MARK] = ConfigRecord({"round": int(best if best is not None else -1)})
    return best is not None


def client_state_files(folder: str | Path) -> list[tuple[int, int, Path]]:
    """(partition, round, path) of every mirrored client state in ``folder``."""
    out = []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    for e in entries:
        m = _MIRROR_FILE.match(e.name)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), Path(e.path)))
    return out


def newest_client_states(folder: str | Path, upto: int) -> dict[int, int]:
    """partition -> the newest mirrored round ``<= upto``."""
    best: dict[int, int] = {}
    for p, r, _ in client_state_files(folder):
        if r <= upto and r > best.get(p, -1):
            best[p] = r
    return best


def prune_client_states(folder: str | Path, upto: int) -> None:
    """Keep, per partition, only the newest mirrored state of a round ``<= upto``; delete files of
    rounds after ``upto`` (left by an interrupted round) and older ones (superseded)."""
    best = newest_client_states(folder, upto)
    for p, r, path in client_state_files(folder):
        if r != best.get(p):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
