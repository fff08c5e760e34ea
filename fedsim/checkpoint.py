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
serialisation), and then the SHA-256 of the bytes it wrote beside it (``p<partition>-r<r>.bin.sha256``,
64 hex digits): a state is complete once its digest is there. The checkpoint of round ``r`` stands
for, per partition, the newest complete state of a round ``<= r``; the server deletes the older ones
after each checkpoint and, before resuming, the files of rounds after the checkpoint. In a resumed run
the server's messages carry ``RESUMED_AT``: a client whose context has not been restored yet loads its
newest state first (and refuses it if its bytes do not match their digest). The mirror needs the run
folder to be reachable from the client processes (always true for the local Ray cluster and the
in-process backend; with ``simulation.ray_address`` the folder must be on a file system the cluster
shares).

**The server process never reads a client-state file.** The files hold the clients' secrets (the
Paillier private key, the CKKS secret key, X25519 keys), which must never exist in the server process.
The checkpoint records the digests the clients wrote (:func:`client_state_digests` reads only the
``.sha256`` files), and the resume check (:func:`verify_resume`) hashes the files in a separate,
short-lived Python process that imports nothing but ``hashlib`` and returns hex digests
(:func:`digests_in_subprocess`). Only the clients read their files, to restore them.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

CHECKPOINT = "checkpoint.npz"
CLIENT_STATE = "client-state"
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


# ============================================================================ what a checkpoint stands for
def metrics_prefix(run_dir: str | Path) -> tuple[int, str]:
    """(bytes, SHA-256) of ``metrics.jsonl`` as it is now (the rows a checkpoint written now stands for)."""
    path = Path(run_dir) / METRICS
    data = path.read_bytes() if path.exists() else b""
    return len(data), hashlib.sha256(data).hexdigest()


_HEX64 = re.compile(r"^[0-9a-f]{64}$")
INVALID_DIGEST = "invalid"  # recorded for a digest file that does not hold 64 hex digits (never matches)


def client_state_digests(folder: str | Path, upto: int) -> dict[str, str]:
    """name -> SHA-256 of each partition's newest complete mirrored state of a round ``<= upto``, as its
    client wrote it beside the file (``<name>.sha256``). Reads the digest files only, never a state file:
    what the server records in every checkpoint costs a 65-byte read per partition."""
    out = {}
    for p, r in sorted(newest_client_states(folder, upto).items()):
        path = mirror_file(folder, p, r)
        try:
            text = digest_file(path).read_text(encoding="ascii", errors="replace").strip()
        except FileNotFoundError:  # gone since it was listed: not part of this checkpoint
            continue
        out[path.name] = text if _HEX64.match(text) else INVALID_DIGEST  # refused at resume: "damaged"
    return out


# the verifier: run by ``python -I -S`` (isolated: no site, no PYTHONPATH, no current folder), it imports
# hashlib and sys only; paths arrive on stdin (NUL-separated), one line per path goes back: a hex digest,
# or "-" when the file cannot be read
_HASHER = """import hashlib, sys
for p in sys.stdin.buffer.read().split(b"\\0"):
    if not p:
        continue
    h = hashlib.sha256()
    try:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        print(h.hexdigest())
    except OSError:
        print("-")
"""


def digests_in_subprocess(paths: Sequence[str | Path], timeout: float = 600.0) -> list[str | None]:
    """SHA-256 (hex) of each file, computed in a separate short-lived Python process (the files' bytes never
    enter this one); None for a file that cannot be read. Raises :class:`CheckpointError` if the process
    fails."""
    if not paths:
        return []
    data = b"\0".join(os.fsencode(str(p)) for p in paths)
    try:
        res = subprocess.run([sys.executable, "-I", "-S", "-c", _HASHER], input=data, capture_output=True,
                             timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CheckpointError(f"cannot check the client-state files ({type(exc).__name__}: {exc})") from None
    lines = res.stdout.decode("ascii", errors="replace").splitlines()
    if res.returncode != 0 or len(lines) != len(paths):
        why = res.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {res.returncode}"]
        raise CheckpointError(f"cannot check the client-state files (the verifier failed: {why[0][:200]})")
    return [ln if _HEX64.match(ln) else None for ln in lines]


def verify_resume(run_dir: str | Path, ckpt: Checkpoint, without_client_state: bool = False) -> None:
    """Refuse (:class:`CheckpointError`, naming the file) a checkpoint that does not fit its run folder:

    * ``metrics.jsonl`` must begin with exactly the rows the checkpoint was written after (same bytes), and
      hold at most one more row (the row of a round that was being written when the run died): a
      checkpoint edited to, or replaced by, an earlier round is refused;
    * every client-state file the checkpoint stands for must be there, with the same SHA-256: a missing
      or damaged file would make the resumed run differ from the uninterrupted one. With
      ``without_client_state`` the client state is not checked (the resumed run drops all of it)."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS
    data = metrics.read_bytes() if metrics.exists() else b""
    head = data[:ckpt.metrics_bytes]
    if len(head) < ckpt.metrics_bytes or hashlib.sha256(head).hexdigest() != ckpt.metrics_digest:
        raise CheckpointError(f"{metrics} does not begin with the rows 0..{ckpt.round} the checkpoint "
                              f"{run_dir / CHECKPOINT} was written after (edited, truncated or from another "
                              "run): resuming would not continue this run; use --overwrite to start it again")
    try:
        rounds = [json.loads(ln).get("round") for ln in head.splitlines() if ln.strip()]
    except (ValueError, AttributeError):
        rounds = None
    if rounds != list(range(ckpt.round + 1)):
        raise CheckpointError(f"the checkpoint {run_dir / CHECKPOINT} says round {ckpt.round}, but the rows of "
                              f"{metrics} it was written after are rounds {_span(rounds)} (edited?): resuming would "
                              "not continue this run; use --overwrite to start it again")
    later = [ln for ln in data[ckpt.metrics_bytes:].splitlines() if ln.strip()]
    if len(later) > 1:
        raise CheckpointError(f"{metrics} holds {len(later)} rows after round {ckpt.round} of the checkpoint "
                              f"{run_dir / CHECKPOINT}: the checkpoint is older than the run (edited or replaced); "
                              "use --overwrite to start the run again")
    for name in ckpt.client_state:
        m = _MIRROR_FILE.match(name)
        if m is None or int(m.group(2)) > ckpt.round:
            raise CheckpointError(f"the checkpoint {run_dir / CHECKPOINT} of round {ckpt.round} records client "
                                  f"state {name!r}, not a state of round <= {ckpt.round} (edited?); use --overwrite "
                                  "to start the run again")
    if without_client_state:
        return
    folder = run_dir / CLIENT_STATE
    flag = "restore it, or resume with --resume-without-client-state (every client starts without its state: " \
           "the run is no longer exact), or --overwrite to start again"
    names = sorted(ckpt.client_state)
    for name in names:  # (a stat: nothing is read)
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"client state {path} (recorded in the checkpoint of round {ckpt.round}) is "
                                  f"missing: the resumed run would differ; {flag}")
    # the files hold the clients' keys: they are hashed in another process, never read in this one
    for name, got in zip(names, digests_in_subprocess([folder / n for n in names])):
        if got != ckpt.client_state[name]:
            raise CheckpointError(f"client state {folder / name} is damaged (its SHA-256 differs from the "
                                  f"checkpoint's): the resumed run would differ; {flag}")


def _span(rounds: list[Any] | None) -> str:
    if not rounds:
        return "(none)"
    return f"{rounds[0]}..{rounds[-1]}" if all(isinstance(r, int) for r in rounds) else str(rounds)[:60]


def keep_client_states(folder: str | Path, names: Mapping[str, str] | Sequence[str]) -> None:
    """Delete every mirrored client-state file in ``folder`` but ``names`` (the ones a checkpoint stands for),
    and their digest files."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return
    for e in entries:
        m = _MIRROR_ANY.match(e.name)
        if m and m.group(1) not in names:
            Path(e.path).unlink(missing_ok=True)


_TEMP = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")  # fedsim.reports.atomic_write_bytes' temporary files


def remove_temp_files(run_dir: str | Path) -> list[str]:
    """Delete temporary files an atomic write left behind when its process was killed (in the folder and
    its client-state folder); only call it while holding the folder's lock. Returns their names."""
    gone = []
    for folder in (Path(run_dir), Path(run_dir) / CLIENT_STATE):
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if _TEMP.match(e.name) and e.is_file(follow_symlinks=False):
                Path(e.path).unlink(missing_ok=True)
                gone.append(e.name)
    return gone


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
_MIRROR_ANY = re.compile(r"^(p\d+-r\d+\.bin)(\.sha256)?$")  # a state file or its digest file
DIGEST_SUFFIX = ".sha256"


def mirror_file(folder: str | Path, partition: int, round: int) -> Path:
    return Path(folder) / f"p{int(partition)}-r{int(round)}.bin"


def digest_file(path: str | Path) -> Path:
    """Where a client writes the SHA-256 of the state file ``path`` (``<name>.sha256``)."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


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
    data = _serialise(content)
    path = mirror_file(folder, partition, round)
    atomic_write_bytes(path, data)
    atomic_write_bytes(digest_file(path), (hashlib.sha256(data).hexdigest() + "\n").encode())  # complete now
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
            data = path.read_bytes()
            digest = digest_file(path).read_text(encoding="ascii", errors="replace").strip()
            if hashlib.sha256(data).hexdigest() != digest:
                raise CheckpointError(f"client state {path} is damaged (its SHA-256 differs from "
                                      f"{digest_file(path).name})")
            loaded = _deserialise(data)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the file
            raise CheckpointError(f"client state {path} cannot be read ({type(exc).__name__}: {exc})") from exc
        for k in list(state.keys()):
            del state[k]
        for k, v in loaded.items():
            state[k] = v
    state[STATE_MIRROR_MARK] = ConfigRecord({"round": int(best if best is not None else -1)})
    return best is not None


def client_state_files(folder: str | Path) -> list[tuple[int, int, Path]]:
    """(partition, round, path) of every complete mirrored client state in ``folder`` (a state file with its
    digest file beside it; a client killed between the two writes left an incomplete one)."""
    out = []
    try:
        names = {e.name: e.path for e in os.scandir(folder)}
    except FileNotFoundError:
        return []
    for name, path in names.items():
        m = _MIRROR_FILE.match(name)
        if m and name + DIGEST_SUFFIX in names:
            out.append((int(m.group(1)), int(m.group(2)), Path(path)))
    return out


def newest_client_states(folder: str | Path, upto: int) -> dict[int, int]:
    """partition -> the newest complete mirrored round ``<= upto``."""
    best: dict[int, int] = {}
    for p, r, _ in client_state_files(folder):
        if r <= upto and r > best.get(p, -1):
            best[p] = r
    return best
