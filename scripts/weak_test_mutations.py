"""Issue 20's check: run each rewritten test against a deliberately broken variant of the code it guards
(small source edits, restored afterwards) and report whether the test caught it.

    PYTHONPATH=$PWD python scripts/weak_test_mutations.py [LABEL-SUBSTRING ...]

First every selected test runs once on the unmutated tree (a test that fails there proves nothing);
then, per mutation: the edit, the test, its outcome (CAUGHT: the test failed, with pytest's failure
line; MISSED: it passed), and the restore. Files are restored (content and modification time) in a
``finally``, also on Ctrl-C, SIGTERM or a timeout; the script ends by comparing ``git status`` with
the one it started from. Nothing outside the checkout is edited: the LocalDpMod mutation patches
Flower's module in the test process through a pytest plugin written to a temporary folder. Tests run
with ``PYTHONDONTWRITEBYTECODE=1`` (no bytecode of a mutated file is cached).

Exit status: 0 when every mutation ran and was caught and the tree is as found, 1 otherwise.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONLY = sys.argv[1:]

# patches Flower's LocalDpMod in the pytest process (the test runs the in-process backend)
NO_CLIP_PLUGIN = '''
import flwr.clientapp.mod.localdp_mod as m
m.compute_clip_model_update = lambda *a, **k: None  # mutation: LocalDpMod without clipping
'''


@dataclass
class Mutation:
    label: str
    test: str
    edits: list[tuple[str, str, str]] = field(default_factory=list)  # (path, old, new): first occurrence
    plugin: str | None = None  # source of a pytest plugin that patches third-party code instead


M = [
    Mutation("compensation skips (small) buffers without names",
             "tests/test_compensation.py::test_global_update_compensation_on_state_dict_lists",
             [("fedsim/compensation.py",
               "        sel = [np.issubdtype(np.asarray(a).dtype, np.floating) for a in arrays]\n",
               "        sel = [np.issubdtype(np.asarray(a).dtype, np.floating) and np.asarray(a).size > 10"
               " for a in arrays]\n")]),
    Mutation("LocalDpMod without clipping",
             "tests/test_defenses.py::test_flower_local_dp_mod_wraps_training_and_clips_plus_noises_the_update",
             plugin=NO_CLIP_PLUGIN),
    Mutation("lrp stubbed to a no-op",
             "tests/test_seed000_e2e.py::test_lrp_without_compensation_keeps_accuracy",
             [("clients/slicing.py", "    def transform_update(self, update",
               "    def transform_update(self, update, ctx=None):\n        return update\n\n"
               "    def _orig_transform_update(self, update")]),
    Mutation("mp-compensation skipped",
             "tests/test_seed000_e2e.py::test_compensation_costs_accuracy_at_the_papers_noise",
             [("strategies/compensation.py", "        var = self.aggregate_variance(ctx)\n",
               "        var = self.aggregate_variance(ctx)\n        return aggregate\n")]),
    Mutation("attacker-side compensation returns the raw update",
             "tests/test_curious.py::test_attacker_side_compensation_changes_only_what_the_attack_sees",
             [("attacks/curious.py", "        var = self.compensate_var if",
               "        return delta\n        var = self.compensate_var if")]),
    Mutation("leakage.png drawn without data",
             "tests/test_curious.py::test_simulation_with_curious_server_writes_leakage_outputs",
             [("attacks/leakage_figures.py",
               "        rs = [r for r in rows if r[\"attack\"] == name]\n        rounds",
               "        rs = [r for r in rows if r[\"attack\"] == name][:0]\n        rounds")]),
    Mutation("dirichlet alpha not passed to the partitioner",
             "tests/test_fedavg.py::test_observers_see_every_sampled_client_with_what_was_sent",
             [("fedsim/factories.py", '        return {"alpha": d["alpha"]}', "        return {}")]),
    Mutation("pld ignores its layers",
             "tests/test_defenses.py::test_client_pipeline_errors",
             [("clients/pruning.py", "        self.layers = list(layers) if layers is not None else None",
               "        self.layers = None")]),
    Mutation("lrp entry's config values ignored (client_pipeline passes only the names)",
             "tests/test_slicing.py::test_lrp_config_validation_and_registration",
             [("fedsim/build.py", 'DEFENSES.build_list(cfg.get("defenses", []), "defenses", cfg=cfg)',
               'DEFENSES.build_list([{"name": e["name"]} for e in cfg.get("defenses", [])], "defenses", cfg=cfg)')]),
    Mutation("attack's iteration budget ignored (DLG/iDLG run a fixed 50 steps)",
             "tests/test_attacks.py::test_seeded_and_known_labels",
             [("attacks/dlg.py", "self._attempt(inp, target, y_fixed, attempt, self.iterations - log.spent)",
               "self._attempt(inp, target, y_fixed, attempt, 50)")]),
    Mutation("channel.name ignored on both sides (the plain channel always)",
             "tests/test_seams.py::test_a_new_channel_plugs_in_and_gives_the_same_aggregate",
             [("fedsim/build.py", 'CHANNELS.build(dict(cfg.get("channel") or {"name": "plain"}), "channel")',
               'CHANNELS.build({"name": "plain"}, "channel")'),
              ("fedsim/app/client.py", 'CHANNELS.lookup(name, "channel.name")',
               'CHANNELS.lookup("plain", "channel.name")')]),
    Mutation("the ClientApp spells the channel-setup action as a literal",
             "tests/test_architecture.py::test_every_wire_key_is_spelled_only_in_the_protocol_module",
             [("fedsim/app/client.py", "@client_app.query(CHANNEL_SETUP_ACTION)", '@client_app.query("channel")')]),
    Mutation("flwr run: the FAB's config wins over the project root's",
             "tests/test_flwr_run.py::test_flwr_run_config_path_resolution",
             [("fedsim/app/flower.py", "bases = [b for b in (root, app_dir) if b is not None]",
               "bases = [b for b in (app_dir, root) if b is not None]")]),
]


class Interrupted(BaseException):
    pass


def _on_signal(signum, frame):
    raise Interrupted(f"signal {signum}")


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout


def pytest(tests: list[str], plugin_dir: Path | None = None, plugin: str | None = None,
           timeout: float = 1800) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COLUMNS="240",
               PYTHONPATH=os.pathsep.join([str(ROOT), *([str(plugin_dir)] if plugin_dir else []),
                                           os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
           *(["-p", plugin] if plugin else []), *tests]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def failure_line(out: str) -> str:
    """pytest's first FAILED/ERROR summary line; with the first ``E`` line of the traceback when the
    summary carries no message (a bare ``assert`` on a comparison pytest does not rewrite)."""
    lines = out.splitlines()
    failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    if not failed:
        tail = [ln for ln in lines if ln.strip()]
        return tail[-1] if tail else "(no output)"
    if not failed[0].rstrip().endswith(("Error:", "Error")):
        return failed[0]
    detail = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    detail = [d for d in detail if d and not d.endswith("Error:")][:2]
    return failed[0].rstrip() + (f" [{' | '.join(detail)}]" if detail else "")


def main() -> int:
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    selected = [m for m in M if not ONLY or any(o in m.label for o in ONLY)]
    start_status = git_status()
    ok = True

    print(f"baseline: {len(selected)} tests on the unmutated tree", flush=True)
    t0 = time.perf_counter()
    tests = sorted({m.test for m in selected})
    base = pytest(tests)
    failed_at_base = {t for t in tests if re.search(rf"^(FAILED|ERROR) {re.escape(t)}\b", base.stdout, re.M)}
    summary = [ln for ln in base.stdout.splitlines() if ln.strip()][-1:]
    print(f"  {summary[0] if summary else '(no output)'}  [{time.perf_counter() - t0:.0f} s]", flush=True)
    for t in sorted(failed_at_base):
        print(f"  FAILS UNMUTATED: {t}", flush=True)
    if base.returncode not in (0, 1):
        print(base.stdout[-3000:] + base.stderr[-3000:])
        return 1

    with tempfile.TemporaryDirectory(prefix="fedsim-mutation-") as tmp:
        for i, m in enumerate(selected, 1):
            print(f"\n[{i}/{len(selected)}] {m.label}", flush=True)
            originals: dict[Path, tuple[str, os.stat_result]] = {}
            try:
                missing = False
                for rel, old, new in m.edits:
                    path = ROOT / rel
                    src = originals[path][0] if path in originals else path.read_text()
                    current = path.read_text()
                    if old not in current:
                        print(f"  SKIP: pattern not found in {rel}: {old.strip()[:70]!r}", flush=True)
                        missing = True
                        break
                    originals.setdefault(path, (src, path.stat()))
                    path.write_text(current.replace(old, new, 1))
                    print(f"  mutated  {rel}: {old.strip()[:60]!r} -> {new.strip()[:60]!r}", flush=True)
                plugin = None
                if m.plugin and not missing:
                    (Path(tmp) / "fedsim_mutation_plugin.py").write_text(m.plugin)
                    plugin = "fedsim_mutation_plugin"
                    print("  mutated  in the test process only (a pytest plugin; no file edited): "
                          + m.plugin.strip().splitlines()[-1].split("#")[-1].strip(), flush=True)
                if missing:
                    ok = False
                    continue
                t1 = time.perf_counter()
                r = pytest([m.test], Path(tmp), plugin)
                secs = time.perf_counter() - t1
                caught = r.returncode != 0
                verdict = "CAUGHT" if caught else "MISSED"
                if m.test in failed_at_base:
                    verdict, caught = "INVALID (the test fails unmutated too)", False
                ok &= caught
                print(f"  test     {m.test}", flush=True)
                print(f"  {verdict}  [{secs:.0f} s]: {failure_line(r.stdout) if r.returncode else 'passed'}",
                      flush=True)
            except subprocess.TimeoutExpired:
                ok = False
                print("  TIMEOUT", flush=True)
            finally:  # signals wait until every file is back
                blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
                try:
                    for path, (src, st) in originals.items():
                        path.write_text(src)
                        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
                        print(f"  restored {path.relative_to(ROOT)} (identical: {path.read_text() == src})",
                              flush=True)
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    end_status = git_status()
    same = end_status == start_status
    print(f"\ngit status as found: {same}" + ("" if same else f"\nbefore:\n{start_status}\nafter:\n{end_status}"))
    return 0 if ok and same else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Interrupted as exc:
        print(f"interrupted ({exc}); files restored")
        sys.exit(130)
