"""How fast fedsim answers: ``--help``, a config error, a 10-client Ray run's start-up, a sweep's start-up.

Every measurement runs the command line in a fresh process (``python -m fedsim ...`` from the checkout,
as a user would) and times it from the outside:

* ``--help``: the wall time of ``fedsim --help``;
* ``error: bad key`` / ``error: missing file``: ``fedsim run experiments/default.toml --set
  federation.bogus=1`` and ``fedsim run experiments/missing.toml`` (both exit 2 with one line);
* ``Ray run, 10 clients``: ``fedsim run experiments/default.toml --set federation.rounds=1``;
* ``sweep, 5 variants on Ray``: a sweep file of the default experiment with 5 learning rates, 1 round
  each (written to a temporary folder).

Columns: ``start-up s``: the runs' own ``startup_seconds`` (from the launch of Flower's simulation
engine to every client ready; for the sweep, the sum over its 5 runs); ``to ready s``: from the
command's start to its first "clients ... ready" progress line (imports, validation, Ray, actors,
discovery: what a user waits before the first round); ``wall s``: the whole command. Medians over
``--repeats``.

``--baseline DIR`` runs every command also from another checkout (an earlier commit: ``git worktree add
/tmp/fedsim-base <commit>`` or ``git archive <commit> | tar -x -C /tmp/fedsim-base``), interleaved with
this one (baseline, current, baseline, current, ...: a busy machine slows both alike), and prints the
ratio current / baseline. ``--breakdown`` prints, for one Ray run of each checkout, when each phase
ended (seconds from the command's start): the first config check, the full validation (plugins,
torch), Ray up, the client actors warm (imports, data, first backward; only where Ray starts ahead),
the simulation engine launched, every client ready, round 1 done.

    python benchmarks/startup.py [--repeats 3] [--baseline DIR] [--skip-ray] [--skip-sweep] [--breakdown]

Prints the machine (CPUs, load average before and after).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY = "ready; start-up took"  # the progress line that ends a run's start-up


def machine() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs, load average {load}"


def fedsim(checkout: Path, args: list[str], tmp: Path, python: str = sys.executable) -> dict:
    """Run ``python -m fedsim ARGS`` in ``checkout``; wall time, time to the first ready line, exit code."""
    env = dict(os.environ, PYTHONPATH=str(checkout), RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(tmp))
    t0 = time.perf_counter()
    p = subprocess.Popen([python, "-m", "fedsim", *args], cwd=checkout, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    ready, tail = None, []
    for line in p.stderr:  # type: ignore[union-attr]
        if ready is None and READY in line:
            ready = time.perf_counter() - t0
        tail = (tail + [line.rstrip()])[-5:]
    rc = p.wait()
    return {"wall": time.perf_counter() - t0, "ready": ready, "rc": rc, "tail": tail}


def startup_seconds(run_dirs: list[Path]) -> list[float]:
    """Each run's own ``startup_seconds`` (a sweep: in the order its runs ran)."""
    return [json.loads((d / "summary.json").read_text())["startup_seconds"] for d in run_dirs]


SWEEP = """
{base}
[[variants]]
label = "lr 0.1"
[[variants]]
label = "lr 0.05"
train = {{ lr = 0.05 }}
[[variants]]
label = "lr 0.02"
train = {{ lr = 0.02 }}
[[variants]]
label = "lr 0.2"
train = {{ lr = 0.2 }}
[[variants]]
label = "lr 0.01"
train = {{ lr = 0.01 }}
"""


def cases(args, tmp: Path) -> list[tuple[str, list[str], str | None]]:
    """(row, CLI arguments, what to read the start-up from: 'run' / 'sweep' / None)."""
    out = [("--help", ["--help"], None),
           ("error: bad key", ["run", "experiments/default.toml", "--set", "federation.bogus=1"], None),
           ("error: missing file", ["run", "experiments/missing.toml"], None)]
    if not args.skip_ray:
        out.append(("Ray run, 10 clients", ["run", "experiments/default.toml", "--set", "federation.rounds=1",
                                            "--out", "{out}"], "run"))
    if not args.skip_sweep:
        base = (ROOT / "experiments" / "default.toml").read_text()
        sweep = tmp / "sweep5.toml"
        sweep.write_text(SWEEP.format(base=base))
        out.append(("sweep, 5 variants on Ray", ["sweep", str(sweep), "--set", "federation.rounds=1", "--out",
                                                 "{out}"], "sweep"))
    return out


def measure(args, checkouts: dict[str, Path], tmp: Path) -> dict[tuple[str, str], list[dict]]:
    results: dict[tuple[str, str], list[dict]] = {}
    n = 0
    for rep in range(args.repeats):
        for row, argv, kind in cases(args, tmp):
            for name, checkout in checkouts.items():
                n += 1
                out = tmp / f"out{n}"
                res = fedsim(checkout, [a.replace("{out}", str(out)) for a in argv], tmp / "ray")
                if kind is not None:
                    if res["rc"] != 0:
                        raise SystemExit(f"{name}: {row} failed (exit {res['rc']}): " + "\n".join(res["tail"]))
                    dirs = [out] if kind == "run" else sorted(p for p in out.iterdir() if (p / "summary.json").exists())
                    each = startup_seconds(dirs)
                    res["startup"] = sum(each)
                results.setdefault((row, name), []).append(res)
                per_run = f"  start-up per run: {', '.join(f'{s:.2f}' for s in each)} s" if kind else ""
                print(f"  [{rep + 1}/{args.repeats}] {name:<8} {row:<26} {res['wall']:7.2f} s  exit {res['rc']}"
                      f"{per_run}  ({machine()})", file=sys.stderr, flush=True)
    return results


def med(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(results, checkouts: dict[str, Path], rows: list[str]) -> str:
    names = list(checkouts)
    head = "| | " + " | ".join(f"{n} start-up s | {n} to ready s | {n} wall s" for n in names)
    if len(names) == 2:
        head += " | start-up ratio | to-ready ratio | wall ratio"
    lines = [head + " |", "|" + "---|" * (1 + 3 * len(names) + (3 if len(names) == 2 else 0))]
    for row in rows:
        cells, vals = [], {}
        for n in names:
            rs = results[(row, n)]
            vals[n] = (med([r.get("startup") for r in rs]), med([r["ready"] for r in rs]), med([r["wall"] for r in rs]))
            cells += [fmt(v) for v in vals[n]]
        if len(names) == 2:
            b, c = vals[names[0]], vals[names[1]]
            cells += [f"{y / x:.2f}x" if x and y else "-" for x, y in zip(b, c)]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- --breakdown: one Ray run, instrumented, in a child process ------------------------------------------
def breakdown_child(out: str, t_spawn: float) -> None:
    """Runs in a fresh process: the CLI's ``run`` with hooks that note when each phase ends."""
    marks: list[tuple[str, float]] = []

    def mark(what: str) -> None:
        if what not in {m[0] for m in marks}:  # the first time only (the prestart and the run both ensure Ray)
            marks.append((what, time.time() - t_spawn))

    def after(owner, name: str, label: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return

        def wrapped(*a, **k):
            res = fn(*a, **k)
            mark(label)
            return res
        setattr(owner, name, wrapped)

    mark("python started, benchmark imported")
    import fedsim.app
    import fedsim.config
    from fedsim.app import cli

    def instrument_run() -> None:
        """After validation (torch and Flower are imported by then): hooks on the engine's launch,
        discovery and rounds, so the instrumentation itself adds no import to the phases before."""
        import flwr.simulation

        import fedsim.rounds

        run_simulation = flwr.simulation.run_simulation

        def launched(*a, **k):
            mark("simulation engine launched")
            return run_simulation(*a, **k)
        flwr.simulation.run_simulation = launched
        after(fedsim.rounds.RoundEngine, "discover", "every client ready (discovery done)")
        after(fedsim.rounds.RoundEngine, "run_round", "round 1 done")
        if ray_runtime is None:
            from flwr.server.superlink.fleet.vce.backend import raybackend

            after(raybackend.RayBackend, "init_ray", "Ray up")

    def then_instrument(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*a, **k):
            res = fn(*a, **k)
            mark(label)
            instrument_run()
            return res
        setattr(owner, name, wrapped)

    after(fedsim.config, "read_config", "config read, first check passed (no torch)")
    then_instrument(fedsim.app, "validate" if hasattr(fedsim.config, "read_config") else "load_config",
                    "config validated (plugins, torch imported)")
    try:
        from fedsim.app import ray_runtime

        after(ray_runtime.Runtime, "ensure_ray", "Ray up")
        keep = ray_runtime.Runtime.keep_pool

        def keep_pool(self, pool, resources, check=True):
            if not check:  # the prestart's pool: note when its warm-up calls have run
                import threading

                import ray

                def watch():
                    ray.get([a.__ray_ready__.remote() for a in pool.pool])
                    mark("client actors warm (imports, data, first backward)")
                threading.Thread(target=watch, daemon=True).start()
            return keep(self, pool, resources, check)
        ray_runtime.Runtime.keep_pool = keep_pool
    except ImportError:  # a checkout before the shared runtime: Flower's own backend, hooked after validation
        ray_runtime = None
    rc = cli.main(["run", "experiments/default.toml", "--set", "federation.rounds=1", "-q", "--out", out])
    mark(f"command done (exit {rc})")
    print(json.dumps(sorted(marks, key=lambda m: m[1])))


def breakdown(checkouts: dict[str, Path], tmp: Path) -> None:
    for name, checkout in checkouts.items():
        env = dict(os.environ, PYTHONPATH=str(checkout), RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(tmp / "ray"))
        t = time.time()
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_breakdown-child",
                            str(tmp / f"bd-{name}"), repr(t)], cwd=checkout, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{name}: the breakdown run failed")
        marks = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"\n{name} ({checkout}): seconds from the command's start")
        prev = 0.0
        for what, at in marks:
            print(f"  {at:7.2f}  (+{at - prev:5.2f})  {what}")
            prev = at


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--_breakdown-child":
        breakdown_child(sys.argv[2], float(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout to compare with (interleaved)")
    ap.add_argument("--skip-ray", action="store_true", help="only --help and the error path")
    ap.add_argument("--skip-sweep", action="store_true", help="no 5-variant sweep")
    ap.add_argument("--breakdown", action="store_true", help="also time the phases of one Ray run")
    args = ap.parse_args()
    checkouts = {"baseline": args.baseline.resolve()} if args.baseline else {}
    checkouts["current"] = ROOT
    print(f"machine: {machine()}; python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="fsbench") as d:
        tmp = Path(d)
        results = measure(args, checkouts, tmp)
        rows = [r for r, _, _ in cases(args, tmp)]
        print(f"\nmedians of {args.repeats} interleaved repeats; machine after: {machine()}\n")
        print(table(results, checkouts, rows))
        if args.breakdown:
            breakdown(checkouts, tmp)


if __name__ == "__main__":
    main()
