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
from fedsim.claims import evaluate_claims, t_interval
from fedsim.config import ConfigError
from fedsim.tables import check_report, paper_table, systematic

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
    # cols: only the variants with these col labels
    spec = check_report({"tables": [{"title": "t", "cells": ["loss"], "cols": ["none", "noise 1"]}]})["tables"][0]
    assert paper_table(rows, spec).splitlines()[0] == "|  | none | noise 1 |"
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


def _runs(jitter: float = 0.0, seeds=(0, 1, 2)):
    """``_rows()`` once per seed; ``jitter`` > 0 moves every number by a small seed- and variant-dependent
    amount (orderings unchanged), 0 repeats the same numbers (a zero-width interval decides like a point)."""
    out = []
    for s in seeds:
        for r in _rows():
            j = jitter * (((s + len(r["variant"])) % 3) - 1)
            out.append({**{k: (v + j if isinstance(v, float) else v) for k, v in r.items()}, "seed": s})
    return out


def test_claims_are_evaluated_on_the_numbers():
    spec = check_report({"systematic": {"attacks": ["a", "b"], "reference": "none"}})["systematic"]
    claims = [{"text": "x", "value": "prune 0.9 B=1:a.rmse", "op": ">", "than": "none B=1:a.rmse"},
              {"text": "y", "value": "noise 0.1 B=4:a.rmse", "op": "<", "than": 0.1},
              {"text": "z", "best_family": "prune", "budget": 0.3},
              {"text": "s", "most_often_strongest": "a"},
              {"text": "w", "best_family": "prune", "budget": 1.0},
              {"text": "v", "value": "prune 0.5 B=1:accuracy", "op": ">=", "than": "none B=1:accuracy", "margin": -0.01},
              {"text": "u", "value": "prune 0.5 B=1:accuracy", "op": ">=", "than": "none B=1:accuracy", "margin": -0.03}]
    for jitter in (0.0, 5e-4):
        out = evaluate_claims(claims, _runs(jitter), spec)
        # v: 0.78 >= 0.80 - 0.01 fails; u: 0.78 >= 0.80 - 0.03 holds
        assert [c["verdict"] for c in out] == ["holds", "does not hold", "holds", "holds", "does not hold",
                                               "does not hold", "holds"], jitter
        assert [c["holds"] for c in out] == [True, False, True, True, False, False, True]
        assert all(c["seeds"] == [0, 1, 2] for c in out)
    assert "0.4" in out[0]["ours"] and "noise 1 B=1" in out[4]["ours"] and "a 6" in out[3]["ours"]
    assert out[0]["value_std"] > 0 and out[0]["ci"][0] < out[0]["difference_mean"] < out[0]["ci"][1]
    runs = [r for r in _runs() if r["variant"] != "none B=1"]
    assert evaluate_claims(claims[:1], runs)[0]["verdict"] == "not measured"  # a missing cell, not "no"
    assert evaluate_claims(claims[:1], runs)[0]["holds"] is None


def test_a_two_sided_claim_fails_where_the_one_sided_one_passes():
    """``op = "~="``: |value - than| <= margin. "Within 0.5 points" of a better number must fail; a
    one-sided ``>=`` with a negative margin passes (what the fedboosting claim used to do)."""
    runs = _runs()  # none B=1: accuracy 0.80; prune 0.5 B=1: 0.78, in every seed
    hi, lo = "none B=1:accuracy", "prune 0.5 B=1:accuracy"
    claims = [{"text": "one-sided", "value": hi, "op": ">=", "than": lo, "margin": -0.005},
              {"text": "two-sided", "value": hi, "op": "~=", "than": lo, "margin": 0.005},
              {"text": "below", "value": lo, "op": "~=", "than": hi, "margin": 0.005},
              {"text": "wide", "value": hi, "op": "~=", "than": lo, "margin": 0.03},
              {"text": "edge", "value": hi, "op": "~=", "than": lo, "margin": 0.02 + 1e-12},  # 0.8 - 0.78 in floats
              {"text": "number", "value": lo, "op": "~=", "than": 0.79, "margin": 0.005}]
    out = evaluate_claims(claims, runs)
    assert [c["holds"] for c in out] == [True, False, False, True, True, False]
    assert "needs |difference| <= 0.005" in out[1]["interval"] and "+0.02" in out[1]["interval"]
    missing = [{"text": "m", "value": "none B=1:nope", "op": "~=", "than": lo, "margin": 0.1}]
    assert evaluate_claims(missing, runs)[0]["verdict"] == "not measured"
    assert "missing" in evaluate_claims(missing, runs)[0]["ours"]


def _pair(a, b, extra_a=None, extra_b=None):
    """Two variants over seeds 0..len(a)-1 with column ``m`` (and extra columns per seed)."""
    runs = []
    for s, (x, y) in enumerate(zip(a, b)):
        runs.append({"variant": "A", "seed": s, "m": x, **{k: v[s] for k, v in (extra_a or {}).items()}})
        runs.append({"variant": "B", "seed": s, "m": y, **{k: v[s] for k, v in (extra_b or {}).items()}})
    return runs


def _verdict(runs, op=">", than="B:m", margin=0.0, value="A:m"):
    return evaluate_claims([{"text": "t", "value": value, "op": op, "than": than, "margin": margin}], runs)[0]


def test_a_claim_is_decided_by_the_t_interval_of_the_paired_difference():
    """The interval is the Student-t interval of value - than over the seeds; it decides holds / does not
    hold / inconclusive, and the pairing removes what a seed shares between the two variants."""
    c = _verdict(_pair([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]))  # differences 1, 2, 3: mean 2, sd 1
    half = 4.302653 / math.sqrt(3)  # t(0.975, 2) = 4.3027 (any t table)
    assert c["ci"] == pytest.approx([2 - half, 2 + half], abs=1e-5) and c["difference_std"] == pytest.approx(1.0)
    assert c["verdict"] == "inconclusive" and "straddles" in c["why"]  # [-0.48, 4.48] contains 0
    assert (c["value_mean"], c["than_mean"]) == (4.0, 2.0) and c["seeds"] == [0, 1, 2]
    assert t_interval([1.0, 2.0, 3.0])[2:] == pytest.approx((2 - half, 2 + half), abs=1e-5)
    # the seeds move both sides together: paired, a consistent +0.1 holds although the sides' spreads overlap
    assert _verdict(_pair([0.6, 0.8, 0.7], [0.5, 0.71, 0.59]))["verdict"] == "holds"
    assert _verdict(_pair([0.6, 0.8, 0.7], [0.5, 0.71, 0.59]), op="<")["verdict"] == "does not hold"
    assert _verdict(_pair([0.6, 0.8, 0.7], [0.5, 0.71, 0.59]), margin=0.2)["verdict"] == "does not hold"
    # a noisy difference straddles 0
    assert _verdict(_pair([0.55, 0.5, 0.58], [0.5, 0.54, 0.55]))["verdict"] == "inconclusive"
    # one cell against a number: the interval of its mean
    runs = _pair([0.12, 0.11, 0.13], [0, 0, 0])
    assert _verdict(runs, op="<", than=0.2)["verdict"] == "holds"
    assert _verdict(runs, op=">", than=0.2)["verdict"] == "does not hold"
    assert _verdict(_pair([0.19, 0.21, 0.2], [0, 0, 0]), op="<", than=0.2)["verdict"] == "inconclusive"
    # equivalence: holds only when the whole interval is within the margin
    assert _verdict(_pair([0.501, 0.498, 0.5], [0.5] * 3), op="~=", margin=0.005)["verdict"] == "holds"
    assert _verdict(_pair([0.52, 0.521, 0.519], [0.5] * 3), op="~=", margin=0.005)["verdict"] == "does not hold"
    assert _verdict(_pair([0.51, 0.49, 0.5], [0.5] * 3), op="~=", margin=0.005)["verdict"] == "inconclusive"
    # fewer than three seeds decide nothing, however clear
    c = _verdict(_pair([0.9, 0.9], [0.1, 0.1]))
    assert c["verdict"] == "inconclusive" and "2 seed(s)" in c["why"] and c["holds"] is None
    # a seed where one side is missing is left out of the pairing
    runs = _pair([0.9, 0.9, 0.9, 0.9], [0.1, 0.1, 0.1, None])
    assert _verdict(runs)["seeds"] == [0, 1, 2] and _verdict(runs)["verdict"] == "holds"


def test_ties_and_two_failed_attacks_are_inconclusive():
    """Both at a ceiling in every seed cannot be ordered; two attacks that both failed (success_content 0 in
    every seed) differ by noise, however consistently (Table III[A]: 5.05 vs 5.37 dB)."""
    ceiling = _pair([1.0] * 3, [1.0] * 3)
    for op in (">=", ">", "<="):
        c = _verdict(ceiling, op=op)
        assert c["verdict"] == "inconclusive" and "tied" in c["why"], op
    assert _verdict(ceiling, op="~=", margin=0.01)["verdict"] == "holds"  # equal is within any margin
    assert _verdict(ceiling, op=">=", margin=-0.01)["verdict"] == "holds"  # "costs at most 1 point": it costs 0
    failed = {"idlg.success_content": [0.0, 0.0, 0.0]}
    psnr = _pair([5.05, 5.06, 5.04], [5.37, 5.39, 5.36], {"idlg.psnr": [5.05, 5.06, 5.04], **failed},
                 {"idlg.psnr": [5.37, 5.39, 5.36], **failed})
    c = _verdict(psnr, op="<", value="A:idlg.psnr", than="B:idlg.psnr")
    assert c["verdict"] == "inconclusive" and "both attacks failed" in c["why"]
    # one of them succeeded in one seed: decided as usual
    ok = {"idlg.success_content": [0.0, 0.5, 0.0]}
    psnr = _pair([5.05, 5.06, 5.04], [5.37, 5.39, 5.36], {"idlg.psnr": [5.05, 5.06, 5.04], **failed},
                 {"idlg.psnr": [5.37, 5.39, 5.36], **ok})
    assert _verdict(psnr, op="<", value="A:idlg.psnr", than="B:idlg.psnr")["verdict"] == "holds"


def test_systematic_claims_are_decided_seed_by_seed():
    spec = check_report({"systematic": {"attacks": ["a", "b"], "reference": "none"}})["systematic"]
    claim = [{"text": "z", "best_family": "prune", "budget": 0.3}]
    runs = _runs()
    assert evaluate_claims(claim, runs, spec)[0]["interval"] == "holds in 3 of 3 seeds"
    for r in runs:  # seed 2: noise 0.1 becomes the best defense within 0.3
        if r["seed"] == 2 and r["variant"].startswith("noise 0.1"):
            r["a.rmse"] = r["b.rmse"] = 0.9
    c = evaluate_claims(claim, runs, spec)[0]
    assert c["verdict"] == "inconclusive" and c["interval"] == "holds in 2 of 3 seeds" and "seed 2: best" in c["ours"]
    two = evaluate_claims(claim, [r for r in runs if r["seed"] < 2], spec)[0]  # holds in both, but 2 seeds
    assert two["verdict"] == "inconclusive" and "2 seed(s)" in two["why"] and two["interval"] == "holds in 2 of 2 seeds"


def test_the_claims_table_shows_verdict_interval_and_seeds():
    from fedsim.claims import claims_markdown

    claims = [{"text": "beats", "value": "A:m", "op": ">", "than": "B:m"},
              {"text": "ext", "value": "A:m", "op": "<", "than": 2, "extension": "5 clients, the paper used 2"}]
    md = claims_markdown(evaluate_claims(claims, _pair([0.9, 0.8, 0.85], [0.5, 0.45, 0.55])))
    assert "seeds [0, 1, 2]" in md and "| **holds**: the 95% interval meets" in md
    assert "A:m 0.85 ± 0.05 vs B:m 0.5 ± 0.05" in md and "95% CI [+" in md
    assert "*(extension beyond the paper: 5 clients, the paper used 2)*" in md


def test_report_figures_are_drawn_linked_or_noted(tmp_path):
    """``[[report.figures]]``: a hook that draws is linked right after the header, one that returns None
    (cannot draw from these runs) leaves no section, one that fails is noted and the report still written;
    a file reference is relative to the experiment file."""
    from fedsim.app.sweep_report import experiment_figures

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
    ('[[report.figures]]\ntitle = "t"\ndraw = "experiments.fedboosting_table:SWEEP"',
     r"must name a class or a function \(got PosixPath\)"),
    ('[[report.figures]]\ntitle = "t"\ndraw = "shutil:rmtree"', r"'shutil:rmtree' names Python's standard library"),
    ('[[experiment.claims]]\ntext = "t"\nvalue = "a:loss"\nop = "~="\nthan = 1\nmargin = -0.1', r"margin must be"),
    ('[[experiment.claims]]\ntext = "t"\nvalue = "a:loss"\nop = ">"\nthan = 1\nmargins = 1', r"claims\[0\]: unknown keys \['margins'\]"),
    ('[[experiment.claims]]\ntext = "t"\nvalue = "a:loss"\nop = ">"\nthan = 1\nextension = 1', r"extension must say"),
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


def _in_table(meta, table) -> bool:
    """A variant (its row/col labels) is one of the table's (``rows`` / ``cols`` keep some)."""
    return all(table.get(k) is None or meta[k[:-1]] in table[k] for k in ("rows", "cols"))


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
            if not any(_in_table(spec.meta[lab], t) for lab in labels):
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
        labels = [lab for lab in all_labels if _in_table(spec.meta[lab], t)]
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
        assert all(c["verdict"] in ("inconclusive", "not measured") for c in claims)  # one seed decides nothing
    # the quick variant shows the method, not a table at chance (issue 32): some variant's model learned
    # (10 points above its untrained accuracy) or some attack recovered its target (an image with SSIM >=
    # 0.5 on average, or records: ASR > 0; membership: ROC AUC >= 0.75)
    rows = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    learned = [r["variant"] for r in rows if r.get("accuracy") is not None and r["accuracy"] >= 0.1 + json.loads(
        (out / (r.get("run") or r["runs"][0]) / "summary.json").read_text())["initial_accuracy"]]
    recovered = [f"{r['variant']}: {k}" for r in rows for k, v in r.items() if isinstance(v, (int, float)) and (
        (k.endswith(".ssim") and v >= 0.5) or (k.endswith(".success_content") and v > 0)
        or (k.endswith(".auc") and v >= 0.75))]
    assert learned or recovered, f"{name}: --quick learns nothing and no attack recovers anything"
    for fig in spec.report["figures"]:  # drawn, linked, and no failure note
        assert f"## {fig['title']}\n" in report and "Not drawn" not in report
        link = report.split(f"## {fig['title']}\n", 1)[1].split("](", 1)[1].split(")", 1)[0]
        assert (out / link).stat().st_size > 5000


TINY_EXPERIMENT = """name = "tiny"
seed = 0
[experiment]
title = "Tiny: FedBoosting vs FedAvg on the two-source task"
[[experiment.claims]]
text = "centralised training beats a model that never trained"
value = "pooled:accuracy"
op = ">"
than = "untrained:accuracy"
[[experiment.claims]]
text = "one local step is as good as pooled training"
value = "untrained:accuracy"
op = "~="
than = "pooled:accuracy"
margin = 0.001
extension = "a made-up claim"
[quick]
set = ["train.local_steps=1"]
[[report.tables]]
title = "accuracy"
cells = ["accuracy", "test.wide_accuracy"]
[federation]
rounds = 2
num_clients = 1
[data]
dataset = "synthetic-2d"
partition = "natural"
[model]
name = "mlp"
hidden = [8]
activation = "sigmoid"
[train]
lr = 0.5
batch_size = 64
local_steps = 75
[simulation]
backend = "inprocess"
[output]
observers = []
[[variants]]
label = "pooled"
[[variants]]
label = "untrained"
train.lr = 1e-9
train.local_steps = 1
"""


def test_an_experiment_runs_three_seeds_and_publishes_the_claims_decided_over_them(tmp_path, capsys):
    """``fedsim experiment NAME --publish DIR`` end to end: three seeds by default, each claim in claims.json
    with its seeds, both sides' mean and std, the interval and a verdict; the index shows them; --quick runs
    one seed (its claims are then inconclusive: tests above); --publish refuses fewer than three seeds before
    running anything."""
    p = tmp_path / "tiny.toml"
    p.write_text(TINY_EXPERIMENT)
    assert load_spec(p).seeds == [0, 1, 2] and load_spec(p, quick=True).seeds is None
    assert cli_main(["experiment", str(p), "--seeds", "0,1", "--publish", str(tmp_path / "pub")]) == 2
    assert "--publish decides the claims over >= 3 seeds" in capsys.readouterr().err
    assert not (tmp_path / "pub").exists()
    out = tmp_path / "run"
    assert cli_main(["experiment", str(p), "--out", str(out), "-q", "--publish", str(tmp_path / "pub")]) == 0
    assert sorted(d.name for d in out.iterdir() if d.is_dir()) == [f"{i:02d}-{v}-seed{s}" for i, v in
                                                                  enumerate(("pooled", "untrained")) for s in range(3)]
    claims = json.loads((tmp_path / "pub" / "tiny" / "claims.json").read_text())
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    acc = {(r["variant"], r["seed"]): r["accuracy"] for r in runs}
    c = claims[0]
    assert c["seeds"] == [0, 1, 2] and c["verdict"] == "holds" and c["holds"] is True
    assert c["value_mean"] == pytest.approx(sum(acc[("pooled", s)] for s in range(3)) / 3)
    assert c["than_std"] >= 0 and c["ci"][0] > 0  # the interval of the difference lies above 0
    assert [x["value"] for x in c["per_seed"]] == [acc[("pooled", s)] for s in range(3)]
    assert claims[1]["verdict"] == "does not hold" and claims[1]["extension"] == "a made-up claim"
    index = (tmp_path / "pub" / "README.md").read_text()
    assert "| 0, 1, 2 | **holds**" in index and "| 0, 1, 2 | **does not hold**" in index
    assert "Verdicts over seeds: 1 holds, 1 does not hold." in index and "extension beyond the paper: a made-up claim" in index
    assert f"| {c['interval']} | 0, 1, 2 | **holds**" in index and "95% CI [+" in c["interval"]  # the interval decided
    assert "before seeds" not in index
    report = (tmp_path / "pub" / "tiny" / "report.md").read_text()
    assert " ± " in report.split("## accuracy", 1)[1].split("##", 1)[0]  # the paper table shows mean ± std
    # full rows carry every metric's mean over the training rounds (mean.<key>)
    from fedsim.comparison import run_row

    d = out / "00-pooled-seed1"
    acc = [json.loads(line)["accuracy"] for line in (d / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(acc) == 2 and run_row("pooled", d, full=True)["mean.accuracy"] == pytest.approx(sum(acc) / 2)
    # the hand-written section on disagreements is kept in the index when it is rewritten
    (tmp_path / "pub" / "disagreements.md").write_text("## Where fedsim and the papers disagree, and why\n\nx\n")
    write_results_index(tmp_path / "pub")
    assert (tmp_path / "pub" / "README.md").read_text().endswith("and why\n\nx\n")
    # a claim published before claims were decided over seeds (no "seeds"): shown as such, not counted as decided
    old = tmp_path / "pub" / "old"
    old.mkdir()
    (old / "meta.json").write_text(json.dumps({"title": "old one"}))
    (old / "claims.json").write_text(json.dumps([{"text": "t", "ours": "0.5 > 0.4", "holds": True}]))
    write_results_index(tmp_path / "pub")
    index = (tmp_path / "pub" / "README.md").read_text()
    assert "| - | 1 (before seeds) | **holds** |" in index
    assert "Verdicts over seeds: 1 holds, 1 does not hold. 1 claim published before claims were decided" in index
    # the experiment file changed after its publication: a claim it no longer makes is superseded (not counted),
    # one it makes now but the publication lacks is not yet published
    (old / "meta.json").write_text(json.dumps({"title": "old one", "commit": "abc1234"}))
    write_results_index(tmp_path / "pub", current={"old": ["t2"]})
    index = (tmp_path / "pub" / "README.md").read_text()
    assert "| t | 0.5 > 0.4 | - | 1 (before seeds) | **superseded**: the experiment no longer makes this claim " \
           "(it changed after commit abc1234)" in index
    assert "| t2 | - | - | - | **not yet published**: added to the experiment after commit abc1234" in index
    assert "Verdicts over seeds: 1 holds, 1 does not hold. 1 published claim superseded and 1 claim of the " \
           "experiments not yet published" in index and "before claims were decided" not in index


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
    # which machine computed it: results published from a GPU machine and from this CPU say so
    meta = json.loads((dest / "meta.json").read_text())
    assert "CPU cores" in meta["machine"] and f"> Machine: {meta['machine']}" in text
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
