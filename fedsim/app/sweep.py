"""Experiments with several variants: one command reproduces a table.

A sweep file is an ordinary config plus ``[[variants]]``; each variant has a ``label`` and any config
keys, merged over the base (tables merge key by key; lists such as ``defenses`` replace). Every
variant is validated before anything runs, then each runs into ``<out>/<nn>-<label>/`` and the sweep
writes ``sweep.jsonl`` (one row per variant) and ``report.md`` with one table: final accuracy, loss,
leakage metrics of every configured attack, and mean round time relative to the first variant.

    [[variants]]
    label = "no defense"

    [[variants]]
    label = "gaussian 1e-2"
    defenses = [{ name = "gaussian-noise", variance = 1e-2 }]
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedsim.app import validate
from fedsim.config import ConfigError, _merge, apply_overrides, defaults, read_toml
from fedsim.reports import atomic_write_text, md_table, new_run_dir, read_jsonl, write_jsonl


def load_sweep(path: str | Path, overrides: Sequence[str] = (),
               only: Sequence[str] = ()) -> tuple[dict[str, Any], list[tuple[str, dict]]]:
    """(base config, [(label, resolved config), ...]); raises ConfigError naming the variant and key.

    ``only`` keeps just the variants with these labels; the overrides are applied to those alone (so
    ``--set defenses.0.sigma=...`` works with ``--only`` a variant that has a defense)."""
    p = Path(path)
    data = read_toml(p, "sweep file")
    variants = data.pop("variants", None)
    if not isinstance(variants, list) or not variants or not all(isinstance(v, dict) for v in variants):
        raise ConfigError(f"{p}: a sweep needs [[variants]] tables (each with a label)")
    base = defaults()
    _merge(base, data)
    out = []
    labels = []
    for i, v in enumerate(variants):
        label = v.get("label")
        if not isinstance(label, str) or not label:
            raise ConfigError(f"variants[{i}].label must be a non-empty string")
        if label in labels:
            raise ConfigError(f"variants[{i}].label {label!r} is used twice")
        labels.append(label)
    unknown = [o for o in only if o not in labels]
    if unknown:
        raise ConfigError(f"--only {unknown}: no such variant; variants: {labels}")
    for i, v in enumerate(variants):
        v = dict(v)
        label = v.pop("label")
        if only and label not in only:
            continue
        cfg = copy.deepcopy(base)
        _merge(cfg, v)
        cfg["name"] = f"{base.get('name', 'sweep')}-{_slug(label)}"
        try:
            apply_overrides(cfg, overrides)
            validate(cfg)
        except ConfigError as exc:
            raise ConfigError(f"variants[{i}] ({label}): {exc}") from exc
        out.append((label, cfg))
    # the base names the output folder and heads the report; every override was checked against every
    # selected variant above, and one that only a variant can take (defenses.<i>.<param>) skips the base
    for o in overrides:
        try:
            apply_overrides(base, [o])
        except ConfigError:
            pass
    return base, out


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-").lower() or "variant"


def variant_row(label: str, run_dir: Path) -> dict[str, Any]:
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train_rounds = [r for r in rows if r["round"] >= 2] or [r for r in rows if r["round"] >= 1]
    secs = [r["seconds"] for r in train_rounds]
    row: dict[str, Any] = {"variant": label, "status": summary.get("status", "completed"),
                           "accuracy": summary.get("final_accuracy"),
                           "loss": summary.get("final_loss"),
                           "round_seconds": float(np.median(secs)) if secs else None,
                           "failures": summary.get("client_failures", 0), "run": run_dir.name}
    eps = [v for k, v in (rows[-1] if rows else {}).items() if k.endswith(".epsilon") and v is not None]
    if eps:  # DP accounting reported by the clients' defenses (example-weighted mean over the clients)
        row["epsilon"] = max(eps)
    for leak in summary.get("leakage", []):
        a = leak["attack"]
        for k in ("psnr", "ssim", "label_acc", "success_content"):
            row[f"{a}.{k}"] = leak.get(k)
    return row


class SweepFailed(RuntimeError):
    """Some variants failed (the others ran; the sweep's report lists every variant's status)."""


def run_sweep(path: str | Path, overrides: Sequence[str] = (), out: str | Path | None = None,
              progress: bool = True, only: Sequence[str] = (), overwrite: bool = False) -> Path:
    """Run every variant into ``<out>/<nn>-<label>/``. Everything is checked first (configs, data,
    partitions, the variant folders): a bad value anywhere stops the sweep before anything runs. Re-run
    into the same ``out``, completed variants are skipped and interrupted ones resume from their
    checkpoints; ``overwrite`` clears the folder first. A variant that fails is recorded (``status``
    in its row) and the sweep goes on; :class:`SweepFailed` is raised at the end."""
    from fedsim.app.runner import run_experiment
    from fedsim.config import check_data
    from fedsim.interrupt import RunInterrupted
    from fedsim.runfolder import RunFolderError, decide, open_sweep_folder

    base, variants = load_sweep(path, overrides, only)
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
            out_dir = new_run_dir(base["output"]["dir"], base.get("name", "sweep"))
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
        dirs = [out_dir / f"{i:02d}-{_slug(label)}" for i, (label, _) in enumerate(variants)]
        for d, (label, cfg) in zip(dirs, variants):  # a folder of another run stops the sweep before it starts
            if d.is_dir():
                decide(d, cfg, what=f"variant {label!r}: folder")
        if not (out_dir / "sweep.jsonl").exists():
            write_jsonl(out_dir / "sweep.jsonl", [])  # marks the folder as a sweep's
        rows, failed = [], []
        for i, ((label, cfg), run_dir) in enumerate(zip(variants, dirs)):
            if progress:
                print(f"[fedsim] sweep {i + 1}/{len(variants)}: {label}", flush=True)
            try:
                run_experiment(cfg, out=run_dir, progress=progress)
                rows.append(variant_row(label, run_dir))
            except RunInterrupted as exc:
                exc.run_dir = out_dir  # type: ignore[attr-defined]
                exc.resume_hint = f"fedsim sweep {path} --resume {out_dir}"  # type: ignore[attr-defined]
                raise
            except (ConfigError, KeyboardInterrupt):
                raise
            except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
                failed.append(label)
                rows.append({"variant": label, "status": "failed", "accuracy": None, "loss": None,
                             "round_seconds": None, "run": run_dir.name,
                             "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]})
                if progress:
                    print(f"[fedsim] sweep variant {label!r} failed: {rows[-1]['error']}", flush=True)
            base_t = rows[0]["round_seconds"]
            for r in rows:
                r["time_ratio"] = r["round_seconds"] / base_t if base_t and r["round_seconds"] else None
            write_jsonl(out_dir / "sweep.jsonl", rows)
            write_sweep_report(out_dir, base, rows)
        if failed:
            err = SweepFailed(f"{len(failed)} of {len(variants)} variants failed: {failed}")
            err.run_dir = out_dir  # type: ignore[attr-defined]
            raise err
    finally:
        folder.release()
    return out_dir


def write_sweep_report(out_dir: Path, base: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    leak_cols = sorted({k for r in rows for k in r if "." in k}, key=lambda k: (k.split(".")[0], k))
    eps = ["epsilon"] if any("epsilon" in r for r in rows) else []
    status = ["status"] if any(r.get("status", "completed") != "completed" for r in rows) else []
    cols = ["variant", *status, "accuracy", "loss", *eps, *leak_cols, "round_seconds", "time_ratio", "failures"]
    fmt = {c: ".3f" for c in cols}
    fmt.update({c: ".2f" for c in cols if c.endswith("psnr") or c in ("round_seconds", "time_ratio")})
    fed, train = base["federation"], base["train"]
    text = [f"# fedsim sweep: {base.get('name', 'sweep')}\n",
            f"{len(rows)} variants; {fed['rounds']} rounds, {fed['num_clients']} clients, data "
            f"{base['data']['dataset']}, model {base['model']['name']}, lr {train['lr']}, batch "
            f"{train['batch_size']}. Accuracy/loss: global model on the test set after the last round. "
            "Leakage columns: mean over the attacked updates (`<attack>.psnr` in dB, `.ssim`, `.label_acc`, "
            "`.success_content` = share of images with SSIM >= the threshold). `round_seconds`: median wall time "
            "of rounds >= 2 (training, aggregation, evaluation; attacks are timed apart); `time_ratio`: relative to the first variant.\n",
            md_table(rows, cols, fmt),
            "\nEach variant's own report: " + ", ".join(f"[{r['variant']}]({r['run']}/report.md)" for r in rows) + "\n"]
    atomic_write_text(out_dir / "report.md", "\n".join(text))
