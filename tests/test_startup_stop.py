"""A stop that arrives while a run starts (issue 29's flaky Ray SIGTERM): before any round is recorded.

On a loaded machine Ray's start-up alone took 1 min 30 s; a SIGTERM in that window (or during
discovery, the channel's setup, round 0's evaluation) must still be one clean stop: exit 143, one line
that says no round completed and how to go on, a summary that agrees with the folder, and a folder
that ``fedsim run --resume`` starts again. These tests put the signal at each start-up point on
purpose instead of hoping a timed test hits it.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading

import pytest
import torch

import fedsim.app.runner as runner
from fedsim.app.cli import main
from fedsim.app.runner import run_experiment
from fedsim.app.server import Server
from fedsim.checkpoint import CHECKPOINT
from fedsim.config import dump_toml
from fedsim.interrupt import RunInterrupted, StopSignal, handle_signals
from fedsim.reports import read_jsonl
from fedsim.rounds import RoundEngine

QUICK = ("train.local_steps=1",)


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def _untimed(rows):
    timing = {"seconds", "observer_seconds", "startup_seconds", "train_seconds"}
    return [{k: v for k, v in r.items() if k not in timing} for r in rows]


@pytest.mark.parametrize("when", ["SIGTERM during discovery", "stop requested before the server loop starts"])
def test_a_stop_during_start_up_says_so_and_resume_starts_the_run_again(when, small_cfg, tmp_path, monkeypatch,
                                                                       capsys):
    """``SIGTERM during discovery``: the in-process backend, where the handler raises in the server loop
    at once. ``stop requested before``: what Ray's start-up gives - the signal arrives while the main
    thread starts Ray, the server loop (in Flower's ServerApp thread) finds the stop at its first safe
    point. Either way: exit 143, the line says no round completed and how to go on, the summary says
    ``completed_round`` null and not resumable, nothing of a round is in the folder, and
    ``fedsim run --resume`` runs the whole run from the start."""
    cfg_file = tmp_path / "cfg.toml"
    cfg_file.write_text(dump_toml(small_cfg(*QUICK, "federation.rounds=1")))
    out = tmp_path / "run"
    if when.startswith("SIGTERM"):
        discover = RoundEngine.discover

        def signalled(self, grid, *args, **kw):
            os.kill(os.getpid(), signal.SIGTERM)
            return discover(self, grid, *args, **kw)

        monkeypatch.setattr(RoundEngine, "discover", signalled)
    else:
        stop = StopSignal()
        stop.request("SIGTERM")
        monkeypatch.setattr(runner, "StopSignal", lambda: stop)
    assert main(["run", str(cfg_file), "--out", str(out), "--quiet"]) == 143
    err = capsys.readouterr().err
    assert (f"fedsim: interrupted by SIGTERM before any round completed; summary in {out}/summary.json; "
            f"continue with: fedsim run --resume {out}") in err, err
    summary = _summary(out)
    assert summary["status"] == "interrupted" and summary["stopped_by"] == "SIGTERM"
    assert summary["completed_round"] is None and summary["resumable"] is False and summary["final_accuracy"] is None
    assert not any((out / f).exists() for f in ("metrics.jsonl", CHECKPOINT, "model.pt", ".fedsim.lock"))
    assert f"before any round completed; start it again with `fedsim run --resume {out}`" in (out / "report.md").read_text()
    if not when.startswith("SIGTERM"):
        return
    monkeypatch.undo()
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert "holds this run with no completed round: starting it again" in capsys.readouterr().err
    assert [r["round"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1]
    assert _summary(out)["status"] == "completed" and _summary(out)["resumed_from"] == []


def test_a_resumed_run_stopped_before_it_restored_its_checkpoint_keeps_its_folder(small_cfg, tmp_path, monkeypatch):
    """A resumed run restores its checkpoint after discovery; a stop before that must leave the folder
    describing the checkpoint's round (it used to rewrite the summary as 'no round completed, not
    resumable' and report.md without rows), say 'after round 1' with the resume hint, and the run then
    resumes exactly."""
    cfg = small_cfg(*QUICK)  # 2 rounds
    out = tmp_path / "run"
    round_end = Server.round_end

    def stop_after_round_1(self, grid, state, record, t0):
        row = round_end(self, grid, state, record, t0)
        if record.round == 1:
            self.stop.request("SIGINT")
        return row

    monkeypatch.setattr(Server, "round_end", stop_after_round_1)
    with pytest.raises(RunInterrupted, match="after round 1"):
        run_experiment(cfg, out=out, progress=False)
    monkeypatch.undo()
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "summary.json"}
    before = _summary(out)
    assert before["completed_round"] == 1 and before["resumable"] is True and before["stopped_by"] == "SIGINT"

    stop = StopSignal()
    stop.request("SIGTERM")  # e.g. while Ray starts for the resumed run
    with pytest.raises(RunInterrupted) as caught:
        run_experiment(cfg, out=out, progress=False, resume=True, stop=stop)
    assert str(caught.value) == "interrupted by SIGTERM after round 1"
    assert caught.value.resume_hint == f"fedsim run --resume {out}"
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "summary.json"} == files
    assert _summary(out) == {**before, "stopped_by": "SIGTERM"}

    run_experiment(cfg, out=out, progress=False, resume=True)
    ref = run_experiment(cfg, out=tmp_path / "reference", progress=False)
    assert _untimed(read_jsonl(out / "metrics.jsonl")) == _untimed(read_jsonl(ref / "metrics.jsonl"))
    got, expected = torch.load(out / "model.pt"), torch.load(ref / "model.pt")
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert _summary(out)["resumed_from"] == [1]


def test_ray_start_up_leaves_the_runs_sigterm_handler_in_place():
    """``ray.init`` installs its own SIGTERM handler in the driver (``sys.exit(15)``) before it starts
    Ray: a SIGTERM in those seconds ended a run with exit code 15 and no line. The runner keeps its own.
    Ray's real ``init`` is called with an unknown keyword, so it installs its handler and stops right
    after (no cluster starts); without the runner's guard the handler is Ray's (the premise holds)."""
    ray = pytest.importorskip("ray")
    probe = {"address": "local", "logging_level": logging.ERROR, "_fedsim_probe": True}
    stop = StopSignal()
    with handle_signals(stop):
        with pytest.raises(RuntimeError, match="Unknown keyword"):
            ray.init(**probe)
        assert signal.getsignal(signal.SIGTERM) != stop._handle  # Ray's own
        stop.install()
        with runner.ray_keeps_signal_handlers():
            with pytest.raises(RuntimeError, match="Unknown keyword"):
                ray.init(**probe)
        assert signal.getsignal(signal.SIGTERM) == stop._handle


def test_when_the_engine_dies_the_runner_waits_for_the_server_loop_to_write_the_summary(small_cfg, tmp_path,
                                                                                       monkeypatch):
    """Flower's engine (here a stand-in for ``run_simulation``) dies while the ServerApp thread waits for
    the clients to register: the runner must not read, keep or unlock the folder until that thread has
    stopped and written its summary (it used to return at once, the summary written later behind its
    back - or into a folder already removed)."""
    import flwr.simulation

    from fedsim.inprocess import InProcessGrid

    cfg = small_cfg('simulation.backend="ray"', "simulation.discovery_timeout=600")
    out = tmp_path / "run"
    out.mkdir()  # the user's folder: kept when nothing completed, so its summary can be read
    waiting = threading.Event()
    discover = RoundEngine.discover

    def discover_and_say(self, grid, *args, **kw):
        waiting.set()
        return discover(self, grid, *args, **kw)

    threads = []

    def dying_engine(server_app, client_app, num_supernodes, backend_config):
        t = threading.Thread(target=server_app, args=(InProcessGrid(client_app, 0), None))  # no node ever registers
        threads.append(t)
        t.start()
        assert waiting.wait(600)
        raise RuntimeError("the simulation engine crashed")

    monkeypatch.setattr(RoundEngine, "discover", discover_and_say)
    monkeypatch.setattr(flwr.simulation, "run_simulation", dying_engine)
    flwr_logs = logging.getLogger("flwr").level  # the stopped server loop quiets them (its actors are killed)
    try:
        with pytest.raises(RuntimeError, match="the simulation engine crashed"):
            run_experiment(cfg, out=out, progress=False)
    finally:
        logging.getLogger("flwr").setLevel(flwr_logs)
    summary = _summary(out)  # written before run_experiment returned
    assert summary["status"] == "failed" and summary["stopped_by"] == "engine-stopped"
    assert not (out / ".fedsim.lock").exists()
    threads[0].join(60)
    assert not threads[0].is_alive()
