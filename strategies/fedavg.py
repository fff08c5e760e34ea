"""FedAvg (McMahan et al. 2017): the example-weighted mean of the client models."""
from __future__ import annotations

from strategies.base import FedsimStrategy


class FedAvg(FedsimStrategy):
    """Plain FedAvg with fedsim's seams (observers, deterministic sampling, failure records)."""

    name = "fedavg"
