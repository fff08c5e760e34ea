"""Seed 000 (Wang et al., INFOCOM 2022) §V: global update compensation with random-matrix theory.

The aggregated update (flattened) is cut into ``v`` consecutive pieces of length ``w`` stacked as the
rows of a ``v x w`` matrix ``C = Z + R`` (row-major reshape, zero-padded at the end), ``v / w ~ Q``
(``Q >= 1``, paper default 6). The noise ``R`` has i.i.d.-like entries of variance ``sigma_hat^2``;
by the Marchenko-Pastur law the eigenvalues of its sample covariance ``(1/v) R^T R`` (``w x w``) fill
``[lambda_min, lambda_max]`` with

    lambda_min = sigma_hat^2 (1 - 1/sqrt(Q))^2,   lambda_max = sigma_hat^2 (1 + 1/sqrt(Q))^2   (eq. 4),

``Q`` being the actual aspect ratio ``v / w`` of the matrix (after rounding and padding).
The eigen-decomposition ``(1/v) C^T C = P diag(lambda) P^T`` (eq. 5) is split into noise directions
(eigenvalues inside the band) and data directions (the rest); the compensation is the projection
``Z* = C P_Z P_Z^T`` onto the data directions, mapped back to the flat vector.

``mode="band"`` (default) is the paper's procedure word for word: the eigenvalues with
``lambda_min <= lambda <= lambda_max`` are the noise, "the remaining eigenvalues are eigenvalues
corresponding to actual data" (so directions *below* ``lambda_min`` are kept too).
``mode="threshold"`` keeps only eigenvalues above ``lambda_max`` (the "simple threshold at
lambda_1,r" of Theorem 1's discussion).

``sigma_hat^2`` of the aggregate: :func:`aggregate_noise_variance` gives ``sum_i w_i^2 sigma_i^2``
for the weighted mean with normalised weights ``w_i`` (``sigma^2 / m`` for ``m`` equal weights),
where ``sigma_i^2`` is client ``i``'s per-entry noise variance on the update (for ``lrp`` already
including the perturbed fraction ``d / s``). The paper's printed ``m * (d/s) * sum_i eps_i * sigma^2``
is ``m`` times the sum of the weights, i.e. the variance of a *sum* of ``m`` client updates, not of
FedAvg's weighted mean; it would put the noise band ``m^2`` times too high for an average.

This module never imports ``attacks``.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

MODES = ("band", "threshold")
BUFFER_LEAVES = ("running_mean", "running_var", "num_batches_tracked")


def mp_bounds(noise_var: float, Q: float) -> tuple[float, float]:
    """Marchenko-Pastur support ``(lambda_min, lambda_max)`` of ``(1/v) R^T R`` for ``v / w = Q``."""
    if Q < 1:
        raise ValueError(f"Q must be >= 1 (v >= w), got {Q}")
    r = 1.0 / math.sqrt(Q)
    return noise_var * (1.0 - r) ** 2, noise_var * (1.0 + r) ** 2


def matrix_shape(n: int, Q: float) -> tuple[int, int]:
    """``(v, w)`` with ``v * w >= n``, ``w = round(sqrt(n / Q))`` and ``v = ceil(n / w)``."""
    if Q < 1:
        raise ValueError(f"Q must be >= 1 (v >= w), got {Q}")
    w = max(1, int(round(math.sqrt(n / Q))))
    v = max(1, -(-n // w))
    return v, w


def compensate_with_info(flat_update: np.ndarray, noise_var: float, Q: float = 6.0,
                         mode: str = "band") -> tuple[np.ndarray, dict[str, Any]]:
    """:func:`compensate` plus what it did (matrix shape, MP bounds, kept/total directions)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    x = np.asarray(flat_update)
    flat = x.reshape(-1).astype(np.float64)
    n = flat.size
    info: dict[str, Any] = {"n": n, "noise_var": float(noise_var), "kept": 0, "w": 0, "v": 0}
    if n == 0 or not noise_var > 0:
        info["kept"] = info["w"] = -1  # nothing to remove
        return x.copy(), info
    v, w = matrix_shape(n, Q)
    info.update(v=v, w=w)
    if w < 2:  # a single column has no spectrum to separate
        info["kept"] = w
        return x.copy(), info
    q_eff = v / w
    lo, hi = mp_bounds(float(noise_var), q_eff)
    padded = np.zeros(v * w, dtype=np.float64)
    padded[:n] = flat
    C = padded.reshape(v, w)
    cov = (C.T @ C) / v
    lam, P = np.linalg.eigh(cov)
    if mode == "band":
        keep = (lam < lo) | (lam > hi)
    else:
        keep = lam > hi
    info.update(Q_eff=q_eff, lambda_min=lo, lambda_max=hi, kept=int(keep.sum()),
                top_eigenvalue=float(lam[-1]))
    if keep.all():
        return x.copy(), info
    Pz = P[:, keep]
    Z = (C @ Pz) @ Pz.T
    out = Z.reshape(-1)[:n].reshape(x.shape)
    return out.astype(x.dtype if np.issubdtype(x.dtype, np.floating) else np.float64), info


def compensate(flat_update: np.ndarray, noise_var: float, Q: float = 6.0, mode: str = "band") -> np.ndarray:
    """Random-matrix compensation of a (flattened) aggregated update with per-entry noise variance
    ``noise_var``; returns an array of the input's shape and (floating) dtype. ``noise_var <= 0``
    returns a copy unchanged."""
    return compensate_with_info(flat_update, noise_var, Q, mode)[0]


def aggregate_noise_variance(weights: Sequence[float], variances: Sequence[float]) -> float:
    """Per-entry noise variance of the weighted mean ``sum_i w_i u_i / sum_i w_i`` of client updates
    carrying independent noise of per-entry variances ``variances``: ``sum_i (w_i / W)^2 sigma_i^2``.

    (FedAvg's example weights ``n_i`` can be passed as they are; uniform weights give ``mean / m``.)
    """
    w = np.asarray(weights, dtype=np.float64)
    s = np.asarray(variances, dtype=np.float64)
    if w.shape != s.shape or w.ndim != 1:
        raise ValueError("weights and variances must be 1-d and of equal length")
    if len(w) == 0:
        return 0.0
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError("weights must be >= 0 with a positive sum")
    if np.any(s < 0):
        raise ValueError("variances must be >= 0")
    p = w / w.sum()
    return float(np.sum(p ** 2 * s))


def paper_noise_variance(weights: Sequence[float], variances: Sequence[float]) -> float:
    """Seed 000's printed noise variance of the aggregate (§V-C): ``sigma_hat^2 = m * (d/s) * sum_i eps_i
    sigma^2`` with ``eps_i = w_i / W`` the aggregation weights, ``d/s`` the share of perturbed slices and
    ``sigma^2`` the noise variance of a perturbed entry. A client's declared per-entry variance already is
    ``(d/s) * sigma_i^2`` (the noise averaged over all coordinates), so this is ``m * sum_i eps_i v_i``.

    For m equal clients with equal noise it is ``m^2`` times :func:`aggregate_noise_variance` (the
    variance of a *sum* of ``m`` updates, not of their weighted mean)."""
    w = np.asarray(weights, dtype=np.float64)
    s = np.asarray(variances, dtype=np.float64)
    aggregate_noise_variance(w, s)  # same validation
    if len(w) == 0:
        return 0.0
    return float(len(w) * np.sum(w / w.sum() * s))


VARIANCE_RULES = {"weighted-mean": aggregate_noise_variance, "paper": paper_noise_variance}


class GlobalUpdateCompensation:
    """Compensates an aggregated update given as a list of arrays (state-dict order).

    All compensated arrays are concatenated into one flat vector (in list order) and compensated
    together, as the paper flattens "the global gradients" into one vector. Non-floating arrays are
    passed through. When ``names`` are given and ``skip_buffers`` is true (default), BatchNorm
    running statistics (``running_mean``/``running_var``) are passed through unchanged as well:
    ``lrp`` never perturbs them, and their scale differs from the parameters'. Without names every
    floating array is compensated. ``noise_var`` must be the per-entry variance over the compensated
    coordinates (``lrp``'s ``noise_variance()`` is over the trainable parameters, i.e. exactly these
    when buffers are skipped).

    Apply it to the aggregated *update* (new global - old global), not to the weights.
    """

    def __init__(self, Q: float = 6.0, mode: str = "band", skip_buffers: bool = True):
        if float(Q) < 1:
            raise ValueError(f"Q must be >= 1, got {Q}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.Q, self.mode, self.skip_buffers = float(Q), mode, bool(skip_buffers)
        self.last_info: dict[str, Any] = {}

    def _selected(self, arrays: Sequence[np.ndarray], names: Sequence[str] | None) -> list[bool]:
        sel = [np.issubdtype(np.asarray(a).dtype, np.floating) for a in arrays]
        if names is not None:
            if len(names) != len(arrays):
                raise ValueError(f"{len(names)} names for {len(arrays)} arrays")
            if self.skip_buffers:
                sel = [s and n.rsplit(".", 1)[-1] not in BUFFER_LEAVES for s, n in zip(sel, names)]
        return sel

    def apply(self, aggregated_update_list: Sequence[np.ndarray], noise_var: float,
              names: Sequence[str] | None = None) -> list[np.ndarray]:
        arrays = [np.asarray(a) for a in aggregated_update_list]
        sel = self._selected(arrays, names)
        out = [a.copy() for a in arrays]
        parts = [a.reshape(-1) for a, s in zip(arrays, sel) if s]
        if not parts:
            self.last_info = {"n": 0, "kept": -1}
            return out
        flat = np.concatenate([p.astype(np.float64) for p in parts])
        comp, info = compensate_with_info(flat, noise_var, self.Q, self.mode)
        self.last_info = info
        offset = 0
        for i, (a, s) in enumerate(zip(arrays, sel)):
            if s:
                out[i] = comp[offset:offset + a.size].reshape(a.shape).astype(a.dtype)
                offset += a.size
        return out

    def metrics(self) -> dict[str, float]:
        return {f"compensation.{k}": float(v) for k, v in self.last_info.items()
                if isinstance(v, (int, float, np.integer, np.floating))}
