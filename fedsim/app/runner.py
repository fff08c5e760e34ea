"""Run an experiment: validate, prepare the run folder, start the federation, collect results.

``backend = "ray"`` runs Flower's simulation engine (``flwr.simulation.run_simulation``) with one
Ray actor per concurrently-running client; the ServerApp runs in a thread of this process, so the
observers (and the curious server) run here. ``backend = "inprocess"`` uses
:class:`fedsim.inprocess.InProcessGrid` (same ServerApp logic and ClientApp, no Ray).

Reliability (docs/failures.md):

* every input is checked before the run folder is touched (config, data, partition, folder);
* the folder is locked while the run holds it (:mod:`fedsim.runfolder`); a folder holding a run of the
  same config is resumed from its checkpoint, or reported complete; any other non-empty folder is
  refused unless ``overwrite``;
* SIGINT and SIGTERM stop the run at the next safe point (:mod:`fedsim.interrupt`): the summary says
  ``interrupted`` with the last completed round, Ray is shut down (its client actors are killed, so a
  client in the middle of a long local training does not hold the stop up), and
  :class:`~fedsim.interrupt.RunInterrupted` is raised.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from fedsim import progress
from fedsim.app import build_components
from fedsim.app.ray_runtime import ACTOR_RETRIES, backend_class, backend_config, quiet_logs, starting_line  # noqa: F401
from fedsim.checkpoint import CHECKPOINT
from fedsim.config import dump_toml
from fedsim.config_checks import check_data
from fedsim.device import torch_threads
from fedsim.factories import model_for
from fedsim.interrupt import RunInterrupted, StopSignal, handle_signals
from fedsim.observers import Observer
from fedsim.protocol import num_nodes
from fedsim.reports import atomic_write_text, new_run_dir
from fedsim.runfolder import NOTHING_COMPLETED, RunFolderError, open_run_folder, read_summary

log = logging.getLogger("fedsim")
# seconds between the server's polls for replies on Flower's simulation grid: its default 0.1 s adds
# ~0.07 s to every round (benchmarks/flower_knobs.py compares 0.1, 0.01 and 0.001)
PULL_INTERVAL = 0.01


def node_count(cfg: dict[str, Any]) -> int:
    """Simulated nodes: every client, or one per ``simulation.clients_per_node`` virtual clients."""
    return num_nodes(cfg["federation"]["num_clients"], cfg["simulation"].get("clients_per_node", 1))


def build_observers(cfg: dict[str, Any]) -> list[Observer]:
    """The observers the config asks for (``output.observers``, plus the curious server for ``[attack]``)."""
    return build_components(cfg)["observers"]


def _backend_config(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    return backend_config(cfg, gpu_available=torch.cuda.is_available(), loud=progress.verbose())


def run_experiment(cfg: dict[str, Any], out: str | Path | None = None, observers: Sequence[Observer] | None = None,
                   progress: bool = True, *, overwrite: bool = False, resume: bool = False,
                   stop: StopSignal | None = None, without_client_state: bool = False,
                   components: dict[str, Any] | None = None) -> Path:
    """Run a validated config; returns the run folder (touched only once every input is checked).

    ``out`` names the folder (default: a new ``<output.dir>/<name>-<timestamp>``). A folder that holds
    this config's run is continued from its checkpoint (or returned as it is when complete); ``resume``
    insists on that (``without_client_state``: even though client-state files are missing or damaged, every
    client then starting without its state); ``overwrite`` clears a folder holding something else. Raises
    :class:`~fedsim.interrupt.RunInterrupted` (with ``run_dir``) when stopped by SIGINT/SIGTERM. ``components``:
    what :func:`fedsim.app.validate` built (else built here: once per run); ``observers`` replaces theirs."""
    show = progress
    check_data(cfg)  # DatasetUnavailable (with instructions), root split, partition: before any folder
    model_for(cfg)  # architecture/data mismatches surface here too
    components = dict(build_components(cfg) if components is None else components)
    if observers is not None:
        components["observers"] = list(observers)
    made_here, parent = False, Path(cfg["output"]["dir"])
    parent_existed = parent.exists()
    if out is None:
        if resume:
            raise RunFolderError("resuming needs the run folder (--resume DIR)")
        try:
            run_dir = new_run_dir(parent, cfg["name"])
        except OSError as exc:
            raise RunFolderError(f"cannot create a run folder in output.dir = {cfg['output']['dir']!r}: "
                                 f"{exc.strerror or exc}") from None
        made_here = True
    else:
        run_dir = Path(out)
    try:
        folder = open_run_folder(run_dir, cfg, overwrite=overwrite, resume=resume,
                                 without_client_state=without_client_state)
    except BaseException:
        if made_here:
            run_dir.rmdir()
        raise
    folder.created = folder.created or made_here
    if made_here and not parent_existed:
        folder.made_parent = parent
    try:
        if folder.action == "complete":
            print(f"[fedsim] {run_dir} holds this run, complete: nothing to do (--overwrite runs it again)",
                  file=sys.stderr)
            return run_dir
        ckpt = folder.decision.checkpoint if folder.action == "resume" else None
        if ckpt is not None:
            print(f"[fedsim] {run_dir} holds this run: resuming after round {ckpt.round} "
                  "(--overwrite starts it again)", file=sys.stderr)
        elif resume and folder.decision.note == NOTHING_COMPLETED:
            print(f"[fedsim] {run_dir} holds this run with no completed round: starting it again",
                  file=sys.stderr)
        atomic_write_text(run_dir / "config.toml", dump_toml(cfg))
        quiet_logs()
        stop = stop if stop is not None else StopSignal()
        with handle_signals(stop), torch_threads(int(cfg["simulation"].get("threads", 1))):
            if cfg["simulation"]["backend"] == "inprocess":
                _run_inprocess(cfg, run_dir, components, show, stop, ckpt)
            else:
                _run_ray(cfg, run_dir, components, show, stop, ckpt)
    except RunInterrupted as exc:
        exc.run_dir = run_dir  # type: ignore[attr-defined]
        # `--resume` continues from the checkpoint of the last completed round, or, when no round
        # completed, starts the run again; a run that cannot checkpoint gets no hint (summary: resumable)
        if exc.before_first_round or (run_dir / CHECKPOINT).is_file():
            exc.resume_hint = f"fedsim run --resume {run_dir}"  # type: ignore[attr-defined]
        raise
    except BaseException as exc:
        done = (read_summary(run_dir) or {}).get("completed_round")
        if folder.created and (done is None or done < 1):
            folder.discard()  # nothing of value: nothing half-way
            if isinstance(exc, Exception):
                exc.nothing_written = True  # type: ignore[attr-defined]  # the CLI says so, in one line
        elif isinstance(exc, Exception) and not isinstance(exc, RunFolderError):
            exc.run_dir = run_dir  # type: ignore[attr-defined]  # the CLI names the folder
        raise
    finally:
        folder.release()
    return run_dir


def _run_inprocess(cfg, run_dir, components, show, stop, ckpt) -> None:
    from fedsim.app.client import client_app
    from fedsim.app.server import run_server
    from fedsim.inprocess import InProcessGrid

    run_server(InProcessGrid(client_app, node_count(cfg)), cfg, run_dir, components["observers"], show, stop=stop,
               resume=ckpt, components=components)


@contextlib.contextmanager
def _ray_backend_hooks(stop: StopSignal, backends: list[Any]) -> Iterator[None]:
    """While Flower's engine runs: keep our SIGINT/SIGTERM handlers after ``ray.init`` (which installs
    its own SIGTERM handler in the driver), remember the backend (its actor pool), so an interrupted
    run can kill its client actors, and run a message again when its client actor died under it.
    Flower builds ``RayBackend`` by name from its module at run time; this swaps in a subclass for the
    duration of one run.

    A dead actor: Flower 1.42's pool hands every message to the last idle actor and puts an actor back
    after an error, so one dead actor (no restarts) takes, and fails at once, most messages of every
    following round while the live ones train. With ``max_restarts`` (``_backend_config``) Ray restarts
    the actor, and runs the message it was running again once the actor is back (``max_task_retries``:
    the task's arguments, the message and the node's Flower ``Context``, are the ones it was first sent
    with, so the reply is the same). A message whose actor keeps dying fails as that client's failure,
    naming the error. At the end the actors are killed without a restart (Flower's ``terminate`` task
    would itself be retried)."""
    try:
        from flwr.server.superlink.fleet.vce.backend import raybackend
    except ImportError:  # pragma: no cover - another Flower layout: no hooks (a stop waits for the clients)
        yield
        return
    original = raybackend.RayBackend

    class TrackedRayBackend(backend_class(original)):  # type: ignore[misc]
        def init_ray(self, backend_config: Any) -> None:
            with ray_keeps_signal_handlers():
                super().init_ray(backend_config)
            stop.install()

        def build(self, app_fn: Any) -> None:
            backends.append(self)
            super().build(app_fn)

        def terminate(self) -> None:
            if self.keep():  # inside ray_runtime.shared(): the idle actors and Ray serve the next run
                return
            kill_client_actors([self], quiet=False)  # Flower's terminate() tasks would be retried (and logged)
            if self.pool is not None:
                self.pool.pool.clear()
            super().terminate()

    raybackend.RayBackend = TrackedRayBackend
    try:
        yield
    finally:
        raybackend.RayBackend = original


@contextlib.contextmanager
def _prompt_dispatch(wake: threading.Event) -> Iterator[None]:
    """Flower's engine hands the server's messages to its client workers in passes 0.1 s apart (its
    ``vce_api.add_messages_to_queue``: at most one message per node per pass, then ``f_stop.wait(0.1)``), so
    each round's messages waited 0.05 s on average before any client started (measured: rounds of 0.18 s
    on Ray against 0.13 s in-process for the demo). While the block runs, a pass waits on ``wake`` instead
    - set by the ServerApp's grid when it pushes messages (:func:`_waking_push`) - or 0.1 s as before: the
    same passes handing out the same messages, each as soon as there is something to hand out.

    Its worker threads (and the one storing replies) wait on their queues with a one-second timeout to notice
    the engine's stop, so every run's end waited up to a second (about 0.75 s on average for three threads)
    after the ServerApp had finished; the engine's queues (``vce_api.Queue``) are made to wait at most
    0.1 s at a time (:class:`_PromptQueue`). Without these names (another Flower layout) nothing is changed."""
    try:
        from flwr.server.superlink.fleet.vce import vce_api
    except ImportError:  # pragma: no cover - another Flower layout
        yield
        return
    original = getattr(vce_api, "add_messages_to_queue", None)
    if original is None:  # pragma: no cover
        yield
        return

    def add_messages_to_queue(state: Any, queue: Any, nodes_mapping: Any, f_stop: threading.Event) -> None:
        while not f_stop.is_set():
            wake.clear()  # before the pass: messages pushed during it wake the next one at once
            for node_id in nodes_mapping.keys():
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            wake.wait(0.1)

    queue_class = getattr(vce_api, "Queue", None)
    vce_api.add_messages_to_queue = add_messages_to_queue
    if queue_class is queue.Queue:
        vce_api.Queue = _PromptQueue
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = original
        if queue_class is queue.Queue:
            vce_api.Queue = queue_class


class _PromptQueue(queue.Queue):
    """A queue whose timed ``get`` waits at most 0.1 s before raising ``queue.Empty``: Flower's engine threads
    call ``get(timeout=1.0)`` in a loop only to look at their stop event between waits (an Empty is their
    "nothing yet, check again"), so they now see it within 0.1 s."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if block and timeout is not None:
            timeout = min(timeout, 0.1)
        return super().get(block, timeout)


def _waking_push(grid: Any, wake: threading.Event) -> None:
    """``grid.push_messages`` sets ``wake`` once the messages are stored (:func:`_prompt_dispatch`)."""
    push = grid.push_messages

    def push_messages(messages: Any) -> Any:
        ids = list(push(messages))
        wake.set()
        return ids

    grid.push_messages = push_messages


_ENGINE_THREAD: list[Any] = []  # one executor whose single thread runs every Ray run of this process


def main_thread_listens(fn: Callable[[], Any]) -> Any:
    """``fn()``, run in fedsim's engine thread while the main thread waits for it in steps of 0.1 s. Python
    runs signal handlers only in the main thread, when it runs Python code; Flower's engine keeps its calling
    thread in a lock wait (joining its workers) for the whole run, and a signal the kernel hands to another
    thread (any thread that does not block it may take a process-directed signal) only flags the handler,
    which then ran when the run was over: a Ctrl-C or SIGTERM seen a whole run late (twice in CI). The
    engine thread is one per process and lives as long as it: Ray's processes, when a run starts Ray there,
    get a parent-death signal tied to the thread that started them. Called outside the main thread, ``fn``
    runs directly."""
    if threading.current_thread() is not threading.main_thread():
        return fn()
    if not _ENGINE_THREAD:
        _ENGINE_THREAD.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fedsim-engine"))
    future = _ENGINE_THREAD[0].submit(fn)
    restored = False
    while not future.done():
        concurrent.futures.wait([future], timeout=0.1)
        restored = restored or _python_signal_handlers_back()
    return future.result()


def _python_signal_handlers_back() -> bool:
    """Once Ray is up in this process, put Python's (fedsim's) SIGINT/SIGTERM handlers back in place: Ray's
    core worker installs a native failure handler for SIGTERM over Python's (it prints "*** SIGTERM
    received ***" and a stack), and fedsim's handler then ran late - in CI once only when the run was
    over. ``signal.signal`` re-installs Python's own handler (main thread only). False while Ray is not up."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)
    return True


@contextlib.contextmanager
def ray_keeps_signal_handlers() -> Iterator[None]:
    """While the block runs, ``ray.init`` does not install its own SIGTERM handler in the driver: Ray's
    (``sys.exit(15)``) would hold SIGTERM for the seconds - a minute and more on a loaded machine - that
    Ray takes to start, and a SIGTERM then ended the process with exit code 15, no line, and a summary
    written behind the runner's back. fedsim's handler stays, so such a SIGTERM stops the run like any
    other (:mod:`fedsim.interrupt`). Ray sets it through ``ray._private.utils.set_sigterm_handler``
    (Ray 2.x); without that function, nothing is changed (the handler is put back after ``init_ray``)."""
    try:
        from ray._private import utils as ray_utils
    except ImportError:  # pragma: no cover - another Ray layout
        yield
        return
    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None:  # pragma: no cover
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def kill_client_actors(backends: Sequence[Any], quiet: bool = True) -> int:
    """Kill the Ray actors of Flower's actor pool (idle and busy), never to be restarted: a worker thread
    waiting on a client gets an error at once instead of waiting for its local training to end.
    ``quiet``: Flower's logs off (the killed actors' errors are expected). Returns how many."""
    import ray

    if quiet:
        logging.getLogger("flwr").setLevel(logging.CRITICAL)
    killed = 0
    for backend in backends:
        pool = getattr(backend, "pool", None)
        actors = list(getattr(pool, "pool", None) or []) + list((getattr(pool, "_future_to_actor", None) or {}).values())
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
                killed += 1
            except Exception:  # noqa: BLE001 - already dead, or Ray already down
                pass
    return killed


#: seconds the runner waits for the ServerApp thread to write its summary once Flower's engine is gone
SERVER_EXIT_WAIT = 120.0


class _ServerLoop:
    """Whether the ServerApp's main function runs: Flower runs it in a thread it does not join, and its
    engine can return or die while the server loop still runs (or has not started). :meth:`engine_gone`
    makes the runner wait until the loop has stopped and written the run's files (``summary.json``)
    before it reads them, decides what to keep and unlocks the folder - not behind its back - and a loop
    that had not started yet does not start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = self._gone = False
        self.done = threading.Event()

    def enter(self) -> bool:
        """The server loop may start (False: the engine is already gone)."""
        with self._lock:
            self._started = not self._gone
            return self._started

    def engine_gone(self, stop: StopSignal) -> None:
        with self._lock:
            self._gone = True
            running = self._started and not self.done.is_set()
        if running:
            stop.request("engine-stopped")  # a server loop still waiting on the dead engine gives up
            if not self.done.wait(SERVER_EXIT_WAIT):  # it stops at its next safe point (a poll interval)
                log.error("the ServerApp thread did not stop within %.0f s of the engine's end", SERVER_EXIT_WAIT)


def _run_ray(cfg, run_dir, components, show, stop, ckpt) -> None:
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedsim.app.client import client_app
    from fedsim.app.server import run_server

    errors: list[BaseException] = []
    stopped: list[RunInterrupted] = []
    backends: list[Any] = []
    loop = _ServerLoop()
    server_app = ServerApp()
    wake = threading.Event()  # the server pushed messages: the engine's next dispatch pass runs now

    @server_app.main()
    def _main(grid, context) -> None:
        if not loop.enter():
            return
        if hasattr(grid, "pull_interval"):
            grid.pull_interval = PULL_INTERVAL
        _waking_push(grid, wake)
        try:
            # (the ServerApp runs in a thread of this process: it uses the components built for this run)
            run_server(grid, cfg, run_dir, components["observers"], show, stop=stop, resume=ckpt,
                       started_at=launched, components=components)
        except RunInterrupted as exc:  # return normally: Flower then shuts its engine down at once
            stopped.append(exc)
            kill_client_actors(backends)
        except BaseException as exc:  # re-raised in the caller: run_simulation would only log it
            errors.append(exc)
            raise
        finally:
            loop.done.set()

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the actors use the cores; a spinning 2-thread evaluation here stalls them
    launched = time.perf_counter()
    with progress.suppressed(not show):
        progress.say(starting_line(cfg, node_count(cfg)))
    try:
        with _ray_backend_hooks(stop, backends), _prompt_dispatch(wake):
            main_thread_listens(lambda: run_simulation(server_app=server_app, client_app=client_app,
                                                       num_supernodes=node_count(cfg),
                                                       backend_config=_backend_config(cfg)))
    except BaseException:
        loop.engine_gone(stop)
        if stopped and stopped[0].signame.startswith("SIG"):  # the engine died of the user's signal
            raise stopped[0] from None
        raise
    finally:
        torch.set_num_threads(threads)
    loop.engine_gone(stop)
    if stopped:
        raise stopped[0]
    if errors:
        raise errors[0]
    if not (run_dir / "summary.json").exists():
        raise RuntimeError("the Flower simulation ended without finishing the run (see the log above)")
