"""Issue 20's check: run each rewritten test against a deliberately broken variant of the code it guards
(one small source edit each, restored afterwards, also on failure) and report whether the test caught it.

    .venv/bin/python scripts/weak_test_mutations.py [LABEL-SUBSTRING ...]

One mutation edits Flower's installed LocalDpMod in .venv (clipping removed) and restores it.
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv/bin/python")
FLWR = ROOT / ".venv/lib/python3.11/site-packages/flwr/clientapp/mod/localdp_mod.py"
ONLY = sys.argv[1:]
M = [
 ("compensation skips (small) buffers without names", ROOT/"fedsim/compensation.py",
  "        sel = [np.issubdtype(np.asarray(a).dtype, np.floating) for a in arrays]\n",
  "        sel = [np.issubdtype(np.asarray(a).dtype, np.floating) and np.asarray(a).size > 10 for a in arrays]\n",
  "tests/test_compensation.py::test_global_update_compensation_on_state_dict_lists"),
 ("LocalDpMod without clipping", FLWR,
  "        compute_clip_model_update(\n", "        (lambda *a, **k: None)(\n",
  "tests/test_defenses.py::test_flower_local_dp_mod_wraps_training_and_clips_plus_noises_the_update"),
 ("lrp stubbed to a no-op", ROOT/"clients/slicing.py",
  "    def transform_update(self, update", "    def transform_update(self, update, ctx=None):\n        return update\n\n    def _orig_transform_update(self, update",
  "tests/test_seed000_e2e.py::test_lrp_without_compensation_keeps_accuracy"),
 ("mp-compensation skipped", ROOT/"strategies/compensation.py",
  "        var = self.aggregate_variance(ctx)\n", "        var = self.aggregate_variance(ctx)\n        return aggregate\n",
  "tests/test_seed000_e2e.py::test_compensation_costs_accuracy_at_the_papers_noise"),
 ("attacker-side compensation returns the raw update", ROOT/"attacks/curious.py",
  "        var = self.compensate_var if", "        return delta\n        var = self.compensate_var if",
  "tests/test_curious.py::test_attacker_side_compensation_changes_only_what_the_attack_sees"),
 ("leakage.png drawn without data", ROOT/"attacks/curious.py",
  "            rs = [r for r in self.rows if r[\"attack\"] == name]\n            rounds", "            rs = [r for r in self.rows if r[\"attack\"] == name][:0]\n            rounds",
  "tests/test_curious.py::test_simulation_with_curious_server_writes_leakage_outputs"),
 ("dirichlet alpha not passed to the partitioner", ROOT/"fedsim/factories.py",
  '        return {"alpha": d["alpha"]}', '        return {}',
  "tests/test_fedavg.py::test_observers_see_every_sampled_client_with_what_was_sent"),
 ("pld ignores its layers", ROOT/"clients/pruning.py",
  "        self.layers = list(layers) if layers is not None else None", "        self.layers = None",
  "tests/test_defenses.py::test_build_pipeline_errors"),
]
for label, path, old, new, test in M:
    if ONLY and not any(o in label for o in ONLY):
        continue
    src = path.read_text()
    if old not in src:
        print(f"SKIP {label}: pattern not found")
        continue
    path.write_text(src.replace(old, new, 1))
    try:
        r = subprocess.run([PY, "-m", "pytest", "-q", "-x", test], cwd=ROOT, capture_output=True, text=True, timeout=900)
        last = [line for line in r.stdout.splitlines() if line.strip()][-1]
        print(f"{'CAUGHT' if r.returncode else 'MISSED'}  {label}: {test.split('::')[1]} -> {last}", flush=True)
    finally:
        path.write_text(src)
