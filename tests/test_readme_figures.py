"""scripts/readme_figures.py without running anything: markers rewritten in place (an unknown one refused),
figures kept for the groups not measured, the demo's target claimed only when measured on a quiet machine,
repeated progress lines elided. The README itself has a marker for every figure the script measures."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def rf():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "scripts" / "readme_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_markers_are_rewritten_kept_or_refused(rf):
    text = "takes <!-- fig:demo_seconds -->old<!-- /fig:demo_seconds --> and <!-- fig:quick_range -->kept<!-- /fig:quick_range -->"
    rf.KEPT.update(rf.GROUP_FIGURES["quick"])
    out = rf.rewrite(text, {"demo_seconds": "12 s"})
    assert out == ("takes <!-- fig:demo_seconds -->12 s<!-- /fig:demo_seconds --> and "
                   "<!-- fig:quick_range -->kept<!-- /fig:quick_range -->")
    with pytest.raises(SystemExit, match="bogus"):
        rf.rewrite(text + "<!-- fig:bogus -->x<!-- /fig:bogus -->", {"demo_seconds": "12 s"})


def test_the_demo_meets_its_target_only_when_measured_quiet(rf):
    assert "within the target" in rf.demo_verdict(rf.Timed(24.0, 0.3, 1.1))
    assert "over the target" in rf.demo_verdict(rf.Timed(41.0, 0.3, 1.1))
    loaded = rf.demo_verdict(rf.Timed(24.0, 0.3, 9.0))
    assert "not measured" in loaded and "within" not in loaded and "load average 0.3-9.0" in loaded


def test_repeated_progress_lines_are_elided(rf):
    still = [f"[fedsim] still starting: waiting for 10 clients ({s}s)" for s in (5, 10, 15, 20)]
    lines = ["[fedsim] starting", *still, "[fedsim] ready", still[0]]
    assert rf.elide(lines) == ["[fedsim] starting", still[0], "...", still[-1], "[fedsim] ready", still[0]]


def test_the_readme_has_a_marker_for_every_measured_figure(rf):
    marked = {m.group(1) for m in rf.MARKER.finditer((ROOT / "README.md").read_text())}
    assert set().union(*rf.GROUP_FIGURES.values()) | {"machine"} <= marked
