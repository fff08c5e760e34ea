"""Run folders are owned: locked while in use, never mixed with another run's files.

:func:`open_run_folder` decides, before anything is written, what a run may do with its folder:

* a folder that does not exist, or is empty, gets a fresh run;
* a folder holding a run of the same config (same :func:`fedsim.checkpoint.config_identity`) is
  continued: from its checkpoint when it has one (``action = "resume"``), or reported complete when its
  ``summary.json`` says so (``action = "complete"``; nothing is run again), or started again when it
  holds no completed round (stopped during start-up: also with ``--resume``);
* any other non-empty folder is refused, unless ``overwrite``, which clears it first - and only if it
  is a fedsim folder (it holds ``.fedsim.lock`` or ``config.toml``): a folder fedsim did not make is
  never cleared.

The folder is locked with ``flock`` on ``.fedsim.lock`` for as long as the run holds it: a second
fedsim process that wants it fails at once with a message naming the process that holds it. The lock
goes away with the process (a killed run leaves no stale lock: the file may stay, unlocked); a run that
ends normally removes the file.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fedsim.checkpoint import (
    CHECKPOINT,
    CheckpointError,
    config_differences,
    config_identity,
    read_checkpoint,
    remove_temp_files,
    verify_resume,
)
from fedsim.components import ConfigError

LOCK = ".fedsim.lock"
NOTHING_COMPLETED = "cleared (nothing completed)"  # a Decision's note: this config's run, no round to continue
SUMMARY = "summary.json"
CONFIG = "config.toml"
METRICS = "metrics.jsonl"

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: no locking
    fcntl = None  # type: ignore[assignment]


class RunFolderError(ConfigError):
    """The run folder cannot be used (in use, not empty, not writable, a file, ...)."""


def _contents(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n != LOCK)


def is_fedsim_folder(path: Path) -> bool:
    return (path / LOCK).exists() or (path / CONFIG).is_file() or (path / "sweep.jsonl").is_file()


def read_summary(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / SUMMARY).read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def read_run_config(path: Path) -> dict[str, Any] | None:
    """The resolved config a run folder holds (``config.toml``), or None if missing or unreadable."""
    import tomllib

    from fedsim.config import with_nulls

    try:
        return with_nulls(tomllib.loads((path / CONFIG).read_text()))
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def completed_rounds_in_metrics(path: Path) -> int:
    """The highest round in ``metrics.jsonl`` (-1 if none)."""
    best = -1
    try:
        lines = (path / METRICS).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return -1
    for line in lines:
        try:
            best = max(best, int(json.loads(line)["round"]))
        except (ValueError, KeyError, TypeError):
            continue
    return best


@dataclass
class Decision:
    """What a run may do with a folder: ``fresh`` (empty, or cleared), ``resume`` or ``complete``."""

    action: str
    checkpoint: Any = None  # fedsim.checkpoint.Checkpoint for "resume"
    note: str = ""


def decide(path: Path, cfg: Mapping[str, Any] | None, overwrite: bool = False, resume: bool = False,
           what: str = "--out", without_client_state: bool = False) -> Decision:
    """Inspect an existing folder (nothing is written). ``cfg`` None: only emptiness matters. A checkpoint
    to resume from must fit the folder (:func:`fedsim.checkpoint.verify_resume`: ``metrics.jsonl`` and
    every client-state file it stands for); ``without_client_state`` resumes without the client state."""
    contents = _contents(path)
    if not contents:
        if resume:
            raise RunFolderError(f"--resume {path}: the folder holds no run to resume")
        return Decision("fresh")
    if overwrite:
        return Decision("fresh", note="cleared")
    stored = read_run_config(path)
    if cfg is None or stored is None:
        raise RunFolderError(f"{what} {path} is not empty; use --overwrite to replace what it holds, "
                             "or choose another folder")
    if config_identity(stored) != config_identity(cfg):
        diff = "; ".join(config_differences(stored, cfg))
        raise RunFolderError(f"{what} {path} holds a run of another config (differs in {diff}); use "
                             "--overwrite to replace it, or choose another folder")
    summary = read_summary(path) or {}
    if summary.get("status", "completed") == "completed" and summary:
        return Decision("complete", note="already complete")
    if (path / CHECKPOINT).is_file():
        try:
            ckpt = read_checkpoint(path / CHECKPOINT)
        except CheckpointError as exc:
            raise RunFolderError(f"{exc}; use --overwrite to start the run again") from None
        if ckpt.identity != config_identity(cfg):
            raise RunFolderError(f"{path / CHECKPOINT} belongs to another config; use --overwrite to start again")
        try:
            verify_resume(path, ckpt, without_client_state=without_client_state)
        except CheckpointError as exc:
            raise RunFolderError(str(exc)) from None
        if without_client_state:  # every client starts afresh; the run records that it is no longer exact
            ckpt.client_state = {}
            ckpt.client_state_dropped = [*ckpt.client_state_dropped, ckpt.round]
        return Decision("resume", checkpoint=ckpt, note=f"resuming after round {ckpt.round}")
    done = completed_rounds_in_metrics(path)
    if done >= 1:
        why = summary.get("checkpoint") or "no checkpoint.npz"
        raise RunFolderError(f"{what} {path} holds an unfinished run of this config that cannot be resumed "
                             f"({why}); use --overwrite to start it again")
    # nothing of value (stopped during start-up, or before round 1 without a checkpoint): the run starts
    # again from the beginning, also on --resume (what a scheduler that requeues a stopped job asks for)
    return Decision("fresh", note=NOTHING_COMPLETED)


class RunFolder:
    """A locked folder (a run's or a sweep's). Use :func:`open_run_folder` / :func:`open_sweep_folder`."""

    def __init__(self, path: Path, fd: int | None, created: bool, decision: Decision):
        self.path, self._fd, self.created, self.decision = path, fd, created, decision
        self.made_parent: Path | None = None  # output.dir, when it was made for this folder

    @property
    def action(self) -> str:
        return self.decision.action

    def clear(self) -> None:
        """Delete everything in the folder but the lock file."""
        for name in _contents(self.path):
            p = self.path / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def release(self) -> None:
        """Remove the lock file (still holding the lock, so no one else can have it) and unlock."""
        if self._fd is not None:
            try:
                (self.path / LOCK).unlink(missing_ok=True)
            except OSError:
                pass
            try:
                if fcntl is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def discard(self) -> None:
        """Release, and remove the folder if this process created it (nothing half-way)."""
        self.release()
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
            if self.made_parent is not None:
                try:
                    self.made_parent.rmdir()  # only if empty: another run may have appeared in it
                except OSError:
                    pass

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _check_path(path: Path, what: str) -> bool:
    """Refuse a path that is a file or an unreadable folder; returns whether it exists."""
    if path.exists() and not path.is_dir():
        raise RunFolderError(f"{what} {path} exists and is not a folder")
    if path.is_dir():
        try:
            _contents(path)
        except OSError as exc:
            raise RunFolderError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
        return True
    return False


def _lock(path: Path, what: str, created: bool) -> tuple[int | None, bool]:
    """Open and lock ``path/.fedsim.lock``; returns (fd, whether the lock file was created)."""
    for _ in range(20):
        fd, new = _lock_once(path, what, created)
        try:  # the holder may have removed the file between our open and our lock: lock the new one
            if os.fstat(fd).st_ino == os.stat(path / LOCK).st_ino:
                return fd, new
        except FileNotFoundError:
            pass
        os.close(fd)
    raise RunFolderError(f"cannot lock {what} {path}: its lock file keeps changing")


def _lock_once(path: Path, what: str, created: bool) -> tuple[int, bool]:
    lock = path / LOCK
    had_lock = lock.exists()
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        if created:
            shutil.rmtree(path, ignore_errors=True)
        raise RunFolderError(f"cannot write in {what} {path}: {exc.strerror or exc}") from None
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                os.close(fd)
                raise RunFolderError(f"cannot lock {what} {path}: {exc.strerror or exc}") from None
            try:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise RunFolderError(f"{what} {path} is in use by another fedsim process ({holder}); wait for it "
                                 "to finish or choose another folder") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
    return fd, not had_lock


def open_folder(path: str | Path, cfg: Mapping[str, Any] | None, *, overwrite: bool = False, resume: bool = False,
                what: str = "--out", sweep: bool = False, without_client_state: bool = False) -> RunFolder:
    """Check, create and lock a run folder (see the module docstring); raises :class:`RunFolderError`
    naming the folder. ``sweep``: a sweep's folder (its variants decide for themselves). Once the folder
    is accepted, temporary files a killed process left (``.<name>.<hex>.tmp``) are deleted."""
    path = Path(path)
    existed = _check_path(path, what)
    if existed and _contents(path) and not is_fedsim_folder(path):
        raise RunFolderError(f"{what} {path} is not empty and holds no fedsim run (no config.toml); "
                             "choose another folder (fedsim never clears a folder it did not make)")
    if resume and not existed:
        raise RunFolderError(f"--resume {path}: no such folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunFolderError(f"cannot create {what} {path}: {exc.strerror or exc}") from None
    created = not existed
    fd, _ = _lock(path, what, created)
    try:
        if sweep:
            decision = Decision("fresh", note="cleared") if overwrite and _contents(path) else Decision("sweep")
        else:
            decision = decide(path, cfg, overwrite=overwrite, resume=resume, what=what,
                              without_client_state=without_client_state)
    except BaseException:
        RunFolder(path, fd, created, Decision("refused")).release()  # removes the lock file
        if created:
            shutil.rmtree(path, ignore_errors=True)
        raise
    folder = RunFolder(path, fd, created, decision)
    if decision.action == "fresh" and decision.note.startswith("cleared"):
        folder.clear()
    remove_temp_files(path)
    return folder


def open_run_folder(path: str | Path, cfg: Mapping[str, Any], *, overwrite: bool = False,
                    resume: bool = False, without_client_state: bool = False) -> RunFolder:
    return open_folder(path, cfg, overwrite=overwrite, resume=resume, without_client_state=without_client_state)


def open_sweep_folder(path: str | Path, *, overwrite: bool = False) -> RunFolder:
    return open_folder(path, None, overwrite=overwrite, what="sweep folder", sweep=True)
