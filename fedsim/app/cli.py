"""The ``fedsim`` command line (composition root)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_run(args: argparse.Namespace) -> int:
    from fedsim.app import load_config
    from fedsim.app.runner import run_experiment

    cfg = load_config(args.config, args.set or [])
    if args.backend:
        cfg["simulation"]["backend"] = args.backend
    run_dir = run_experiment(cfg, out=args.out, progress=not args.quiet)
    print(f"[fedsim] results in {run_dir}  (report: {Path(run_dir) / 'report.md'})")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from fedsim.app.sweep import run_sweep

    out = run_sweep(args.config, args.set or [], out=args.out, progress=not args.quiet, only=args.only or [])
    print(f"[fedsim] sweep results in {out}  (report: {Path(out) / 'report.md'})")
    return 0


def _cmd_datasets(args: argparse.Namespace) -> int:
    from fedsim.data import dataset_status

    for name, ok, desc, detail in dataset_status(args.data_dir):
        print(f"{'yes' if ok else 'no ':<4} {name:<14} {desc}")
        if not ok or args.verbose:
            print(f"     {detail}")
    return 0


def _config_arguments(p: argparse.ArgumentParser, config_help: str, set_help: str, out_what: str) -> None:
    """The arguments every command that runs a config file takes: the file, --set, --out, --quiet."""
    p.add_argument("config", help=config_help)
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help=set_help)
    p.add_argument("--out", help=f"{out_what} to write (default: <output.dir>/<name>-<timestamp>)")
    p.add_argument("--quiet", action="store_true", help="no per-round progress lines")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedsim", description="Federated-learning privacy lab on Flower: "
                                "simulations, curious-server gradient-leakage attacks and defenses.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run an experiment config (Flower simulation on Ray)",
                       description="Run a federated simulation from a TOML config and write a run folder "
                                   "(config.toml, metrics.jsonl, summary.json, accuracy.png, report.md, ...).")
    _config_arguments(r, "TOML config, e.g. experiments/default.toml",
                      "override a config value (repeatable), e.g. --set federation.rounds=3", "run folder")
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
    from fedsim.components import ConfigError
    from fedsim.data import DatasetUnavailable

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DatasetUnavailable) as exc:
        print(f"fedsim: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
