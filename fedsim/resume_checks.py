"""The checks before a run resumes from its checkpoint (:mod:`fedsim.checkpoint`): the checkpoint must fit
its run folder (``metrics.jsonl``, the clients' mirrored state), and temporary files of a killed write go.

**The server process never reads a client-state file.** The files hold the clients' secrets (the
Paillier private key, the CKKS secret key, X25519 keys), which must never exist in the server process.
The checkpoint records the digests the clients wrote (:func:`fedsim.client_state.client_state_digests` reads only the
``.sha256`` files), and the resume check (:func:`verify_resume`) hashes the files in a separate,
short-lived Python process that imports nothing but ``hashlib`` and returns hex digests
(:func:`digests_in_subprocess`). Only the clients read their files, to restore them.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from fedsim.checkpoint import CHECKPOINT, METRICS, Checkpoint, CheckpointError
from fedsim.client_state import CLIENT_STATE, HEX64, STATE_FILE

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
    return [ln if HEX64.match(ln) else None for ln in lines]


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
        m = STATE_FILE.match(name)
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
