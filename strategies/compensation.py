"""Seed 000's global update compensation as a server transform (``[[transforms]] name = "mp-compensation"``).

After the aggregation rule has formed the new global model, the aggregated update (aggregate - the
model this transform saw sent) is compensated by random-matrix eigenvalue thresholding
(:mod:`fedsim.compensation`, seed 000 §V, eq. 3-5) and added back. The noise variance of the
aggregate is ``sum_i p_i^2 sigma_i^2`` (:func:`fedsim.compensation.aggregate_noise_variance`) over
the ``noise_variance`` each client's defenses declare in its reply (``lrp``, ``gaussian-noise``,
``laplace-noise``), with ``p_i`` the weights the rule used (FedAvg: example counts), or
``noise_variance`` when the server is told it.

``feedback = true`` carries what the projection removed (noise and the signal cut with it) into the
next round's update before compensating it: ``applied_t = comp(U_t + e_{t-1})``,
``e_t = U_t + e_{t-1} - applied_t`` - the accumulated error ``theta_t`` of the paper's update rule
(seed 000 eq. 6). Without it the signal the projection cuts is lost for good every round.

It needs the aggregate in plaintext, so it composes with any aggregation rule under the plain channel.
"""
from __future__ import annotations

from typing import Annotated, Any, Mapping, Sequence

import numpy as np

from fedsim.compensation import MODES, VARIANCE_RULES, GlobalUpdateCompensation
from fedsim.components import TRANSFORMS
from fedsim.params import OneOf, Range
from fedsim.protocol import NOISE_VARIANCE
from fedsim.seams import RoundContext, ServerTransform


def _floating(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.floating)


@TRANSFORMS.register
class MPCompensation(ServerTransform):
    """Marchenko-Pastur compensation of the aggregated update (``Q``: aspect ratio of the matrix the
    update is reshaped into, paper default 6; ``mode``: ``band`` as printed or ``threshold``).

    ``variance`` is how the aggregate's noise variance is computed from the variances the clients
    declare: ``"weighted-mean"`` (default) the per-entry variance of FedAvg's weighted mean,
    ``sum_i p_i^2 sigma_i^2``; ``"paper"`` seed 000's printed ``m * (d/s) * sum_i eps_i sigma^2``
    (:func:`fedsim.compensation.paper_noise_variance`), ``m^2`` times larger for equal clients: the
    paper's exact procedure (docs/seed000.md compares them)."""

    name = "mp-compensation"

    def __init__(self, Q: Annotated[float, Range(1)] = 6.0, mode: Annotated[str, OneOf(*MODES)] = "band",
                 noise_variance: Annotated[float | None, Range(0)] = None, feedback: bool = False,
                 variance: Annotated[str, OneOf(*VARIANCE_RULES)] = "weighted-mean"):
        self.variance_rule = VARIANCE_RULES[variance]
        self.noise_variance = noise_variance
        self.feedback = bool(feedback)
        self.compensator = GlobalUpdateCompensation(Q=Q, mode=mode)
        self.residual: list[np.ndarray] | None = None  # what compensation removed, carried forward
        self._sent: list[np.ndarray] | None = None
        self._metrics: dict[str, Any] = {}

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        self.names = list(param_names)

    def before_send(self, server_round: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        self._sent = arrays
        return arrays

    def aggregate_variance(self, ctx: RoundContext) -> float | None:
        if self.noise_variance is not None:
            return float(self.noise_variance)
        replies = ctx.replies
        weights = ctx.weights if ctx.weights is not None else [float(r.num_examples) for r in replies]
        vs = [float(r.metrics.get(NOISE_VARIANCE, 0.0)) for r in replies]
        return self.variance_rule(weights, vs) if any(v > 0 for v in vs) else None

    def after_aggregate(self, ctx: RoundContext, aggregate: list[np.ndarray]) -> list[np.ndarray]:
        var = self.aggregate_variance(ctx)
        if var is None:
            self._metrics = {"skipped": 1.0}
            return aggregate
        sent = self._sent
        update = [a.astype(np.float64) - s.astype(np.float64) if _floating(a) else a
                  for a, s in zip(aggregate, sent)]
        if self.feedback and self.residual is not None:
            update = [u + r if _floating(u) else u for u, r in zip(update, self.residual)]
        comp = self.compensator.apply(update, var, names=self.names)
        if self.feedback:
            self.residual = [u - c if _floating(u) else u for u, c in zip(update, comp)]
        new = [(s + c).astype(a.dtype) if _floating(a) else a for a, s, c in zip(aggregate, sent, comp)]
        self._metrics = {"variance": var, **{k.split(".", 1)[1]: v for k, v in self.compensator.metrics().items()}}
        if self.feedback:
            self._metrics["residual_norm"] = float(np.sqrt(sum(
                np.sum(np.square(r, dtype=np.float64)) for r in self.residual if _floating(r))))
        return new

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def state(self) -> dict[str, Any]:
        """The feedback residual carried into the next round (None without feedback or before round 1)."""
        return {"residual": None if self.residual is None else [np.array(r) for r in self.residual]}

    def load_state(self, state: Mapping[str, Any]) -> None:
        res = state.get("residual")
        self.residual = None if res is None else [np.asarray(r) for r in res]
