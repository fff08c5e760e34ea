"""Learning-rate schedules (``train.lr_schedule``): the clients' rate in a given round."""
from __future__ import annotations

import math
from typing import Any, Mapping

LR_SCHEDULES = ("constant", "step", "exponential", "cosine")


def scheduled_lr(train: Mapping[str, Any], server_round: int, rounds: int) -> float:
    """The clients' learning rate in ``server_round`` under ``train.lr_schedule`` (rounds count from 1).

    ``constant``: ``lr``; ``step``: ``lr * lr_gamma ** floor((round - 1) / lr_step_rounds)``;
    ``exponential``: ``lr * lr_gamma ** (round - 1)``; ``cosine``: from ``lr`` in round 1 to ``lr_min`` in
    the last round, ``lr_min + (lr - lr_min) * (1 + cos(pi * (round - 1) / (rounds - 1))) / 2``.
    The server sends the round's rate with every train message, so the clients and an attacker that
    reads the recipe use the same one.
    """
    lr = float(train["lr"])
    kind = train.get("lr_schedule") or "constant"
    r = max(int(server_round), 1) - 1
    if kind == "constant":
        return lr
    gamma = float(train.get("lr_gamma", 0.5))
    if kind == "step":
        return lr * gamma ** (r // max(int(train.get("lr_step_rounds", 10)), 1))
    if kind == "exponential":
        return lr * gamma ** r
    if kind == "cosine":
        lo = float(train.get("lr_min", 0.0))
        span = max(int(rounds) - 1, 1)
        return lo + (lr - lo) * (1 + math.cos(math.pi * min(r, span) / span)) / 2
    raise ValueError(f"train.lr_schedule must be one of {list(LR_SCHEDULES)}, got {kind!r}")
