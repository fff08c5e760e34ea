"""The mirror of the clients' state, written and read by the clients (resume).

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

The server never reads a state file: it records the digests the clients wrote (:func:`client_state_digests`
reads only the ``.sha256`` files) and deletes superseded files (:func:`keep_client_states`); the resume
check hashes the files in another process (:mod:`fedsim.resume_checks`).
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedsim.checkpoint import CheckpointError

CLIENT_STATE = "client-state"  # the mirror's folder in the run folder
STATE_FILE = re.compile(r"^p(\d+)-r(\d+)\.bin$")
_MIRROR_ANY = re.compile(r"^(p\d+-r\d+\.bin)(\.sha256)?$")  # a state file or its digest file
DIGEST_SUFFIX = ".sha256"
HEX64 = re.compile(r"^[0-9a-f]{64}$")
INVALID_DIGEST = "invalid"  # recorded for a digest file that does not hold 64 hex digits (never matches)


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
        m = STATE_FILE.match(name)
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
        out[path.name] = text if HEX64.match(text) else INVALID_DIGEST  # refused at resume: "damaged"
    return out


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
