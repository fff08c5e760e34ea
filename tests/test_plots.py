"""Plot axes a reader can read: rounds are integers on every round axis (accuracy.png, leakage.png) and
the single-round leakage bars have their client labels under the middle of their group of bars.

The figures are drawn as the runs draw them; ``save_figure`` is replaced by one that keeps the figure
(no PNG is written, nothing trains)."""
from __future__ import annotations

import numpy as np
import pytest

import fedsim.reports
from attacks.curious import CuriousServer
from attacks.leakage_figures import leakage_plot
from fedsim.reports import plot_accuracy


@pytest.fixture
def figures(monkeypatch):
    kept = []
    monkeypatch.setattr(fedsim.reports, "save_figure", lambda fig, path: kept.append(fig))
    yield kept
    import matplotlib.pyplot as plt

    plt.close("all")


def _visible_ticks(ax) -> list[float]:
    lo, hi = ax.get_xlim()
    return [t for t in ax.get_xticks() if lo <= t <= hi]


def test_accuracy_plot_puts_rounds_on_integer_ticks(figures, tmp_path):
    """20 rounds: matplotlib's default locator puts ticks at 0, 2.5, 5, 7.5, ..."""
    rows = [{"round": r, "accuracy": 0.04 * r, "loss": 2.0 - 0.05 * r} for r in range(21)]
    plot_accuracy(rows, tmp_path / "accuracy.png")
    ax = figures[0].axes[0]
    ticks = _visible_ticks(ax)
    assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks), ticks


def _observer(small_cfg, names):
    obs = CuriousServer(cfg=small_cfg(), name=names)
    obs._is_records = False  # images: SSIM and PSNR
    return obs


def test_leakage_plot_over_rounds_puts_rounds_on_integer_ticks(figures, small_cfg, tmp_path):
    obs = _observer(small_cfg, ["dlg", "idlg"])
    obs.out = tmp_path
    obs.rows = [{"round": r, "attack": a, "client": 0, "ssim": 0.5, "psnr": 20.0, "accuracy": 0.1 * r}
                for r in (1, 2, 3) for a in ("dlg", "idlg")]
    leakage_plot(obs.rows, obs.names, obs.records, obs.out / "leakage.png")
    ticks = _visible_ticks(figures[0].axes[0])
    assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks), ticks


def test_single_round_leakage_bars_have_their_client_label_under_their_middle(figures, small_cfg, tmp_path):
    """Two attacks x three victims: each victim's label sits at the centre of its two bars (it sat at the
    first attack's bar, beside the group)."""
    obs = _observer(small_cfg, ["dlg", "idlg"])
    obs.out = tmp_path
    victims = [0, 2, 3]
    obs.rows = [{"round": 1, "attack": a, "client": v, "ssim": 0.3 + 0.1 * v, "psnr": 15.0 + v, "accuracy": 0.2}
                for a in ("dlg", "idlg") for v in victims]
    leakage_plot(obs.rows, obs.names, obs.records, obs.out / "leakage.png")
    for ax in figures[0].axes:
        bars = [(p.get_x() + p.get_width() / 2) for p in ax.patches]
        assert len(bars) == 2 * len(victims)
        groups = np.sort(np.asarray(bars).reshape(2, len(victims)), axis=0)  # per attack, per victim
        centres = groups.mean(axis=0)
        assert np.allclose(ax.get_xticks(), centres)
        assert [t.get_text() for t in ax.get_xticklabels()] == [f"client {v}" for v in victims]
