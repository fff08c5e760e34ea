"""A run builds its components once (issue 28): ``fedsim run`` validates the config by building them and
hands those to the runner and the server, which build none of their own."""
from __future__ import annotations

from pathlib import Path

from conftest import small_sets

import fedsim.build
from fedsim.app.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_fedsim_run_builds_the_components_once(tmp_path, monkeypatch):
    real = fedsim.build.build_components
    built = []
    monkeypatch.setattr(fedsim.build, "build_components", lambda cfg: built.append(cfg["name"]) or real(cfg))
    config = ROOT / "experiments" / "default.toml"
    sets = small_sets("federation.rounds=1", "federation.num_clients=2", path=config, output__dir=str(tmp_path / "runs"))
    argv = ["run", str(config), "--out", str(tmp_path / "run"), "-q",
            *(x for s in sets for x in ("--set", s))]
    assert main(argv) == 0
    assert built == ["default"]  # (the config file's name)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # rounds 0 and 1
