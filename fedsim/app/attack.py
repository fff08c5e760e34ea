"""``fedsim attack``: attack one client update without running a whole federation.

One round, as the curious server would see it in round 1: the server sends the initial global
model to one client (client 0 of a ``--clients`` IID split), which trains through the real
ClientApp (so ``[[defenses]]``, ``[[client.flower_mods]]`` and ``device`` apply exactly as in a
simulation), and the curious server attacks the returned update and scores it. It runs on the
in-process grid and writes the same files as a federated run with ``[attack]`` on.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Sequence

from fedsim.app import validate
from fedsim.config import ConfigError, absolute_references, apply_overrides, defaults

VICTIM = 0


def oneshot_config(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The one-shot attack's config from the command's arguments, validated, and the components that built
    (:func:`fedsim.app.validate`), for :func:`run_oneshot`: built once."""
    cfg = defaults()
    cfg.update(name=f"attack-{'-'.join(args.attack)}", seed=args.seed, device=args.device)
    if getattr(args, "threads", None) is not None:
        cfg["simulation"]["threads"] = args.threads
    cfg["federation"].update(rounds=1, num_clients=args.clients, clients_per_round=1)
    cfg["data"]["dataset"] = args.dataset
    from fedsim.models import is_builtin_model

    builtin = is_builtin_model(args.model)  # a user's model takes its own parameters (--set model.params=...)
    cfg["model"].update(name=args.model, activation=args.activation if builtin else None, init=args.init)
    cfg["train"].update(lr=args.lr, batch_size=args.batch_size, local_steps=args.local_steps, local_epochs=None)
    cfg["output"]["observers"] = []
    cfg["simulation"]["backend"] = "inprocess"
    cfg["attack"] = {"name": list(args.attack), "rounds": [1], "victims": [VICTIM], "seed": args.seed,
                     "device": args.device}
    apply_overrides(cfg, args.set or [])
    absolute_references(cfg)
    return cfg, validate(cfg)


def run_oneshot(cfg: dict[str, Any], out: Path, progress: bool = True, stop: Any = None,
                components: dict[str, Any] | None = None) -> dict[str, Any]:
    """Client 0 trains once from the seeded initial model (through the ClientApp); attack its update.
    ``stop`` (a :class:`fedsim.interrupt.StopSignal`) ends the attack at its next iteration when requested.
    ``components``: what validating ``cfg`` built (:func:`oneshot_config`; built here when not given)."""
    from fedsim.app.client import client_app
    from fedsim.app.server import Server
    from fedsim.config import dump_toml
    from fedsim.device import torch_threads
    from fedsim.inprocess import InProcessGrid
    from fedsim.reports import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.toml", dump_toml(cfg))
    with torch_threads(int(cfg["simulation"].get("threads", 1))):  # attacks on a shared machine: 1 thread
        server = Server(cfg, out, progress=progress, fixed_partitions=[VICTIM], checkpoint=False, stop=stop,
                        components=components)
        summary = server.run(InProcessGrid(client_app, cfg["federation"]["num_clients"]))
    rows = [r for obs in server.observers if obs.name == "curious-server" for r in obs.rows]
    if progress:
        for r in rows:
            quality = f"MSE {r['mse']:.3g}" if r.get("ssim") is None else \
                f"PSNR {r['psnr']:.2f} dB  SSIM {r['ssim']:.3f}"  # records have no SSIM/PSNR
            print(f"[fedsim] {r['attack']}: {quality}  label acc {r['label_acc']:.2f}  {r['iterations']} it  "
                  f"{r['seconds']:.1f}s")
    return summary


def _cmd_attack(args: argparse.Namespace) -> int:
    """Ctrl-C (SIGINT) or SIGTERM stops the command at once (the attack at its next iteration) with exit
    130 (143) and one line, as for ``fedsim run``; a second signal aborts without a summary."""
    from fedsim.interrupt import RunInterrupted, StopSignal, handle_signals

    stop = StopSignal(notice="stopping the attack")
    stop.bind_current_thread()  # everything runs in this (the main) thread: the handler raises here
    try:
        with handle_signals(stop):
            return _attack(args, stop)
    except RunInterrupted as exc:
        stopped = RunInterrupted(exc.signame)  # no "after round 0": the one round is the attacked one
        if getattr(exc, "run_dir", None) is not None:
            stopped.run_dir = exc.run_dir  # type: ignore[attr-defined]
        raise stopped from None


def _attack(args: argparse.Namespace, stop: Any) -> int:
    from fedsim.config_checks import check_data
    from fedsim.reports import new_run_dir
    from fedsim.runfolder import RunFolderError, open_run_folder

    cfg, components = oneshot_config(args)
    check_data(cfg)  # availability and partition errors before any folder exists
    parent = Path(cfg["output"]["dir"])
    parent_existed = parent.exists()
    try:
        out = Path(args.out) if args.out else new_run_dir(parent, cfg["name"])
    except OSError as exc:
        raise RunFolderError(f"cannot create an output folder in output.dir = {cfg['output']['dir']!r}: "
                             f"{exc.strerror or exc}") from None
    folder = open_run_folder(out, cfg, overwrite=args.overwrite)
    folder.created = folder.created or not args.out
    if not args.out and not parent_existed:
        folder.made_parent = parent
    try:
        if folder.action == "complete":
            print(f"[fedsim] {out} holds this attack, complete: nothing to do (--overwrite runs it again)")
        else:
            run_oneshot(cfg, out, progress=not args.quiet, stop=stop, components=components)
    except BaseException as exc:
        done = (folder.path / "summary.json").exists()
        if done and isinstance(exc, KeyboardInterrupt):
            exc.run_dir = folder.path  # type: ignore[attr-defined]  # its summary says "interrupted"
        else:  # a failed attack leaves nothing half-way: the folder goes (or is emptied, if it was there)
            if folder.created:
                folder.discard()
            else:
                folder.clear()
            if isinstance(exc, Exception):
                exc.nothing_written = True  # type: ignore[attr-defined]
        raise
    finally:
        folder.release()
    print(f"[fedsim] results in {out}  (report: {out / 'report.md'})")
    return 0


def add_attack_command(sub: Any, output_arguments: Callable[[Any], None]) -> None:
    """The ``attack`` subcommand; ``output_arguments`` adds the CLI's shared --quiet/--verbose."""
    a = sub.add_parser("attack", help="attack a single client update (no federation)",
                       description="Train one client once from the seeded initial model, attack its update "
                                   "like a curious server, score the reconstruction and write a report.")
    a.add_argument("--model", default="lenet", help="model.name (default lenet)")
    a.add_argument("--activation", default="sigmoid", help="model.activation (default sigmoid, as in DLG)")
    a.add_argument("--init", default="uniform", choices=("default", "uniform"),
                   help="model.init (default uniform: U(-0.5, 0.5), as DLG initialises its LeNet)")
    a.add_argument("--dataset", default="fmnist-small", help="data.dataset (default fmnist-small)")
    a.add_argument("--batch-size", type=int, default=1, help="the victim's batch size (default 1)")
    a.add_argument("--local-steps", type=int, default=1, help="the victim's local SGD steps (default 1: FedSGD)")
    a.add_argument("--lr", type=float, default=0.1, help="the victim's learning rate")
    a.add_argument("--clients", type=int, default=10, help="clients the data is split among (victim = client 0)")
    a.add_argument("--attack", action="append", required=True, metavar="NAME",
                   help="attack to run (repeatable): dlg, idlg, ig, cpl, ...")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--device", default="auto")
    a.add_argument("--threads", type=int, metavar="N", help="torch threads (simulation.threads, default 1; "
                   "0 = torch's default): on a shared 2-core machine one thread ran iDLG 8x faster than two")
    output_arguments(a)
    a.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="further config overrides, e.g. --set attack.params.dlg.iterations=100")
    a.add_argument("--out", help="output folder (default: runs/attack-<name>-<timestamp>); a folder holding "
                   "anything else is refused")
    a.add_argument("--overwrite", action="store_true", help="clear the output folder first if it holds another run")
    a.set_defaults(func=_cmd_attack)


__all__: Sequence[str] = ("add_attack_command", "oneshot_config", "run_oneshot", "ConfigError")
