"""FedAvg (McMahan et al. 2017), optionally with seed 000's global update compensation."""
from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message

from fedsim.compensation import GlobalUpdateCompensation, aggregate_noise_variance
from strategies.base import NUM_EXAMPLES_KEY, FedsimStrategy, from_record, to_record

NOISE_KEY = "noise_variance"


class FedAvg(FedsimStrategy):
    """The example-weighted mean of the client models.

    ``compensation = "mp"`` applies global update compensation (seed 000 §V) to the aggregated update
    (aggregate - global): the noise variance of the weighted mean is ``sum_i p_i^2 sigma_i^2`` from the
    ``noise_variance`` each client's defenses declare in its reply (``lrp``, ``gaussian-noise``,
    ``laplace-noise``), or ``noise_variance`` when the server is told it. ``Q`` is the aspect ratio
    of the matrix the update is reshaped into (paper default 6).

    ``compensation_feedback = true`` carries what the projection removed (noise and the signal cut
    with it) into the next round's update before compensating it: ``applied_t = comp(U_t + e_{t-1})``,
    ``e_t = U_t + e_{t-1} - applied_t`` - the accumulated error ``theta_t`` of the paper's update rule
    (seed 000 eq. 6). Without it the signal the projection cuts is lost for good every round.
    """

    name = "fedavg"

    def __init__(self, *, compensation: str = "none", Q: float = 6.0, compensation_mode: str = "band",
                 noise_variance: float | None = None, compensation_feedback: bool = False,
                 **kw: Any) -> None:
        super().__init__(**kw)
        if compensation not in ("none", "mp"):
            raise ValueError(f"strategy.compensation must be 'none' or 'mp', got {compensation!r}")
        self.compensation = compensation
        self.noise_variance = noise_variance
        if not isinstance(compensation_feedback, bool):
            raise ValueError(f"strategy.compensation_feedback must be true or false, got {compensation_feedback!r}")
        if compensation_feedback and compensation == "none":
            raise ValueError("strategy.compensation_feedback = true needs strategy.compensation = 'mp'")
        self.compensation_feedback = compensation_feedback
        self.residual: list[np.ndarray] | None = None  # what compensation removed, carried forward
        try:
            self.compensator = GlobalUpdateCompensation(Q=Q, mode=compensation_mode)
        except ValueError as exc:
            raise ValueError(f"strategy: {exc} (keys strategy.Q, strategy.compensation_mode)") from exc

    def aggregate_noise_variance(self, replies: list[Message]) -> float | None:
        if self.noise_variance is not None:
            return float(self.noise_variance)
        ws, vs = [], []
        for m in replies:
            metrics = m.content["metrics"]
            ws.append(float(metrics[NUM_EXAMPLES_KEY]))
            vs.append(float(metrics[NOISE_KEY]) if NOISE_KEY in metrics else 0.0)
        return aggregate_noise_variance(ws, vs) if any(v > 0 for v in vs) else None

    def finalize_arrays(self, server_round: int, arrays: ArrayRecord, replies: list[Message]) -> ArrayRecord:
        if self.compensation == "none":
            return arrays
        var = self.aggregate_noise_variance(replies)
        info = self.round_info.setdefault(server_round, {})
        if var is None:
            info["compensation"] = {"skipped": "no client declared a noise variance"}
            return arrays
        sent = next(iter(self._sent.values()))
        agg = from_record(arrays)
        update = [a.astype(np.float64) - s.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a
                  for a, s in zip(agg, sent)]
        if self.compensation_feedback and self.residual is not None:
            update = [u + r if np.issubdtype(u.dtype, np.floating) else u for u, r in zip(update, self.residual)]
        comp = self.compensator.apply(update, var, names=self.param_names)
        if self.compensation_feedback:
            self.residual = [u - c if np.issubdtype(u.dtype, np.floating) else u for u, c in zip(update, comp)]
        new = [(s + c).astype(a.dtype) if np.issubdtype(a.dtype, np.floating) else a
               for a, s, c in zip(agg, sent, comp)]
        info["compensation"] = {"noise_variance": var, **self.compensator.metrics()}
        if self.compensation_feedback:
            info["compensation"]["compensation.residual_norm"] = float(np.sqrt(sum(
                np.sum(np.square(r, dtype=np.float64)) for r in self.residual
                if np.issubdtype(r.dtype, np.floating))))
        return to_record(self.param_names, new)
