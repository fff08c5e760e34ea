"""What a sweep writes (:mod:`fedsim.app.sweep` runs it): ``sweep.jsonl``/``.csv`` (one row per variant),
``runs.jsonl``/``.csv`` (with seeds), ``report.md``, ``comparison.png``, and for an experiment its
paper-shaped tables, systematic evaluation, figures and claims."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from fedsim.app.sweep_spec import SweepSpec
from fedsim.comparison import (
    comparison_table,
    mean_std_rows,
    plot_comparison,
    run_row,
    table_columns,
    table_formats,
)
from fedsim.config import read_toml
from fedsim.export import write_csv
from fedsim.reports import atomic_write_text, write_jsonl


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
