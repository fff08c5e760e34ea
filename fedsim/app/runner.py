"""Run an experiment: validate, prepare the run folder, start the federation, collect results.

``backend = "ray"`` runs Flower's simulation engine (``flwr.simulation.run_simulation``) with one
Ray actor per concurrently-running client; the ServerApp runs in a thread of this process, so the
observers (and the curious server) run here. ``backend = "inprocess"`` uses
:class:`fedsim.inprocess.InProcessGrid` (same ServerApp logic and ClientApp, no Ray).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from fedsim import progress
from fedsim.app import build_components
from fedsim.config import dump_toml
from fedsim.factories import dataset_for, model_for
from fedsim.observers import Observer
from fedsim.protocol import num_nodes
from fedsim.reports import atomic_write_text, new_run_dir
from fedsim.training import torch_threads

log = logging.getLogger("fedsim")


def node_count(cfg: dict[str, Any]) -> int:
    """Simulated nodes: every client, or one per ``simulation.clients_per_node`` virtual clients."""
    return num_nodes(cfg["federation"]["num_clients"], cfg["simulation"].get("clients_per_node", 1))


def build_observers(cfg: dict[str, Any]) -> list[Observer]:
    """The observers the config asks for (``output.observers``, plus the curious server for ``[attack]``)."""
    return build_components(cfg)["observers"]


def quiet_logs() -> None:
    """Flower's and Ray's own logs off (at ERROR), unless ``--verbose`` (``fedsim.progress.VERBOSE``)."""
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    level = logging.INFO if progress.verbose() else logging.ERROR
    logging.getLogger("flwr").setLevel(level)  # Flower logs every round at INFO and deprecations
    logging.getLogger("ray").setLevel(level)


def _backend_config(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    sim = cfg["simulation"]
    gpus = float(sim["num_gpus"])
    if gpus == 0 and cfg["device"] != "cpu" and torch.cuda.is_available():
        gpus = 0.25  # device=auto with a GPU present: share it between client actors
    loud = progress.verbose()
    init: dict[str, Any] = {"logging_level": "INFO" if loud else "ERROR", "log_to_driver": loud,
                            "include_dashboard": False}
    if sim.get("ray_address"):
        init["address"] = sim["ray_address"]
    return {"client_resources": {"num_cpus": int(sim["num_cpus"]), "num_gpus": gpus}, "init_args": init}


def run_experiment(cfg: dict[str, Any], out: str | Path | None = None, observers: Sequence[Observer] | None = None,
                   progress: bool = True) -> Path:
    """Run a validated config; returns the run folder (written only once the inputs are checked).
    ``progress=False`` silences this run's progress lines (``fedsim.progress``)."""
    show = progress
    dataset_for(cfg)  # raises DatasetUnavailable (with instructions) before any folder is made
    model_for(cfg)  # architecture/data mismatches surface here too
    observers = build_observers(cfg) if observers is None else list(observers)
    run_dir = Path(out) if out is not None else new_run_dir(cfg["output"]["dir"], cfg["name"])
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.toml", dump_toml(cfg))
    quiet_logs()
    try:
        with torch_threads(int(cfg["simulation"].get("threads", 1))):
            if cfg["simulation"]["backend"] == "inprocess":
                _run_inprocess(cfg, run_dir, observers, show)
            else:
                _run_ray(cfg, run_dir, observers, show)
    except BaseException:
        if not (run_dir / "summary.json").exists() and out is None:
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing half-way
        raise
    return run_dir


def _run_inprocess(cfg, run_dir, observers, show) -> None:
    from fedsim.app.client import client_app
    from fedsim.app.server import run_server
    from fedsim.inprocess import InProcessGrid

    run_server(InProcessGrid(client_app, node_count(cfg)), cfg, run_dir, observers, show)


def _run_ray(cfg, run_dir, observers, show) -> None:
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedsim.app.client import client_app
    from fedsim.app.server import run_server

    errors: list[BaseException] = []
    server_app = ServerApp()

    @server_app.main()
    def _main(grid, context) -> None:
        if hasattr(grid, "pull_interval"):
            grid.pull_interval = 0.01  # Flower's default 0.1 s poll adds ~0.07 s to every round
        try:
            run_server(grid, cfg, run_dir, observers, show, started_at=launched)
        except BaseException as exc:  # re-raised in the caller: run_simulation would only log it
            errors.append(exc)
            raise

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the actors use the cores; a spinning 2-thread evaluation here stalls them
    launched = time.perf_counter()
    with progress.suppressed(not show):
        where = f"joining the Ray cluster at {cfg['simulation']['ray_address']}" if cfg["simulation"].get(
            "ray_address") else "starting Ray"
        progress.say(f"{where} for {node_count(cfg)} client nodes ({cfg['simulation']['num_cpus']} CPU each); "
                     "Ray and its actors take a few seconds to start")
    try:
        run_simulation(server_app=server_app, client_app=client_app,
                       num_supernodes=node_count(cfg), backend_config=_backend_config(cfg))
    finally:
        torch.set_num_threads(threads)
    if errors:
        raise errors[0]
    if not (run_dir / "summary.json").exists():
        raise RuntimeError("the Flower simulation ended without finishing the run (see the log above)")
