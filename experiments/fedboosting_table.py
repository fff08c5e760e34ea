"""Seed 003 Table 4.3 / Fig. 4.5 in shape: FedAvg vs FedBoosting, plaintext vs Paillier, on non-IID data.

    python -m experiments.fedboosting_table [--out DIR] [--set key=value ...]
    python -m experiments.fedboosting_table --plot-only DIR     # redo table and figure from a finished sweep

Runs ``experiments/fedboosting.toml`` (labels ``<split> <method>[ <protection>]``), then writes into the
sweep folder ``table.md`` (rows: method x protection as in Table 4.3; for each split: the final test
accuracy, the mean over the last 5 rounds, and the mean over all rounds - the area under the accuracy
curve, higher when a method converges faster) and ``accuracy_curves.png`` (test accuracy per round,
one panel per split). The experiment file names :func:`draw` in ``[[report.figures]]``, so ``fedsim
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
        ("FedBoosting", "HE+DP"), ("FedAvg", "CKKS"), ("FedBoosting", "CKKS+DP"))  # HE: Paillier 2048; CKKS: N 8192
LAST = 5


def parse_label(label: str) -> tuple[str, str, str]:
    """``"k3 FedBoosting HE+DP"`` -> (split, method, protection)."""
    parts = label.split()
    return parts[0], parts[1], parts[2] if len(parts) > 2 else "N/A"


def collect(out_dir: Path) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """Each finished variant's per-round metrics (a failed run, without ``metrics.jsonl``, is left out)."""
    from fedsim.reports import read_jsonl

    out = {}
    for row in read_jsonl(out_dir / "sweep.jsonl"):
        metrics = out_dir / str(row.get("run") or "") / "metrics.jsonl"
        if row.get("run") and metrics.exists():
            out[parse_label(row["variant"])] = read_jsonl(metrics)
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

    from fedsim.reports import save_figure

    splits = list(dict.fromkeys(k[0] for k in runs))
    fig, axes = plt.subplots(1, len(splits), figsize=(6 * len(splits), 4.2), squeeze=False)
    style = {"N/A": "-", "HE": "--", "DP": ":", "HE+DP": "--", "CKKS": "-.", "CKKS+DP": "-."}
    colour = {"FedAvg": "tab:blue", "FedBoosting": "tab:red"}
    for ax, s in zip(axes[0], splits):
        for (split, method, prot), rows in runs.items():
            if split != s:
                continue
            ax.plot([r["round"] for r in rows], [r["accuracy"] for r in rows], style.get(prot, "-"),
                    color=colour.get(method, "k"), alpha=0.55 if prot == "DP" else 0.9,
                    marker="." if prot in ("HE+DP", "CKKS+DP") else None, label=f"{method} {prot}")
        ax.set_title(f"split {s}")
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
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
