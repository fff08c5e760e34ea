"""Resume exact or refused (issue 29): a checkpoint stands for the rows of ``metrics.jsonl`` it was written
after and for every client-state file (a SHA-256 each); a run folder that does not match - a client-state
file missing or damaged, the checkpoint edited to an earlier round, a non-finite model - is refused with
exit 2 and one line naming the file, the folder untouched; ``--resume-without-client-state`` continues
explicitly. Temporary files a killed write left are removed when a run takes the folder. A disk-write
failure of the first checkpoint is one line; a signal delivered to the process and then to its process
group (GNU ``timeout -s INT``) is one stop, and the run is resumable.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_pythonpath

import fedsim.app.client as client_module
from fedsim.app import load_config
from fedsim.app.cli import main
from fedsim.app.runner import run_experiment
from fedsim.checkpoint import CHECKPOINT, CheckpointError, read_checkpoint, write_checkpoint
from fedsim.components import ConfigError
from fedsim.interrupt import RunInterrupted
from fedsim.reports import read_jsonl
from fedsim.runfolder import decide

CONFIG = """
name = "guard"
seed = 5
device = "cpu"
[federation]
rounds = {rounds}
num_clients = 3
[model]
activation = "relu"
[train]
lr = 0.1
batch_size = 16
local_steps = 1
[simulation]
backend = "inprocess"
[output]
observers = []
[[defenses]]
name = "compress"
ratio = 0.5
"""


def write_config(folder: Path, rounds: int = 3) -> Path:
    p = folder / "guard.toml"
    p.write_text(CONFIG.format(rounds=rounds))
    return p


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run of 3 rounds interrupted in round 2 (SIGINT inside a client's training): checkpoint of round 1,
    one client-state file per client (compress's residual)."""
    base = tmp_path_factory.mktemp("guard")
    cfg_file = write_config(base)
    original = client_module.local_train

    def trap(*args, **kw):
        if kw["round"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        return original(*args, **kw)

    client_module.local_train = trap
    try:
        with pytest.raises(RunInterrupted):
            run_experiment(load_config(cfg_file), out=base / "run", progress=False)
    finally:
        client_module.local_train = original
    assert read_checkpoint(base / "run" / CHECKPOINT).round == 1
    return base / "run"


def copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def refused(out: Path, capsys, *argv: str) -> str:
    """Resuming ``out`` is refused with exit 2 and one line; nothing in the folder changed."""
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedsim: error: ") and "Traceback" not in err, err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    return err


def test_missing_or_damaged_client_state_is_refused(interrupted, tmp_path, capsys):
    out = copy(interrupted, tmp_path)
    files = sorted((out / "client-state").glob("*.bin"))
    assert [f.name for f in files] == ["p0-r1.bin", "p1-r1.bin", "p2-r1.bin"]
    recorded = read_checkpoint(out / CHECKPOINT).client_state
    assert sorted(recorded) == [f.name for f in files]
    assert recorded == {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}

    data = files[1].read_bytes()
    files[1].write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit
    err = refused(out, capsys)
    assert f"client state {files[1]} is damaged" in err and "--resume-without-client-state" in err
    files[1].write_bytes(data)

    files[2].unlink()
    err = refused(out, capsys)
    assert f"client state {files[2]} (recorded in the checkpoint of round 1) is missing" in err

    shutil.rmtree(out / "client-state")
    assert f"client state {out / 'client-state' / 'p0-r1.bin'}" in refused(out, capsys)


def test_the_clients_write_the_digests_and_refuse_a_damaged_state(tmp_path):
    """The digest beside each state file is the SHA-256 of the bytes the client wrote (what the checkpoint
    records, read without opening the state file); a state file without its digest is incomplete (not
    listed); a client restoring a state whose bytes do not match its digest refuses it, naming the file."""
    from flwr.app import ConfigRecord, RecordDict

    from fedsim.checkpoint import client_state_digests, restore_client_state, save_client_state

    folder = tmp_path / "client-state"
    folder.mkdir()
    for p in (0, 1):
        assert save_client_state(RecordDict({"k": ConfigRecord({"secret": f"client {p}"})}), folder, p, 2)
    (folder / "p1-r3.bin").write_bytes(b"a client killed before its digest was written")
    digests = client_state_digests(folder, upto=5)
    assert digests == {f"p{p}-r2.bin": hashlib.sha256((folder / f"p{p}-r2.bin").read_bytes()).hexdigest()
                       for p in (0, 1)}
    (folder / "p0-r2.bin.sha256").write_text("not a digest")
    assert client_state_digests(folder, upto=5)["p0-r2.bin"] == "invalid"
    restored = RecordDict()
    assert restore_client_state(restored, folder, 1, upto=5) and restored["k"]["secret"] == "client 1"
    data = (folder / "p1-r2.bin").read_bytes()
    (folder / "p1-r2.bin").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=r"client state .*p1-r2.bin is damaged"):
        restore_client_state(RecordDict(), folder, 1, upto=5)


def test_resume_without_client_state_is_explicit_and_recorded(interrupted, tmp_path, capsys):
    out = copy(interrupted, tmp_path)
    (out / "client-state" / "p2-r1.bin").unlink()
    orphans = [out / ".checkpoint.npz.0123456789ab.tmp", out / "client-state" / ".p0-r1.bin.ba9876543210.tmp"]
    for p in orphans:
        p.write_bytes(b"half a file")  # what a killed atomic write leaves
    assert main(["run", "--resume", str(out), "--resume-without-client-state", "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == [1]
    assert summary["resumed_without_client_state"] == [1]
    assert not any(p.exists() for p in orphans)
    assert main(["run", "--resume-without-client-state", str(write_config(tmp_path)), "--quiet"]) == 2


def test_a_checkpoint_that_does_not_match_its_run_is_refused(interrupted, tmp_path, capsys):
    out = copy(interrupted, tmp_path)
    path = out / CHECKPOINT
    original = path.read_bytes()
    ckpt = read_checkpoint(path)

    ckpt.round = 0  # edited to an earlier round
    write_checkpoint(path, ckpt)
    assert "says round 0, but the rows of" in refused(out, capsys)

    first_row = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)[0]
    ckpt.metrics_bytes, ckpt.metrics_digest = len(first_row), hashlib.sha256(first_row).hexdigest()
    write_checkpoint(path, ckpt)  # edited so that its rows fit round 0: its client state does not
    assert "of round 0 records client state 'p0-r1.bin', not a state of round <= 0" in refused(out, capsys)

    path.write_bytes(original)
    rows = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(rows.replace('"round": 1', '"round": 1, "edited": 1'))
    assert "does not begin with the rows 0..1" in refused(out, capsys)
    (out / "metrics.jsonl").write_text(rows)

    ckpt = read_checkpoint(path)
    ckpt.arrays[0] = np.full_like(ckpt.arrays[0], np.nan)
    write_checkpoint(path, ckpt)
    assert "holds a non-finite global model" in refused(out, capsys)


def test_a_dataset_with_nan_images_is_refused(tmp_path):
    plugin = tmp_path / "nan_data.py"
    plugin.write_text(
        "import numpy as np\n"
        "def load():\n"
        "    rng = np.random.default_rng(0)\n"
        "    x = rng.random((300, 1, 28, 28)).astype('float32'); x[7, 0, 3, 3] = np.nan\n"
        "    return {'x_train': x, 'y_train': rng.integers(0, 10, 300), 'x_test': x[:50].copy() * 0,\n"
        "            'y_test': rng.integers(0, 10, 50)}\n")
    with pytest.raises(ConfigError, match=r"data.dataset '.*nan_data.py:load': x_train holds 1 non-finite values"):
        load_config(None, [f'data.dataset="{plugin}:load"', "federation.num_clients=2", "data.root_size=10",
                           "train.local_steps=1"])


def test_a_failed_first_checkpoint_write_is_one_line(tmp_path, capsys):
    """The file-size limit (RLIMIT_FSIZE) makes writing the first checkpoint fail as a full disk would:
    exit 1, one line naming the file, no traceback, no folder left (no round completed)."""
    cfg_file = write_config(tmp_path, rounds=2)
    out = tmp_path / "run"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    capsys.readouterr()
    resource.setrlimit(resource.RLIMIT_FSIZE, (32_000, hard))  # config, rows: small; the checkpoint: ~60 kB
    try:
        code = main(["run", str(cfg_file), "--out", str(out), "--quiet"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines() == [f"fedsim: the run failed: cannot write {out / CHECKPOINT}: File too large; "
                                        "nothing was kept"]
    assert not out.exists()


def test_gnu_timeout_signalling_the_process_group_stops_the_run_once(tmp_path):
    """``timeout -s INT`` signals fedsim, then fedsim's whole process group: one stop, not an abort. The
    expiry is triggered with SIGALRM (what timeout's own timer raises) once a round has completed, so the
    test does not depend on how fast the machine is."""
    if shutil.which("timeout") is None:
        pytest.skip("GNU timeout is not installed")
    cfg_file = write_config(tmp_path, rounds=200)
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), OMP_NUM_THREADS="1")
    cmd = ["timeout", "--preserve-status", "-s", "INT", "600", sys.executable, "-m", "fedsim", "run",
           str(cfg_file), "--out", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGALRM)  # timeout's timer: it sends SIGINT to fedsim, then to the group
        _, err = proc.communicate(timeout=600)  # a hang guard, not a speed limit (a loaded machine)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "aborting without a summary" not in err and "interrupted by SIGINT" in err and "Traceback" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["resumable"] is True
    done = summary["completed_round"]
    assert read_jsonl(out / "metrics.jsonl")[-1]["round"] == done >= 1
    decision = decide(out, load_config(out / "config.toml"))  # what `fedsim run --resume` would do
    assert decision.action == "resume" and decision.checkpoint.round == done


def test_a_repeat_within_the_window_is_one_stop_and_a_later_one_aborts(monkeypatch, capsys):
    """The handler itself (the subprocess test above shows the process-group case end to end): a second
    SIGINT 0.2 s after the first changes nothing; one 1.5 s after it aborts at once."""
    import fedsim.interrupt as interrupt
    from fedsim.interrupt import StopSignal

    now = [100.0]
    exits = []
    monkeypatch.setattr(interrupt.os, "_exit", lambda code: exits.append(code))
    stop = StopSignal()  # the server runs in another thread: the handler only records the stop
    stop.clock = lambda: now[0]
    stop._handle(signal.SIGINT, None)
    now[0] += 0.2
    stop._handle(signal.SIGINT, None)
    assert stop.requested and exits == []
    now[0] += 1.3
    stop._handle(signal.SIGINT, None)
    assert exits == [130] and "SIGINT again: aborting without a summary" in capsys.readouterr().err
