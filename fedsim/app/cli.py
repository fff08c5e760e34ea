"""The ``fedsim`` command line (composition root).

Only argparse is imported up front: ``fedsim --help`` and ``fedsim --version`` never import torch;
each command imports what it needs when it runs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _shortcuts(args: argparse.Namespace) -> list[str]:
    """``--set`` overrides for the shortcut options (applied after the user's own ``--set``)."""
    out = []
    if getattr(args, "seed", None) is not None:
        out.append(f"seed={args.seed}")
    if getattr(args, "device", None) is not None:
        out.append(f'device="{args.device}"')
    if getattr(args, "threads", None) is not None:
        out.append(f"simulation.threads={args.threads}")
    if getattr(args, "backend", None):
        out.append(f'simulation.backend="{args.backend}"')
    return out


def _cmd_run(args: argparse.Namespace) -> int:
    from fedsim.app import ray_runtime, validate
    from fedsim.config import ConfigError, read_config

    out = args.out
    if args.resume:
        if out is not None and Path(out) != Path(args.resume):
            raise ConfigError(f"--out {out} and --resume {args.resume} name different folders")
        out = args.resume
    if args.resume_without_client_state and not args.resume:
        raise ConfigError("--resume-without-client-state continues a run: give it with --resume RUN_FOLDER")
    sets = [*(args.set or []), *_shortcuts(args)]
    if args.config is None:
        if not args.resume:
            raise ConfigError("give a config file (or --resume RUN_FOLDER to continue a run)")
        stored = Path(args.resume) / "config.toml"
        if not stored.is_file():
            raise ConfigError(f"--resume {args.resume}: no fedsim run there (no config.toml)")
        cfg = read_config(stored, sets)
    else:
        cfg = read_config(args.config, sets)  # the first pass: no torch, Flower or Ray imported yet
    ray_runtime.prestart(cfg)  # Ray and warm client actors start while the rest is checked and loaded
    components = validate(cfg)  # built once: the run uses them
    from fedsim.app.runner import run_experiment

    run_dir = run_experiment(cfg, out=out, progress=not args.quiet, overwrite=args.overwrite,
                             resume=bool(args.resume), without_client_state=args.resume_without_client_state,
                             components=components)
    print(f"[fedsim] results in {run_dir}  (report: {Path(run_dir) / 'report.md'})")
    return 0


def _seeds(text: str | None) -> list[int] | None:
    from fedsim.components import ConfigError

    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ConfigError(f"--seeds expects comma-separated integers, e.g. 0,1,2; got {text!r}") from None


def _jobs(args: argparse.Namespace) -> int:
    from fedsim.components import ConfigError

    if args.jobs < 1:
        raise ConfigError(f"--jobs expects a positive number of worker processes, got {args.jobs}")
    return args.jobs


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
    out = run_sweep(args.config, [*(args.set or []), *_shortcuts(args)], out=out, progress=not args.quiet,
                    only=args.only or [], seeds=_seeds(args.seeds), overwrite=args.overwrite, workers=_jobs(args))
    print(f"[fedsim] sweep results in {out}  (report: {Path(out) / 'report.md'})")
    return 0


def _cmd_experiment(args: argparse.Namespace) -> int:
    from fedsim.app.experiment import cmd_experiment

    args.name = args.config
    return cmd_experiment(args, _shortcuts(args), _seeds(args.seeds), _jobs(args))


def _cmd_compare(args: argparse.Namespace) -> int:
    from fedsim.comparison import compare, comparison_table, table_columns, table_formats
    from fedsim.components import ConfigError
    from fedsim.reports import new_run_dir

    out = Path(args.out) if args.out else None
    try:
        if out is None:
            out = new_run_dir("runs", "compare", create=False)
        rows = compare(args.runs, out, title=args.title or ", ".join(Path(r).name for r in args.runs))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    except OSError as exc:  # the output folder cannot be written
        raise ConfigError(f"--out {str(out)!r}: {exc.strerror or exc}") from None
    cols = table_columns(rows)
    print(comparison_table(rows, cols, table_formats(cols)))
    print(f"[fedsim] comparison in {out}  (comparison.md, comparison.csv, comparison.png)")
    return 0


def _cmd_datasets(args: argparse.Namespace) -> int:
    from fedsim.data import dataset_status

    for name, ok, desc, detail in dataset_status(args.data_dir):
        print(f"{'yes' if ok else 'no ':<4} {name:<14} {desc}")
        if not ok or args.verbose:
            print(f"     {detail}")
    return 0


def output_arguments(p: argparse.ArgumentParser) -> None:
    """--quiet / --verbose (every command that runs something)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="also show Flower's and Ray's own logs (hidden by default)")


def run_shortcuts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, help="shortcut for --set seed=N")
    p.add_argument("--device", help="shortcut for --set device=... (auto, cpu, cuda, cuda:N)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch threads of this process (simulation.threads; 0 = torch's default, all cores)")


JOBS_HELP = ("run the in-process runs on N worker processes at once (each with simulation.threads torch "
             "threads, default 1): the same results, about N times sooner on N free cores; runs on Ray still run "
             "one after another (default 1)")
BACKENDS = ("simulation.backend = \"ray\" (the default) runs the clients in parallel Ray actors; Ray and the "
            "actors start once per command, in the background while the config is checked. --backend inprocess "
            "(no Ray: the clients one after another in this process) starts at once and is the better choice "
            "for short runs (a few rounds), machines with 1-2 cores and debugging; the same seed gives the "
            "same results on both.")


def _config_arguments(p: argparse.ArgumentParser, config_help: str, set_help: str, out_what: str,
                      config_optional: bool = False) -> None:
    """The arguments every command that runs a config file takes: the file, --set, --out,
    --resume/--overwrite, --quiet/--verbose and the shortcuts."""
    p.add_argument("config", help=config_help, nargs="?" if config_optional else None)
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help=set_help)
    p.add_argument("--out", help=f"{out_what} to write (default: <output.dir>/<name>-<timestamp>). A folder "
                   "holding this config's run is continued from its checkpoint (complete: nothing to do); "
                   "a folder holding anything else is refused")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", metavar="DIR", help=f"continue the {out_what} DIR after its last completed round "
                   "(docs/failures.md)")
    g.add_argument("--overwrite", action="store_true", help=f"clear the {out_what} first if it holds another run")
    output_arguments(p)
    run_shortcuts(p)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fedsim")
    except Exception:  # noqa: BLE001 - not installed (run from a checkout)
        from fedsim import __version__

        return __version__


class _VersionAction(argparse.Action):
    """``--version``: the installed version, looked up only when asked (importlib.metadata costs a tenth
    of a second on every other command)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"fedsim {_version()}")  # on stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedsim", description="Federated-learning privacy lab on Flower: "
                                "simulations, curious-server gradient-leakage attacks and defenses.")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run an experiment config (Flower simulation on Ray)",
                       description="Run a federated simulation from a TOML config and write a run folder "
                                   "(config.toml, metrics.jsonl/.csv, summary.json, accuracy.png, report.md, ...). "
                                   + BACKENDS)
    _config_arguments(r, "TOML config, e.g. experiments/default.toml (with --resume: default the run's own)",
                      "override a config value (repeatable), e.g. --set federation.rounds=3", "run folder",
                      config_optional=True)
    r.add_argument("--backend", choices=("ray", "inprocess"),
                   help="override simulation.backend: ray (the clients in parallel Ray actors; a few seconds of "
                        "start-up) or inprocess (no Ray: one client after another in this process; starts at "
                        "once: better for short runs, 1-2 cores and debugging)")
    r.add_argument("--resume-without-client-state", action="store_true",
                   help="with --resume: continue although client-state files are missing or damaged; every client "
                   "starts without its state (residuals, accountants, keys), so the run is no longer exact")
    r.set_defaults(func=_cmd_run)

    s = sub.add_parser("sweep", help="run every variant of an experiment and tabulate them",
                       description="Run a sweep file (a config plus [[variants]], optionally seeds = [...]) and "
                                   "write one report with a row per variant (mean ± std over seeds), "
                                   "sweep.jsonl/.csv and comparison.png. Every variant on Ray runs on one Ray "
                                   "runtime: Ray and the client actors start once for the whole sweep; "
                                   "--set simulation.backend='\"inprocess\"' runs the variants without Ray "
                                   "(better for many short variants on 1-2 cores).")
    _config_arguments(s, "sweep TOML, e.g. experiments/defenses.toml",
                      "override a config value in every variant that runs (repeatable)", "sweep folder")
    s.add_argument("--only", action="append", metavar="LABEL", help="run only this variant (repeatable)")
    s.add_argument("--seeds", metavar="S1,S2,...", help="repeat every variant once per seed (replaces the "
                   "file's seeds); the table shows mean ± std")
    s.add_argument("--jobs", type=int, default=1, metavar="N", help=JOBS_HELP)
    s.set_defaults(func=_cmd_sweep)

    e = sub.add_parser("experiment", help="reproduce a paper's table: a named experiment (fedsim experiment --list)",
                       description="Run a named experiment (experiments/NAME.toml, or a file): a sweep whose report "
                                   "has tables shaped like the paper's, the systematic evaluation and the paper's "
                                   "claims checked. Re-run into the same --out to skip completed variants. "
                                   "Every variant on Ray runs on one Ray runtime (Ray and the client actors start "
                                   "once); --set simulation.backend='\"inprocess\"' skips Ray's start-up (the "
                                   "clients run one after another): usually better for --quick and other short "
                                   "variants on 1-2 cores.")
    _config_arguments(e, "experiment name (e.g. seed004-systematic) or file", "override a config value in every "
                      "variant that runs (repeatable)", "experiment folder", config_optional=True)
    e.add_argument("--quick", action="store_true", help="the experiment's quick variant: a smoke test of the whole pipeline "
                   "at a tiny scale (README: how long each takes)")
    e.add_argument("--list", action="store_true", help="list the experiments")
    e.add_argument("--only", action="append", metavar="LABEL", help="run only this variant (repeatable)")
    e.add_argument("--seeds", metavar="S1,S2,...", help="repeat every variant once per seed")
    e.add_argument("--jobs", type=int, default=1, metavar="N", help=JOBS_HELP)
    e.add_argument("--publish", metavar="DIR", help="copy the full report to DIR/<name>/ with command, date and "
                   "commit, and update DIR/README.md (e.g. docs/results)")
    e.set_defaults(func=_cmd_experiment)

    c = sub.add_parser("compare", help="compare existing run or sweep folders",
                       description="Tabulate and plot existing run folders (and sweep folders, one entry per "
                                   "variant): comparison.md, comparison.csv, comparison.png (accuracy vs round; "
                                   "accuracy vs leakage when the runs were attacked).")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run folders (with summary.json) or sweep folders")
    c.add_argument("--out", help="folder to write (default: runs/compare-<timestamp>)")
    c.add_argument("--title", help="title of the table and figure")
    c.set_defaults(func=_cmd_compare)

    d = sub.add_parser("datasets", help="list datasets and whether they are available here",
                       description="List the registered datasets, whether each can be loaded on this machine, "
                                   "and how to get the missing ones.")
    d.add_argument("--data-dir", help="also look in this folder")
    d.add_argument("-v", "--verbose", action="store_true", help="show where each dataset is read from")
    d.set_defaults(func=_cmd_datasets)

    from fedsim.app.attack import add_attack_command

    add_attack_command(sub, output_arguments)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 2 a bad input (config, data, run folder; nothing written); 1 the run failed
    (its folder says how far it got); 128 + signal number when stopped by SIGINT (130) or SIGTERM (143)."""
    args = build_parser().parse_args(argv)  # --help / --version exit here, before anything heavy loads
    from fedsim import progress
    from fedsim.app.ray_runtime import shared
    from fedsim.components import ConfigError
    from fedsim.interrupt import RunInterrupted

    progress.log_to_stderr()  # warnings: one "[fedsim] warning: ..." line each, once
    if args.command != "datasets":
        progress.set_level(progress.QUIET if getattr(args, "quiet", False) else
                           progress.VERBOSE if getattr(args, "verbose", False) else progress.NORMAL)
    with shared() as runtime:  # one Ray runtime for the whole command, stopped after the last line is printed
        try:
            return args.func(args)
        except ConfigError as exc:
            runtime.abandon()  # exit now, not once a background Ray start has finished
            print(f"fedsim: error: {exc}", file=sys.stderr)
            return 2
        except RunInterrupted as exc:
            run_dir = getattr(exc, "run_dir", None)
            where = f"; summary in {run_dir}/summary.json" if run_dir else ""
            hint = getattr(exc, "resume_hint", None)
            print(f"fedsim: {exc}{where}{f'; continue with: {hint}' if hint else ''}", file=sys.stderr)
            return exc.exit_code
        except Exception as exc:
            from fedsim.checkpoint import CheckpointError
            from fedsim.data import DatasetUnavailable

            if isinstance(exc, (CheckpointError, DatasetUnavailable)):
                runtime.abandon()
                print(f"fedsim: error: {exc}", file=sys.stderr)
                return 2
            line = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
            run_dir = getattr(exc, "run_dir", None)
            if isinstance(exc, OSError) and exc.filename is not None:  # a disk that is full, read-only, gone
                kept = f"; last completed round in {run_dir}/summary.json" if run_dir else "; nothing was kept"
                print(f"fedsim: the run failed: cannot write {exc.filename}: {exc.strerror or exc}{kept}",
                      file=sys.stderr)
                return 1
            if run_dir is not None:
                print(f"fedsim: the run failed: {line} (traceback and last completed round in "
                      f"{run_dir}/summary.json)", file=sys.stderr)
                return 1
            # no traceback by default (one line, as for every other failure); --verbose (or
            # FEDSIM_TRACEBACK=1 for the commands without it) shows it
            import os

            show = progress.verbose() or os.environ.get("FEDSIM_TRACEBACK", "") not in ("", "0")
            if show:
                import traceback

                traceback.print_exc()
            how = "--verbose" if hasattr(args, "quiet") else "FEDSIM_TRACEBACK=1"
            hint = "" if show else f"; {how} shows the traceback"
            if getattr(exc, "nothing_written", False):
                print(f"fedsim: the {'attack' if args.command == 'attack' else 'run'} failed before completing a "
                      f"round: {line} (nothing written{hint})", file=sys.stderr)
            else:
                print(f"fedsim: error: {line} (an unexpected error{hint})", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
