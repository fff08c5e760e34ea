"""``flwr run .`` (fedsim/app/flower.py): Flower's own tooling starts fedsim's ServerApp and ClientApp.

The test starts a local SuperLink in a throwaway ``FLWR_HOME`` (flwr run starts it detached), runs 2
rounds with ``;``-separated overrides and an explicit run folder, checks what the run wrote, and then
stops only the SuperLink it started (found by its ``--log-file`` under this ``FLWR_HOME``).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _superlinks(flwr_home: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "flower-superlink" in cmd and str(flwr_home) in cmd:
            pids.append(int(proc.name))
    return pids


def test_flwr_run_config_path_resolution(tmp_path):
    """The ServerApp's ``config`` run-config key: absolute as is, relative under the project root first,
    then under the app bundle (FAB); a relative path in neither fails naming both places."""
    from fedsim.app.flower import resolve_config_path
    from fedsim.config import ConfigError

    root, fab = tmp_path / "project", tmp_path / "fab"
    for base, names in ((root, ["both.toml", "sub/root-only.toml"]), (fab, ["both.toml", "sub/fab-only.toml"])):
        for name in names:
            (base / name).parent.mkdir(parents=True, exist_ok=True)
            (base / name).write_text("")
    elsewhere = tmp_path / "elsewhere.toml"
    assert resolve_config_path(str(elsewhere), root, fab) == elsewhere  # absolute: as is (even if missing)
    assert resolve_config_path("sub/root-only.toml", root, fab) == root / "sub/root-only.toml"
    assert resolve_config_path("both.toml", root, fab) == root / "both.toml"  # the root wins
    assert resolve_config_path("sub/fab-only.toml", root, fab) == fab / "sub/fab-only.toml"
    assert resolve_config_path("sub/root-only.toml", root, None) == root / "sub/root-only.toml"
    with pytest.raises(ConfigError, match=rf"'config' = 'sub/nope.toml': no such file under '{root}' or '{fab}'"):
        resolve_config_path("sub/nope.toml", root, fab)
    with pytest.raises(ConfigError, match=rf"'sub/fab-only.toml': no such file under '{root}' \(the project root\)"):
        resolve_config_path("sub/fab-only.toml", root, None)  # not run from a FAB: only the root


@pytest.mark.ray
@pytest.mark.slow  # 55-85 s on 2 cores; `flwr run` itself stays in CI through the deployment test (test_deployment.py)
def test_flwr_run_runs_fedsim_apps_and_the_superlink_is_stopped(tmp_path):
    flwr = Path(sys.executable).with_name("flwr")
    if not flwr.exists() or shutil.which("flower-superlink", path=str(flwr.parent)) is None:
        pytest.fail("flwr / flower-superlink are not installed next to this Python")
    home, out = tmp_path / "flwr-home", tmp_path / "run"
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               PATH=f"{flwr.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = [str(flwr), "run", ".", "--run-config",
           f'overrides="federation.rounds=2;federation.num_clients=2;output.observers=[]" out="{out}"',
           "--federation-config", "num-supernodes=2 client-resources-num-cpus=1", "--stream"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [0, 1, 2] and all(r["replies"] == 2 for r in rows[1:])
        summary = json.loads((out / "summary.json").read_text())
        assert summary["clients"] == 2 and summary["client_failures"] == 0
        assert (out / "model.pt").is_file() and (out / "report.md").is_file()
        cfg = tomllib.loads((out / "config.toml").read_text())  # the ;-separated overrides all applied
        assert (cfg["federation"]["rounds"], cfg["federation"]["num_clients"], cfg["output"]["observers"]) == \
            (2, 2, [])
        assert _superlinks(home), "the SuperLink flwr run started is running (detached)"
    finally:
        for pid in _superlinks(home):
            os.kill(pid, signal.SIGTERM)
        deadline = time.time() + 120
        while _superlinks(home) and time.time() < deadline:
            time.sleep(0.2)
    assert not _superlinks(home)
