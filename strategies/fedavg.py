"""FedAvg (McMahan et al. 2017): the example-weighted mean of the client models.

A weighted-sum rule whose weights are the example counts, so it runs under every channel that gives the
server the example-weighted mean: the plain channel forms the mean in the clear, an encrypted channel
combines ciphertexts with the same weights, Flower's SecAgg+ unmasks only the mean.
"""
from __future__ import annotations

from fedsim.components import STRATEGIES
from fedsim.replies import Reply
from fedsim.seams import EXAMPLE_WEIGHTED_MEAN, RoundContext, WeightedSumRule


@STRATEGIES.register
class FedAvg(WeightedSumRule):
    """``sum_i n_i x_i / sum_i n_i`` over the round's valid replies (``n_i``: the client's example count)."""

    name = "fedavg"
    stateless = True
    requires = frozenset({EXAMPLE_WEIGHTED_MEAN})
    example_weighted_mean = True

    def weights(self, ctx: RoundContext, replies: list[Reply]) -> list[float]:
        return [float(r.num_examples) for r in replies]
