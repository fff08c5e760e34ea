"""Experiments with several variants: one command reproduces a table.

A sweep file is an ordinary config plus ``[[variants]]``; each variant has a ``label`` and any config
keys, merged over the base (tables merge key by key; lists such as ``defenses`` replace). Every
variant is validated before anything runs, then each runs into ``<out>/<nn>-<label>/`` and the sweep
writes ``sweep.jsonl`` / ``sweep.csv`` (one row per variant), ``report.md`` with one table (final
accuracy, loss, leakage metrics of every configured attack, mean round time relative to the first
variant) and ``comparison.png`` (accuracy against the round for every variant; final accuracy
against leakage when the runs were attacked).

``seeds = [0, 1, 2]`` (top level, or ``fedsim sweep --seeds 0,1,2``) repeats every variant once per
seed (``seed`` replaced; folders ``<nn>-<label>-seed<s>``): the table then shows ``mean ± std``
(sample standard deviation) of every column, ``sweep.jsonl`` has the means and ``<column>_std``, and
``runs.jsonl`` / ``runs.csv`` one row per run. A file with an ``[experiment]`` table runs seeds 0, 1, 2
unless it names its own (its claims are decided over them, :mod:`fedsim.claims`); its ``--quick``
variant runs one seed unless ``[quick] seeds`` names more.

    seeds = [0, 1]

    [[variants]]
    label = "no defense"

    [[variants]]
    label = "gaussian 1e-2"
    defenses = [{ name = "gaussian-noise", variance = 1e-2 }]
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from fedsim import progress as prog
from fedsim.app.sweep_pool import failed_row, run_pooled
from fedsim.app.sweep_report import write_sweep_outputs
from fedsim.app.sweep_spec import SweepSpec, load_spec, load_sweep, run_config, variant_slug
from fedsim.comparison import run_row
from fedsim.config import ConfigError
from fedsim.reports import new_run_dir, write_jsonl

__all__ = ["SweepFailed", "SweepSpec", "load_spec", "load_sweep", "resume_command", "run_sweep", "variant_row"]

variant_row = run_row  # one run folder as a table row (fedsim.comparison.run_row)


class SweepFailed(RuntimeError):
    """Some variants failed (the others ran; the sweep's report lists every variant's status)."""


def resume_command(path: str | Path, out_dir: str | Path, overrides: Sequence[str] = (), only: Sequence[str] = (),
                   seeds: Sequence[int] | None = None, quick: bool = False,
                   command: Sequence[str] | None = None, workers: int = 1) -> str:
    """The command that continues an interrupted sweep or experiment in ``out_dir``: ``command`` (default
    ``fedsim sweep PATH``; ``fedsim experiment NAME`` for an experiment) with the same ``--quick``,
    ``--only``, ``--set``, ``--seeds`` and ``--jobs``, and ``--resume OUT_DIR``."""
    import shlex

    argv = list(command) if command else ["fedsim", "sweep", str(path)]
    if quick:
        argv.append("--quick")
    for o in only:
        argv += ["--only", o]
    for o in overrides:
        argv += ["--set", o]
    if seeds is not None:
        argv += ["--seeds", ",".join(str(s) for s in seeds)]
    if workers > 1:
        argv += ["--jobs", str(workers)]
    return shlex.join([*argv, "--resume", str(out_dir)])


def run_sweep(path: str | Path, overrides: Sequence[str] = (), out: str | Path | None = None,
              progress: bool = True, only: Sequence[str] = (), seeds: Sequence[int] | None = None,
              overwrite: bool = False, quick: bool = False, command: Sequence[str] | None = None,
              workers: int = 1) -> Path:
    """Run every variant (once per seed when the file or ``seeds`` gives seeds) into
    ``<out>/<nn>-<label>[-seed<s>]/``. Everything is checked first (configs, data, partitions, the
    variant folders): a bad value anywhere stops the sweep before anything runs. Re-run into the same
    ``out``, completed runs are skipped and interrupted ones resume from their checkpoints;
    ``overwrite`` clears the folder first. A run that fails is recorded (``status`` in its row) and the
    sweep goes on; :class:`SweepFailed` is raised at the end. ``quick`` runs the file's ``[quick]``
    variant (:func:`load_spec`). ``command`` is how the caller was invoked (``fedsim experiment NAME``),
    for the hint an interruption prints (:func:`resume_command`). The progress line of each run shows
    the runs done of the total and an ETA from the runs that ran here (complete ones are skipped and
    do not count). ``workers`` > 1 runs the in-process runs on that many worker processes at once
    (:mod:`fedsim.app.sweep_pool`; the same results), then the Ray runs here one after another."""
    from fedsim.app import ray_runtime

    with ray_runtime.shared():  # every variant's run shares Ray and, where their resources match, the actors
        return _run_sweep(path, overrides, out, progress, only, seeds, overwrite, quick, command, workers)


def _prestart(cfgs: list[dict[str, Any]]) -> None:
    from fedsim.app import ray_runtime

    for cfg in cfgs:
        if cfg["simulation"]["backend"] == "ray":
            ray_runtime.prestart(cfg)  # the first Ray variant: its actors warm up while the rest is checked
            return


def _run_sweep(path: str | Path, overrides: Sequence[str], out: str | Path | None, progress: bool,
               only: Sequence[str], seeds: Sequence[int] | None, overwrite: bool, quick: bool,
               command: Sequence[str] | None, workers: int = 1) -> Path:
    # no torch before its first pass; every run's config is validated, building its components once
    spec = load_spec(path, overrides, only, quick, checked=_prestart, seeds=seeds, runs=True)
    from fedsim.config_checks import check_data
    from fedsim.runfolder import decide

    base, variants = spec.base, spec.variants
    given_seeds = list(seeds) if seeds is not None else None
    seeds = spec.seeds
    for i, (label, cfg) in enumerate(variants):
        try:
            check_data(cfg)
        except ConfigError as exc:
            raise ConfigError(f"variants[{i}] ({label}): {exc}") from None
    out_dir, folder = _open_folder(out, base, quick, overwrite)
    try:
        jobs = _jobs(variants, seeds, out_dir)
        complete: set[Path] = set()
        for _, label, cfg, _, d in jobs:  # a folder of another run stops the sweep before it starts
            if d.is_dir() and decide(d, cfg, what=f"variant {label!r}: folder").action == "complete":
                complete.add(d)
        if not (out_dir / "sweep.jsonl").exists():
            write_jsonl(out_dir / "sweep.jsonl", [])  # marks the folder as a sweep's
        results: dict[int, tuple[dict[str, Any], list[Path]]] = {}  # job index -> (row, run folders)

        def record(k: int, row: dict[str, Any], dirs: list[Path]) -> None:
            """Keep job ``k``'s row and rewrite the sweep's outputs from every row so far, in job order."""
            if jobs[k][3] is not None:
                row["seed"] = jobs[k][3]
            results[k] = (row, dirs)
            runs: dict[int, list[dict[str, Any]]] = {}
            run_dirs: dict[int, list[Path]] = {}
            for j in sorted(results):
                runs.setdefault(jobs[j][0], []).append(results[j][0])
                run_dirs.setdefault(jobs[j][0], []).extend(results[j][1])
            write_sweep_outputs(out_dir, base, variants, runs, run_dirs, seeds, spec)

        failed: list[str] = []
        t0 = time.perf_counter()
        ran, spent = 0, 0.0  # runs that ran here (not skipped as complete) and their wall time
        resume_hint = (path, out_dir, overrides, only, given_seeds, quick, command, workers)
        with prog.suppressed(not progress):
            if workers > 1:  # the in-process runs on a pool of worker processes first (fedsim.app.sweep_pool)
                todo = [k for k, j in enumerate(jobs) if j[4] not in complete and j[2]["simulation"]["backend"] != "ray"]
                signame = run_pooled(jobs, todo, workers, record, failed, resume_hint, _run_job)
                if signame is not None:
                    from fedsim.interrupt import RunInterrupted

                    raise _with_resume_hint(RunInterrupted(signame), resume_hint)
            for done, (_, label, cfg, seed, job_dir) in enumerate(jobs):
                if done in results:  # ran on the pool
                    continue
                elapsed = time.perf_counter() - t0
                skip = job_dir in complete
                to_run = sum(1 for k, j in enumerate(jobs[done:], done) if j[4] not in complete and k not in results)
                left = f", ETA {prog.duration(prog.eta(ran, ran + to_run, spent))}" if ran and to_run else ""
                prog.say(f"sweep {done + 1}/{len(jobs)}: {label}" + (f" (seed {seed})" if seed is not None else "")
                         + ("  (complete: skipped)" if skip else "")
                         + f"  [{done} done in {prog.duration(elapsed)}{left}]")
                t_job = time.perf_counter()
                dirs: list[Path] = []
                row = _run_job(label, cfg, seed, job_dir, progress, resume_hint, failed, dirs,
                               spec.built.pop((label, seed), None))
                if not skip:
                    ran, spent = ran + 1, spent + time.perf_counter() - t_job
                record(done, row, dirs)
            prog.say(f"sweep done: {len(jobs)} runs in {prog.duration(time.perf_counter() - t0)}; "
                     f"report {out_dir / 'report.md'}")
        if failed:
            err = SweepFailed(f"{len(failed)} of {len(jobs)} runs failed: {failed}")
            err.run_dir = out_dir  # type: ignore[attr-defined]
            raise err
    finally:
        folder.release()
    return out_dir


def _open_folder(out: str | Path | None, base: dict[str, Any], quick: bool, overwrite: bool) -> tuple[Path, Any]:
    """The sweep folder (``out``, or a new one in ``output.dir``), opened; a folder made here and refused
    is removed again."""
    from fedsim.runfolder import RunFolderError, open_sweep_folder

    made_here = False
    if out:
        out_dir = Path(out)
    else:
        try:
            out_dir = new_run_dir(base["output"]["dir"], base.get("name", "sweep") + ("-quick" if quick else ""))
        except OSError as exc:
            raise RunFolderError(f"cannot create a sweep folder in output.dir = {base['output']['dir']!r}: "
                                 f"{exc.strerror or exc}") from None
        made_here = True
    try:
        return out_dir, open_sweep_folder(out_dir, overwrite=overwrite)
    except BaseException:
        if made_here:
            out_dir.rmdir()
        raise


def _jobs(variants: Sequence[tuple[str, dict]], seeds: Sequence[int] | None,
          out_dir: Path) -> list[tuple[int, str, dict, int | None, Path]]:
    """(variant index, label, config, seed, run folder) of every run, variant by variant."""
    jobs = []
    for i, (label, cfg) in enumerate(variants):
        for seed in (seeds or [None]):
            name = f"{i:02d}-{variant_slug(label)}" + (f"-seed{seed}" if seed is not None else "")
            jobs.append((i, label, run_config(cfg, seed), seed, out_dir / name))
    return jobs


def _with_resume_hint(exc: BaseException, resume_hint: tuple) -> BaseException:
    """``exc`` naming the sweep folder and the command that continues it (``resume_hint``: the arguments
    of :func:`resume_command`), as the CLI prints them."""
    exc.run_dir = resume_hint[1]  # type: ignore[attr-defined]
    exc.resume_hint = resume_command(*resume_hint)  # type: ignore[attr-defined]
    return exc


def _run_job(label: str, cfg: dict, seed: int | None, job_dir: Path, progress: bool, resume_hint: tuple,
             failed: list[str], run_dirs: list[Path], components: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one job and return its table row; a failed run is recorded (in ``failed`` and its row), an
    interruption gets the command that resumes the sweep (``resume_hint``: :func:`resume_command`'s
    arguments). ``components``: what validating the job's config built (:func:`load_spec`), for the run."""
    from fedsim.app.runner import run_experiment
    from fedsim.interrupt import RunInterrupted

    try:
        run_dir = run_experiment(cfg, out=job_dir, progress=progress, components=components)
        row = run_row(label, run_dir)
        run_dirs.append(run_dir)
        return row
    except RunInterrupted as exc:
        raise _with_resume_hint(exc, resume_hint) from None
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - recorded; the other runs still run
        return failed_row(label, seed, job_dir, f"{type(exc).__name__}: {exc}", failed)
