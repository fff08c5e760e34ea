"""Beyond one process: Flower's deployment engine (SuperLink and SuperNodes as separate processes on
loopback over TLS with SuperNode authentication, fedsim's ServerApp and ClientApp unchanged), an
unregistered SuperNode refused, a SuperNode killed mid-run, lost replies, and ``simulation.ray_address``
against a Ray head started by the test (docs/deployment.md).

Every process a test starts is found again by a marker in its command line (the test's temporary
folder) and stopped in a ``finally``; nothing else on the machine is touched.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsim.app.runner import run_experiment
from fedsim.reports import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


# Flower 1.42 hard-codes a SuperNode's heartbeat interval at 30 s (flwr.common.constant), and the SuperLink
# declares a node dead 2 intervals after its last heartbeat: a killed node would hold its round for up to a
# minute. The test's SuperNodes are Flower's own entry point with the interval at the SuperLink's accepted
# minimum (10 s: heartbeats every ~4 s, dead after 20 s); nothing else of Flower or fedsim is changed.
_SUPERNODE = (
    "import sys\n"
    "import flwr.common.constant as c, flwr.supercore.heartbeat as h, flwr.supernode.fleet_http_connection as f\n"
    "for m in (c, h, f):\n"
    "    m.HEARTBEAT_DEFAULT_INTERVAL = c.HEARTBEAT_MIN_INTERVAL\n"
    "from flwr.supernode.cli import flower_supernode\n"
    "sys.exit(flower_supernode())\n"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            pids.append(int(proc.name))
    return pids


def _stop(marker: str, sig: int = signal.SIGTERM, wait: float = 20.0) -> None:
    for pid in _pids(marker):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.time() + wait
    while _pids(marker) and time.time() < deadline:
        time.sleep(0.2)
    for pid in _pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 10
    while _pids(marker) and time.time() < deadline:
        time.sleep(0.2)


def _wait_for(pred, timeout: float, what) -> None:
    """Wait until ``pred()``; ``what`` (a string, or a function giving one when the wait fails) says for what."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")


def _credentials(tmp_path: Path, nodes: list[str]) -> dict[str, Path]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("deploy_credentials", ROOT / "scripts" / "deploy_credentials.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_credentials(tmp_path / "credentials", ("127.0.0.1",), nodes, days=1)


def _speaks_tls_only(port: int, ca: Path) -> None:
    """The port answers a TLS handshake with a certificate for 127.0.0.1 chained to our CA; a client that
    does not trust that CA, and a plaintext HTTP request, get nothing."""
    import http.client
    import ssl

    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=60) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
            assert ("IP Address", "127.0.0.1") in tls.getpeercert()["subjectAltName"]
    with pytest.raises(ssl.SSLCertVerificationError):
        with socket.create_connection(("127.0.0.1", port), timeout=60) as raw:
            ssl.create_default_context().wrap_socket(raw, server_hostname="127.0.0.1")
    plain = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            plain.request("GET", "/")
            plain.getresponse().read()
    finally:
        plain.close()


@pytest.mark.ray
def test_secure_deployment_refuses_an_unregistered_node_and_survives_a_killed_one(tmp_path):
    """Flower's deployment engine as docs/deployment.md sets it up: a SuperLink over TLS (certificates made
    by scripts/deploy_credentials.py with `cryptography`) with SuperNode authentication
    (`--enable-supernode-auth`; the public keys of two SuperNodes registered with `flwr supernode
    register`), on loopback. The port speaks TLS only; a third SuperNode whose key was never registered is
    refused (it exits with Flower's connection error code 305, and the SuperLink logs the failed activation);
    `flwr run` submits fedsim over TLS: round 1 has the 2 registered nodes' replies, then one of them is
    killed, and the run still completes its 2 rounds with that node's failure recorded.

    Two nodes, not three: a SuperNode starts a `flwr-clientapp` process (torch and fedsim imported anew)
    for every message, so each node costs ~5-9 s of CPU per exchange; a second live node adds nothing
    that the killed one and the survivor do not already show."""
    for tool in ("flwr", "flower-superlink"):  # the SuperNodes: flwr.supernode.cli, run by _SUPERNODE
        if not (BIN / tool).exists():
            pytest.fail(f"{tool} is not installed next to this Python")
    home, out, logs = tmp_path / "flwr-home", tmp_path / "run", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    names = ["node0", "node1", "intruder"]
    creds = _credentials(tmp_path, names)
    port = _free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\n'
                                      f'address = "127.0.0.1:{port}"\nroot-certificates = "{creds["ca"]}"\n')
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    marker = str(tmp_path)  # every process of this test carries it (log files, FLWR_HOME, key paths)
    procs = []

    def supernode(name: str, i: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", _SUPERNODE, "--root-certificates", str(creds["ca"]),
             "--auth-supernode-private-key", str(creds[f"{name}.key"]), "--superlink", f"127.0.0.1:{port}",
             "--host", "127.0.0.1", "--port", str(_free_port()),
             "--node-config", f"partition-id={i} num-partitions=2 marker='{marker}'"],
            env=env, stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT)

    try:
        procs.append(subprocess.Popen(
            [str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(creds["ca"]),
             "--ssl-certfile", str(creds["server_cert"]), "--ssl-keyfile", str(creds["server_key"]),
             "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(port),
             "--disable-runtime-dependency-installation", "--database", str(tmp_path / "state.db")],
            env=env, stdout=open(logs / "superlink.log", "w"), stderr=subprocess.STDOUT))
        # waits, not limits: generous, so that a loaded machine does not fail them
        _wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 300, "the SuperLink's port")
        _speaks_tls_only(port, creds["ca"])
        register = [subprocess.Popen([str(BIN / "flwr"), "supernode", "register", str(creds[f"{n}.pub"]), "deploy"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    for n in names[:2]]
        for r in register:
            said = r.communicate(timeout=300)[0]
            assert r.returncode == 0 and "registered successfully" in said, said
        intruder = supernode("intruder", 0)
        nodes = [supernode(n, i) for i, n in enumerate(names[:2])]
        procs += [intruder, *nodes]
        # the intruder is refused while the run goes on: its refusal is checked after the run, which does
        # not wait for it
        overrides = ("federation.rounds=2;federation.num_clients=2;output.observers=[];"
                     "federation.round_timeout=300;train.local_epochs=1")
        run = subprocess.Popen([str(BIN / "flwr"), "run", ".", "deploy", "--run-config",
                                f'overrides="{overrides}" out="{out}"', "--stream"],
                               cwd=ROOT, env=env, stdout=open(logs / "run.log", "w"), stderr=subprocess.STDOUT)
        procs.append(run)

        def round_done(r: int) -> bool:
            p = out / "metrics.jsonl"
            return p.exists() and any(row["round"] == r for row in read_jsonl(p, skip_bad=True))

        _wait_for(lambda: round_done(1), 900, lambda: "round 1 (log: " + (logs / "run.log").read_text()[-1500:] + ")")
        nodes[1].send_signal(signal.SIGKILL)  # the node serving partition 1 dies mid-run
        _wait_for(lambda: (out / "summary.json").exists(), 900, "the end of the run")
        assert run.wait(timeout=300) == 0, (logs / "run.log").read_text()[-3000:]
        said = (logs / "intruder.log").read_text() if intruder.wait(timeout=300) is not None else ""
        assert intruder.returncode != 0 and "Exit Code: 305" in said and "Failed to activate SuperNode" in said, said
        assert "No SuperNode found with the given public key" in (logs / "superlink.log").read_text()
        rows = read_jsonl(out / "metrics.jsonl")
        assert [r["round"] for r in rows] == [0, 1, 2]
        assert [r["replies"] for r in rows[1:]] == [2, 1]  # the dead node's share is missing, not fatal
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["clients"] == 2
        assert summary["client_failures"] == 1  # round 2
        fails = summary["failures"]
        assert [(f["round"], f["client"]) for f in fails] == [(2, 1)]
        # which of the two notices the dead node first is a race: Flower's SuperLink (its heartbeat
        # expires 2 x 10 s after the last one, and its error reply names the node unavailable) or
        # fedsim's round timeout; either way the failure is the dead node's and the round goes on
        assert all("unavailable" in f["reason"].lower() or "round_timeout" in f["reason"] for f in fails), fails
        assert 0.1 < summary["final_accuracy"] <= 1.0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        _stop(marker)  # the SuperExec / app processes the SuperLink and SuperNodes started
    assert not _pids(marker)


def test_missing_replies_are_recorded_and_the_round_goes_on(small_cfg, tmp_path):
    """A grid that loses one client's reply (a node that vanished without an error reply): the round
    aggregates the others and records the lost client as failed, naming the round timeout."""
    from fedsim.app.client import client_app
    from fedsim.app.server import run_server
    from fedsim.inprocess import InProcessGrid

    class LossyGrid(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            replies = list(super().send_and_receive(messages, timeout=timeout))
            self.timeouts.append(timeout)
            lose = len(self.timeouts) > 1  # after discovery (the first exchange)
            return [r for r in replies if not (lose and r.metadata.src_node_id == self.lost_node)]

    cfg = small_cfg("federation.num_clients=3", "federation.rounds=2", "federation.round_timeout=7.5")
    grid = LossyGrid(client_app, 3)
    grid.timeouts = []
    grid.lost_node = sorted(grid.get_node_ids())[1]
    (tmp_path / "run").mkdir()
    summary = run_server(grid, cfg, tmp_path / "run", progress=False)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["replies"] for r in rows[1:]] == [2, 2]
    assert summary["status"] == "completed"
    fails = summary["failures"]
    assert len(fails) == 2 and all("round_timeout = 7.5 s" in f["reason"] for f in fails)
    assert len({f["client"] for f in fails}) == 1 and fails[0]["client"] is not None
    assert set(grid.timeouts) == {7.5}  # the configured timeout reaches the grid


def test_ray_address_reaches_rays_init_and_is_named_in_the_progress_line(small_cfg):
    """The part of `simulation.ray_address` that CI checks (the join itself, below, is `slow`: it starts a
    Ray head and a `fedsim run` subprocess, 60-120 s): the address becomes ray.init's `address`, and
    without it fedsim starts its own runtime."""
    from fedsim.app.ray_runtime import backend_config, starting_line

    own_cfg = small_cfg('simulation.backend="ray"')
    own = backend_config(own_cfg, gpu_available=False)["init_args"]
    assert "address" not in own and "joining" not in starting_line(own_cfg, 4)
    cfg = small_cfg('simulation.backend="ray"', "simulation.ray_address='127.0.0.1:6379'")
    assert backend_config(cfg, gpu_available=False)["init_args"]["address"] == "127.0.0.1:6379"
    assert starting_line(cfg, 4).startswith("joining the Ray cluster at 127.0.0.1:6379 for 4 client nodes")


@pytest.mark.ray
@pytest.mark.slow  # 60-120 s on 2 cores; make test-slow / test-all
def test_ray_address_joins_a_head_started_by_the_test(tmp_path):
    """`simulation.ray_address`: fedsim joins an existing Ray cluster (a head on loopback started here)
    instead of starting its own, and the run gives the same numbers as the in-process backend.

    The joining run is a `fedsim run` subprocess: a process holds one Ray connection, so joining from the
    test's own process would stop the Ray runtime its other Ray tests share (tests/conftest.py), and the
    next of them would pay Ray's start-up (~20 s here) again."""
    from conftest import child_pythonpath, make_small_cfg

    ray = BIN / "ray"
    if not ray.exists():
        pytest.fail("ray is not installed next to this Python")
    port = _free_port()
    ray_tmp = Path("/tmp") / f"fs-ray-{os.getpid()}-{port}"  # Ray's socket paths must stay short
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    try:
        # `ray start` gives up after Ray's own 30 s wait for its raylet, which a loaded machine can exceed:
        # up to three tries, each after stopping what the last one left (a hang guard, not a time limit)
        for _ in range(3):
            started = subprocess.run([str(ray), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                                      "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={ray_tmp}",
                                      "--disable-usage-stats"], env=env, capture_output=True, text=True,
                                     timeout=600)
            if started.returncode == 0:
                break
            _stop(str(ray_tmp), signal.SIGTERM, 30)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        sets = ("federation.num_clients=3", "federation.rounds=2", "output.observers=[]")
        ref = make_small_cfg(*sets, "simulation.backend='inprocess'", output__dir=str(tmp_path))
        ref_dir = run_experiment(ref, out=tmp_path / "inprocess", progress=False)
        run_dir = tmp_path / "ray"  # the same config (as the reference run wrote it), on the cluster
        joined = subprocess.run([sys.executable, "-m", "fedsim", "run", str(ref_dir / "config.toml"), "--out",
                                 str(run_dir), "--quiet", "--set", "simulation.backend='ray'",
                                 "--set", f"simulation.ray_address='127.0.0.1:{port}'"],
                                env=dict(env, PYTHONPATH=child_pythonpath()), cwd=tmp_path, capture_output=True,
                                text=True, timeout=900)  # a hang guard, not a time limit
        assert joined.returncode == 0, joined.stdout[-2000:] + joined.stderr[-3000:]
        got, want = (json.loads((d / "summary.json").read_text()) for d in (run_dir, ref_dir))
        assert got["status"] == "completed" and got["client_failures"] == 0
        assert got["final_accuracy"] == want["final_accuracy"] and got["final_loss"] == pytest.approx(want["final_loss"])
        # it ran on that cluster: the head's session folder holds the run's worker logs
        assert any((ray_tmp / "session_latest" / "logs").glob("worker-*"))
    finally:
        _stop(str(ray_tmp), signal.SIGTERM, 30)  # not `ray stop`: that would stop every Ray on the machine
    assert not _pids(str(ray_tmp))


def test_ray_address_needs_the_ray_backend():
    from conftest import make_small_cfg

    from fedsim.config import ConfigError

    with pytest.raises(ConfigError, match="simulation.ray_address .* simulation.backend = 'inprocess'"):
        make_small_cfg("simulation.ray_address='127.0.0.1:6379'")
