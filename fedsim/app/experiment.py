"""``fedsim experiment NAME [--quick] [--out DIR] [--publish DIR]``: the papers' tables, one command each.

An experiment is a sweep file (:mod:`fedsim.app.sweep`: one mechanism) in ``experiments/`` with an
``[experiment]`` table (title, paper, scale, notes, claims), a ``[quick]`` table (overrides, per-variant
overrides and a variant subset that run in minutes on 2 CPU cores: the CI smoke test runs every one,
and every table has a quick row) and a
``[report]`` table (tables shaped like the paper's, the systematic evaluation; :mod:`fedsim.tables`).
``NAME`` is a file or the stem of one in ``experiments/``. Re-running into the same ``--out`` skips
the variants whose runs are complete. ``--publish DIR`` (e.g. ``docs/results``) copies the report
and its figures to ``DIR/<name>/`` with the command, date and commit, and rewrites ``DIR/README.md``:
every published experiment's claims, our numbers over the seeds, the interval and the verdict
(:mod:`fedsim.claims`), then ``DIR/disagreements.md`` (hand-written). An experiment runs seeds 0, 1, 2
unless its file or ``--seeds`` names others; ``--publish`` refuses fewer than three. The per-variant run folders
are not published: the published report names them as plain text, relative to the run folder, instead
of linking to them.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from fedsim.config import ConfigError, read_toml
from fedsim.reports import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"


def experiment_files(folder: Path = EXPERIMENTS) -> dict[str, Path]:
    """Every file in ``folder`` with an ``[experiment]`` table, by stem."""
    out = {}
    for p in sorted(folder.glob("*.toml")):
        try:
            if "experiment" in read_toml(p, "experiment file"):
                out[p.stem] = p
        except ConfigError:
            continue
    return out


def resolve(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise ConfigError(f"experiment file {name}: no such file")
        return p
    known = experiment_files()
    if name not in known:
        raise ConfigError(f"experiment {name!r}: no such experiment; known: {', '.join(known) or 'none'}")
    return known[name]


def _commit(results: Path | None = None) -> str:
    """The checkout's commit, with "+local changes" when tracked files differ from it - except those
    under ``results`` (the folder reports are published to: publishing one experiment after another
    changes it, which is no change to the code that produces the next one)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        spec: list[str] = []
        if results is not None:
            try:
                spec = ["--", ".", f":(exclude){Path(results).resolve().relative_to(ROOT.resolve())}"]
            except ValueError:  # published outside the checkout: every change counts
                spec = []
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", *spec],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+local changes" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def unlink_missing(text: str, folder: Path) -> str:
    """Markdown links (and images) in ``text`` whose relative target is not in ``folder`` become the
    target as plain text (code): a published report does not link to the run folders left behind."""
    def sub(m: re.Match) -> str:
        target = m.group(3)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")):
            return m.group(0)  # a URL, an anchor, an absolute path: left as they are
        if (folder / target.split("#", 1)[0]).exists():
            return m.group(0)
        return f"`{target}`"

    return _LINK.sub(sub, text)


def machine() -> str:
    """What computed the results, in words: CPU cores, the torch build, and the GPU when runs use one
    (``device = auto`` picks CUDA when present), so results published from different machines say so."""
    import platform

    import torch

    where = f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}"
    if torch.cuda.is_available():
        return f"{where}, GPU {torch.cuda.get_device_name(0)} (runs with device = auto use it)"
    return f"{where}, no GPU"


def publish(run_dir: Path, dest_root: Path, name: str, argv: Sequence[str]) -> Path:
    """Copy the experiment's report and figures to ``dest_root/name/`` with command, date and commit
    and rewrite ``dest_root/README.md``."""
    dest = dest_root / name
    commit, host = _commit(dest_root), machine()
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.iterdir():
        if old.is_file():
            old.unlink()
    stamp = (f"> Command: `{shlex.join(['fedsim', *argv])}`  \n> Date: "
             f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}  \n> Commit: {commit}  \n> Machine: {host}  \n"
             f"> Run folder (not in the repo): `{run_dir}`\n\n")
    for f in ("claims.json", "systematic.json", "sweep.csv"):
        if (run_dir / f).exists():
            shutil.copy2(run_dir / f, dest / f)
    for png in run_dir.glob("*.png"):
        shutil.copy2(png, dest / png.name)
    text = (run_dir / "report.md").read_text()
    title, _, rest = text.partition("\n")
    atomic_write_text(dest / "report.md", f"{title}\n\n{stamp}{unlink_missing(rest, dest)}")
    meta = {"name": name, "title": title.lstrip("# ").strip(), "command": shlex.join(["fedsim", *argv]),
            "date": _dt.date.today().isoformat(), "commit": commit, "machine": host}
    atomic_write_text(dest / "meta.json", json.dumps(meta, indent=1))
    write_results_index(dest_root)
    return dest


DISAGREEMENTS = "disagreements.md"  # hand-written, kept beside the index and included in it


def current_claims(experiments: dict[str, Path] | None = None) -> dict[str, list[str]]:
    """The claim texts each experiment file makes today, by experiment name."""
    files = experiment_files() if experiments is None else experiments
    return {name: [str(c.get("text", "")) for c in read_toml(p, "experiment file")["experiment"].get("claims", [])]
            for name, p in files.items()}


def _index_rows(root: Path, current: dict[str, list[str]]) -> tuple[list[str], dict[str, int], int, int, int]:
    """The index's table rows, the verdict counts over seeds, and how many claims are from before seeds,
    superseded and not yet published (:func:`write_results_index`)."""
    from fedsim.claims import cell, verdict_of

    rows: list[str] = []
    counts: dict[str, int] = {}
    legacy = superseded = pending = 0
    for d in sorted(p for p in root.iterdir() if (p / "meta.json").exists()):
        meta = json.loads((d / "meta.json").read_text())
        claims = json.loads((d / "claims.json").read_text()) if (d / "claims.json").exists() else []
        link = f"[{meta['title']}]({d.name}/report.md)"
        now = current.get(d.name)
        since = f"commit {meta['commit']}" if meta.get("commit") else "its publication"
        if not claims and not now:
            rows.append(f"| {link} | (tables only) | see report | - | - | - |")
        for c in claims:
            if now is not None and c["text"] not in now:
                superseded += 1
                rows.append(f"| {link} | {cell(c['text'])} | {cell(c['ours'])} | {cell(c.get('interval', '-'))} | "
                            f"{', '.join(str(s) for s in c.get('seeds', [])) or '1 (before seeds)'} | **superseded**: "
                            f"the experiment no longer makes this claim (it changed after {cell(since)}); "
                            "re-publish it |")
                continue
            v = verdict_of(c)
            if "seeds" in c:
                counts[v] = counts.get(v, 0) + 1
                seeds = ", ".join(str(s) for s in c["seeds"])
            else:  # published before claims were decided over seeds: one run, a plain comparison
                legacy += 1
                seeds = "1 (before seeds)"
            text = c["text"] + (f" *(extension beyond the paper: {c['extension']})*" if c.get("extension") else "")
            why = f": {c['why']}" if c.get("why") else ""
            rows.append(f"| {link} | {cell(text)} | {cell(c['ours'])} | {cell(c.get('interval', '-'))} | {seeds} | "
                        f"**{v}**{cell(why)} |")
        published = {c["text"] for c in claims}
        for text in now or []:
            if text not in published:
                pending += 1
                rows.append(f"| {link} | {cell(text)} | - | - | - | **not yet published**: added to the experiment "
                            f"after {cell(since)}; re-publish it |")
    return rows, counts, legacy, superseded, pending


def write_results_index(root: Path, current: dict[str, list[str]] | None = None) -> None:
    """``root/README.md``: every published experiment's claims with the numbers over seeds, the interval
    that decided each, the seeds and the verdict; then ``root/disagreements.md`` (hand-written: where
    fedsim and the papers disagree, and why) when it exists. ``current`` (default: the experiment files'
    claims, :func:`current_claims`) marks what changed since a publication: a published claim the experiment
    no longer makes is **superseded** (not counted among the verdicts), and a claim the experiment makes
    but its publication lacks is **not yet published**."""
    from fedsim.claims import LEVEL, MIN_SEEDS

    rows, counts, legacy, superseded, pending = _index_rows(root, current_claims() if current is None else current)
    plural = {"holds": "hold", "does not hold": "do not hold", "inconclusive": "inconclusive",
              "not measured": "not measured"}
    summary = ", ".join(f"{counts[v]} {v if counts[v] == 1 else plural[v]}" for v in plural if counts.get(v))
    summary = (f"Verdicts over seeds: {summary}." if summary else "") + (
        f"{' ' if summary else ''}{legacy} claim{'s' if legacy != 1 else ''} published before claims were "
        "decided over seeds (seeds: *1 (before seeds)*): their holds / does not hold compares one run's two "
        "numbers, without an interval, and is replaced when the experiment is re-published (`make results`)."
        if legacy else "")
    changed = [f"{superseded} published claim{'s' if superseded != 1 else ''} superseded" if superseded else "",
               f"{pending} claim{'s' if pending != 1 else ''} of the experiments not yet published" if pending else ""]
    if superseded or pending:
        summary += (" " if summary else "") + " and ".join(x for x in changed if x) + (
            " (the experiment files changed after their last publication: the rows say which; re-publishing "
            "replaces them).")
    lines = ["# Results\n", "Each folder holds an experiment's latest full report (`fedsim experiment NAME "
             "--publish docs/results`), with its command, date and commit. The table lists every paper claim "
             "the experiments check: what the paper says, what we measured, and the verdict. The reports say "
             "why numbers differ (offline data, scale, CPU).\n",
             f"**How a claim is decided** (`fedsim/claims.py`): every variant runs once per seed (at least "
             f"{MIN_SEEDS}); *ours* is the mean ± sample standard deviation over the seeds of each side; the "
             f"*interval* is the {LEVEL:.0%} Student-t interval of the per-seed difference `value - than` (paired: "
             "a seed gives both variants the same data split, initial model and client sampling), or of the "
             "value's mean against a fixed number. The claim **holds** when the whole interval lies on the "
             "claim's side of its bound, **does not hold** when it lies on the other side, and is "
             "**inconclusive** when it straddles the bound, when fewer than "
             f"{MIN_SEEDS} seeds ran, when a comparison without a margin ties in every seed (e.g. both at a ceiling of "
             "1.0), or when "
             "it compares two attacks that both failed in every seed (no reconstruction met the attack's "
             "success line: `success_content` 0). Systematic-evaluation claims hold when they hold in every "
             "seed. Each claim is tested on its own at 95% (no multiple-comparison correction). A claim "
             "marked *extension* applies the paper's claim to a setting the paper did not test.\n",
             "**Re-publishing** every experiment at seeds 0, 1, 2: `make results` (per experiment: `fedsim "
             "experiment NAME --out runs/results/NAME --publish docs/results`; re-running it resumes an "
             "interrupted experiment; `make results JOBS=N` / `--jobs N` runs N runs at once, with the same "
             "numbers). Publish from a clean commit: the stamp names it.\n",
             *([f"{summary}\n"] if summary else []),
             "| experiment | claim | ours (mean ± std over seeds) | interval | seeds | verdict |",
             "|---|---|---|---|---|---|", *rows]
    if (root / DISAGREEMENTS).exists():
        lines += ["", (root / DISAGREEMENTS).read_text().rstrip()]
    atomic_write_text(root / "README.md", "\n".join(lines) + "\n")


def cmd_experiment(args: Any, shortcuts: Sequence[str], seeds: list[int] | None, workers: int = 1) -> int:
    from fedsim.app.sweep import run_sweep
    from fedsim.claims import MIN_SEEDS

    if args.list:
        for stem, p in experiment_files().items():
            data = read_toml(p, "experiment file")
            print(f"{stem:<22} {data['experiment'].get('title', '')}")
        return 0
    if not args.name:
        raise ConfigError("fedsim experiment: name an experiment (fedsim experiment --list shows them)")
    path = resolve(args.name)
    out = args.out
    if args.resume:
        if out is not None and Path(out) != Path(args.resume):
            raise ConfigError(f"--out {out} and --resume {args.resume} name different folders")
        if not Path(args.resume).is_dir():
            raise ConfigError(f"--resume {args.resume}: no such experiment folder")
        out = args.resume
    if args.publish and (args.quick or args.only):
        raise ConfigError("--publish is for full-scale reports of every variant; drop --quick / --only")
    if args.publish and seeds is not None and len(seeds) < MIN_SEEDS:
        raise ConfigError(f"--publish decides the claims over >= {MIN_SEEDS} seeds; --seeds gives {len(seeds)}")
    run_dir = run_sweep(path, [*(args.set or []), *shortcuts], out=out, progress=not args.quiet,
                        only=args.only or [], seeds=seeds, overwrite=args.overwrite, quick=args.quick,
                        command=["fedsim", "experiment", args.name], workers=workers)
    print(f"[fedsim] experiment {path.stem} results in {run_dir}  (report: {Path(run_dir) / 'report.md'})")
    if args.publish:
        dest = publish(Path(run_dir), Path(args.publish), path.stem, sys.argv[1:])
        print(f"[fedsim] published to {dest} (index: {Path(args.publish) / 'README.md'})")
    return 0
