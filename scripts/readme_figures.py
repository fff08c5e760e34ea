"""Re-measure the figures in README.md and rewrite them in place (run before each release).

Every timing or number in the README that comes from a run sits between markers, inline
``<!-- fig:NAME -->value<!-- /fig:NAME -->`` or around a block (an example's output). This script runs
the commands the README shows, as a user would (``python -m fedsim ...`` in a fresh process from this
checkout, outputs in a temporary folder), and replaces each marked value with what it measured; the
``machine`` figure says where and when (CPUs, Python and torch, the load average over the whole script)
and every timing carries the machine's 1-minute load average at its start and end (other processes slow
every timing, so a figure without its load would mislead).

Figures:

* ``demo_seconds``: ``fedsim run experiments/demo.toml`` (what ``make demo`` runs after installing),
  wall time, its load, and whether it meets the README's target (under 30 s on a quiet 2-core
  machine: said only when the machine was quiet, a 1-minute load average below ``QUIET`` throughout);
  ``demo_accuracy``: its final accuracy;
* ``progress_example`` (block), ``progress_startup``: ``fedsim run experiments/default.toml --set
  federation.rounds=2``: its progress lines and its start-up (``startup_seconds``);
* ``attack_example`` (block) and the attack paragraph's numbers: ``fedsim attack --attack dlg --attack
  idlg --batch-size 1`` (PSNR and iterations of each), then DLG alone with ``restarts=1`` (the stuck first
  start: ``dlg_stuck_*``) and with ``restarts=1 iterations=1000 patience=1000`` (``dlg_alone_psnr``);
* ``quick_range``: every experiment's ``fedsim experiment NAME --quick``, wall time (``--skip-quick``
  keeps the old figure; the slowest step);
* ``full_<experiment>``: an experiment's full-scale duration as its file states it (``[experiment]
  scale``: "~25 min on 2 CPU cores"), which the experiment's author measured.

    python scripts/readme_figures.py [--only GROUP ...] [--skip-quick] [--wait-quiet SECONDS] [--dry-run]
                                     [--readme README.md]

``--only`` measures only these groups (demo, progress, attack, quick) and keeps the other figures;
``--wait-quiet`` waits up to SECONDS before each timed group for the load average to fall below
``QUIET`` (a shared machine's quiet moments), and measures anyway when it does not.
``--dry-run`` prints the figures and writes nothing. A marker the script does not know, or a figure with
no marker, is an error (the README and this script must agree).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET = 1.5  # 1-minute load average below which a 2-core machine counts as quiet
TARGET_DEMO_S = 30.0  # the README's promise for its first command
MARKER = re.compile(r"<!-- fig:([\w-]+) -->(.*?)<!-- /fig:\1 -->", re.S)


class Timed(float):
    """Wall seconds of a command, with the 1-minute load average at its start and end."""

    def __new__(cls, wall: float, load_before: float, load_after: float) -> "Timed":
        obj = super().__new__(cls, wall)
        obj.loads = (load_before, load_after)
        return obj


def load1() -> float:
    return os.getloadavg()[0]


def under_load(loads: list[float]) -> str:
    lo, hi = min(loads), max(loads)
    return f"load average {lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"load average {lo:.1f}-{hi:.1f}"


def quiet(loads: list[float]) -> bool:
    return max(loads) < QUIET


WAIT_QUIET = 0.0  # --wait-quiet


def wait_quiet() -> None:
    end = time.monotonic() + WAIT_QUIET
    while load1() >= QUIET and time.monotonic() < end:
        time.sleep(5)


def fedsim(args: list[str], tmp: Path) -> tuple[Timed, str]:
    """``python -m fedsim ARGS`` from the checkout: (wall seconds with the load, stderr). Fails loudly on a
    non-zero exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(tmp / "ray"),
               FEDSIM_PROGRESS_INTERVAL=os.environ.get("FEDSIM_PROGRESS_INTERVAL", "2"))
    print(f"  fedsim {' '.join(args)}", file=sys.stderr, flush=True)
    before, t0 = load1(), time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "fedsim", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = Timed(time.perf_counter() - t0, before, load1())
    if p.returncode != 0:
        raise SystemExit(f"fedsim {' '.join(args)} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    print(f"    {wall:.1f} s ({under_load(list(wall.loads))})", file=sys.stderr, flush=True)
    return wall, p.stderr


def seconds(x: float) -> str:
    return f"{x:.0f} s" if x >= 10 else f"{x:.1f} s"


def timed(x: Timed) -> str:
    return f"{seconds(x)} ({under_load(list(x.loads))})"


def block(lines: list[str]) -> str:
    return "\n```\n" + "\n".join(lines) + "\n```\n"


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def machine(load_before: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    import torch

    return (f"measured by `scripts/readme_figures.py` on {datetime.date.today().isoformat()}: {os.cpu_count()} "
            f"CPU cores ({cpu}), no GPU in use, Python {platform.python_version()}, torch {torch.__version__}; load "
            f"average (1/5/15 min) {load_before} before and {load()} after the script; each timing gives the "
            "1-minute load average at its start and end (a quiet 2-core machine: below "
            f"{QUIET})")


# ---- the figures --------------------------------------------------------------------------------------
def demo_verdict(wall: Timed) -> str:
    """The demo's time, its load, and what that says about the target (under 30 s, quiet 2-core machine)."""
    loads = list(wall.loads)
    if quiet(loads):
        met = "within" if wall < TARGET_DEMO_S else "over"
        return (f"{seconds(wall)} on a quiet machine ({under_load(loads)}): {met} the target of under "
                f"{TARGET_DEMO_S:.0f} s on a quiet 2-core machine")
    return (f"{seconds(wall)} with other processes busy ({under_load(loads)}); the target, under "
            f"{TARGET_DEMO_S:.0f} s on a quiet 2-core machine, was not measured in this run (no quiet moment)")


def demo(tmp: Path) -> dict[str, str]:
    out = tmp / "demo"
    wait_quiet()
    wall, _ = fedsim(["run", "experiments/demo.toml", "--out", str(out), "-q"], tmp)
    summary = json.loads((out / "summary.json").read_text())
    return {"demo_seconds": demo_verdict(wall), "demo_accuracy": f"{summary['final_accuracy']:.2f}"}


def elide(lines: list[str]) -> list[str]:
    """Of each run of repeated "still ..." lines (the same message every few seconds): the first and
    the last, with "..." between (a loaded machine repeats them dozens of times)."""
    def key(ln: str) -> str | None:
        m = re.match(r"(\[fedsim\] (?:still starting|round \d+/\d+: clients training))", ln)
        return m.group(1) if m else None

    out: list[str] = []
    i = 0
    while i < len(lines):
        j = i
        while j + 1 < len(lines) and key(lines[i]) is not None and key(lines[j + 1]) == key(lines[i]):
            j += 1
        out += [lines[i], "...", lines[j]] if j - i >= 2 else lines[i:j + 1]
        i = j + 1
    return out


def progress(tmp: Path) -> dict[str, str]:
    out = tmp / "progress"
    wait_quiet()
    wall, err = fedsim(["run", "experiments/default.toml", "--set", "federation.rounds=2", "--out", str(out)], tmp)
    lines = elide([ln for ln in err.splitlines() if ln.startswith("[fedsim]") and "results in" not in ln])
    summary = json.loads((out / "summary.json").read_text())
    return {"progress_example": block(lines),
            "progress_startup": f"{seconds(summary['startup_seconds'])} ({under_load(list(wall.loads))})"}


def _leak(out: Path) -> dict[str, dict]:
    return {r["attack"]: r for r in map(json.loads, (out / "leakage.jsonl").read_text().splitlines())}


def _attack_lines(err: str) -> list[str]:
    """Of each attack's progress: the start, the first iteration, the last two lines of its iterations
    and its result."""
    lines = [ln for ln in err.splitlines() if ln.startswith("[fedsim] attack ")]
    out: list[str] = []
    for name in dict.fromkeys(ln.split()[2].rstrip(":") for ln in lines):
        mine = [ln for ln in lines if ln.startswith(f"[fedsim] attack {name}:")]
        its = [ln for ln in mine if "  it " in ln]
        keep = [ln for ln in mine if "started" in ln] + its[:1] + [ln for ln in its[-3:-1] if ln not in its[:1]]
        keep += [ln for ln in its[-1:] if ln not in keep] + [ln for ln in mine if ": PSNR" in ln]
        out += keep
    return out


def attack(tmp: Path) -> dict[str, str]:
    both = tmp / "attack"
    _, err = fedsim(["attack", "--attack", "dlg", "--attack", "idlg", "--batch-size", "1", "--out", str(both)], tmp)
    leak = _leak(both)
    stuck = tmp / "attack-stuck"
    fedsim(["attack", "--attack", "dlg", "--batch-size", "1", "--set", "attack.params.dlg.restarts=1",
            "--out", str(stuck), "-q"], tmp)
    alone = tmp / "attack-alone"
    fedsim(["attack", "--attack", "dlg", "--batch-size", "1", "--set", "attack.params.dlg.restarts=1",
            "--set", "attack.params.dlg.iterations=1000", "--set", "attack.params.dlg.patience=1000",
            "--out", str(alone), "-q"], tmp)
    s, a = _leak(stuck)["dlg"], _leak(alone)["dlg"]
    return {"attack_example": block(_attack_lines(err)),
            "dlg_psnr": f"{leak['dlg']['psnr']:.1f}", "dlg_it": str(leak["dlg"]["iterations"]),
            "idlg_psnr": f"{leak['idlg']['psnr']:.1f}", "idlg_it": str(leak["idlg"]["iterations"]),
            "dlg_stuck_psnr": f"{s['psnr']:.1f}", "dlg_stuck_it": str(s["iterations"]),
            "dlg_alone_psnr": f"{a['psnr']:.1f}", "dlg_alone_it": str(a["iterations"])}


def experiments() -> dict[str, dict]:
    out = {}
    for p in sorted((ROOT / "experiments").glob("*.toml")):
        data = tomllib.loads(p.read_text())
        if "experiment" in data:
            out[p.stem] = data
    return out


def quick(tmp: Path) -> dict[str, str]:
    walls = {}
    for name, data in experiments().items():
        if "quick" in data:
            wait_quiet()
            walls[name], _ = fedsim(["experiment", name, "--quick", "-q", "--out", str(tmp / f"quick-{name}")], tmp)
    slowest = max(walls, key=walls.get)
    loads = [x for w in walls.values() for x in w.loads]
    return {"quick_range": f"{seconds(min(walls.values()))} to {seconds(walls[slowest])} (median "
                           f"{seconds(statistics.median(walls.values()))}; the slowest: {slowest}; "
                           f"{under_load(loads)})"}


def full_scale() -> dict[str, str]:
    out = {}
    for name, data in experiments().items():
        m = re.search(r"~\s*[\d.]+\s*(?:s|min|h)\b[^.;,)]*", str(data["experiment"].get("scale", "")))
        if m:
            out[f"full_{name}"] = m.group(0).strip()
    return out


def rewrite(text: str, figures: dict[str, str]) -> str:
    names = {m.group(1) for m in MARKER.finditer(text)}
    unknown = names - set(figures) - KEPT
    if unknown:
        raise SystemExit(f"README markers with no figure: {sorted(unknown)}")
    return MARKER.sub(lambda m: f"<!-- fig:{m.group(1)} -->{figures.get(m.group(1), m.group(2))}<!-- /fig:{m.group(1)} -->",
                      text)


KEPT: set[str] = set()  # figures skipped this time (--only, --skip-quick): their markers keep the old value
GROUPS = ("demo", "progress", "attack", "quick")
GROUP_FIGURES = {"demo": {"demo_seconds", "demo_accuracy"}, "progress": {"progress_example", "progress_startup"},
                 "attack": {"attack_example", "dlg_psnr", "dlg_it", "idlg_psnr", "idlg_it", "dlg_stuck_psnr",
                            "dlg_stuck_it", "dlg_alone_psnr", "dlg_alone_it"},
                 "quick": {"quick_range"}}


def marker_value(text: str, name: str) -> str:
    return next((m.group(2) for m in MARKER.finditer(text) if m.group(1) == name), "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--only", action="append", choices=GROUPS, help="measure only this group (repeatable); "
                    "the other figures keep their values")
    ap.add_argument("--skip-quick", action="store_true", help="keep the quick variants' figure (slowest step)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help=f"before each timed command wait up to SECONDS for the load average to fall below {QUIET}")
    ap.add_argument("--dry-run", action="store_true", help="print the figures, write nothing")
    args = ap.parse_args()
    global WAIT_QUIET
    WAIT_QUIET = args.wait_quiet
    groups = set(args.only or GROUPS) - ({"quick"} if args.skip_quick else set())
    text = args.readme.read_text()
    before = load()
    figures: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fsfig") as d:
        tmp = Path(d)
        for name in GROUPS:
            if name in groups:
                figures.update(globals()[name](tmp))
            else:
                KEPT.update(GROUP_FIGURES[name])
    figures.update(full_scale())
    figures["machine"] = machine(before)
    marked = {m.group(1) for m in MARKER.finditer(text)}
    figures = {k: v for k, v in figures.items() if k in marked or not k.startswith("full_")}
    missing = set(figures) - marked
    unmeasured = {k for k in marked - set(figures) if k in KEPT and marker_value(text, k) == "?"}
    if unmeasured:
        print(f"warning: never measured (still '?'): {sorted(unmeasured)}", file=sys.stderr)
    if missing:
        raise SystemExit(f"figures with no marker in {args.readme}: {sorted(missing)}")
    for k, v in figures.items():
        print(f"{k}: {v.strip()}" if "\n" not in v.strip() else f"{k}:\n{v.strip()}")
    if not args.dry_run:
        args.readme.write_text(rewrite(text, figures))
        print(f"rewrote {len(figures)} figures in {args.readme}", file=sys.stderr)


if __name__ == "__main__":
    main()
