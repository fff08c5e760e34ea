"""Robbing the Fed as a federation scenario: the MALICIOUS server imprints the model it sends
(``model.imprint_bins`` + ``[[transforms]] name = "robbing-imprint"``) and reads a victim's batch back
from its update (``attack.name = "robbing"``), labelled as a malicious threat model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fedsim.app.runner import run_experiment
from fedsim.config import ConfigError
from fedsim.reports import read_jsonl

IMPRINT = ("model.imprint_bins=128", 'transforms=[{name="robbing-imprint"}]', "data.root_size=200",
           "federation.num_clients=4", "federation.rounds=1", "train.batch_size=16", "train.local_steps=1")


def test_the_malicious_server_reads_most_of_a_batch_of_16_back(small_cfg, tmp_path, recorder):
    cfg = small_cfg(*IMPRINT, attack={"name": "robbing", "rounds": [1], "victims": [0]})
    out = run_experiment(cfg, out=tmp_path / "run", observers=None, progress=False)
    (row,) = read_jsonl(out / "leakage.jsonl")
    assert row["threat_model"] == "malicious" and row["batch_size"] >= 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["client_failures"] == 0
    # measured: 14 of 16 images recovered (SSIM >= 0.5; the others share a bin), mean PSNR 84 dB
    assert row["batch_size"] == 16 and row["success_content"] >= 0.6 and row["psnr"] > 40, row
    assert "malicious" in (out / "report.md").read_text()


def test_the_imprint_the_server_sends_is_the_binning_block(small_cfg, recorder):
    from fedsim.app.client import client_app
    from fedsim.app.server import run_server
    from fedsim.inprocess import InProcessGrid

    cfg = small_cfg(*IMPRINT)
    run_server(InProcessGrid(client_app, 4), cfg, None, [recorder], progress=False)
    u = recorder.updates[0]
    sent = dict(zip(u.param_names, u.global_weights))
    w0, b0, w1 = sent["imprint.linear0.weight"], sent["imprint.linear0.bias"], sent["imprint.linear1.weight"]
    assert np.allclose(w0, w0[0]) and np.allclose(w0, 1e-3 / w0.shape[1])  # every unit: mean brightness
    assert np.all(np.diff(-b0) > 0)  # increasing bin boundaries
    assert np.all(w1 == 1.0)


@pytest.mark.parametrize("sets,message", [
    (('attack={name="robbing"}',), "model.imprint_bins"),
    (('transforms=[{name="robbing-imprint"}]',), "model.imprint_bins"),
    (("model.imprint_bins=500", 'transforms=[{name="robbing-imprint"}]', "data.root_size=100"), "distinct quantiles"),
])
def test_robbing_settings_are_checked_when_the_config_is_loaded(small_cfg, sets, message):
    with pytest.raises(ConfigError, match=message):
        small_cfg(*sets)
