"""Scoring a reconstruction - the only place that sees truth - shared by the curious server and the
curious client: the samples a client trained on in a round, re-created from (seed, round, client)
without any channel from the client (its batch order is ``fedsim.training.batches.batch_schedule``, its
partition a pure function of the config); the best-matching subset of more candidate truths than
reconstructions; and the matched scores (PSNR/SSIM/MSE/label accuracy for images, MSE on the
standardised features for records, :mod:`fedsim.metrics`)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from fedsim.factories import client_data
from fedsim.observers import ClientUpdate
from fedsim.training.batches import iter_batches
from fedsim.training.recipe import Recipe


def select_truth(recon: torch.Tensor, truth_x: torch.Tensor, truth_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From more candidate truths than reconstructions, keep the best-matching subset (min total MSE)."""
    if len(truth_x) <= len(recon):
        return truth_x, truth_y
    from scipy.optimize import linear_sum_assignment  # here: the import costs a second at start-up

    cost = ((recon.flatten(1)[:, None, :] - truth_x.flatten(1)[None, :, :]) ** 2).mean(-1).numpy()
    _, cols = linear_sum_assignment(cost)
    idx = torch.as_tensor(np.sort(cols))
    return truth_x[idx], truth_y[idx]


def mean_of(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the rows that have it; None where none has (SSIM/PSNR of records)."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else None


def client_truth(cfg: Mapping[str, Any], client: int, rnd: int, recipe: Mapping[str, Any],
                 max_truth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (at most ``max_truth``) samples ``client`` trained on in round ``rnd``, first-seen order."""
    x, y = client_data(cfg, client)
    want = min(max_truth, len(y))
    seen: dict[int, None] = {}  # first-seen order; stop once enough samples are known (any local_steps)
    for b in iter_batches(cfg["seed"], rnd, client, len(y), Recipe.from_mapping(recipe)):
        for i in b.tolist():
            seen.setdefault(i)
        if len(seen) >= want:
            break
    idx = torch.as_tensor(list(seen)[:max_truth])
    return x[idx], y[idx]


def update_truth(cfg: Mapping[str, Any], update: ClientUpdate, max_truth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples behind an intercepted update; for an aggregate, the union of every contributor's."""
    if update.kind == "aggregate":
        parts = [client_truth(cfg, c, update.round, update.recipe, max_truth) for c in update.contributors]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return client_truth(cfg, update.client_id, update.round, update.recipe, max_truth)


def match_and_score(rx: torch.Tensor, ry: torch.Tensor, tx: torch.Tensor, ty: torch.Tensor, *, records: bool = False,
                    mse_threshold: float = 0.0, psnr_threshold: float | None = None, ssim_threshold: float = 0.5
                    ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """(scores, the truths matched, the reconstructions in the truths' order). Images are clamped to
    [0, 1]; records (standardised features, no box) are scored by MSE with ``mse_threshold``."""
    from fedsim.metrics import score_reconstruction, score_records

    if records:
        rx = rx.float()
        tx, ty = select_truth(rx, tx, ty)
        score = score_records(rx, ry, tx, ty, mse_threshold=mse_threshold)
    else:
        rx = rx.clamp(0, 1)
        tx, ty = select_truth(rx, tx, ty)
        score = score_reconstruction(rx, ry, tx, ty, psnr_threshold=psnr_threshold, ssim_threshold=ssim_threshold)
    return score, tx, rx[torch.as_tensor(score["assignment"])]
