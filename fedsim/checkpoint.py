"""Checkpoints of a run (resume): what one holds and how it is written and read.

At the end of every round the server writes ``checkpoint.npz`` into the run folder, atomically
(temporary file, fsync, rename): the round, the global model, the state of the aggregation rule, the
channel, every server transform and every observer (their ``state()``), the server process's RNG
positions (Python, NumPy, torch), the recorded client failures, the run's elapsed time, the
``metrics.jsonl`` prefix it was written after and the digests of the clients' mirrored state files it
stands for. It is an ``.npz`` read with ``allow_pickle=False``: arrays plus one JSON document, never
pickled objects.

The clients' state is mirrored beside it by the clients themselves (:mod:`fedsim.client_state`); a
checkpoint is checked against its run folder before a run resumes from it (:mod:`fedsim.resume_checks`).
"""
from __future__ import annotations

import hashlib
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

CHECKPOINT = "checkpoint.npz"
METRICS = "metrics.jsonl"
FORMAT = 3  # 2: the checkpoint records its metrics.jsonl prefix and a digest of every client-state file;
# 3: the digests are the ones the clients wrote beside their files (``.bin.sha256``)

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
    # metrics.jsonl as it was when the checkpoint was written: its length in bytes (rows 0..round) and their
    # SHA-256; and each client-state file the checkpoint stands for (name -> SHA-256)
    metrics_bytes: int = 0
    metrics_digest: str = ""
    client_state: dict[str, str] = field(default_factory=dict)
    client_state_dropped: list[int] = field(default_factory=list)  # rounds resumed without client state


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
            "resumed": list(ckpt.resumed), "global": len(ckpt.arrays),
            "metrics_bytes": int(ckpt.metrics_bytes), "metrics_digest": ckpt.metrics_digest,
            "client_state": dict(ckpt.client_state), "client_state_dropped": list(ckpt.client_state_dropped)}
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
        ckpt = Checkpoint(round=int(meta["round"]), identity=str(meta["identity"]), arrays=glob,
                          components=unpack(meta["components"], arrays), rng=unpack(meta["rng"], arrays),
                          failures=failures, seconds=float(meta.get("seconds", 0.0)),
                          resumed=[int(r) for r in meta.get("resumed", [])],
                          metrics_bytes=int(meta["metrics_bytes"]), metrics_digest=str(meta["metrics_digest"]),
                          client_state={str(k): str(v) for k, v in meta["client_state"].items()},
                          client_state_dropped=[int(r) for r in meta.get("client_state_dropped", [])])
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - OSError, zipfile.BadZipFile, bad JSON, missing keys: name the file
        raise CheckpointError(f"checkpoint {p} cannot be read ({type(exc).__name__}: {exc})") from exc
    for i, a in enumerate(ckpt.arrays):
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            raise CheckpointError(f"checkpoint {p} holds a non-finite global model (NaN or infinity in entry {i}): "
                                  "it cannot be resumed; use --overwrite to start the run again")
    return ckpt


# ============================================================================ the run it was written after
def metrics_prefix(run_dir: str | Path) -> tuple[int, str]:
    """(bytes, SHA-256) of ``metrics.jsonl`` as it is now (the rows a checkpoint written now stands for)."""
    path = Path(run_dir) / METRICS
    data = path.read_bytes() if path.exists() else b""
    return len(data), hashlib.sha256(data).hexdigest()


# ============================================================================ what can be checkpointed
def resume_blocker(channel: Any, rule: Any, transforms: Sequence[Any], observers: Sequence[Any]) -> str | None:
    """Why a run with these components cannot be checkpointed and resumed exactly, or None if it can.

    The global model must be readable by the server (the channel provides the plaintext aggregate) or
    the channel must save it in its own form (``checkpoint_arrays``, e.g. ciphertexts), a
    channel with a setup exchange must restore its state (``load_state``), and every component and
    observer must report its state (``state()`` returning a dict; an observer's default is None)."""
    from fedsim.lifecycle import resume_problem
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
        problem = resume_problem(comp)  # state() fails closed (fedsim.lifecycle.Component)
        if problem:
            return f"{kind} {getattr(comp, 'name', type(comp).__name__)!r} cannot be checkpointed: {problem}"
    return None
