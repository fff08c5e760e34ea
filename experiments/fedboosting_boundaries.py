"""Seed 003 Fig. 4.2: decision boundaries of FedAvg, FedBoosting and centralised training, in one command.

    python -m experiments.fedboosting_boundaries [--out DIR] [--set key=value ...]
    python -m experiments.fedboosting_boundaries --plot-only DIR   # redraw from a finished sweep

Runs the sweep ``experiments/fedboosting_synthetic.toml`` (variants ``centralised``, ``FedAvg``,
``FedBoosting``; ``--set`` overrides apply to every variant) and writes ``decision_boundaries.png`` into
the sweep folder (the experiment file names :func:`draw` in ``[[report.figures]]``, so ``fedsim experiment
fedboosting_synthetic`` draws it too, links it from its report and ``--publish`` copies it): top row, each final global model's P(class 1) over the plane with its 0.5 contour and
its test accuracy; bottom row, client 0's and client 1's training data and the test set (both sources),
as in the thesis' figure.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from fedsim.components import FIGURES

SWEEP = Path(__file__).with_name("fedboosting_synthetic.toml")
PANELS = ("FedAvg", "FedBoosting", "centralised")
FIGURE = "decision_boundaries.png"


def _model(cfg: dict[str, Any], run_dir: Path) -> torch.nn.Module:
    from fedsim.factories import model_for
    from fedsim.models.weights import set_weights

    model = model_for(cfg)
    state = torch.load(run_dir / "model.pt")
    set_weights(model, [state[k].numpy() for k in model.state_dict()])
    return model.eval()


def grid_probabilities(model: torch.nn.Module, xlim: Sequence[float], ylim: Sequence[float],
                       steps: int = 200) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(xx, yy, P(class 1)) of ``model`` on a ``steps`` x ``steps`` grid over the box."""
    xx, yy = np.meshgrid(np.linspace(*xlim, steps), np.linspace(*ylim, steps))
    pts = torch.from_numpy(np.stack([xx.ravel(), yy.ravel()], 1).astype(np.float32))
    with torch.no_grad():
        prob = torch.softmax(model(pts), 1)[:, 1].numpy()
    return xx, yy, prob.reshape(xx.shape)


def plot(out_dir: Path, configs: dict[str, dict[str, Any]]) -> Path:
    """Draw the figure from a finished sweep folder (``sweep.jsonl`` names each variant's run folder)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedsim.config import read_toml
    from fedsim.factories import client_data, dataset_for
    from fedsim.reports import read_jsonl, save_figure

    rows = {r["variant"]: r for r in read_jsonl(out_dir / "sweep.jsonl")}
    runs = {label: first_run(r) for label, r in rows.items()}
    missing = [p for p in PANELS if p not in rows or runs[p] is None]
    if missing:
        raise SystemExit(f"{out_dir}: the sweep has no variant(s) {missing}")
    cfg = configs["FedAvg"]
    ds = dataset_for(cfg)
    x_all = torch.cat([ds.x_train, ds.x_test]).numpy()
    lo, hi = x_all.min(0) - 0.5, x_all.max(0) + 0.5
    fig, axes = plt.subplots(2, 3, figsize=(13, 8.4))
    seed = None
    for ax, label in zip(axes[0], PANELS):
        run = out_dir / runs[label]
        model = _model(configs[label], run)
        xx, yy, prob = grid_probabilities(model, (lo[0], hi[0]), (lo[1], hi[1]))
        ax.contourf(xx, yy, prob, levels=np.linspace(0, 1, 11), cmap="RdBu_r", alpha=0.8)
        ax.contour(xx, yy, prob, levels=[0.5], colors="k", linewidths=1.5)
        summary = json.loads((run / "summary.json").read_text())
        seed = read_toml(run / "config.toml", "run config").get("seed", 0)
        ax.set_title(f"{label}: test accuracy {summary['final_accuracy']:.4f}")
    rng = np.random.default_rng(0)

    def scatter(ax, x: torch.Tensor, y: torch.Tensor, title: str, n: int = 3000) -> None:
        idx = rng.choice(len(y), size=min(n, len(y)), replace=False)
        xs, ys = x[idx].numpy(), y[idx].numpy()
        for c, colour in ((0, "tab:blue"), (1, "tab:red")):
            ax.scatter(xs[ys == c, 0], xs[ys == c, 1], s=2, c=colour, label=f"class {c}")
        ax.set_title(f"{title} ({len(y)} points, {min(n, len(y))} drawn)")
        ax.legend(loc="upper right", markerscale=4, fontsize=8)

    for k in range(2):
        scatter(axes[1][k], *client_data(cfg, k), f"client {k} training data")
    scatter(axes[1][2], ds.x_test, ds.y_test, "test data (both sources)")
    for ax in axes.ravel():
        ax.set_xlim(lo[0], hi[0])
        ax.set_ylim(lo[1], hi[1])
        ax.set_aspect("equal")
    fed = cfg["federation"]
    fig.suptitle(f"synthetic-2d, {fed['num_clients']} clients, {fed['rounds']} rounds, the runs of seed {seed} "
                 f"(seed 003 Fig. 4.2); colour: P(class 1), black: the 0.5 boundary")
    fig.tight_layout()
    path = out_dir / FIGURE
    save_figure(fig, path)
    plt.close(fig)
    return path


def first_run(row: dict[str, Any]) -> str | None:
    """The run folder of a sweep row's first seed (a row over seeds names its runs in ``runs``)."""
    runs = row.get("runs") or [row.get("run")]
    return runs[0] if runs and runs[0] else None


@FIGURES.register(name="fedboosting-boundaries")  # referenced as "experiments.fedboosting_boundaries:draw", also when installed
def draw(out_dir: Path, configs: dict[str, dict[str, Any]]) -> Path | None:
    """The experiment's ``[[report.figures]]`` hook: the figure once every panel's run has its model, else
    None (a sweep still running, or ``--only`` without one of the panels)."""
    from fedsim.reports import read_jsonl

    if not (out_dir / "sweep.jsonl").exists() or any(p not in configs for p in PANELS):
        return None
    rows = {r["variant"]: r for r in read_jsonl(out_dir / "sweep.jsonl")}
    if any(p not in rows or not first_run(rows[p]) or not (out_dir / first_run(rows[p]) / "model.pt").exists()
           for p in PANELS):
        return None
    return plot(out_dir, configs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.fedboosting_boundaries", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="sweep folder (default: a new folder under output.dir)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key in every variant (repeatable)")
    parser.add_argument("--seeds", default="0", metavar="S1,S2,...",
                        help="seeds to run (default 0: the figure shows one seed's models; "
                        "fedsim experiment fedboosting_synthetic runs three and decides the claim)")
    parser.add_argument("--plot-only", metavar="DIR", help="redraw the figure from a finished sweep folder")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    from fedsim.app.sweep import load_sweep, run_sweep

    if args.plot_only:
        out_dir = Path(args.plot_only)
        overrides = json.loads((out_dir / "overrides.json").read_text()) if (out_dir / "overrides.json").exists() \
            else args.overrides
        path = plot(out_dir, dict(load_sweep(SWEEP, overrides)[1]))
    else:
        started = time.time()
        seeds = [int(s) for s in args.seeds.split(",")]
        out_dir = run_sweep(SWEEP, args.overrides, out=args.out, progress=not args.quiet, seeds=seeds)
        (out_dir / "overrides.json").write_text(json.dumps(args.overrides))
        path = out_dir / FIGURE  # drawn by the sweep's report ([[report.figures]] -> draw)
        if not path.exists() or path.stat().st_mtime < started:
            path = plot(out_dir, dict(load_sweep(SWEEP, args.overrides)[1]))
    print(f"[fedsim] decision boundaries: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
