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

import copy
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from fedsim import progress as prog
from fedsim.app import validate
from fedsim.claims import check_claims
from fedsim.comparison import (
    comparison_table,
    mean_std_rows,
    plot_comparison,
    run_row,
    table_columns,
    table_formats,
)
from fedsim.config import (
    ConfigError,
    _merge,
    absolute_references,
    apply_overrides,
    defaults,
    precheck,
    read_toml,
)
from fedsim.export import write_csv
from fedsim.reports import atomic_write_text, new_run_dir, write_jsonl
from fedsim.tables import check_report

variant_row = run_row  # one run folder as a table row (fedsim.comparison.run_row)


def check_seeds(seeds: Any, where: str = "seeds") -> list[int]:
    ok = isinstance(seeds, list) and seeds and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                   for x in seeds) and len(set(seeds)) == len(seeds)
    if not ok:
        raise ConfigError(f"{where} must be a non-empty list of distinct integers >= 0, got {seeds!r}")
    return list(seeds)


# an experiment's seeds unless its file names them (``seeds = [...]``) or ``--seeds`` does: its claims
# are decided over at least three (fedsim.claims); ``--quick`` runs one seed unless ``[quick] seeds``
EXPERIMENT_SEEDS = (0, 1, 2)
VARIANT_META = ("label", "row", "col", "family")  # variant keys that describe it rather than configure it


@dataclass
class SweepSpec:
    """A sweep or experiment file, resolved: the base config, the variants' labels and configs, the
    seeds, and (experiments) the ``[experiment]`` description, the ``[report]`` tables, the claims and
    each variant's ``row`` / ``col`` / ``family`` labels."""

    base: dict[str, Any]
    variants: list[tuple[str, dict]]
    seeds: list[int] | None = None
    experiment: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=lambda: {"tables": [], "systematic": None})
    claims: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, dict[str, str]] = field(default_factory=dict)  # label -> {row, col, family}
    quick: bool = False


def load_sweep(path: str | Path, overrides: Sequence[str] = (),
               only: Sequence[str] = ()) -> tuple[dict[str, Any], list[tuple[str, dict]]]:
    """(base config, [(label, resolved config), ...]); raises ConfigError naming the variant and key.

    ``only`` keeps just the variants with these labels; the overrides are applied to those alone (so
    ``--set defenses.0.sigma=...`` works with ``--only`` a variant that has a defense)."""
    spec = load_spec(path, overrides, only)
    return spec.base, spec.variants


def load_sweep_seeds(path: str | Path, overrides: Sequence[str] = (), only: Sequence[str] = ()
                     ) -> tuple[dict[str, Any], list[tuple[str, dict]], list[int] | None]:
    """:func:`load_sweep` plus the file's ``seeds`` (None when it has none)."""
    spec = load_spec(path, overrides, only)
    return spec.base, spec.variants, spec.seeds


def _check_quick(quick: Any, p: Path, labels: Sequence[str]) -> dict[str, Any]:
    if not isinstance(quick, dict):
        raise ConfigError(f"{p}: [quick] must be a table (set = [...], variants = [...], seeds = [...])")
    unknown = set(quick) - {"set", "variants", "seeds", "variant_set"}
    if unknown:
        raise ConfigError(f"{p}: quick: unknown keys {sorted(unknown)} (set, variants, seeds, variant_set)")
    if not isinstance(quick.get("set", []), list) or not all(isinstance(x, str) for x in quick.get("set", [])):
        raise ConfigError(f"{p}: quick.set must be a list of 'section.key=value' strings")
    per = quick.get("variant_set", {})
    if not isinstance(per, dict) or not all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                                            for v in per.values()):
        raise ConfigError(f"{p}: quick.variant_set must be a table from variant label to a list of "
                          "'section.key=value' strings")
    if any(k not in labels for k in per):
        raise ConfigError(f"{p}: quick.variant_set: no variant labelled {[k for k in per if k not in labels]}")
    vs = quick.get("variants", [])
    if not isinstance(vs, list) or any(v not in labels for v in vs):
        raise ConfigError(f"{p}: quick.variants must list variant labels; unknown: "
                          f"{[v for v in vs if v not in labels] if isinstance(vs, list) else vs!r}")
    return quick


def load_spec(path: str | Path, overrides: Sequence[str] = (), only: Sequence[str] = (),
              quick: bool = False, checked: Callable[[list[dict[str, Any]]], None] | None = None) -> SweepSpec:
    """Read and validate a sweep/experiment file (every variant's config, the report specs and claims).
    ``quick`` applies the file's ``[quick]`` table: its ``set`` overrides come before ``overrides`` (then
    ``variant_set``: a variant's own quick overrides, for keys the other variants do not have, such as
    the parameters of an attack only it runs) and its ``variants`` choose the variants unless ``only``
    does. Every variant passes the first pass (:func:`fedsim.config.precheck`, no heavy import) before
    any is validated in full; ``checked`` is then called with their configs (``run_sweep`` starts Ray
    there)."""
    p = Path(path)
    data = read_toml(p, "sweep file")
    seeds = check_seeds(data.pop("seeds")) if "seeds" in data else None
    if seeds is None and "experiment" in data:  # an experiment decides its claims over seeds
        seeds = list(EXPERIMENT_SEEDS)
    variants = data.pop("variants", None)
    experiment = data.pop("experiment", {})
    report = data.pop("report", None)
    quick_spec = data.pop("quick", None)
    if not isinstance(variants, list) or not variants or not all(isinstance(v, dict) for v in variants):
        raise ConfigError(f"{p}: a sweep needs [[variants]] tables (each with a label)")
    if not isinstance(experiment, dict):
        raise ConfigError(f"{p}: [experiment] must be a table (title, paper, scale, notes, claims)")
    unknown = set(experiment) - {"title", "paper", "scale", "notes", "claims"}
    if unknown:
        raise ConfigError(f"{p}: experiment: unknown keys {sorted(unknown)} (title, paper, scale, notes, claims)")
    base = defaults()
    _merge(base, data)
    out = []
    labels = []
    meta: dict[str, dict[str, str]] = {}
    for i, v in enumerate(variants):
        label = v.get("label")
        if not isinstance(label, str) or not label:
            raise ConfigError(f"variants[{i}].label must be a non-empty string")
        if label in labels:
            raise ConfigError(f"variants[{i}].label {label!r} is used twice")
        for k in VARIANT_META[1:]:
            if k in v and not isinstance(v[k], str):
                raise ConfigError(f"variants[{i}].{k} must be a string, got {v[k]!r}")
        labels.append(label)
        meta[label] = {"row": v.get("row", label), "col": v.get("col"), "family": v.get("family")}
    report_spec = check_report(report, f"{p}: report", base=str(p.parent))
    claims = check_claims(experiment.get("claims"), labels, f"{p}: experiment.claims")
    pre: list[str] = []
    per_variant: dict[str, list[str]] = {}
    if quick:
        if quick_spec is None:
            raise ConfigError(f"{p}: --quick: this file has no [quick] table")
        q = _check_quick(quick_spec, p, labels)
        pre = list(q.get("set", []))
        per_variant = {k: list(v) for k, v in q.get("variant_set", {}).items()}
        if not only and q.get("variants"):
            only = list(q["variants"])
        # a smoke test: one run per variant at the file's seed unless [quick] names seeds
        seeds = check_seeds(q["seeds"], f"{p}: quick.seeds") if "seeds" in q else None
    elif quick_spec is not None:
        _check_quick(quick_spec, p, labels)
    unknown = [o for o in only if o not in labels]
    if unknown:
        raise ConfigError(f"--only {unknown}: no such variant; variants: {labels}")
    overrides = [*pre, *overrides]
    index = {}
    for i, v in enumerate(variants):
        v = {k: x for k, x in v.items() if k not in VARIANT_META}
        label = labels[i]
        if only and label not in only:
            continue
        cfg = copy.deepcopy(base)
        _merge(cfg, v)
        cfg["name"] = f"{base.get('name', 'sweep')}-{_slug(label)}"
        try:
            apply_overrides(cfg, [*pre, *per_variant.get(label, []), *overrides[len(pre):]])
            absolute_references(cfg)
            precheck(cfg)
        except ConfigError as exc:
            raise ConfigError(f"variants[{i}] ({label}): {exc}") from exc
        index[label] = i
        out.append((label, cfg))
    if checked is not None:
        checked([cfg for _, cfg in out])
    for label, cfg in out:
        try:
            validate(cfg)
        except ConfigError as exc:
            raise ConfigError(f"variants[{index[label]}] ({label}): {exc}") from exc
    # the base names the output folder and heads the report; every override was checked against every
    # selected variant above, and one that only a variant can take (defenses.<i>.<param>) skips the base
    for o in overrides:
        try:
            apply_overrides(base, [o])
        except ConfigError:
            pass
    return SweepSpec(base, out, seeds, experiment, report_spec, claims, meta, quick)


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-").lower() or "variant"


class SweepFailed(RuntimeError):
    """Some variants failed (the others ran; the sweep's report lists every variant's status)."""


def resume_command(path: str | Path, out_dir: str | Path, overrides: Sequence[str] = (), only: Sequence[str] = (),
                   seeds: Sequence[int] | None = None, quick: bool = False,
                   command: Sequence[str] | None = None) -> str:
    """The command that continues an interrupted sweep or experiment in ``out_dir``: ``command`` (default
    ``fedsim sweep PATH``; ``fedsim experiment NAME`` for an experiment) with the same ``--quick``,
    ``--only``, ``--set`` and ``--seeds``, and ``--resume OUT_DIR``."""
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
    return shlex.join([*argv, "--resume", str(out_dir)])


def run_sweep(path: str | Path, overrides: Sequence[str] = (), out: str | Path | None = None,
              progress: bool = True, only: Sequence[str] = (), seeds: Sequence[int] | None = None,
              overwrite: bool = False, quick: bool = False, command: Sequence[str] | None = None) -> Path:
    """Run every variant (once per seed when the file or ``seeds`` gives seeds) into
    ``<out>/<nn>-<label>[-seed<s>]/``. Everything is checked first (configs, data, partitions, the
    variant folders): a bad value anywhere stops the sweep before anything runs. Re-run into the same
    ``out``, completed runs are skipped and interrupted ones resume from their checkpoints;
    ``overwrite`` clears the folder first. A run that fails is recorded (``status`` in its row) and the
    sweep goes on; :class:`SweepFailed` is raised at the end. ``quick`` runs the file's ``[quick]``
    variant (:func:`load_spec`). ``command`` is how the caller was invoked (``fedsim experiment NAME``),
    for the hint an interruption prints (:func:`resume_command`). The progress line of each run shows
    the runs done of the total and an ETA from the runs that ran here (complete ones are skipped and
    do not count)."""
    from fedsim.app import ray_runtime

    with ray_runtime.shared():  # every variant's run shares Ray and, where their resources match, the actors
        return _run_sweep(path, overrides, out, progress, only, seeds, overwrite, quick, command)


def _prestart(cfgs: list[dict[str, Any]]) -> None:
    from fedsim.app import ray_runtime

    for cfg in cfgs:
        if cfg["simulation"]["backend"] == "ray":
            ray_runtime.prestart(cfg)  # the first Ray variant: its actors warm up while the rest is checked
            return


def _run_sweep(path: str | Path, overrides: Sequence[str], out: str | Path | None, progress: bool,
               only: Sequence[str], seeds: Sequence[int] | None, overwrite: bool, quick: bool,
               command: Sequence[str] | None) -> Path:
    spec = load_spec(path, overrides, only, quick, checked=_prestart)  # no torch before its first pass
    from fedsim.app.runner import run_experiment
    from fedsim.config import check_data
    from fedsim.interrupt import RunInterrupted
    from fedsim.runfolder import RunFolderError, decide, open_sweep_folder

    base, variants = spec.base, spec.variants
    given_seeds = list(seeds) if seeds is not None else None
    seeds = check_seeds(list(seeds), "--seeds") if seeds is not None else spec.seeds
    spec.seeds = seeds
    for i, (label, cfg) in enumerate(variants):
        try:
            check_data(cfg)
        except ConfigError as exc:
            raise ConfigError(f"variants[{i}] ({label}): {exc}") from None
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
        folder = open_sweep_folder(out_dir, overwrite=overwrite)
    except BaseException:
        if made_here:
            out_dir.rmdir()
        raise
    try:
        jobs = []
        for i, (label, cfg) in enumerate(variants):
            for seed in (seeds or [None]):
                name = f"{i:02d}-{_slug(label)}"
                if seed is not None:
                    cfg = copy.deepcopy(cfg)
                    cfg["seed"] = seed
                    cfg["name"] = f"{variants[i][1]['name']}-seed{seed}"
                    name += f"-seed{seed}"
                jobs.append((i, label, cfg, seed, out_dir / name))
        complete: set[Path] = set()
        for _, label, cfg, _, d in jobs:  # a folder of another run stops the sweep before it starts
            if d.is_dir() and decide(d, cfg, what=f"variant {label!r}: folder").action == "complete":
                complete.add(d)
        if not (out_dir / "sweep.jsonl").exists():
            write_jsonl(out_dir / "sweep.jsonl", [])  # marks the folder as a sweep's
        runs: dict[int, list[dict[str, Any]]] = {}
        run_dirs: dict[int, list[Path]] = {}
        failed: list[str] = []
        t0 = time.perf_counter()
        ran, spent = 0, 0.0  # runs that ran here (not skipped as complete) and their wall time
        with prog.suppressed(not progress):
            for done, (i, label, cfg, seed, job_dir) in enumerate(jobs):
                elapsed = time.perf_counter() - t0
                skip = job_dir in complete
                to_run = sum(1 for j in jobs[done:] if j[4] not in complete)  # this one included
                left = f", ETA {prog.duration(prog.eta(ran, ran + to_run, spent))}" if ran and to_run else ""
                prog.say(f"sweep {done + 1}/{len(jobs)}: {label}" + (f" (seed {seed})" if seed is not None else "")
                         + ("  (complete: skipped)" if skip else "")
                         + f"  [{done} done in {prog.duration(elapsed)}{left}]")
                t_job = time.perf_counter()
                try:
                    run_dir = run_experiment(cfg, out=job_dir, progress=progress)
                    row = run_row(label, run_dir)
                    run_dirs.setdefault(i, []).append(run_dir)
                except RunInterrupted as exc:
                    exc.run_dir = out_dir  # type: ignore[attr-defined]
                    exc.resume_hint = resume_command(path, out_dir, overrides, only,  # type: ignore[attr-defined]
                                                     given_seeds, quick, command)
                    raise
                except (ConfigError, KeyboardInterrupt):
                    raise
                except Exception as exc:  # noqa: BLE001 - recorded; the other runs still run
                    failed.append(label if seed is None else f"{label} (seed {seed})")
                    row = {"variant": label, "status": "failed", "accuracy": None, "loss": None,
                           "round_seconds": None, "run": job_dir.name,
                           "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
                    prog.say(f"sweep run {failed[-1]!r} failed: {row['error']}")
                if not skip:
                    ran, spent = ran + 1, spent + time.perf_counter() - t_job
                if seed is not None:
                    row["seed"] = seed
                runs.setdefault(i, []).append(row)
                write_sweep_outputs(out_dir, base, variants, runs, run_dirs, seeds, spec)
            prog.say(f"sweep done: {len(jobs)} runs in {prog.duration(time.perf_counter() - t0)}; "
                     f"report {out_dir / 'report.md'}")
        if failed:
            err = SweepFailed(f"{len(failed)} of {len(jobs)} runs failed: {failed}")
            err.run_dir = out_dir  # type: ignore[attr-defined]
            raise err
    finally:
        folder.release()
    return out_dir


def write_sweep_outputs(out_dir: Path, base: dict[str, Any], variants: Sequence[tuple[str, dict]],
                        runs: dict[int, list[dict[str, Any]]], run_dirs: dict[int, list[Path]],
                        seeds: Sequence[int] | None, spec: SweepSpec | None = None) -> None:
    """sweep.jsonl/.csv (one row per variant), runs.jsonl/.csv (with seeds), report.md, comparison.png;
    for an experiment also its paper-shaped tables, the systematic evaluation (``systematic.png``) and
    the claims (``claims.json``)."""
    order = sorted(runs)
    if seeds:
        rows = [mean_std_rows(variants[i][0], runs[i], [r["seed"] for r in runs[i]]) for i in order]
        for i, r in zip(order, rows):
            if any(x.get("status") == "failed" for x in runs[i]):
                r["status"] = "failed"
        every = [r for i in order for r in runs[i]]
        write_jsonl(out_dir / "runs.jsonl", every)
        write_csv(out_dir / "runs.csv", every)
    else:
        rows = [dict(runs[i][0]) for i in order]
    base_t = rows[0].get("round_seconds")
    for r in rows:
        r["time_ratio"] = r["round_seconds"] / base_t if base_t and r.get("round_seconds") else None
    write_jsonl(out_dir / "sweep.jsonl", rows)
    write_csv(out_dir / "sweep.csv", rows)
    groups = [(variants[i][0], run_dirs[i]) for i in order if run_dirs.get(i)]
    plot_comparison(groups, rows, out_dir / "comparison.png", title=str(base.get("name", "sweep")))
    extra = experiment_sections(out_dir, spec, variants, run_dirs) if spec is not None else []
    write_sweep_report(out_dir, base, rows, seeds, spec, extra)


def experiment_runs(spec: SweepSpec, variants: Sequence[tuple[str, dict]],
                    run_dirs: dict[int, list[Path]]) -> list[dict[str, Any]]:
    """One full row per run that completed (:func:`fedsim.comparison.run_row`), with its ``seed`` (from
    the run's config) and the variant's ``row``/``col``/``family``: what the claims are decided on."""
    out = []
    for i, (label, _) in enumerate(variants):
        meta = {k: v for k, v in spec.meta.get(label, {}).items() if v is not None}
        for d in run_dirs.get(i, []):
            seed = read_toml(Path(d) / "config.toml", "run config").get("seed", 0)
            out.append({**run_row(label, d, full=True), "seed": seed, **meta})
    return out


def experiment_rows(spec: SweepSpec, runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant that ran: the mean (and ``<column>_std``) over its seeds' ``runs``, with its
    ``row``/``col``/``family``."""
    out = []
    for label in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == label]
        r = mean_std_rows(label, mine, [x["seed"] for x in mine] if len(mine) > 1 else ())
        out.append({**r, **{k: v for k, v in spec.meta.get(label, {}).items() if v is not None}})
    return out


def experiment_sections(out_dir: Path, spec: SweepSpec, variants: Sequence[tuple[str, dict]],
                        run_dirs: dict[int, list[Path]]) -> list[str]:
    """The report's experiment sections (tables shaped like the paper's, systematic evaluation, claims)."""
    from fedsim.claims import claims_markdown, evaluate_claims
    from fedsim.tables import paper_table, plot_systematic, systematic, systematic_markdown

    if not (spec.report["tables"] or spec.report["systematic"] or spec.claims or spec.report.get("figures")):
        return []
    runs = experiment_runs(spec, variants, run_dirs)
    rows = experiment_rows(spec, runs)
    text = experiment_figures(out_dir, spec, variants)
    for t in spec.report["tables"]:
        text += [f"## {t['title']}\n", paper_table(rows, t), ""]
        if t.get("note"):
            text += [t["note"], ""]
    sys_spec, result = spec.report["systematic"], None
    if sys_spec:
        result = systematic(rows, sys_spec)
        fig = None
        if result["points"]:
            plot_systematic(result, sys_spec, out_dir / "systematic.png")
            fig = "systematic.png"
        text += [systematic_markdown(result, sys_spec, fig), ""]
        atomic_write_text(out_dir / "systematic.json", json.dumps(result, indent=1, default=str))
    if spec.claims:
        results = evaluate_claims(spec.claims, runs, sys_spec)
        text += [claims_markdown(results), ""]
        atomic_write_text(out_dir / "claims.json", json.dumps(results, indent=1))
    return text


def experiment_figures(out_dir: Path, spec: SweepSpec, variants: Sequence[tuple[str, dict]]) -> list[str]:
    """``[[report.figures]]``: call each figure's ``draw(out_dir, configs)``; a section per figure drawn."""
    from fedsim.components import FIGURES

    configs = {label: cfg for label, cfg in variants}
    text = []
    for fig in spec.report.get("figures", []):
        try:
            path = FIGURES.lookup(fig["draw"], "report.figures.draw")(out_dir, configs)
        except Exception as exc:  # noqa: BLE001 - a figure that fails is noted, the report is still written
            text += [f"## {fig['title']}\n", f"Not drawn: {type(exc).__name__}: {exc}".splitlines()[0][:300], ""]
            continue
        if path is None:
            continue
        try:
            rel = Path(path).resolve().relative_to(out_dir.resolve()).as_posix()
        except ValueError:  # drawn outside the sweep folder: link it where it is
            rel = Path(path).resolve().as_posix()
        text += [f"## {fig['title']}\n", f"![{fig['title']}]({rel})\n"]
    return text


def write_sweep_report(out_dir: Path, base: dict[str, Any], rows: list[dict[str, Any]],
                       seeds: Sequence[int] | None = None, spec: SweepSpec | None = None,
                       extra: Sequence[str] = ()) -> None:
    cols = table_columns(rows)
    fed, train = base["federation"], base["train"]
    repeat = (f" Every variant ran once per seed {list(seeds)}: cells are mean ± sample standard deviation "
              "over the seeds (`sweep.jsonl`: the means and `<column>_std`; `runs.jsonl`: every run).") if seeds else ""
    links = []
    for r in rows:
        runs = r.get("runs") or [r.get("run")]
        links.append(f"{r['variant']}: " + ", ".join(f"[{x}]({x}/report.md)" for x in runs if x))
    exp = spec.experiment if spec is not None else {}
    head = [f"# {exp['title']}\n" if exp.get("title") else f"# fedsim sweep: {base.get('name', 'sweep')}\n"]
    if exp:
        head += [f"Paper: {exp['paper']}.\n" if exp.get("paper") else "",
                 f"Scale: {exp['scale']}\n" if exp.get("scale") else "",
                 f"Seeds: {', '.join(str(x) for x in seeds)} (every variant runs once per seed; the claims are "
                 "decided over them)\n" if seeds and spec is not None and not spec.quick else "",
                 "**Quick variant** (`--quick`): a smoke-test scale, "
                 + (f"seeds {list(seeds)}" if seeds else "one seed")
                 + "; the numbers are not the experiment's, and a claim needs three seeds to be decided.\n"
                 if spec is not None and spec.quick else "",
                 f"{exp['notes'].strip()}\n" if exp.get("notes") else ""]
    text = [*[h for h in head if h], *extra,
            *(["## All variants\n"] if extra else []),
            f"{len(rows)} variants; {fed['rounds']} rounds, {fed['num_clients']} clients, data "
            f"{base['data']['dataset']}, model {base['model']['name']}, lr {train['lr']}, batch "
            f"{train['batch_size']}. Accuracy/loss: global model on the test set after the last round"
            + ("; other `*_accuracy` columns: what defenses and observers report in the last round (e.g. "
               "FedKL's own-key and random-key accuracies). " if any("." in k and k.endswith("_accuracy") for k in cols) else ". ")
            + "Leakage columns: mean over the attacked updates (`<attack>.psnr` in dB, `.ssim`, `.label_acc`, "
            "`.success_content` = share of images with SSIM >= the threshold; of records (tabular data) with MSE "
            "<= `attack.mse_threshold`, and no PSNR/SSIM). `round_seconds`: median wall time "
            "of rounds >= 2 (training, aggregation, evaluation; attacks are timed apart); `time_ratio`: relative to "
            f"the first variant.{repeat}\n",
            comparison_table(rows, cols, table_formats(cols)),
            "\n![comparison](comparison.png)\n",
            "\nEach run's own report (in its folder under this sweep's folder): " + "; ".join(links) + "\n"]
    atomic_write_text(out_dir / "report.md", "\n".join(text))
