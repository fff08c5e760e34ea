"""Comparing runs: one row per run, mean ± std over seeds, and the comparison figure.

Used by sweeps (``fedsim sweep``: every variant, repeated over ``seeds = [...]``) and by ``fedsim
compare RUN...`` (existing run or sweep folders). Everything is read back from run folders
(``summary.json``, ``metrics.jsonl``), so a comparison never needs the runs' processes.

* :func:`run_row` - a run's row: final accuracy and loss, median round time, client failures, DP
  epsilon, and the leakage columns of every observer (``<attack>.psnr``, ``.ssim``, ...);
* :func:`mean_std_rows` - rows of the same variant over several seeds -> one row with the mean of
  every numeric column and ``<column>_std`` (sample standard deviation, ``ddof = 1``);
* :func:`plot_comparison` - ``comparison.png``: test accuracy against the round for every variant
  (mean over seeds, a band of ± one standard deviation) and, when the runs were attacked, the
  privacy-utility scatter (final accuracy against leakage, error bars over seeds);
* :func:`comparison_table` - the markdown table (``mean ± std`` cells when there are seeds).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fedsim.privacy_utility import plot_privacy_utility, privacy_columns
from fedsim.reports import md_table, read_jsonl

log = logging.getLogger("fedsim")
ID_COLUMNS = ("variant", "run", "seed", "seeds", "runs", "n")


def run_row(label: str, run_dir: str | Path, full: bool = False) -> dict[str, Any]:
    """One run folder as a row (see the module docstring). ``full`` adds every numeric key of each
    leakage entry (``<attack>.mse``, ``.iterations``, ``.rmse`` = sqrt of the mean MSE, ...) and of the
    last round's metrics (``final.<key>``), for experiment tables that name them; a run with one attack
    also gets its columns as ``attack.<metric>``, ``best_accuracy``, the global model's accuracy in its
    best round, and every metric's mean over the training rounds (``mean.<key>``, e.g.
    ``mean.strategy.weights_entropy``)."""
    run_dir = Path(run_dir)
    summary = read_json(run_dir / "summary.json")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not all(isinstance(r, dict) and isinstance(r.get("round"), int) for r in rows):
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: every line must be a round's row (a JSON object with "
                         "an integer 'round'), as fedsim writes it")
    train_rounds = [r for r in rows if r["round"] >= 2] or [r for r in rows if r["round"] >= 1]
    secs = [r["seconds"] for r in train_rounds]
    row: dict[str, Any] = {"variant": label, "status": summary.get("status", "completed"),
                           "accuracy": summary.get("final_accuracy"),
                           "loss": summary.get("final_loss"),
                           "round_seconds": float(np.median(secs)) if secs else None,
                           "failures": summary.get("client_failures", 0), "run": run_dir.name}
    last = rows[-1] if rows else {}
    if last.get("client_accuracy") is not None:  # client-side evaluation
        row["client_accuracy"] = last["client_accuracy"]
        row["client_accuracy_min"] = last.get("client_accuracy_min")
    for k, v in last.items():  # other accuracies defenses and observers report (e.g. FedKL's random key)
        if "." in k and k.endswith("_accuracy") and _number(v):
            row[k] = v
    eps = [v for k, v in last.items() if k.endswith(".epsilon") and v is not None]
    if eps:  # DP accounting reported by the clients' defenses (example-weighted mean over the clients)
        row["epsilon"] = max(eps)
    row.update(privacy_columns(summary))  # the run's privacy ledger, when it has one (fedsim.privacy_utility)
    # leakage entries of observers (the curious server's "leakage", seed 002's curious client's
    # "client_leakage"); an entry's "columns" names the keys to show (default: the curious server's)
    for leak in [*summary.get("leakage", []), *summary.get("client_leakage", []), *summary.get("membership", [])]:
        a = leak["attack"]
        for k in leak.get("columns", ("psnr", "ssim", "label_acc", "success_content")):
            row[f"{a}.{k}"] = leak.get(k)
        if full:
            row.update({f"{a}.{k}": v for k, v in leak.items() if _number(v) and f"{a}.{k}" not in row})
            if _number(leak.get("mse")):
                row[f"{a}.rmse"] = math.sqrt(float(leak["mse"]))
    if full:
        row.update({f"final.{k}": v for k, v in last.items() if _number(v)})
        if _number(summary.get("best_accuracy")):  # the best round's global accuracy (papers that report it)
            row["best_accuracy"] = summary["best_accuracy"]
        trained = [r for r in rows if r["round"] >= 1]
        for k in dict.fromkeys(k for r in trained for k in r):  # the mean over the training rounds
            vals = [float(r[k]) for r in trained if _number(r.get(k))]
            if vals and k != "round":
                row[f"mean.{k}"] = float(np.mean(vals))
        leaks = summary.get("leakage", [])
        if len(leaks) == 1:  # one attack: also as attack.<metric>, so a table can compare runs of different attacks
            row.update({f"attack.{k[len(leaks[0]['attack']) + 1:]}": v for k, v in list(row.items())
                        if k.startswith(leaks[0]["attack"] + ".")})
    return row


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file; a file that is unreadable, not JSON or not an object is a ValueError
    naming it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, as fedsim writes it; got {type(data).__name__}")
    return data


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None and math.isfinite(float(v))


def mean_std_rows(label: str, rows: Sequence[Mapping[str, Any]], seeds: Sequence[int] = ()) -> dict[str, Any]:
    """One row for a variant run over several seeds: every numeric column's mean, and ``<column>_std``
    (sample standard deviation over the runs that have the column; absent for a single run)."""
    out: dict[str, Any] = {"variant": label, "n": len(rows)}
    if seeds:
        out["seeds"] = list(seeds)
    out["runs"] = [r.get("run") for r in rows]
    cols: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k not in ID_COLUMNS:
                cols.setdefault(k, None)
    for c in cols:
        vals = [float(r[c]) for r in rows if _number(r.get(c))]
        if not vals:
            out[c] = None
            continue
        out[c] = float(np.mean(vals))
        if len(rows) > 1:
            out[f"{c}_std"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
    if len(rows) == 1:
        out["run"] = rows[0].get("run")
    return out


def leak_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The leakage columns (``<attack>.<metric>``) of rows, grouped by attack."""
    return sorted({k for r in rows for k in r if "." in k and not k.endswith(("_std", "_accuracy"))},
                  key=lambda k: (k.split(".")[0], k))


def accuracy_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Other accuracies (``<who>.<what>_accuracy``) reported by defenses and observers."""
    return sorted({k for r in rows for k in r if "." in k and k.endswith("_accuracy")})


def comparison_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str],
                     fmt: Mapping[str, str] | None = None) -> str:
    """A markdown table; a column whose ``<column>_std`` is in a row shows ``mean ± std``."""
    fmt = dict(fmt or {})
    shown = []
    for r in rows:
        s = dict(r)
        for c in columns:
            std = r.get(f"{c}_std")
            if std is not None and _number(r.get(c)):
                f = fmt.get(c, ".4g")
                s[c] = f"{format(float(r[c]), f)} ± {format(float(std), f)}"
        shown.append(s)
    return md_table(shown, columns, fmt)


def accuracy_curve(run_dirs: Sequence[str | Path]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(rounds, mean accuracy, std) over runs (rounds where every run has an accuracy)."""
    per_run = []
    for d in run_dirs:
        per_run.append({r["round"]: r["accuracy"] for r in read_jsonl(Path(d) / "metrics.jsonl")
                        if r.get("accuracy") is not None})
    rounds = sorted(set.intersection(*(set(m) for m in per_run))) if per_run else []
    acc = np.array([[m[k] for k in rounds] for m in per_run], dtype=float).reshape(len(per_run), len(rounds))
    std = acc.std(0, ddof=1) if len(per_run) > 1 else np.zeros(len(rounds))
    return rounds, acc.mean(0) if len(per_run) else np.zeros(0), std


def plot_comparison(groups: Sequence[tuple[str, Sequence[str | Path]]], rows: Sequence[Mapping[str, Any]],
                    path: str | Path, title: str = "") -> str | None:
    """``comparison.png``: accuracy vs round per group (label, run folders) and, when ``rows`` (the
    groups' mean rows, same order) have leakage columns, final accuracy vs the first SSIM (else PSNR)
    column of every attack. Returns the leakage metric plotted (or None)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedsim.reports import save_figure

    leaks = leak_columns(rows)
    metric = "ssim" if any(c.endswith(".ssim") for c in leaks) else ("psnr" if any(c.endswith(".psnr") for c in leaks)
                                                                    else None)
    fig, axes = plt.subplots(1, 2 if metric else 1, figsize=(10 if metric else 5.5, 3.6), squeeze=False)
    ax = axes[0][0]
    colors: dict[str, Any] = {}
    for k, (label, dirs) in enumerate(groups):
        colors[label] = f"C{k % 10}"
        rounds, mean, std = accuracy_curve(dirs)
        if not rounds:
            continue
        ax.plot(rounds, mean, marker="o", markersize=3, color=colors[label],
                label=f"{label}" + (f" (n={len(dirs)})" if len(dirs) > 1 else ""))
        if len(dirs) > 1:
            ax.fill_between(rounds, mean - std, mean + std, color=colors[label], alpha=0.2)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("accuracy (mean ± std over seeds)" if any(len(d) > 1 for _, d in groups) else "accuracy",
                 fontsize=9)
    if metric:
        ax2 = axes[0][1]
        attacks = sorted({c.split(".")[0] for c in leaks if c.endswith("." + metric)})
        markers = "osD^v<>P*X"
        for j, a in enumerate(attacks):
            col = f"{a}.{metric}"
            pts = [r for r in rows if _number(r.get(col)) and _number(r.get("accuracy"))]
            for r in pts:
                ax2.errorbar(r["accuracy"], r[col], xerr=r.get("accuracy_std"), yerr=r.get(f"{col}_std"),
                             marker=markers[j % len(markers)], linestyle="none", capsize=2,
                             color=colors.get(str(r["variant"]), "k"),
                             label=a if r is pts[0] and len(attacks) > 1 else None)
                ax2.annotate(str(r["variant"]), (r["accuracy"], r[col]), fontsize=6, xytext=(3, 3),
                             textcoords="offset points")
        if len(attacks) > 1:
            ax2.legend(fontsize=7, title="attack (marker)", title_fontsize=7)
        ax2.set_xlabel("final test accuracy (utility)")
        ax2.set_ylabel(f"{metric.upper()} of the reconstruction (leakage)")
        ax2.grid(alpha=0.3)
        ax2.set_title(f"privacy-utility ({', '.join(attacks)}; lower-right is better)", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
    plt.close(fig)
    return metric


def run_folders(path: str | Path) -> list[tuple[str, list[Path]]]:
    """What ``fedsim compare`` reads from one argument: a run folder (one entry, labelled with its
    folder name), or a sweep folder (one entry per variant, with its seeds' runs)."""
    p = Path(path)
    if (p / "summary.json").is_file() and (p / "metrics.jsonl").is_file():
        return [(p.name, [p])]
    if (p / "sweep.jsonl").is_file():
        out = []
        for r in read_jsonl(p / "sweep.jsonl"):
            if not isinstance(r, dict) or "variant" not in r:
                raise ValueError(f"{p / 'sweep.jsonl'}: every line must be a variant's row with a 'variant', "
                                 "as fedsim writes it")
            runs = r.get("runs") or [r.get("run")]
            out.append((str(r["variant"]), [p / str(x) for x in (runs if isinstance(runs, list) else [runs]) if x]))
        return out
    raise ValueError(f"{str(p)!r} is neither a run folder (summary.json, metrics.jsonl) nor a sweep folder "
                     "(sweep.jsonl); an unfinished run has no summary.json yet")


def _setting(run_dir: Path) -> dict[str, Any]:
    """What makes two runs comparable: their length (the last round in metrics.jsonl), seed and dataset
    (from the run's resolved ``config.toml``; missing: None)."""
    import tomllib

    try:
        cfg = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        cfg = {}
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return {"rounds": rows[-1]["round"] if rows else None, "seed": cfg.get("seed"),
            "dataset": (cfg.get("data") or {}).get("dataset")}


def mismatches(groups: Sequence[tuple[str, Sequence[str | Path]]]) -> list[str]:
    """One line for each of length (rounds), seeds and dataset in which the compared entries differ: their
    final numbers then differ for that reason too. A sweep variant's entry stands for all its seeds."""
    settings = {label: [_setting(Path(d)) for d in dirs] for label, dirs in groups}
    out = []
    for key, what in (("rounds", "length (rounds)"), ("seed", "seeds"), ("dataset", "dataset")):
        per = {label: sorted({s[key] for s in ss}, key=str) for label, ss in settings.items()}
        if len({tuple(v) for v in per.values()}) > 1:
            shown = [f"{label}: {', '.join(map(str, v))}" for label, v in per.items()]
            out.append(f"the compared runs differ in {what}: " + "; ".join(shown[:8])
                       + (f"; ... ({len(shown) - 8} more)" if len(shown) > 8 else ""))
    return out


def compare(paths: Sequence[str | Path], out: str | Path, title: str = "comparison") -> list[dict[str, Any]]:
    """``fedsim compare``: rows (mean ± std over a sweep variant's seeds), ``comparison.md``,
    ``comparison.csv`` and ``comparison.png`` in ``out``. Entries that differ in length, seeds or dataset
    (:func:`mismatches`) get a warning on the fedsim log and in ``comparison.md``. Returns the rows."""
    from fedsim.export import write_csv
    from fedsim.reports import atomic_write_text

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a folder")
    groups: list[tuple[str, list[Path]]] = []
    for p in paths:
        groups += run_folders(p)
    labels = [g[0] for g in groups]
    groups = [(f"{lab} [{i}]" if labels.count(lab) > 1 else lab, dirs) for i, (lab, dirs) in enumerate(groups)]
    rows = []
    for label, dirs in groups:
        per_run = []
        for d in dirs:
            try:
                per_run.append(run_row(label, d))
            except (KeyError, TypeError, AttributeError, IndexError) as exc:  # valid JSON, not fedsim's
                raise ValueError(f"{d}: summary.json / metrics.jsonl are not as fedsim writes them "
                                 f"({type(exc).__name__}: {exc})") from None
        rows.append(mean_std_rows(label, per_run))
    warnings = mismatches(groups)
    for w in warnings:
        log.warning("compare: %s", w)
    out.mkdir(parents=True, exist_ok=True)  # everything is read: nothing below fails on the runs' files
    plot_comparison(groups, rows, out / "comparison.png", title)
    figures = privacy_figure(rows, out)
    cols = table_columns(rows)
    write_csv(out / "comparison.csv", rows)
    text = [f"# fedsim comparison: {title}\n",
            "Accuracy/loss: the global model on the test set after the last round; leakage columns: mean over "
            "the attacked updates; `round_seconds`: median wall time of rounds >= 2. Sweep variants with several "
            "seeds show mean ± sample standard deviation.\n",
            *(f"**Warning:** {w}.\n" for w in warnings),
            comparison_table(rows, cols, table_formats(cols)),
            "\n![comparison](comparison.png)\n", *figures,
            "Runs: " + ", ".join(f"{label}: " + ", ".join(str(d) for d in dirs) for label, dirs in groups) + "\n"]
    atomic_write_text(out / "comparison.md", "\n".join(text))
    return rows


def table_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    extra = [c for c in ("client_accuracy", "epsilon") if any(c in r for r in rows)]
    status = ["status"] if any(r.get("status") not in (None, "completed") for r in rows) else []
    cols = ["variant", *status, "accuracy", *accuracy_columns(rows), "loss", *extra, *leak_columns(rows), "round_seconds"]
    if any("time_ratio" in r for r in rows):
        cols.append("time_ratio")
    return cols + ["failures"]


def table_formats(cols: Sequence[str]) -> dict[str, str]:
    fmt = {c: ".3f" for c in cols}
    fmt.update({c: ".2f" for c in cols if c.endswith("psnr") or c in ("round_seconds", "time_ratio")})
    fmt.update({c: ".2e" for c in cols if c.endswith(".mse")})  # records: errors of 1e-10 are not "0.000"
    fmt["failures"] = ".3g"
    return fmt


def privacy_figure(rows: Sequence[Mapping[str, Any]], out: Path) -> list[str]:
    """``privacy_utility.png`` (:mod:`fedsim.privacy_utility`) when a run reports differential privacy; the
    report lines that show it."""
    if not any("dp_mechanisms" in r for r in rows):
        return []
    path = plot_privacy_utility(rows, out / "privacy_utility.png")
    return [f"\n![privacy-utility]({Path(path).name})\n"] if path else []
