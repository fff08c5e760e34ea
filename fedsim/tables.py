"""Paper-shaped tables and the systematic evaluation (seed 004 eq. 3) for experiments.

An experiment (``fedsim experiment NAME``: a sweep file with ``[experiment]``, ``[quick]`` and
``[report]`` tables, :mod:`fedsim.app.sweep`) gives every variant a ``row`` and optionally a ``col``
label and its report one or more tables laid out like the paper's:

* :func:`paper_table` - ``[[report.tables]]``: rows are the variants' ``row`` labels (in file order;
  ``rows = [...]`` keeps some, ``cols = [...]`` keeps the variants with some ``col`` labels; ``expand = [names]`` makes one column per name, substituting it for
  ``{name}`` in the cell keys: one run with several attacks, a column per attack),
  columns ``cells`` (``{key, header, scale, fmt}``; a key is any column of the variant's row, e.g.
  ``accuracy``, ``idlg.ssim``, ``ig.rmse``, ``final.<metric>``), one group of cells per ``col`` label
  when the variants have them; ``layout = "cells-as-rows"`` puts the cells under each row instead
  (seed 004's Table 4: attacks as rows, defense settings as columns); ``row_labels = {row = "shown"}``
  shows a row under another name (a row label shared with another table, e.g. "1" for batch 1 that
  Table 3.4 calls the fresh model);
* :func:`systematic` - ``[report.systematic]``: for every defense setting (a variant) the strongest
  attack's reconstruction error (the smallest error over the attack set: eq. 3's inner optimum) and the
  utility loss against the undefended variant of the same ``row`` (final loss increase or accuracy
  drop); the best defense at equal utility (largest strongest-attack error among the settings within a
  utility budget) and the utility-privacy scatter (Fig. 3);
* ``[[report.figures]]`` - ``{title, draw}``: a figure the experiment draws itself after its runs, shown
  right after the header: ``draw`` is an import reference (``"package.module:function"``, or
  ``"file.py:function"`` relative to the experiment file) to ``function(out_dir, configs)``, where
  ``configs`` maps every variant's label to its resolved config; it writes a PNG into the sweep folder
  and returns its path, or None when it cannot be drawn from the runs there (e.g. ``--only`` left out
  a variant it needs). A figure that fails is noted in the report, not fatal;
* the claims (``[[experiment.claims]]``) are decided over seeds in :mod:`fedsim.claims`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedsim.config import ConfigError

LAYOUTS = ("cells-as-columns", "cells-as-rows")


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def _cell(row: Mapping[str, Any] | None, key: str, spec: Mapping[str, Any]) -> str:
    """``row[key]`` in the cell's format; ``mean ± std`` when the row has ``<key>_std`` (runs over seeds)."""
    v = (row or {}).get(key)
    x = _num(v)
    if x is None:
        return "-" if v is None else str(v)
    scale, fmt = float(spec.get("scale", 1.0)), spec.get("fmt", ".3f")
    sd = _num((row or {}).get(f"{key}_std"))
    return format(x * scale, fmt) + (f" ± {format(sd * abs(scale), fmt)}" if sd is not None else "")


# ------------------------------------------------------------------ validation of the [report] specs
def check_cells(cells: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(cells, list) or not cells:
        raise ConfigError(f"{where}.cells must be a non-empty list of {{key = ..., header = ...}} tables")
    out = []
    for i, c in enumerate(cells):
        c = {"key": c} if isinstance(c, str) else c
        if not isinstance(c, dict) or not isinstance(c.get("key"), str) or not c["key"]:
            raise ConfigError(f"{where}.cells[{i}] must be a column name or a table with a 'key'")
        unknown = set(c) - {"key", "header", "scale", "fmt"}
        if unknown:
            raise ConfigError(f"{where}.cells[{i}]: unknown keys {sorted(unknown)} (key, header, scale, fmt)")
        if "scale" in c and _num(c["scale"]) is None:
            raise ConfigError(f"{where}.cells[{i}].scale must be a number, got {c['scale']!r}")
        try:
            format(1.0, c.get("fmt", ".3f"))
        except (ValueError, TypeError):
            raise ConfigError(f"{where}.cells[{i}].fmt is not a number format: {c.get('fmt')!r}") from None
        out.append({"header": c["key"], **c})
    return out


def check_figures(figures: Any, where: str, base: str | None = None) -> list[dict[str, str]]:
    """``[[report.figures]]``: ``{title, draw}``; ``draw`` must import (a file reference is made absolute
    against ``base``, the experiment file's folder)."""
    from fedsim.components import FIGURES
    from fedsim.references import absolute_reference, is_reference

    if not isinstance(figures, list):
        raise ConfigError(f"{where} must be a list of {{title = ..., draw = 'module:function'}} tables")
    out = []
    for i, f in enumerate(figures):
        w = f"{where}[{i}]"
        if not isinstance(f, dict) or not isinstance(f.get("title"), str) or not is_reference(f.get("draw")):
            raise ConfigError(f"{w} must be a table with a 'title' and 'draw' = 'module:function'")
        unknown = set(f) - {"title", "draw"}
        if unknown:
            raise ConfigError(f"{w}: unknown keys {sorted(unknown)} (title, draw)")
        ref = absolute_reference(f["draw"], base)
        FIGURES.lookup(ref, f"{w}.draw")  # a function of the user's own code, or registered (docs/plugins.md)
        out.append({"title": f["title"], "draw": ref})
    return out


def check_report(report: Any, where: str = "report", base: str | None = None) -> dict[str, Any]:
    """Validate ``[report]`` (tables, figures and systematic); returns it normalised. ``base``: the folder
    file references in ``figures`` are relative to."""
    if report is None:
        return {"tables": [], "systematic": None, "figures": []}
    if not isinstance(report, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = set(report) - {"tables", "systematic", "figures"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (tables, figures, systematic)")
    figures = check_figures(report.get("figures", []), f"{where}.figures", base)
    tables = []
    for i, t in enumerate(report.get("tables", [])):
        w = f"{where}.tables[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("title"), str):
            raise ConfigError(f"{w} must be a table with a 'title'")
        unknown = set(t) - {"title", "cells", "layout", "row_header", "note", "rows", "cols", "expand", "row_labels"}
        if unknown:
            raise ConfigError(f"{w}: unknown keys {sorted(unknown)} (title, cells, layout, row_header, note, rows, "
                              "cols, expand, row_labels)")
        if "row_labels" in t and (not isinstance(t["row_labels"], dict)
                                  or not all(isinstance(v, str) for v in t["row_labels"].values())):
            raise ConfigError(f"{w}.row_labels must be a table from row label to the label shown (strings)")
        if "expand" in t and (not isinstance(t["expand"], list) or not t["expand"]
                              or not all(isinstance(e, str) for e in t["expand"])):
            raise ConfigError(f"{w}.expand must be a non-empty list of names (e.g. attacks) for '{{name}}' in cell keys")
        for k in ("rows", "cols"):
            if k in t and (not isinstance(t[k], list) or not all(isinstance(r, str) for r in t[k])):
                raise ConfigError(f"{w}.{k} must be a list of {k[:-1]} labels (the variants' {k[:-1]})")
        layout = t.get("layout", "cells-as-columns")
        if layout not in LAYOUTS:
            raise ConfigError(f"{w}.layout must be one of {list(LAYOUTS)}, got {layout!r}")
        tables.append({**t, "cells": check_cells(t.get("cells"), w), "layout": layout})
    sys_ = report.get("systematic")
    if sys_ is not None:
        w = f"{where}.systematic"
        if not isinstance(sys_, dict):
            raise ConfigError(f"{w} must be a table")
        unknown = set(sys_) - {"error", "attacks", "utility", "reference", "budgets", "higher_is_safer"}
        if unknown:
            raise ConfigError(f"{w}: unknown keys {sorted(unknown)}")
        if sys_.get("utility", "loss") not in ("loss", "accuracy"):
            raise ConfigError(f"{w}.utility must be 'loss' (final loss increase) or 'accuracy' (accuracy drop)")
        if not isinstance(sys_.get("attacks"), list) or not sys_["attacks"] or \
                not all(isinstance(a, str) for a in sys_["attacks"]):
            raise ConfigError(f"{w}.attacks must be a non-empty list of attack names")
        if not isinstance(sys_.get("reference"), str):
            raise ConfigError(f"{w}.reference must be the family of the undefended variants (e.g. 'none')")
        budgets = sys_.get("budgets", [])
        if not isinstance(budgets, list) or not all(_num(b) is not None for b in budgets):
            raise ConfigError(f"{w}.budgets must be a list of numbers (utility-loss levels)")
        sys_ = {"error": "rmse", "utility": "loss", "budgets": [], **sys_}
    return {"tables": tables, "systematic": sys_, "figures": figures}


# ------------------------------------------------------------------ tables
def _ordered(values: Sequence[str | None]) -> list[str]:
    out: list[str] = []
    for v in values:
        if v is not None and v not in out:
            out.append(v)
    return out


def paper_table(rows: Sequence[Mapping[str, Any]], spec: Mapping[str, Any]) -> str:
    """A markdown table shaped like the paper's (module docstring). ``rows`` carry ``row``/``col``;
    ``spec["rows"]`` / ``spec["cols"]`` (optional) keep only the variants with those row / col labels."""
    cells = spec["cells"]
    shown = spec.get("row_labels") or {}

    def disp(rl: Any) -> str:
        return shown.get(rl, rl)

    if spec.get("rows") is not None:
        rows = [r for r in rows if r.get("row") in spec["rows"]]
    if spec.get("cols") is not None:
        rows = [r for r in rows if r.get("col") in spec["cols"]]
    if spec.get("expand"):  # columns are the names, each cell key's {name} replaced by the column's name
        by_row: dict[Any, Mapping[str, Any]] = {}
        for r in rows:  # one run per row: the first variant with that row label
            by_row.setdefault(r.get("row"), r)
        names = spec["expand"]
        if spec["layout"] == "cells-as-rows":
            header = [spec.get("row_header", ""), ""] + names
            body = [[disp(rl), c["header"]] + [_cell(by_row[rl], c["key"].replace("{name}", n), c) for n in names]
                    for rl in by_row for c in cells]
        else:
            header = [spec.get("row_header", "")] + [f"{n}: {c['header']}" for n in names for c in cells]
            body = [[disp(rl)] + [_cell(by_row[rl], c["key"].replace("{name}", n), c) for n in names for c in cells]
                    for rl in by_row]
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                         + ["| " + " | ".join(x) + " |" for x in body])
    row_labels = _ordered([r.get("row") for r in rows])
    col_labels = _ordered([r.get("col") for r in rows])
    at = {(r.get("row"), r.get("col")): r for r in rows}
    head = spec.get("row_header", "")
    lines: list[list[str]] = []
    if spec["layout"] == "cells-as-rows":
        cols = col_labels or [None]
        header = [head, ""] + [c or "" for c in cols]
        for rl in row_labels:
            for c in cells:
                lines.append([disp(rl), c["header"]] + [_cell(at.get((rl, cl)), c["key"], c) for cl in cols])
    elif col_labels:
        header = [head] + [f"{cl}: {c['header']}" if len(cells) > 1 else cl for cl in col_labels for c in cells]
        for rl in row_labels:
            lines.append([disp(rl)] + [_cell(at.get((rl, cl)), c["key"], c) for cl in col_labels for c in cells])
    else:
        header = [head] + [c["header"] for c in cells]
        for rl in row_labels:
            lines.append([disp(rl)] + [_cell(at.get((rl, None)), c["key"], c) for c in cells])
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(x) + " |" for x in lines]
    return "\n".join(md)


# ------------------------------------------------------------------ systematic evaluation (seed 004)
def systematic(rows: Sequence[Mapping[str, Any]], spec: Mapping[str, Any]) -> dict[str, Any]:
    """Per variant: the strongest attack (smallest ``<attack>.<error>`` over ``spec["attacks"]``), its
    error and the utility loss against the reference variant of the same ``row``; per budget: the best
    defense at equal utility. Variants without a reference or without any attack error are listed in
    ``missing``."""
    err, attacks = spec["error"], spec["attacks"]
    refs = {r.get("row"): r for r in rows if r.get("family") == spec["reference"]}
    points, missing = [], []
    for r in rows:
        errs = {a: _num(r.get(f"{a}.{err}")) for a in attacks}
        errs = {a: e for a, e in errs.items() if e is not None}
        ref = refs.get(r.get("row"))
        if not errs or ref is None:
            missing.append(r["variant"])
            continue
        strongest = min(errs, key=lambda a: errs[a])
        if spec["utility"] == "loss":
            u = (_num(r.get("loss")) or math.nan) - (_num(ref.get("loss")) or math.nan)
        else:
            u = (_num(ref.get("accuracy")) or math.nan) - (_num(r.get("accuracy")) or math.nan)
        points.append({"variant": r["variant"], "family": r.get("family"), "row": r.get("row"),
                       "col": r.get("col"), "strongest": strongest, "error": errs[strongest],
                       "errors": errs, "utility_loss": u, "reference": r.get("family") == spec["reference"]})
    best = []
    rows_seen = _ordered([p["row"] for p in points]) or [None]
    for rl in rows_seen:  # equal utility at equal batch size (row): the defenses compete within a row
        for b in spec.get("budgets", []):
            ok = [p for p in points if p["row"] == rl and not p["reference"] and math.isfinite(p["utility_loss"])
                  and p["utility_loss"] <= b]
            by_family: dict[str, dict[str, Any]] = {}
            for p in ok:
                f = str(p["family"])
                if f not in by_family or p["error"] > by_family[f]["error"]:
                    by_family[f] = p
            winner = max(ok, key=lambda p: p["error"]) if ok else None
            best.append({"row": rl, "budget": float(b), "best": winner, "by_family": by_family})
    strongest: dict[str, int] = {}
    for p in points:
        if not p["reference"]:
            strongest[p["strongest"]] = strongest.get(p["strongest"], 0) + 1
    return {"points": points, "best": best, "missing": missing, "strongest_counts": strongest}


def systematic_markdown(result: Mapping[str, Any], spec: Mapping[str, Any], figure: str | None) -> str:
    err, util = spec["error"], spec["utility"]
    ulabel = "final loss increase" if util == "loss" else "accuracy drop"
    lines = ["## Systematic evaluation (seed 004, eq. 3)\n",
             f"For each defense setting: the strongest attack of {spec['attacks']} (smallest reconstruction "
             f"{err.upper()}), its {err.upper()} (the defense's worst case: larger is safer) and the utility loss "
             f"({ulabel} against the undefended run with the same row).\n",
             f"| setting | row | strongest attack | {err.upper()} | utility loss | " +
             " | ".join(f"{a} {err.upper()}" for a in spec["attacks"]) + " |",
             "|" + "---|" * (5 + len(spec["attacks"]))]
    for p in result["points"]:
        lines.append(f"| {p['variant']} | {p['row'] or ''} | {p['strongest']} | {p['error']:.4f} | "
                     f"{p['utility_loss']:+.4f} | " +
                     " | ".join(f"{p['errors'][a]:.4f}" if a in p["errors"] else "-" for a in spec["attacks"]) + " |")
    if result["best"]:
        fams = _ordered([str(p["family"]) for p in result["points"] if not p["reference"]])
        lines += ["", "**Best defense at equal utility**: among the settings whose utility loss is within the "
                  f"budget, the one whose strongest attack has the largest {err.upper()} (per family: its best "
                  "setting within the budget).\n",
                  "| row | utility budget | best defense | its " + err.upper() + " | " + " | ".join(fams) + " |",
                  "|" + "---|" * (4 + len(fams))]
        for b in result["best"]:
            w = b["best"]
            lines.append(f"| {b['row'] or ''} | <= {b['budget']:g} | {w['variant'] if w else 'none within budget'} | "
                         + (f"{w['error']:.4f} | " if w else "- | "))
            lines[-1] += " | ".join(f"{b['by_family'][f]['error']:.4f} ({b['by_family'][f]['variant']})"
                                    if f in b["by_family"] else "-" for f in fams) + " |"
    if result.get("strongest_counts"):
        counts = ", ".join(f"{a} {n}" for a, n in sorted(result["strongest_counts"].items(), key=lambda x: -x[1]))
        lines.append(f"\nStrongest attack per defended setting (count): {counts}.")
    if result["missing"]:
        lines.append(f"\nNot evaluated (no attack error or no reference run in their row): {result['missing']}")
    if figure:
        lines.append(f"\n![utility-privacy]({figure})\n")
    return "\n".join(lines)


def plot_systematic(result: Mapping[str, Any], spec: Mapping[str, Any], path: Path) -> None:
    """The utility-privacy scatter (seed 004 Fig. 3): strongest-attack error against utility loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedsim.reports import save_figure

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    fams = _ordered([str(p["family"]) for p in result["points"]])
    rows = _ordered([p["row"] for p in result["points"] if p["row"] is not None])
    markers = "osD^v<>P*X"
    colours = plt.get_cmap("tab10")
    for i, fam in enumerate(fams):  # one colour per defense family, one marker per row (batch size)
        for j, rl in enumerate(rows or [None]):
            ps = [p for p in result["points"] if str(p["family"]) == fam and p["row"] == rl]
            if ps:
                ax.scatter([p["utility_loss"] for p in ps], [p["error"] for p in ps], marker=markers[j % len(markers)],
                           color=colours(i % 10), label=f"{fam}" + (f" ({rl})" if rl else ""), s=36)
    losses = [abs(p["utility_loss"]) for p in result["points"] if math.isfinite(p["utility_loss"])]
    small = sorted(x for x in losses if x > 0)
    if small and max(losses) > 20 * small[len(small) // 2]:  # an outlier (a diverged run) would flatten the rest
        ax.set_xscale("symlog", linthresh=max(small[len(small) // 2], 1e-6))
    ax.set_xlabel("utility loss (" + ("final loss increase" if spec["utility"] == "loss" else "accuracy drop") + ")")
    ax.set_ylabel(f"strongest attack's {spec['error'].upper()} (larger = safer)")
    ax.set_title("utility-privacy trade-off (seed 004 Fig. 3)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
    plt.close(fig)
