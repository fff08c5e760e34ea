"""One Ray runtime per command: Ray and the client actors start once and serve every run.

Flower's simulation engine (``flwr.simulation.run_simulation``) starts Ray when it is not running,
builds a pool of ClientApp actors (one per ``simulation.num_cpus`` CPUs), and when the run ends it
terminates the actors and shuts Ray down. Every run of a sweep or experiment paid that start-up
again: Ray's own processes, then every actor's imports (torch, Flower, fedsim) and torch's one-time
cost of the first backward pass. Inside :func:`shared` (opened by the CLI for every command, by
:func:`fedsim.app.sweep.run_sweep`, and by the test suite for its whole session) fedsim keeps both:

* Ray is started at most once (:attr:`Runtime.ray_starts` counts the starts) and shut down when the
  outermost :func:`shared` block ends; a run that needs other init arguments restarts it.
* The actor pool of a run that ended cleanly - every actor idle and alive - is kept and handed to the
  next run that asks for the same resources per client; otherwise its actors are killed and the next
  run builds a fresh pool (:attr:`Runtime.actor_starts` counts the actors created). A client keeps
  nothing between runs but caches keyed by the whole config (data, partitions, models): its replies
  are a function of the message, exactly as with fresh actors.
* :func:`prestart` starts Ray and the pool in a background thread as soon as a config has passed the
  torch-free first check (:func:`fedsim.config.precheck`), and has every actor import the ClientApp,
  load the config's data and run one backward pass (:func:`fedsim.app.client.warm_up`) while this
  process imports torch, validates the components and loads the data. The run then finds Ray up and
  its actors warm.

A cluster joined through ``simulation.ray_address`` is not fedsim's: runs on it connect and
disconnect as before, and keep no actors there. Outside :func:`shared` nothing changes: each run
starts and stops Ray as Flower does.

The mechanism is a subclass of Flower's ``RayBackend`` (:func:`backend_class`, installed by the
runner for each run) overriding ``init_ray``, ``build`` and ``terminate``; Flower's worker threads,
message queues and node contexts stay per run.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from typing import Any, Callable, Iterator, Mapping

log = logging.getLogger("fedsim")
#: times a message is run again on a restarted actor after its actor died under it
ACTOR_RETRIES = 2
ALIVE_TIMEOUT = 30.0  # seconds idle actors get to answer before a finished run's pool is discarded


def _key(d: Mapping[str, Any]) -> str:
    return json.dumps(d, sort_keys=True, default=str)


def _joins_cluster(init_args: Mapping[str, Any]) -> bool:
    return bool(init_args.get("address"))


def quiet_logs() -> None:
    """Flower's and Ray's own logs off (at ERROR), unless ``--verbose`` (``fedsim.progress.VERBOSE``)."""
    from fedsim import progress

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # Flower's usage telemetry posts from a thread pool that the interpreter joins at exit: offline, every
    # run waited seconds for it before exiting. Off unless the user turned it on explicitly.
    if os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0") == "0":
        telemetry = sys.modules.get("flwr.supercore.telemetry")
        if telemetry is not None and hasattr(telemetry, "FLWR_TELEMETRY_ENABLED"):
            telemetry.FLWR_TELEMETRY_ENABLED = "0"  # read when the module was imported
    level = logging.INFO if progress.verbose() else logging.ERROR
    logging.getLogger("flwr").setLevel(level)  # Flower logs every round at INFO and deprecations
    logging.getLogger("ray").setLevel(level)


def backend_config(cfg: Mapping[str, Any], gpu_available: bool, loud: bool = False) -> dict[str, Any]:
    """Flower's ``backend_config`` for ``cfg``: resources per client actor and Ray's init arguments.
    ``device = auto`` with a GPU present and ``simulation.num_gpus = 0`` shares the GPU between client
    actors (a quarter each); ``loud`` (``--verbose``) keeps Ray's own logs."""
    sim = cfg["simulation"]
    gpus = float(sim["num_gpus"])
    if gpus == 0 and cfg["device"] != "cpu" and gpu_available:
        gpus = 0.25
    init: dict[str, Any] = {"logging_level": "INFO" if loud else "ERROR", "log_to_driver": loud,
                            "include_dashboard": False}
    if sim.get("ray_address"):
        init["address"] = sim["ray_address"]
    # max_restarts: Ray restarts a client actor whose process died (kill -9, the OOM killer, a crash in
    # native code); without it Flower puts the dead actor back into its pool, where it fails most of the
    # following messages at once (see fedsim.app.runner._ray_backend_hooks)
    return {"client_resources": {"num_cpus": int(sim["num_cpus"]), "num_gpus": gpus, "max_restarts": -1,
                                 "max_task_retries": ACTOR_RETRIES},
            "init_args": init}


class Runtime:
    """What this process keeps of Ray between runs (the one instance is :data:`RUNTIME`)."""

    def __init__(self) -> None:
        self.depth = 0  # open shared() blocks
        self.ray_starts = 0  # ray.init calls fedsim made in this process (a start, or joining a cluster)
        self.actor_starts = 0  # client actors created
        self.init_key: str | None = None  # init arguments of the Ray fedsim started (None: none running)
        self.pool: Any = None  # an idle actor pool kept for the next run
        self.pool_key: str | None = None  # its resources per client
        self.lock = threading.RLock()
        # A prestart's thread lives until close(): Ray's processes are started with a parent-death signal
        # (fate sharing), which Linux sends when the *thread* that started them exits.
        self.thread: threading.Thread | None = None
        self.ready = threading.Event()  # the prestart thread has done its work
        self.release = threading.Event()  # ... and may exit now (set by close(), after Ray stopped)
        self.abandoned = False  # nothing will run: close() does not wait for a prestart (abandon())

    @property
    def active(self) -> bool:
        return self.depth > 0

    def wait_prestart(self) -> None:
        """Wait for a background start to finish (if it failed, the run starts Ray itself)."""
        if self.thread is not None and self.thread is not threading.current_thread():
            self.ready.wait()

    # ---- Ray ------------------------------------------------------------------------------------------
    def ensure_ray(self, init_args: Mapping[str, Any], init: Callable[[], None]) -> None:
        """Ray running with ``init_args``: left as it is when it already runs with them (or was started
        by someone else), restarted when fedsim started it with others, else started with ``init``
        (Flower's own ``init_ray``)."""
        import ray

        key = _key(init_args)
        with self.lock:
            if ray.is_initialized():
                if self.init_key is None or self.init_key == key:
                    return
                self.drop_pool()
                ray.shutdown()
            init()
            self.ray_starts += 1
            self.init_key = key

    def ray_stopped(self) -> None:
        with self.lock:
            self.pool, self.pool_key, self.init_key = None, None, None

    # ---- actors ---------------------------------------------------------------------------------------
    def take_pool(self, resources: Mapping[str, Any]) -> Any:
        """The kept pool if its actors have these resources (it leaves the runtime), else None; a kept
        pool with other resources is dropped (its actors hold the CPUs the new pool needs)."""
        with self.lock:
            if self.pool is None:
                return None
            if self.pool_key != _key(resources):
                self.drop_pool()
                return None
            pool, self.pool, self.pool_key = self.pool, None, None
            return pool

    def keep_pool(self, pool: Any, resources: Mapping[str, Any], check: bool = True) -> bool:
        """Keep a pool for the next run (inside :func:`shared`, on a Ray fedsim started itself) when
        every actor is idle and answers (``check``); otherwise kill its actors. False: not handled
        here (outside :func:`shared`, or a joined cluster): Flower terminates the pool and Ray."""
        with self.lock:
            if not self.active or pool is None or self.init_key is None \
                    or _joins_cluster(json.loads(self.init_key)):
                return False
            idle = not getattr(pool, "_future_to_actor", None) and len(pool.pool) == pool.num_actors
            if check and not (idle and _alive(pool)):
                _kill(pool)
                return True
            self.drop_pool()
            self.pool, self.pool_key = pool, _key(resources)
            return True

    def drop_pool(self) -> None:
        with self.lock:
            if self.pool is not None:
                _kill(self.pool)
            self.pool, self.pool_key = None, None

    # ---- the end of the outermost block ----------------------------------------------------------------
    def abandon(self) -> None:
        """Nothing will run (the command failed): the end of :func:`shared` does not wait for a prestart
        still starting Ray. Its thread skips the actors and leaves Ray to the process's exit: Ray's
        processes die with the thread that started them (parent-death signal), and ``ray.init`` registers
        ``ray.shutdown`` to run at exit."""
        self.abandoned = True

    def close(self) -> None:
        if self.abandoned and self.thread is not None and not self.ready.is_set():
            self.release.set()
            self.thread = None
            return
        self.abandoned = False
        self.wait_prestart()
        with self.lock:
            started = self.init_key is not None
            self.drop_pool()
            if started:
                import ray

                if ray.is_initialized():
                    stop_ray()
            self.ray_stopped()
        if self.thread is not None:
            self.release.set()
            self.thread.join()
            self.thread = None


RUNTIME = Runtime()


def stop_ray() -> None:
    """``ray.shutdown()``, without its one-second wait for the autoscaler monitor. Ray stops its processes
    one after another, each with a SIGTERM and up to a second to exit before a SIGKILL; the monitor's SIGTERM
    handler reports its own death to the driver through the GCS, which takes that whole second every time
    (measured: the raylet, GCS, dashboard and log monitor exit in 0.1 s each, the monitor is killed at 1.0
    s), so every command waited a second at exit for a message nobody reads. Here the monitor - the
    autoscaler of this one-node cluster, which holds no state - gets the SIGKILL Ray would send it a second
    later, first; Ray then stops the rest as it does. Without the attributes this relies on (Ray 2.x's
    ``Node.all_processes``), plain ``ray.shutdown()``."""
    import ray

    try:
        from ray._private import ray_constants
        from ray._private import worker as ray_worker

        node = ray_worker._global_node
        monitors = [info.process for info in node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, [])]
    except (ImportError, AttributeError):  # pragma: no cover - another Ray layout, or no node of ours
        monitors = []
    for proc in monitors:
        if proc.poll() is None:
            proc.kill()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - Ray's shutdown kills it again
                pass
    ray.shutdown()


def _alive(pool: Any) -> bool:
    """Every actor of an idle pool answers (one that died - killed, out of memory - does not)."""
    import ray

    actors = list(pool.pool)
    if not actors:
        return False
    try:
        ray.get([a.__ray_ready__.remote() for a in actors], timeout=ALIVE_TIMEOUT)
        return True
    except Exception:  # noqa: BLE001 - RayActorError, GetTimeoutError: not reusable
        return False


def _kill(pool: Any) -> None:
    import ray

    actors = list(getattr(pool, "pool", None) or []) + list((getattr(pool, "_future_to_actor", None) or {}).values())
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead, or Ray already down
            pass


@contextlib.contextmanager
def shared() -> Iterator[Runtime]:
    """Runs inside the block share one Ray runtime and, where their resources per client match, one
    pool of warm client actors. Blocks nest; the end of the outermost one stops what fedsim started."""
    RUNTIME.depth += 1
    try:
        yield RUNTIME
    except BaseException:
        RUNTIME.abandon()
        raise
    finally:
        RUNTIME.depth -= 1
        if RUNTIME.depth == 0:
            RUNTIME.close()


def backend_class(base: type) -> type:
    """A subclass of Flower's ``RayBackend`` (``base``) that takes Ray and its actors from
    :data:`RUNTIME` and, inside :func:`shared`, leaves them there when the run ends."""

    class SharedRayBackend(base):  # type: ignore[misc, valid-type]
        def init_ray(self, backend_config: Any) -> None:
            RUNTIME.wait_prestart()
            RUNTIME.ensure_ray(dict(backend_config.get("init_args") or {}),
                               lambda: super(SharedRayBackend, self).init_ray(backend_config))

        def build(self, app_fn: Any) -> None:
            pool = RUNTIME.take_pool(self.client_resources)
            if pool is None:
                super().build(app_fn)
                RUNTIME.actor_starts += self.pool.num_actors if self.pool is not None else 0
            else:
                self.pool, self.app_fn = pool, app_fn

        def keep(self) -> bool:
            """Leave the pool (or, when it cannot serve again, the killing of its actors) and Ray to
            :data:`RUNTIME` for the next run; False outside :func:`shared` and on a joined cluster."""
            if RUNTIME.keep_pool(self.pool, self.client_resources):
                self.pool = None
                return True
            return False

        def terminate(self) -> None:
            if not self.keep():
                super().terminate()  # Flower's: the actors, then ray.shutdown()
                RUNTIME.ray_stopped()

    return SharedRayBackend


def starting_line(cfg: Mapping[str, Any], nodes: int) -> str:
    """The progress line of a Ray run's start: Ray starting, starting in the background, or running."""
    sim = cfg["simulation"]
    what = f"{nodes} client nodes ({sim['num_cpus']} CPU each)"
    if sim.get("ray_address"):
        return f"joining the Ray cluster at {sim['ray_address']} for {what}"
    if RUNTIME.init_key is not None and RUNTIME.pool is not None:
        return f"Ray is running: {what} on warm client actors"
    if RUNTIME.thread is not None and not RUNTIME.ready.is_set():
        return f"Ray and the client actors have been starting since the config was read: {what}"
    return f"starting Ray for {what}; Ray and its actors take a few seconds to start"


def warm_actor(actor: Any, cfg_text: str) -> None:
    """Runs inside a client actor (``__ray_call__``): :func:`fedsim.app.client.warm_up`."""
    from fedsim.app.client import warm_up

    warm_up(json.loads(cfg_text))


def prestart(cfg: Mapping[str, Any]) -> None:
    """Start Ray and a warm actor pool for ``cfg`` in a background thread, inside :func:`shared` and
    when nothing is running or starting yet (a second call does nothing). Torch-free: the thread
    imports only Ray and Flower's backend, which this thread imports first; whether a GPU is present
    is Ray's answer here (a run whose resources then differ builds its own pool)."""
    if not RUNTIME.active or RUNTIME.thread is not None or RUNTIME.init_key is not None:
        return
    if cfg["simulation"]["backend"] != "ray" or cfg["simulation"].get("ray_address"):
        return
    quiet_logs()
    import ray
    from flwr.server.superlink.fleet.vce.backend import raybackend

    from fedsim import progress

    text = json.dumps(cfg, default=str)
    loud = progress.verbose()
    cls = backend_class(raybackend.RayBackend)

    def start() -> None:
        try:
            config = backend_config(cfg, gpu_available=False, loud=loud)
            backend = cls(config)  # starts Ray as Flower's engine would (init_ray)
            if RUNTIME.abandoned:
                return
            if ray.cluster_resources().get("GPU", 0) > 0:  # Ray sees a GPU: the run's resources follow torch
                backend.client_resources = backend_config(cfg, gpu_available=True, loud=loud)["client_resources"]
            backend.build(None)
            for actor in backend.pool.pool:
                actor.__ray_call__.remote(warm_actor, text)  # runs before the run's first message
            RUNTIME.keep_pool(backend.pool, backend.client_resources, check=False)
        except Exception as exc:  # noqa: BLE001 - the run starts Ray itself and reports any problem
            log.debug("background Ray start failed: %r", exc)
        finally:
            RUNTIME.ready.set()
        RUNTIME.release.wait()  # Ray's processes die with the thread that started them (a daemon thread:
        # after abandon() it waits here until the process exits)

    RUNTIME.ready.clear()
    RUNTIME.release.clear()
    RUNTIME.abandoned = False
    RUNTIME.thread = threading.Thread(target=start, name="fedsim-ray-prestart", daemon=True)
    RUNTIME.thread.start()
