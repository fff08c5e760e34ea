"""``fedsim experiment``: paper-shaped tables, the systematic evaluation, claims, quick variants of every
experiment (the smoke test: a few in CI, all with ``--slow``), resume and publishing."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedsim.app.cli import main as cli_main
from fedsim.app.experiment import experiment_files, write_results_index
from fedsim.app.sweep import load_spec
from fedsim.config import ConfigError
from fedsim.tables import check_report, evaluate_claims, paper_table, systematic

ROOT = Path(__file__).resolve().parents[1]


def _rows():
    """Two rows (batch sizes) x (reference + two families x two strengths), errors of two attacks."""
    rows = []
    for b, base_loss in (("B=1", 1.0), ("B=4", 1.2)):
        rows.append({"variant": f"none {b}", "row": b, "col": "none", "family": "none", "loss": base_loss,
                     "accuracy": 0.8, "a.rmse": 0.10, "b.rmse": 0.30})
        for fam, strength, du, ea, eb in (("prune", "0.5", 0.02, 0.20, 0.25), ("prune", "0.9", 0.20, 0.40, 0.35),
                                          ("noise", "0.1", 0.04, 0.15, 0.50), ("noise", "1", 0.50, 0.60, 0.70)):
            rows.append({"variant": f"{fam} {strength} {b}", "row": b, "col": f"{fam} {strength}", "family": fam,
                         "loss": base_loss + du, "accuracy": 0.8 - du, "a.rmse": ea, "b.rmse": eb})
    return rows


def test_paper_table_layouts():
    rows = _rows()
    spec = check_report({"tables": [{"title": "t", "cells": [{"key": "a.rmse", "header": "A", "fmt": ".2f"},
                                                                 {"key": "b.rmse", "header": "B"}],
                                     "layout": "cells-as-rows", "row_header": "batch"}]})["tables"][0]
    lines = paper_table(rows, spec).splitlines()
    assert lines[0] == "| batch |  | none | prune 0.5 | prune 0.9 | noise 0.1 | noise 1 |"
    assert len(lines) == 2 + 2 * 2  # header, rule, (2 batch rows x 2 attacks)
    assert lines[2] == "| B=1 | A | 0.10 | 0.20 | 0.40 | 0.15 | 0.60 |"
    assert lines[5].startswith("| B=4 | B | 0.300 | 0.250 |")
    spec = check_report({"tables": [{"title": "t", "cells": [{"key": "loss", "header": "L", "scale": 10}]}]})
    lines = paper_table(rows, spec["tables"][0]).splitlines()
    assert lines[0] == "|  | none | prune 0.5 | prune 0.9 | noise 0.1 | noise 1 |"  # one cell: the col is the header
    assert lines[3] == "| B=4 | 12.000 | 12.200 | 14.000 | 12.400 | 17.000 |"
    # expand: one run with several attacks, a column per attack name
    spec = check_report({"tables": [{"title": "t", "expand": ["a", "b"], "layout": "cells-as-rows",
                                     "cells": [{"key": "{name}.rmse", "header": "RMSE", "fmt": ".2f"}]}]})
    lines = paper_table([r for r in rows if r["family"] == "none"], spec["tables"][0]).splitlines()
    assert lines[0] == "|  |  | a | b |" and lines[2:] == ["| B=1 | RMSE | 0.10 | 0.30 |", "| B=4 | RMSE | 0.10 | 0.30 |"]
    # row_labels: a row shown under another name
    spec = check_report({"tables": [{"title": "t", "cells": ["loss"], "row_labels": {"B=1": "fresh"}}]})["tables"][0]
    assert [ln.split("|")[1].strip() for ln in paper_table(rows, spec).splitlines()[2:]] == ["fresh", "B=4"]
    # a missing value shows as '-', never as a made-up number
    rows[1].pop("a.rmse")
    spec = check_report({"tables": [{"title": "t", "cells": ["a.rmse"]}]})["tables"][0]
    assert "| B=1 | 0.100 | - |" in paper_table(rows, spec)


def test_systematic_takes_the_strongest_attack_and_the_best_defense_within_budget():
    rows = _rows()
    spec = check_report({"systematic": {"attacks": ["a", "b"], "reference": "none", "budgets": [0.05, 0.3, 1.0]}}
                        )["systematic"]
    res = systematic(rows, spec)
    assert len(res["points"]) == len(rows) and not res["missing"]
    for p in res["points"]:
        r = next(x for x in rows if x["variant"] == p["variant"])
        ref = next(x for x in rows if x["family"] == "none" and x["row"] == r["row"])
        assert p["error"] == min(r["a.rmse"], r["b.rmse"])  # eq. 3: the strongest attack
        assert p["strongest"] == ("a" if r["a.rmse"] <= r["b.rmse"] else "b")
        assert p["utility_loss"] == pytest.approx(r["loss"] - ref["loss"])
    best = {(b["row"], b["budget"]): b["best"]["variant"] for b in res["best"]}
    # per batch size (row): within 0.05 prune 0.5 (min 0.20) beats noise 0.1 (min 0.15); within 0.3 prune
    # 0.9 (0.35); within 1 noise 1 (0.60)
    for r in ("B=1", "B=4"):
        assert best[(r, 0.05)] == f"prune 0.5 {r}" and best[(r, 0.3)] == f"prune 0.9 {r}"
        assert best[(r, 1.0)] == f"noise 1 {r}"
    assert len(res["best"]) == 2 * 3
    # strongest attack per defended setting: a in 3 of 4 (noise 0.1 -> a 0.15; prune 0.9 -> b 0.35)
    assert res["strongest_counts"] == {"a": 6, "b": 2}
    acc = systematic(rows, {**spec, "utility": "accuracy"})
    assert all(p["utility_loss"] == pytest.approx(q["utility_loss"]) for p, q in zip(acc["points"], res["points"]))


def test_claims_are_evaluated_on_the_numbers():
    rows = _rows()
    spec = check_report({"systematic": {"attacks": ["a", "b"], "reference": "none"}})["systematic"]
    claims = [{"text": "x", "value": "prune 0.9 B=1:a.rmse", "op": ">", "than": "none B=1:a.rmse"},
              {"text": "y", "value": "noise 0.1 B=4:a.rmse", "op": "<", "than": 0.1},
              {"text": "z", "best_family": "prune", "budget": 0.3},
              {"text": "s", "most_often_strongest": "a"},
              {"text": "w", "best_family": "prune", "budget": 1.0},
              {"text": "v", "value": "prune 0.5 B=1:accuracy", "op": ">=", "than": "none B=1:accuracy", "margin": -0.01},
              {"text": "u", "value": "prune 0.5 B=1:accuracy", "op": ">=", "than": "none B=1:accuracy", "margin": -0.03}]
    out = evaluate_claims(claims, rows, {}, spec)
    # v: 0.78 >= 0.80 - 0.01 fails; u: 0.78 >= 0.80 - 0.03 holds
    assert [c["holds"] for c in out] == [True, False, True, True, False, False, True]
    assert "0.4" in out[0]["ours"] and "noise 1 B=1" in out[4]["ours"] and "a 6" in out[3]["ours"]
    rows = [r for r in rows if r["variant"] != "none B=1"]
    assert evaluate_claims(claims[:1], rows)[0]["holds"] is None  # a missing cell: not measured, not "no"


def test_a_two_sided_claim_fails_where_the_one_sided_one_passes():
    """``op = "~="``: |value - than| <= margin. "Within 0.5 points" of a better number must fail; a
    one-sided ``>=`` with a negative margin passes (what the fedboosting claim used to do)."""
    rows = _rows()  # none B=1: accuracy 0.80; prune 0.5 B=1: 0.78
    hi, lo = "none B=1:accuracy", "prune 0.5 B=1:accuracy"
    claims = [{"text": "one-sided", "value": hi, "op": ">=", "than": lo, "margin": -0.005},
              {"text": "two-sided", "value": hi, "op": "~=", "than": lo, "margin": 0.005},
              {"text": "below", "value": lo, "op": "~=", "than": hi, "margin": 0.005},
              {"text": "wide", "value": hi, "op": "~=", "than": lo, "margin": 0.03},
              {"text": "edge", "value": hi, "op": "~=", "than": lo, "margin": 0.02},  # 0.8 - 0.78 in floats
              {"text": "number", "value": lo, "op": "~=", "than": 0.79, "margin": 0.005}]
    out = evaluate_claims(claims, rows)
    assert [c["holds"] for c in out] == [True, False, False, True, True, False]
    assert "|difference| = 0.02 > 0.005" in out[1]["ours"] and "<= 0.03" in out[3]["ours"]
    missing = [{"text": "m", "value": "none B=1:nope", "op": "~=", "than": lo, "margin": 0.1}]
    assert evaluate_claims(missing, rows)[0]["holds"] is None
    assert "missing" in evaluate_claims(missing, rows)[0]["ours"]


def test_report_figures_are_drawn_linked_or_noted(tmp_path):
    """``[[report.figures]]``: a hook that draws is linked right after the header, one that returns None
    (cannot draw from these runs) leaves no section, one that fails is noted and the report still written;
    a file reference is relative to the experiment file."""
    from fedsim.app.sweep import experiment_figures

    (tmp_path / "figs.py").write_text(
        "from pathlib import Path\n"
        "def ok(out_dir, configs):\n"
        "    p = Path(out_dir) / 'f.png'\n"
        "    p.write_text(','.join(sorted(configs)))\n"
        "    return p\n"
        "def none(out_dir, configs):\n"
        "    return None\n"
        "def boom(out_dir, configs):\n"
        "    raise RuntimeError('no model.pt')\n")
    p = tmp_path / "e.toml"
    p.write_text('name = "e"\n[train]\nlocal_steps = 1\n[experiment]\ntitle = "t"\n'
                 '[[report.figures]]\ntitle = "Drawn"\ndraw = "figs.py:ok"\n'
                 '[[report.figures]]\ntitle = "Skipped"\ndraw = "figs.py:none"\n'
                 '[[report.figures]]\ntitle = "Broken"\ndraw = "figs.py:boom"\n'
                 '[[variants]]\nlabel = "a"\n[[variants]]\nlabel = "b"\n')
    spec = load_spec(p)
    assert spec.report["figures"][0]["draw"] == f"{tmp_path / 'figs.py'}:ok"  # made absolute
    out = tmp_path / "sweep"
    out.mkdir()
    text = "\n".join(experiment_figures(out, spec, spec.variants))
    assert "## Drawn\n" in text and "![Drawn](f.png)" in text and (out / "f.png").read_text() == "a,b"
    assert "Skipped" not in text
    assert "## Broken" in text and "Not drawn: RuntimeError: no model.pt" in text


@pytest.mark.parametrize("bad, msg", [
    ('[report]\nwhat = 1', "report: unknown keys"),
    ('[[report.tables]]\ntitle = "t"\ncells = []', r"report.tables\[0\].cells must be"),
    ('[[report.tables]]\ntitle = "t"\ncells = ["loss"]\nlayout = "diagonal"', "layout must be one of"),
    ('[report.systematic]\nattacks = ["idlg"]\nreference = "none"\nutility = "speed"', "utility must be"),
    ('[[report.tables]]\ntitle = "t"\ncells = ["loss"]\nrow_labels = { a = 1 }', r"row_labels must be a table"),
    ('[quick]\nvariants = ["nope"]', "quick.variants must list variant labels"),
    ('[quick]\nvariant_set = { nope = ["seed=1"] }', "quick.variant_set: no variant labelled"),
    ('[quick]\nvariant_set = { a = "seed=1" }', "quick.variant_set must be a table"),
    ('[[experiment.claims]]\ntext = "t"\nvalue = "nope:loss"\nop = ">"\nthan = 1', "no variant labelled 'nope'"),
    ('[[experiment.claims]]\ntext = "t"\nvalue = "a:loss"\nop = "~"\nthan = 1', "op must be one of"),
    ('[[experiment.claims]]\ntext = "t"\nvalue = "a:loss"\nop = "~="\nthan = 1', r"margin must be a number >= 0"),
    ('[[report.figures]]\ntitle = "t"\ndraw = "no_such_module_xyz:f"', r"report.figures\[0\].draw: cannot import"),
    ('[[report.figures]]\ntitle = "t"', r"report.figures\[0\] must be a table with a 'title' and 'draw'"),
    ('[[report.figures]]\ntitle = "t"\ndraw = "json:__name__"', r"is not a function"),
    ('[[experiment.claims]]\ntext = "t"\nvalue = "a:loss"\nop = "~="\nthan = 1\nmargin = -0.1', r"margin must be"),
])
def test_bad_experiment_files_name_the_key(tmp_path, bad, msg):
    p = tmp_path / "e.toml"
    p.write_text(f'name = "e"\n[experiment]\ntitle = "t"\n{bad}\n[[variants]]\nlabel = "a"\n')
    with pytest.raises(ConfigError, match=msg):
        load_spec(p)


def test_quick_needs_a_quick_table_and_picks_its_variants(tmp_path):
    p = tmp_path / "e.toml"
    p.write_text('name = "e"\n[[variants]]\nlabel = "a"\n[[variants]]\nlabel = "b"\n')
    with pytest.raises(ConfigError, match="has no \\[quick\\] table"):
        load_spec(p, quick=True)
    p.write_text('name = "e"\n[train]\nlocal_steps = 1\n[quick]\nset = ["federation.rounds=1"]\nvariants = ["b"]\n'
                 '[[variants]]\nlabel = "a"\n[[variants]]\nlabel = "b"\nrow = "r"\n')
    spec = load_spec(p, quick=True)
    assert [lab for lab, _ in spec.variants] == ["b"] and spec.variants[0][1]["federation"]["rounds"] == 1
    assert spec.meta["b"]["row"] == "r" and spec.meta["a"]["row"] == "a"  # row defaults to the label
    assert "row" not in spec.variants[0][1]  # descriptive keys never reach the config
    assert len(load_spec(p).variants) == 2
    # variant_set: one variant's own quick overrides, after quick.set and before the user's overrides
    p.write_text(p.read_text().replace('variants = ["b"]', 'variant_set = { a = ["federation.rounds=2", "seed=5"] }'))
    spec = load_spec(p, ["seed=7"], quick=True)
    got = {lab: (c["federation"]["rounds"], c["seed"]) for lab, c in spec.variants}
    assert got == {"a": (2, 7), "b": (1, 7)}
    assert load_spec(p).variants[0][1]["federation"]["rounds"] != 2  # full scale: not applied


EXPERIMENTS = experiment_files()


def test_every_paper_has_an_experiment():
    papers = " ".join(json.dumps(load_spec(p).experiment.get("paper", "")) for p in EXPERIMENTS.values())
    for seed in ("seed 000", "seed 001", "seed 002", "seed 003", "seed 004"):
        assert seed in papers, f"no experiment reproduces {seed}"


def test_every_table_has_a_quick_row():
    """Every paper table of every experiment is exercised by the smoke test (in CI only the experiments
    of QUICK_IN_CI, all with ``--slow``): its [quick] variants, each loaded and validated here, include
    at least one of the table's rows (checked without running anything)."""
    # an experiment file that does not load would drop out of EXPERIMENTS (and of the smoke test) silently
    files = {p.stem for p in (ROOT / "experiments").glob("*.toml") if "\n[experiment]" in p.read_text()}
    assert files == set(EXPERIMENTS), files ^ set(EXPERIMENTS)
    assert set(QUICK_IN_CI) <= set(EXPERIMENTS), set(QUICK_IN_CI) - set(EXPERIMENTS)  # a rename drops none from CI
    missing = []
    for name, path in EXPERIMENTS.items():
        spec = load_spec(path, quick=True)
        labels = [lab for lab, _ in spec.variants]
        for t in spec.report["tables"]:
            if not any(t.get("rows") is None or spec.meta[lab]["row"] in t["rows"] for lab in labels):
                missing.append(f"{name}: {t['title']}")
    assert not missing, f"tables no [quick] variant exercises: {missing}"


# The quick variants `make test` (CI) runs: together they exercise every report feature - paper tables,
# the systematic evaluation (seed004-systematic), drawn figures (fedboosting_synthetic), claims - and a
# secure channel (secagg). The others are marked `slow` (`make test-slow`); that every experiment file
# loads, validates and has a quick variant for each of its tables is checked without running anything
# (test_every_table_has_a_quick_row).
QUICK_IN_CI = ("fedboosting_synthetic", "secagg", "seed004-systematic")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK_IN_CI else pytest.mark.slow)
                                  for n in sorted(EXPERIMENTS)])
def test_quick_variant_runs_and_has_the_papers_table_shape(name, tmp_path):
    """The smoke test: an experiment's quick variant runs and its report has each table's rows and
    columns (the variants' row/col labels), and its claims are evaluated."""
    out = tmp_path / name
    assert cli_main(["experiment", name, "--quick", "--out", str(out), "-q"]) == 0
    spec = load_spec(EXPERIMENTS[name], quick=True)
    report = (out / "report.md").read_text()
    all_labels = [lab for lab, _ in spec.variants]
    for t in spec.report["tables"]:
        labels = [lab for lab in all_labels if t.get("rows") is None or spec.meta[lab]["row"] in t["rows"]]
        assert labels, f"{name}: [quick] runs no variant of {t['title']!r}"  # (test_every_table_has_a_quick_row)
        section = report.split(f"## {t['title']}\n", 1)[1].split("\n## ", 1)[0]
        lines = [ln for ln in section.splitlines() if ln.startswith("|")]
        rows = list(dict.fromkeys(spec.meta[lab]["row"] for lab in labels))
        cols = t.get("expand") or list(dict.fromkeys(spec.meta[lab]["col"] for lab in labels if spec.meta[lab]["col"]))
        per_row = len(t["cells"]) if t["layout"] == "cells-as-rows" else 1
        assert len(lines) == 2 + len(rows) * per_row, t["title"]
        for c in cols:
            assert c in lines[0], (t["title"], c)
        body = [ln.split("|")[1].strip() for ln in lines[2:]]
        shown = t.get("row_labels") or {}
        assert body == [shown.get(r, r) for r in rows for _ in range(per_row)]
        # every variant that ran shows measured numbers (a cell may be '-' where it does not apply, e.g.
        # FedAvg has no own-key accuracy, but no variant is all '-')
        pairs = {(spec.meta[lab]["row"], spec.meta[lab]["col"]) for lab in labels}
        numbers = sum(1 for ln in lines[2:] for x in ln.split("|")[2:-1] if x.strip() not in ("-", ""))
        assert numbers >= len(pairs), section
    if spec.report["systematic"]:
        assert (out / "systematic.png").stat().st_size > 5000
        sys_ = json.loads((out / "systematic.json").read_text())
        assert {p["variant"] for p in sys_["points"]} == set(all_labels)
        assert all(math.isfinite(p["error"]) for p in sys_["points"])
    if spec.claims:
        claims = json.loads((out / "claims.json").read_text())
        assert [c["text"] for c in claims] == [c["text"] for c in spec.claims]
    for fig in spec.report["figures"]:  # drawn, linked, and no failure note
        assert f"## {fig['title']}\n" in report and "Not drawn" not in report
        link = report.split(f"## {fig['title']}\n", 1)[1].split("](", 1)[1].split(")", 1)[0]
        assert (out / link).stat().st_size > 5000


def test_rerun_skips_complete_variants_and_publish_writes_the_index(tmp_path, capsys):
    name = "seed004-systematic"
    out = tmp_path / "x"
    args = ["experiment", name, "--quick", "--only", "none B=1", "--out", str(out)]
    assert cli_main(args) == 0
    run = next(out.glob("00-*"))
    stamp = (run / "summary.json").stat().st_mtime_ns
    capsys.readouterr()
    assert cli_main(args) == 0
    assert (run / "summary.json").stat().st_mtime_ns == stamp  # not run again
    assert cli_main(["experiment", name, "--quick", "--publish", str(tmp_path / "pub")]) == 2
    assert "--publish is for full-scale reports" in capsys.readouterr().err and not (tmp_path / "pub").exists()
    from fedsim.app.experiment import publish

    dest = publish(out, tmp_path / "pub", name, ["experiment", name])
    text = (dest / "report.md").read_text()
    assert "> Command: `fedsim experiment seed004-systematic`" in text and "> Commit:" in text
    # the variant folders are not published: named as text (relative to the run folder), not linked;
    # the published figures stay linked
    assert "(00-none-b-1/report.md)" in (out / "report.md").read_text()
    assert "](00-none-b-1/report.md)" not in text and "`00-none-b-1/report.md`" in text
    assert "![comparison](comparison.png)" in text and (dest / "comparison.png").exists()
    index = (tmp_path / "pub" / "README.md").read_text()
    assert f"({name}/report.md)" in index and "Gradient pruning is the best defense" in index
    (tmp_path / "pub" / "other").mkdir()  # a folder without meta.json is not an experiment
    write_results_index(tmp_path / "pub")
    assert (tmp_path / "pub" / "README.md").read_text() == index


def test_an_interrupted_experiment_suggests_resuming_the_experiment(tmp_path, capsys, monkeypatch):
    """The hint names ``fedsim experiment`` with the same --quick/--only/--set, not ``fedsim sweep``."""
    import fedsim.app.runner as runner
    from fedsim.interrupt import RunInterrupted

    def interrupted(*a, **kw):
        raise RunInterrupted("SIGINT", completed_round=0)

    monkeypatch.setattr(runner, "run_experiment", interrupted)
    out = tmp_path / "x"
    argv = ["experiment", "seed004-systematic", "--quick", "--only", "none B=1", "--set", "seed=3", "--out", str(out)]
    assert cli_main(argv) == 130
    err = capsys.readouterr().err
    assert f"continue with: fedsim experiment seed004-systematic --quick --only 'none B=1' --set seed=3 --resume {out}" \
        in err, err


def test_unknown_experiment_lists_the_known_ones(capsys):
    assert cli_main(["experiment", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no such experiment" in err and "seed004-systematic" in err


def test_the_commit_stamp_ignores_only_the_results_folder(tmp_path, monkeypatch):
    """Publishing one experiment after another changes the results folder; that is no change to the code
    that produces the next report, so it does not make the stamp '+local changes' - a change anywhere
    else does."""
    import subprocess

    from fedsim.app import experiment

    repo = tmp_path / "repo"
    (repo / "docs" / "results").mkdir(parents=True)
    (repo / "docs" / "results" / "a.md").write_text("old\n")
    (repo / "code.py").write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(experiment, "ROOT", repo)
    results = repo / "docs" / "results"
    assert experiment._commit(results) == head
    (results / "a.md").write_text("new\n")  # a previous publish
    assert experiment._commit(results) == head
    assert experiment._commit() == head + "+local changes"  # without the folder, everything counts
    (repo / "code.py").write_text("x = 2\n")
    assert experiment._commit(results) == head + "+local changes"
    assert experiment._commit(tmp_path / "elsewhere") == head + "+local changes"
