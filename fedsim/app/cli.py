"""The ``fedsim`` command line (composition root)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_run(args: argparse.Namespace) -> int:
    from fedsim.app import load_config
    from fedsim.app.runner import run_experiment
    from fedsim.config import ConfigError

    out = args.out
    if args.resume:
        if out is not None and Path(out) != Path(args.resume):
            raise ConfigError(f"--out {out} and --resume {args.resume} name different folders")
        out = args.resume
    if args.config is None:
        if not args.resume:
            raise ConfigError("give a config file (or --resume RUN_FOLDER to continue a run)")
        stored = Path(args.resume) / "config.toml"
        if not stored.is_file():
            raise ConfigError(f"--resume {args.resume}: no fedsim run there (no config.toml)")
        cfg = load_config(stored, args.set or [])
    else:
        cfg = load_config(args.config, args.set or [])
    if args.backend:
        cfg["simulation"]["backend"] = args.backend
    run_dir = run_experiment(cfg, out=out, progress=not args.quiet, overwrite=args.overwrite,
                             resume=bool(args.resume))
    print(f"[fedsim] results in {run_dir}  (report: {Path(run_dir) / 'report.md'})")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from fedsim.app.sweep import run_sweep
    from fedsim.config import ConfigError

    out = args.out
    if args.resume:
        if out is not None and Path(out) != Path(args.resume):
            raise ConfigError(f"--out {out} and --resume {args.resume} name different folders")
        if not Path(args.resume).is_dir():
            raise ConfigError(f"--resume {args.resume}: no such sweep folder")
        out = args.resume
    out = run_sweep(args.config, args.set or [], out=out, progress=not args.quiet, only=args.only or [],
                    overwrite=args.overwrite)
    print(f"[fedsim] sweep results in {out}  (report: {Path(out) / 'report.md'})")
    return 0


def _cmd_datasets(args: argparse.Namespace) -> int:
    from fedsim.data import dataset_status

    for name, ok, desc, detail in dataset_status(args.data_dir):
        print(f"{'yes' if ok else 'no ':<4} {name:<14} {desc}")
        if not ok or args.verbose:
            print(f"     {detail}")
    return 0


def _config_arguments(p: argparse.ArgumentParser, config_help: str, set_help: str, out_what: str,
                      config_optional: bool = False) -> None:
    """The arguments every command that runs a config file takes: the file, --set, --out, --quiet,
    --resume/--overwrite."""
    p.add_argument("config", help=config_help, nargs="?" if config_optional else None)
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help=set_help)
    p.add_argument("--out", help=f"{out_what} to write (default: <output.dir>/<name>-<timestamp>). A folder "
                   "holding this config's run is continued from its checkpoint (complete: nothing to do); "
                   "a folder holding anything else is refused")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", metavar="DIR", help=f"continue the {out_what} DIR after its last completed round "
                   "(docs/failures.md)")
    g.add_argument("--overwrite", action="store_true", help=f"clear the {out_what} first if it holds another run")
    p.add_argument("--quiet", action="store_true", help="no per-round progress lines")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedsim", description="Federated-learning privacy lab on Flower: "
                                "simulations, curious-server gradient-leakage attacks and defenses.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run an experiment config (Flower simulation on Ray)",
                       description="Run a federated simulation from a TOML config and write a run folder "
                                   "(config.toml, metrics.jsonl, summary.json, accuracy.png, report.md, ...).")
    _config_arguments(r, "TOML config, e.g. experiments/default.toml (with --resume: default the run's own)",
                      "override a config value (repeatable), e.g. --set federation.rounds=3", "run folder",
                      config_optional=True)
    r.add_argument("--backend", choices=("ray", "inprocess"), help="override simulation.backend")
    r.set_defaults(func=_cmd_run)

    s = sub.add_parser("sweep", help="run every variant of an experiment and tabulate them",
                       description="Run a sweep file (a config plus [[variants]]) and write one report with a "
                                   "row per variant: accuracy, leakage per attack, round time.")
    _config_arguments(s, "sweep TOML, e.g. experiments/defenses.toml",
                      "override a config value in every variant that runs (repeatable)", "sweep folder")
    s.add_argument("--only", action="append", metavar="LABEL", help="run only this variant (repeatable)")
    s.set_defaults(func=_cmd_sweep)

    d = sub.add_parser("datasets", help="list datasets and whether they are available here",
                       description="List the registered datasets, whether each can be loaded on this machine, "
                                   "and how to get the missing ones.")
    d.add_argument("--data-dir", help="also look in this folder")
    d.add_argument("-v", "--verbose", action="store_true", help="show where each dataset is read from")
    d.set_defaults(func=_cmd_datasets)

    from fedsim.app.attack import add_attack_command

    add_attack_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 2 a bad input (config, data, run folder; nothing written); 1 the run failed
    (its folder says how far it got); 128 + signal number when stopped by SIGINT (130) or SIGTERM (143)."""
    from fedsim.checkpoint import CheckpointError
    from fedsim.components import ConfigError
    from fedsim.data import DatasetUnavailable
    from fedsim.interrupt import RunInterrupted

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DatasetUnavailable, CheckpointError) as exc:
        print(f"fedsim: error: {exc}", file=sys.stderr)
        return 2
    except RunInterrupted as exc:
        run_dir = getattr(exc, "run_dir", None)
        where = f"; summary in {run_dir}/summary.json" if run_dir else ""
        hint = getattr(exc, "resume_hint", None)
        print(f"fedsim: {exc}{where}{f'; continue with: {hint}' if hint else ''}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        run_dir = getattr(exc, "run_dir", None)
        if run_dir is None:
            raise  # not a run's failure: a bug, keep the traceback
        line = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(f"fedsim: the run failed: {line} (traceback and last completed round in {run_dir}/summary.json)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
