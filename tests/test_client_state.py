"""Client state across rounds through the real ClientApp and Flower's Context (issue 20).

Every stateful defense is run twice through the in-process grid: once normally (its state kept by Flower
in each node's ``Context.state``), once on a grid that wipes every node's state after each round. Round 1
is identical in both; from round 2 on the state must matter - compression residuals change the update,
the DP accountant's epsilon grows, the slicing plan is reused instead of recomputed.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import RecordingObserver
from flwr.app import RecordDict

from fedsim.app.client import client_app
from fedsim.app.server import run_server
from fedsim.inprocess import InProcessGrid
from fedsim.protocol import STATE_DEFENSES


class ForgetfulGrid(InProcessGrid):
    """Clients lose their Flower state after every message (as if every node restarted)."""

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for ctx in self.contexts.values():
            ctx.state = RecordDict()
        return ids


def _run(small_cfg, grid_cls, defenses, rounds=3):
    cfg = small_cfg(f"federation.rounds={rounds}", "train.local_steps=2", defenses=defenses)
    grid = grid_cls(client_app, cfg["federation"]["num_clients"])
    rec = RecordingObserver()
    run_server(grid, cfg, None, [rec], progress=False)
    return grid, {r: sorted(u, key=lambda x: x.client_id) for r, u in rec.by_round().items()}


def _untimed(metrics):
    return {k: v for k, v in metrics.items() if "seconds" not in k}


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a.weights, b.weights))


def test_compression_residuals_carry_over_through_flowers_context(small_cfg):
    defenses = [{"name": "compress", "ratio": 0.9}]
    grid, kept = _run(small_cfg, InProcessGrid, defenses)
    _, lost = _run(small_cfg, ForgetfulGrid, defenses)
    for ctx in grid.contexts.values():  # the residual is in the node's state, one array per entry
        state = ctx.state[STATE_DEFENSES]
        assert any(k.startswith("0.") for k in state.keys())
        assert any(np.abs(v.numpy()).sum() > 0 for v in state.values())
    assert all(_same(a, b) for a, b in zip(kept[1], lost[1]))  # round 1: no state yet
    assert not any(_same(a, b) for a, b in zip(kept[2], lost[2]))  # round 2: the residual is added


def test_the_dp_accountant_accumulates_through_flowers_context(small_cfg):
    defenses = [{"name": "dp-sgd", "clip_norm": 1.0, "noise_multiplier": 1.0}]
    _, kept = _run(small_cfg, InProcessGrid, defenses)
    _, lost = _run(small_cfg, ForgetfulGrid, defenses)
    key = "defense.0.dp-sgd.epsilon"
    eps_kept = [kept[r][0].metrics[key] for r in (1, 2, 3)]
    eps_lost = [lost[r][0].metrics[key] for r in (1, 2, 3)]
    assert eps_kept[0] == pytest.approx(eps_lost[0])
    assert eps_kept[0] < eps_kept[1] < eps_kept[2]  # spent privacy accumulates over rounds
    assert eps_lost[0] == pytest.approx(eps_lost[1]) == pytest.approx(eps_lost[2])  # without state: resets


def test_the_slicing_plan_is_kept_through_flowers_context(small_cfg):
    defenses = [{"name": "lrp", "slices": 5, "gamma": 0.4, "sigma": 0.1, "risk": "size"}]
    _, kept = _run(small_cfg, InProcessGrid, defenses)
    _, lost = _run(small_cfg, ForgetfulGrid, defenses)
    key = "defense.0.lrp.plan_round"
    assert [kept[r][0].metrics[key] for r in (1, 2, 3)] == [1.0, 1.0, 1.0]  # planned once, then reused
    assert [lost[r][0].metrics[key] for r in (1, 2, 3)] == [1.0, 2.0, 3.0]  # re-planned every round


def test_a_client_process_builds_its_pipeline_once_per_config_and_keeps_each_clients_state(small_cfg, monkeypatch):
    """The ClientApp builds the defense pipeline once per config and reuses it for every message and every
    partition of its process (here all 4 clients, in-process); what it gives is what a pipeline built for
    every message gives, stateful defenses included; a different config (a sweep's next variant on a warm
    actor) builds its own."""
    from fedsim.app import client as client_app_module

    real = client_app_module.client_pipeline
    built = []
    monkeypatch.setattr(client_app_module, "client_pipeline", lambda cfg: built.append(cfg["defenses"]) or real(cfg))
    client_app_module._cached_pipeline.cache_clear()
    stateful = [{"name": "dp-sgd", "clip_norm": 1.0, "noise_multiplier": 1.0}, {"name": "compress", "ratio": 0.9}]
    _, cached = _run(small_cfg, InProcessGrid, stateful, rounds=2)
    assert built == [stateful]  # 4 clients x 2 rounds: one build, then cache hits
    with monkeypatch.context() as m:  # the old way: a fresh pipeline for every message
        m.setattr(client_app_module, "pipeline_for", lambda msg: real(client_app_module.config_of(msg)))
        _, fresh = _run(small_cfg, InProcessGrid, stateful, rounds=2)
    assert sorted(cached) == sorted(fresh) == [1, 2]
    for r in cached:
        assert [u.client_id for u in cached[r]] == [u.client_id for u in fresh[r]]
        assert all(_same(a, b) and _untimed(a.metrics) == _untimed(b.metrics) for a, b in zip(cached[r], fresh[r]))
    assert cached[1][0].metrics["defense.0.dp-sgd.epsilon"] < cached[2][0].metrics["defense.0.dp-sgd.epsilon"]
    assert not _same(cached[1][0], cached[1][1])  # (each client its own update)
    other = [{"name": "compress", "ratio": 0.5}]
    _run(small_cfg, InProcessGrid, other, rounds=1)
    assert built == [stateful, other]  # a new config: built anew (and once)
