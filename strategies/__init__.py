"""Server-side aggregation strategies (Flower Message-API strategies with fedsim's seams).

``STRATEGIES`` maps ``strategy.name`` to a class; the class's keyword-only ``__init__`` parameters
are the accepted ``strategy.*`` keys.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from strategies.base import FedsimStrategy, check_params, strategy_params
from strategies.fedavg import FedAvg

STRATEGIES: dict[str, type[FedsimStrategy]] = {"fedavg": FedAvg}


def _params(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg["strategy"].items() if k != "name"}


def validate_strategy(cfg: Mapping[str, Any]) -> None:
    name = cfg["strategy"]["name"]
    if name not in STRATEGIES:
        raise ValueError(f"strategy.name must be one of {sorted(STRATEGIES)}, got {name!r}")
    check_params(STRATEGIES[name], _params(cfg))
    STRATEGIES[name](param_names=[], **_params(cfg))  # value checks raise ValueError naming the key


def build_strategy(cfg: Mapping[str, Any], *, param_names: Sequence[str], observers=()) -> FedsimStrategy:
    cls = STRATEGIES[cfg["strategy"]["name"]]
    return cls(param_names=param_names, seed=cfg["seed"], clients_per_round=cfg["federation"]["clients_per_round"],
               observers=observers, **_params(cfg))


__all__ = ["STRATEGIES", "FedAvg", "FedsimStrategy", "build_strategy", "strategy_params", "validate_strategy"]
