"""Shared fixtures and helpers for fedsim's tests.

* Every test session runs with Ray's temp dir (``RAY_TMPDIR``, honoured by Ray 2.55's
  ``get_default_system_temp_dir``) and ``FLWR_HOME`` inside a pytest temp folder, with Ray's
  accelerator-env override off and Flower/Ray logs quiet (:func:`_isolated_env`, autouse).
* Every test process has fedsim's plugins registered (:func:`_plugins_registered`, autouse).
* Every Ray simulation of a test process runs on one Ray runtime, started by the first and stopped at
  the end of the session (:func:`_one_ray_runtime`).
* The test process uses one torch thread (``FEDSIM_TEST_THREADS``, default 1): on a 2-core machine
  shared with other processes, two OpenMP threads made small LeNet steps 5-10x slower.
* :func:`make_small_cfg` / the ``small_cfg`` fixture build a *validated* config for fast in-process
  runs: 4 clients, 2 rounds, LeNet (ReLU) on fmnist-small, a few local steps, backend "inprocess",
  no default observers. Override with ``--set`` strings and/or ``section__key=value`` keywords::

      cfg = small_cfg("federation.rounds=3", data__partition="dirichlet", seed=1)

* :class:`RecordingObserver` (fixture ``recorder``) keeps every ``ClientUpdate`` it sees.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import pytest

from fedsim.app import load_config
from fedsim.observers import ClientUpdate, Observer


def child_pythonpath() -> str:
    """PYTHONPATH for a ``python -m fedsim`` child process: this checkout first, then whatever the
    environment already had (a venv-less machine may install the dependencies through PYTHONPATH)."""
    return os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))

SMALL_SETTINGS: dict[str, Any] = {
    "name": "test",
    "federation.num_clients": 4,
    "federation.rounds": 2,
    "data.dataset": "fmnist-small",
    "data.partition": "iid",
    "model.name": "lenet",
    "model.activation": "relu",
    "train.lr": 0.05,
    "train.batch_size": 16,
    "train.local_steps": 3,
    "simulation.backend": "inprocess",
    "output.observers": [],
}

_ENV = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_USAGE_STATS_ENABLED": "0"}


# ------------------------------------------------------------------------------------------- env
def quiet_logs() -> None:
    for name in ("flwr", "ray", "fedsim", "matplotlib"):
        logging.getLogger(name).setLevel(logging.ERROR)


def pytest_configure(config):
    """A shell's background job (``cmd &``, nohup) starts with SIGINT ignored, which its children inherit
    across exec. The tests send Ctrl-C to this process and to fedsim subprocesses as a user would at a
    terminal, so they run with Python's usual SIGINT handler (children then start with the default)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory):
    """Ray temp files and Flower's home under the session's pytest temp folder; quiet logs.

    The Ray folder is kept short, directly under the system's temp folder (pytest's own folders grow
    with pytest-xdist's worker names): Ray puts Unix sockets below it and socket paths are limited to
    107 bytes. It is removed at the end of the session.
    """
    ray_tmp = Path(tempfile.mkdtemp(prefix="fsray"))
    flwr_home = tmp_path_factory.mktemp("flwr-home")
    new = {"RAY_TMPDIR": str(ray_tmp), "FLWR_HOME": str(flwr_home), **_ENV}
    old = {k: os.environ.get(k) for k in new}
    os.environ.update(new)
    quiet_logs()
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("FEDSIM_TEST_THREADS", "1")))
    yield {"ray_tmp": ray_tmp, "flwr_home": flwr_home}
    torch.set_num_threads(threads)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session", autouse=True)
def _plugins_registered():
    """fedsim's plugins are registered in every test process, as every entry point (CLI, runner, ClientApp)
    registers them: a test that builds a component directly (a defense pipeline, an attack) does not depend
    on which test ran before it on its xdist worker (test_defense_leakage.py failed when run alone)."""
    from fedsim.app import load_plugins

    load_plugins()


@pytest.fixture(scope="session", autouse=True)
def _one_ray_runtime(_isolated_env):
    """The Ray simulations of this test process share one Ray runtime and, where their resources per
    client match, its warm client actors (:mod:`fedsim.app.ray_runtime`): Ray starts once per process
    instead of once per test, and stops before its temp folder is removed."""
    from fedsim.app.ray_runtime import shared

    with shared():
        yield


@pytest.fixture(autouse=True)
def _normal_progress_level():
    """Every test starts at the normal progress level: the CLI's ``--quiet``/``--verbose`` set a
    process-wide level, which would otherwise leak into whatever test the same process runs next."""
    from fedsim import progress

    progress.set_level(progress.NORMAL)
    yield


@pytest.fixture
def ray_tmp(_isolated_env) -> Path:
    """Ray's temp folder for this session (what ``RAY_TMPDIR`` points at)."""
    return _isolated_env["ray_tmp"]


# ---------------------------------------------------------------------------------------- config
def toml_value(v: Any) -> str:
    """A Python value as TOML text for ``--set`` (inline tables for dicts)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot express {v!r} in TOML")


def _file_keys(path: str | Path | None) -> set[str]:
    """Dotted keys a TOML config file sets (none if it is missing or invalid: load_config reports that)."""
    import tomllib

    try:
        data = tomllib.loads(Path(path).read_text()) if path is not None else {}
    except (OSError, tomllib.TOMLDecodeError):
        return set()

    def flat(d: Mapping[str, Any], prefix: str = "") -> set[str]:
        out: set[str] = set()
        for k, v in d.items():
            out |= flat(v, f"{prefix}{k}.") if isinstance(v, Mapping) else {f"{prefix}{k}"}
        return out

    return flat(data)


def small_sets(*sets: str, path: str | Path | None = None, **overrides: Any) -> list[str]:
    """The ``--set`` list of :func:`make_small_cfg`: the small settings the file at ``path`` and the
    caller do not set, then the caller's."""
    settings = dict(SMALL_SETTINGS)
    given = {s.split("=", 1)[0].strip() for s in sets if "=" in s}
    given |= {k.replace("__", ".") for k in overrides}
    given |= _file_keys(path)
    if "train.local_epochs" in given:  # the caller picked epochs: drop the default step count
        settings.pop("train.local_steps")
    out = [f"{k}={toml_value(v)}" for k, v in settings.items() if k not in given]
    out += list(sets)
    out += [f"{k.replace('__', '.')}={toml_value(v)}" for k, v in overrides.items()]
    return out


def make_small_cfg(*sets: str, path: str | Path | None = None, **overrides: Any) -> dict[str, Any]:
    """A validated config for a fast in-process run (through :func:`fedsim.config.load_config`).

    ``sets`` are ``--set`` strings (``"federation.rounds=3"``); keyword ``section__key=value`` does
    the same with Python values (``train__lr=0.1``, ``defenses=[{"name": "prune", "ratio": 0.5}]``).
    ``path`` is an optional TOML file applied before the overrides; the small settings fill in only
    the keys it leaves out.
    """
    return load_config(path, small_sets(*sets, path=path, **overrides))


@pytest.fixture
def small_cfg(tmp_path: Path):
    """``make_small_cfg`` with ``output.dir`` defaulting to ``<tmp_path>/runs``."""

    def make(*sets: str, **overrides: Any) -> dict[str, Any]:
        if "output__dir" not in overrides and not any(s.startswith("output.dir=") for s in sets):
            overrides["output__dir"] = str(tmp_path / "runs")
        return make_small_cfg(*sets, **overrides)

    return make


# ------------------------------------------------------------------------------------- observers
class RecordingObserver(Observer):
    """Keeps every ``ClientUpdate`` (and the per-round metric rows) it is shown."""

    def __init__(self) -> None:
        self.updates: list[ClientUpdate] = []
        self.rounds: list[dict[str, Any]] = []
        self.started = False
        self.finished = False

    def on_start(self, out_dir: Path | None) -> None:
        self.started = True

    def observe(self, update: ClientUpdate) -> None:
        self.updates.append(update)

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        self.rounds.append(dict(metrics))

    def on_finish(self) -> dict[str, Any]:
        self.finished = True
        return {}

    def by_round(self) -> dict[int, list[ClientUpdate]]:
        out: dict[int, list[ClientUpdate]] = {}
        for u in self.updates:
            out.setdefault(u.round, []).append(u)
        return out


@pytest.fixture
def recorder() -> RecordingObserver:
    return RecordingObserver()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked `slow` (`make test-slow` runs only those, `make test-all` all)")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (full-length reproductions whose quick check is in the default suite) are
    skipped unless ``--slow`` is given: ``make test`` (what CI runs) stays within its time budget.

    With pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``) the tests that share a module-scoped
    fixture of a test file (a few simulations run once for several tests) run on one worker: spread over
    two, each worker ran the fixture itself (CI showed seed 000's accuracy runs, ~57 s, set up twice).
    The Ray tests (marked ``ray``) are not grouped: put on one worker they made a ~650 s chain, the
    suite's critical path (a quiet fresh-clone run took 865 s instead of 750 s); spread over both
    workers, as the suite always ran them, they overlap their start-up waits with other work."""
    run_slow = config.getoption("--slow")
    skip_slow = pytest.mark.skip(reason="slow: run with --slow (make test-slow / make test-all)")
    for item in items:
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(skip_slow)
        if shared := _module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(shared))


def _module_fixture(item) -> str | None:
    """``file::fixture`` for the first module-scoped fixture defined in a test file that ``item`` asks for
    (autouse ones, such as a module's torch-thread setting, do not count)."""
    info = getattr(item, "_fixtureinfo", None)
    autouse = set(getattr(info, "initialnames", ())) - set(getattr(info, "argnames", ()))
    for name in getattr(info, "names_closure", ()):
        if name in autouse:
            continue
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if fixturedef.scope == "module" and Path(str(fixturedef.baseid or "")).name.startswith("test_"):
                return f"{fixturedef.baseid}::{name}"
    return None
