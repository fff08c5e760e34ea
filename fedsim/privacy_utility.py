"""The privacy-utility picture of a sweep of DP settings: accuracy, epsilon and the strongest attacks.

For every variant (a row of :func:`fedsim.comparison.run_row`): the final test accuracy, the epsilon of
its best formal guarantee (:func:`privacy_columns`, from ``summary.json["privacy"]``, the run's
:class:`fedsim.privacy.PrivacyLedger`), the strongest reconstruction attack's SSIM (the largest
``<attack>.ssim`` of the row) and the strongest membership attack's ROC AUC (the largest ``<attack>.auc``).
:func:`plot_privacy_utility` draws them against epsilon (log scale); variants without a formal guarantee
(no DP, or noise without a clipping bound) stand at the right edge, labelled "none". ``fedsim compare``
draws it when a run reports privacy (``privacy_utility.png``); an experiment draws it with
``[[report.figures]] draw = "fedsim.privacy_utility:draw"``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedsim.components import FIGURES
from fedsim.reports import read_jsonl


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def privacy_columns(summary: Mapping[str, Any]) -> dict[str, Any]:
    """A run's privacy as table columns: ``epsilon`` (the smallest final epsilon of its mechanisms with a
    formal guarantee - a client-level guarantee is also one for every example - or None), ``epsilon_client``
    (the smallest client-level one), ``dp_mechanisms`` / ``dp_formal`` (how many it has / with a guarantee).
    Empty for a run without any DP mechanism."""
    entries = summary.get("privacy") or []
    if not entries:
        return {}
    formal = [e for e in entries if _finite(e.get("epsilon"))]
    client = [e["epsilon"] for e in formal if e.get("level") == "client"]
    return {"epsilon": min((e["epsilon"] for e in formal), default=None),
            "epsilon_client": min(client, default=None), "dp_mechanisms": len(entries), "dp_formal": len(formal)}


def strongest(row: Mapping[str, Any], metric: str) -> tuple[float | None, str | None]:
    """The largest ``<attack>.<metric>`` of a row and the attack that reached it."""
    best: tuple[float | None, str | None] = (None, None)
    for k, v in row.items():
        if k.endswith("." + metric) and k.count(".") == 1 and _finite(v) and (best[0] is None or v > best[0]):
            best = (float(v), k.split(".")[0])
    return best


def plot_privacy_utility(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> str | None:
    """``privacy_utility.png``: accuracy, the strongest reconstruction attack's SSIM and (when measured) the
    strongest membership attack's AUC, each against epsilon. Returns the path, or None when no row has an
    accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedsim.reports import save_figure

    rows = [r for r in rows if _finite(r.get("accuracy"))]
    if not rows:
        return None
    eps = [float(r["epsilon"]) for r in rows if _finite(r.get("epsilon")) and float(r["epsilon"]) > 0]
    lo, hi = (min(eps), max(eps)) if eps else (1.0, 1.0)
    none_x = hi * 10 if eps else 1.0  # where variants without a guarantee stand

    def x(r: Mapping[str, Any]) -> float:
        e = r.get("epsilon")
        return float(e) if _finite(e) and float(e) > 0 else none_x

    panels = [("accuracy", "final test accuracy (utility)", lambda r: (r.get("accuracy"), None))]
    if any(strongest(r, "ssim")[0] is not None for r in rows):
        panels.append(("ssim", "strongest reconstruction: SSIM", lambda r: strongest(r, "ssim")))
    if any(strongest(r, "auc")[0] is not None for r in rows):
        panels.append(("auc", "strongest membership attack: ROC AUC", lambda r: strongest(r, "auc")))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False, layout="constrained")
    for ax, (key, label, value) in zip(axes[0], panels):
        for k, r in enumerate(rows):
            v, who = value(r)
            if not _finite(v):
                continue
            err = r.get(f"{key}_std") if key == "accuracy" else None
            ax.errorbar(x(r), v, yerr=err, marker=_marker(r), linestyle="none", capsize=2, color=_color(k),
                        markersize=7, alpha=0.85)
        ax.set_xscale("log")
        ax.set_xlim(lo / 3 if eps else 0.3, none_x * 3)
        if eps:
            ax.axvspan(hi * 3, none_x * 3, color="0.92", zorder=0)
            ticks = [t for t in ax.get_xticks() if lo / 3 <= t <= hi * 3]
            ax.set_xticks([*ticks, none_x])
            ax.set_xticklabels([f"{t:g}" for t in ticks] + ["none"])
        ax.set_xlabel("epsilon (best formal guarantee; none: no DP or no bound)", fontsize=7)
        ax.set_ylabel(label, fontsize=8)
        if key in ("accuracy", "ssim"):
            ax.set_ylim(-0.02, 1.02)
        else:
            ax.set_ylim(0.4, 1.02)
            ax.axhline(0.5, color="k", linestyle="--", linewidth=0.7)
        ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D

    axes[0][0].legend(handles=[Line2D([], [], marker=m, linestyle="none", color="0.4", label=t) for m, t in (
        ("o", "sample-level"), ("s", "client-level"), ("X", "no formal guarantee"))], fontsize=6, loc="upper left")
    fig.legend(handles=[Line2D([], [], marker=_marker(r), linestyle="none", color=_color(k), label=str(r.get("variant")))
                        for k, r in enumerate(rows)], fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5),
               title="variant", title_fontsize=7)
    fig.suptitle(title or "privacy-utility: accuracy and the strongest attacks against epsilon", fontsize=9)
    save_figure(fig, path)
    plt.close(fig)
    return str(path)


def _color(k: int) -> Any:
    import matplotlib

    return matplotlib.colormaps["tab20"](k % 20)


def _marker(row: Mapping[str, Any]) -> str:
    """o: the best guarantee is sample-level, s: client-level, X: none."""
    e = row.get("epsilon")
    if not _finite(e):
        return "X"
    return "s" if _finite(row.get("epsilon_client")) and float(row["epsilon_client"]) <= float(e) else "o"


@FIGURES.register(name="privacy-utility")  # referenced as "fedsim.privacy_utility:draw", also when installed
def draw(out_dir: Path, configs: Mapping[str, Any]) -> str | None:
    """``[[report.figures]]`` hook: the picture of the sweep folder's variants (``sweep.jsonl``)."""
    out_dir = Path(out_dir)
    if not (out_dir / "sweep.jsonl").is_file():
        return None
    rows = read_jsonl(out_dir / "sweep.jsonl")
    return plot_privacy_utility(rows, out_dir / "privacy_utility.png")
