"""Seed 003 Table 4.3 / Fig. 4.5: FedAvg vs FedBoosting, plaintext vs Paillier, style shift and label skew.

    python -m experiments.fedboosting_table [--out DIR] [--set key=value ...]
    python -m experiments.fedboosting_table --plot-only DIR     # redo table and figure from a finished sweep

Runs ``experiments/fedboosting.toml`` (labels ``<split> <method>[ <protection>]``), then writes into the
sweep folder ``table.md`` (rows: method x protection as in Table 4.3; for each setting: the final
test accuracy, the mean over the last 5 rounds, and the mean over all rounds - the area under the
accuracy curve, higher when a method converges faster - each the mean over the seeds) and
``accuracy_curves.png`` (test accuracy per round, one panel per setting, and below it FedBoosting's
weight entropy per round; means over the seeds). The experiment file names :func:`draw` in ``[[report.figures]]``, so ``fedsim
experiment fedboosting`` draws the curves too, shows them in its report and ``--publish`` copies them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedsim.components import FIGURES

SWEEP = Path(__file__).with_name("fedboosting.toml")
FIGURE = "accuracy_curves.png"
ROWS = (("FedAvg", "N/A"), ("FedAvg", "HE"), ("FedBoosting", "N/A"), ("FedBoosting", "DP"),
        ("FedBoosting", "HE+DP"), ("FedAvg", "CKKS"), ("FedBoosting", "CKKS+DP"),  # HE: Paillier 2048; CKKS: N 8192
        ("FedBoosting", "code"))  # code: the authors' weighting (inverse losses)
LAST = 5


def parse_label(label: str) -> tuple[str, str, str]:
    """``"k3 FedBoosting HE+DP"`` -> (split, method, protection)."""
    parts = label.split()
    return parts[0], parts[1], parts[2] if len(parts) > 2 else "N/A"


CURVES = ("accuracy", "seconds", "strategy.weights_entropy_norm")  # averaged over the seeds, per round


def collect(out_dir: Path) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """Each finished variant's per-round metrics, averaged over its seeds (``CURVES``; a failed run,
    without ``metrics.jsonl``, is left out)."""
    from fedsim.reports import read_jsonl

    out = {}
    for row in read_jsonl(out_dir / "sweep.jsonl"):
        paths = [out_dir / str(r) / "metrics.jsonl" for r in (row.get("runs") or [row.get("run")]) if r]
        runs = [read_jsonl(p) for p in paths if p.exists()]
        if not runs:
            continue
        rounds = min(len(r) for r in runs)
        mean = []
        for k in range(rounds):
            m: dict[str, Any] = {"round": runs[0][k]["round"], "seeds": len(runs)}
            for key in CURVES:
                vals = [r[k][key] for r in runs if isinstance(r[k].get(key), (int, float))]
                m[key] = float(np.mean(vals)) if vals else None
            mean.append(m)
        out[parse_label(row["variant"])] = mean
    return out


@FIGURES.register(name="fedboosting-table")  # referenced as "experiments.fedboosting_table:draw", also when installed
def draw(out_dir: Path, configs: dict[str, dict[str, Any]]) -> Path | None:
    """The experiment's ``[[report.figures]]`` hook: the accuracy curves of the variants that have run so
    far (None before the first)."""
    runs = collect(out_dir) if (out_dir / "sweep.jsonl").exists() else {}
    if not runs:
        return None
    curves(runs, out_dir / FIGURE)
    return out_dir / FIGURE


def table(runs: dict[tuple[str, str, str], list[dict[str, Any]]]) -> str:
    from fedsim.reports import md_table

    splits = list(dict.fromkeys(k[0] for k in runs))
    rows = []
    for method, prot in ROWS:
        row: dict[str, Any] = {"method": method, "protection": prot}
        for s in splits:
            acc = [r["accuracy"] for r in runs.get((s, method, prot), [])[1:] if r.get("accuracy") is not None]
            row[f"{s} final"] = acc[-1] if acc else None
            row[f"{s} last-{LAST}"] = float(np.mean(acc[-LAST:])) if acc else None
            row[f"{s} mean"] = float(np.mean(acc)) if acc else None
            secs = [r["seconds"] for r in runs.get((s, method, prot), [])[2:]]
            row[f"{s} s/round"] = float(np.median(secs)) if secs else None
        rows.append(row)
    cols = ["method", "protection"] + [f"{s} {c}" for s in splits for c in ("final", f"last-{LAST}", "mean", "s/round")]
    return md_table(rows, cols, {c: (".2f" if c.endswith("s/round") else ".4f") for c in cols})


def curves(runs: dict[tuple[str, str, str], list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from fedsim.reports import save_figure

    splits = list(dict.fromkeys(k[0] for k in runs))
    entropy = any(r.get("strategy.weights_entropy_norm") is not None for rows in runs.values() for r in rows)
    fig, axes = plt.subplots(1 + entropy, len(splits), figsize=(6 * len(splits), 4.2 * (1 + entropy)),
                             squeeze=False)
    style = {"N/A": "-", "HE": "--", "DP": ":", "HE+DP": "--", "CKKS": "-.", "CKKS+DP": "-.", "code": "-"}
    marker = {"HE+DP": ".", "CKKS+DP": ".", "code": "x"}
    colour = {"FedAvg": "tab:blue", "FedBoosting": "tab:red"}
    seeds = max((r.get("seeds", 1) for rows in runs.values() for r in rows), default=1)
    for col, s in enumerate(splits):
        for (split, method, prot), rows in runs.items():
            if split != s:
                continue
            kw = dict(color=colour.get(method, "k"), alpha=0.55 if prot == "DP" else 0.9,
                      marker=marker.get(prot), label=f"{method} {prot}")
            axes[0][col].plot([r["round"] for r in rows], [r["accuracy"] for r in rows], style.get(prot, "-"), **kw)
            if entropy:
                pts = [(r["round"], r["strategy.weights_entropy_norm"]) for r in rows
                       if r.get("strategy.weights_entropy_norm") is not None]
                if pts:
                    axes[1][col].plot(*zip(*pts), style.get(prot, "-"), **kw)
        axes[0][col].set_title(f"{s}" + (f" (mean over {seeds} seeds)" if seeds > 1 else ""))
        axes[0][col].set_ylabel("test accuracy")
        if entropy:
            axes[1][col].set_title(f"{s}: FedBoosting's weights")
            axes[1][col].set_ylabel("weight entropy / log N (1 = uniform)")
            axes[1][col].set_ylim(0, 1.05)
        for ax in axes[:, col]:
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.fedboosting_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="sweep folder (default: a new folder under output.dir)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key in every variant (repeatable)")
    parser.add_argument("--only", action="append", default=[], metavar="LABEL", help="run only these variants")
    parser.add_argument("--plot-only", metavar="DIR", help="redo the table and figure from a finished sweep")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    from fedsim.app.sweep import run_sweep
    from fedsim.reports import atomic_write_text

    if args.plot_only:
        out_dir = Path(args.plot_only)
    else:
        out_dir = run_sweep(SWEEP, args.overrides, out=args.out, progress=not args.quiet, only=args.only)
    runs = collect(out_dir)
    text = table(runs)
    atomic_write_text(out_dir / "table.md", "# FedBoosting vs FedAvg (seed 003 Table 4.3 in shape)\n\n" + text + "\n")
    curves(runs, out_dir / FIGURE)
    print(text)
    print(f"[fedsim] {out_dir / 'table.md'}, {out_dir / FIGURE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
