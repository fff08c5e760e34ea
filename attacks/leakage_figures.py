"""The leakage figures of the curious server and the curious client: truth above reconstruction grids,
heat maps of records, and leakage against rounds and accuracy (``leakage.png``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def image_grid(pairs: Sequence[tuple[str, torch.Tensor, torch.Tensor]], guess_label: str, path: Path) -> None:
    """One column per (title, true image, reconstruction): the truth row above the reconstruction row."""
    from fedsim.reports import save_figure

    plt = _pyplot()
    fig, axes = plt.subplots(2, len(pairs), figsize=(1.3 * len(pairs) + 0.6, 3.0), squeeze=False)
    for j, (title, t, r) in enumerate(pairs):
        for row, img in ((0, t), (1, r)):
            ax = axes[row][j]
            arr = img.permute(1, 2, 0).numpy()
            ax.imshow(arr.squeeze(-1) if arr.shape[-1] == 1 else arr, cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[0][j].set_title(title, fontsize=7)
    axes[0][0].set_ylabel("truth")
    axes[1][0].set_ylabel(guess_label)
    save_figure(fig, path)
    plt.close(fig)


def record_map(name: str, images: Mapping[str, tuple[torch.Tensor, torch.Tensor]], keys: Sequence[str],
               max_images: int, path: Path) -> None:
    """Records: a heat map of up to ``max_images`` true records (rows 'truth') above their matched
    reconstructions, one column per standardised feature (colour clipped at +-3)."""
    from fedsim.reports import save_figure

    plt = _pyplot()
    rows, labels = [], []
    for k in keys:
        tx, rx = images[k]
        for i in range(len(rx)):
            if len(rows) >= 2 * max_images:
                break
            rows += [tx[i].flatten().numpy(), rx[i].flatten().numpy()]
            labels += [f"{k.split('-', 1)[1]} truth", f"{name}"]
    fig, ax = plt.subplots(figsize=(min(2 + 0.22 * len(rows[0]), 12), 0.9 + 0.28 * len(rows)))
    im = ax.imshow(np.stack(rows), cmap="coolwarm", vmin=-3, vmax=3, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.set_xlabel("feature (standardised)", fontsize=7)
    ax.tick_params(axis="x", labelsize=6)
    fig.colorbar(im, ax=ax, fraction=0.03)
    ax.set_title(f"{name}: true records and their reconstructions", fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


def reconstruction_figures(names: Sequence[str], images: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                           records: bool, max_images: int, out: Path) -> None:
    """``reconstruction_<attack>.png`` per attack from its ``"<attack>-r<round>-<who>"`` image pairs:
    every attacked (round, client), at most ``max_images`` pairs per update and ``4 x max_images`` in all."""
    for name in names:
        keys = [k for k in images if k.startswith(name + "-")]
        if not keys:
            continue
        if records:
            record_map(name, images, keys, max_images, out / f"reconstruction_{name}.png")
            continue
        pairs = []
        for k in keys:
            tx, rx = images[k]
            for i in range(min(len(rx), max_images)):
                pairs.append((k.split("-", 1)[1], tx[i], rx[i]))
        image_grid(pairs[: 4 * max_images], name, out / f"reconstruction_{name}.png")


def plot_series(rows: Sequence[Mapping[str, Any]], names: Sequence[str], metric: str
                ) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """What leakage.png plots, per attack: attacked rounds, mean ``metric`` (SSIM; records: MSE) per round,
    mean accuracy per round."""
    out = {}
    for name in names:
        rs = [r for r in rows if r["attack"] == name]
        rounds = sorted({r["round"] for r in rs})
        ssim = [float(np.mean([r[metric] for r in rs if r["round"] == k])) for k in rounds]
        acc = [float(np.mean([r["accuracy"] for r in rs if r["round"] == k and r.get("accuracy") is not None]
                             or [np.nan])) for k in rounds]
        out[name] = (rounds, ssim, acc)
    return out


def leakage_plot(rows: Sequence[Mapping[str, Any]], names: Sequence[str], records: bool, path: Path) -> None:
    """leakage.png: the leakage measure per attack against the round and the global accuracy (one attacked
    round: :func:`single_round_plot`)."""
    from fedsim.reports import save_figure

    plt = _pyplot()
    if len({r["round"] for r in rows}) < 2:  # one attacked round: a line per attack would be a dot
        single_round_plot(rows, names, records, path)
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    for name, (rounds, ssim, acc) in plot_series(rows, names, "mse" if records else "ssim").items():
        a1.plot(rounds, ssim, marker="o", label=name)
        a2.plot(acc, ssim, marker="o", label=name)
    what = "MSE of reconstruction (standardised)" if records else "SSIM of reconstruction"
    a1.set_xlabel("round")
    a1.xaxis.get_major_locator().set_params(integer=True)  # rounds, not 2.5
    a1.set_ylabel(what)
    a2.set_xlabel("global test accuracy")
    a2.set_ylabel(what)
    for a in (a1, a2):
        if records:
            a.set_yscale("log")
        else:
            a.set_ylim(-0.1, 1.05)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)


def single_round_plot(rows: Sequence[Mapping[str, Any]], names: Sequence[str], records: bool, path: Path) -> None:
    """One attacked round: SSIM and PSNR (records: MSE and label accuracy) of every (attack, victim) as
    bars, with the mean per attack."""
    from fedsim.reports import save_figure

    plt = _pyplot()
    rnd = rows[0]["round"]
    keys = (("mse", "MSE of reconstruction (standardised)"), ("label_acc", "label accuracy")) if records \
        else (("ssim", "SSIM of reconstruction"), ("psnr", "PSNR (dB)"))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    width = min(0.8 / max(len(names), 1), 0.35)
    victims = sorted({r["client"] for r in rows})
    for j, name in enumerate(names):
        rs = {r["client"]: r for r in rows if r["attack"] == name}
        xs = [i + j * width for i in range(len(victims))]
        for ax, (key, _) in zip((a1, a2), keys):
            vals = [rs[v][key] if v in rs and rs[v][key] is not None else np.nan for v in victims]
            mean = np.nanmean(vals) if np.isfinite(vals).any() else np.nan
            ax.bar(xs, vals, width, label=f"{name} (mean {mean:.3g})")
    for ax, (_, key) in zip((a1, a2), keys):
        centre = (len(names) - 1) * width / 2  # the middle of a victim's group of bars
        ax.set_xticks([i + centre for i in range(len(victims))], [f"client {v}" for v in victims], fontsize=7)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    if records:
        a1.set_yscale("log")
        a2.set_ylim(-0.05, 1.05)
    else:
        a1.set_ylim(-0.1, 1.05)
    acc = rows[0].get("accuracy")
    fig.suptitle(f"leakage of round {rnd}" + (f" (global accuracy after it: {acc:.3f})" if acc is not None else ""),
                 fontsize=9)
    save_figure(fig, path)
    plt.close(fig)
