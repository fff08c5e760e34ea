"""The interception point: read-only observers of every client reply, before aggregation.

Every round, before the strategy aggregates, the server hands each client's reply to the registered
observers as a :class:`ClientUpdate`. Arrays are read-only NumPy views: an observer can look (and
copy) but cannot change what gets aggregated. Observers run in the server process only.

``attacks.curious.CuriousServer`` is the observer that runs gradient-leakage attacks; the trivial
:class:`UpdateNormObserver` below writes per-client update norms to ``updates.jsonl``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np


def _frozen(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    out = []
    for a in arrays:
        v = np.asarray(a).view()
        v.flags.writeable = False
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class ClientUpdate:
    """One client's reply as the (honest-but-curious) server sees it."""

    round: int
    client_id: int  # partition id
    node_id: int
    global_weights: tuple[np.ndarray, ...]  # what the server sent this client
    weights: tuple[np.ndarray, ...]  # what the client returned, before aggregation
    num_examples: int
    recipe: Mapping[str, Any]  # local training recipe the server configured (lr, local_steps, batch_size, ...)
    metrics: Mapping[str, Any] = field(default_factory=dict)
    param_names: tuple[str, ...] = ()

    @classmethod
    def create(cls, *, round: int, client_id: int, node_id: int, global_weights, weights, num_examples: int,
               recipe: Mapping[str, Any], metrics: Mapping[str, Any] | None = None,
               param_names: Sequence[str] = ()) -> "ClientUpdate":
        return cls(round, int(client_id), int(node_id), _frozen(global_weights), _frozen(weights),
                   int(num_examples), MappingProxyType(dict(recipe)), MappingProxyType(dict(metrics or {})),
                   tuple(param_names))

    def delta(self) -> list[np.ndarray]:
        """The update: returned weights minus the global weights it started from (fresh arrays)."""
        return [w - g for w, g in zip(self.weights, self.global_weights)]


class Observer:
    """Base class: override what you need. Called in the server process, in round order."""

    def on_start(self, out_dir: Path | None) -> None:  # before round 1
        pass

    def observe(self, update: ClientUpdate) -> None:  # every reply, every round, before aggregation
        pass

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:  # after central evaluation
        pass

    def on_finish(self) -> dict[str, Any]:  # after the last round; returns items for summary.json
        return {}

    def report_markdown(self) -> str:  # a section appended to report.md
        return ""


class UpdateNormObserver(Observer):
    """Writes the L2 norm of every client's update to ``updates.jsonl`` (proves the seam)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.path: Path | None = None

    def on_start(self, out_dir: Path | None) -> None:
        self.path = out_dir / "updates.jsonl" if out_dir else None

    def observe(self, update: ClientUpdate) -> None:
        norm = float(np.sqrt(sum(float(np.sum(d.astype(np.float64) ** 2)) for d in update.delta())))
        self.rows.append({"round": update.round, "client": update.client_id, "num_examples": update.num_examples,
                          "update_norm": norm})

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        if self.path is not None:
            from fedsim.reports import write_jsonl

            write_jsonl(self.path, self.rows)

    def on_finish(self) -> dict[str, Any]:
        return {"updates_observed": len(self.rows)}
