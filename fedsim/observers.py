"""The interception point: read-only observers of every client reply, before aggregation.

Every round, before the strategy aggregates, the server hands each client's reply to the registered
observers as a :class:`ClientUpdate`. Arrays are read-only NumPy views: an observer can look (and
copy) but cannot change what gets aggregated. Observers run in the server process only.

``attacks.curious.CuriousServer`` is the observer that runs gradient-leakage attacks; the trivial
:class:`UpdateNormObserver` below writes per-client update norms to ``updates.jsonl``.
"""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from fedsim.components import OBSERVERS
from fedsim.lifecycle import Component


def _frozen(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    out = []
    for a in arrays:
        v = np.asarray(a).view()
        v.flags.writeable = False
        out.append(v)
    return tuple(out)


class ClientUpdate:
    """One client's reply as the (honest-but-curious) server sees it - through the channel.

    ``kind`` says what the channel lets the server see: ``"individual"`` (the client's model in
    plaintext: ``weights``), ``"ciphertext"`` (only an encrypted ``payload``; ``weights`` is empty) or
    ``"aggregate"`` (secure aggregation: ``weights`` is the aggregate of ``contributors``).
    Arrays are read-only and decoded on first access (observers that do not look cost nothing).
    ``extras`` are the extra arrays the client's defenses sent with the reply (record ``EXTRAS``), by name.
    """

    __slots__ = ("round", "client_id", "node_id", "num_examples", "recipe", "metrics", "param_names", "kind",
                 "payload", "contributors", "_global", "_weights", "_extras")

    def __init__(self, *, round: int, client_id: int, node_id: int, global_weights: Any = (),
                 weights: Any = (), num_examples: int, recipe: Mapping[str, Any],
                 metrics: Mapping[str, Any] | None = None, param_names: Sequence[str] = (),
                 kind: str = "individual", payload: Any = None, contributors: Sequence[int] = (),
                 extras: Any = None):
        set_ = object.__setattr__
        set_(self, "round", int(round))
        set_(self, "client_id", int(client_id))
        set_(self, "node_id", int(node_id))
        set_(self, "num_examples", int(num_examples))
        set_(self, "recipe", MappingProxyType(dict(recipe)))
        set_(self, "metrics", MappingProxyType(dict(metrics or {})))
        set_(self, "param_names", tuple(param_names))
        set_(self, "kind", kind)
        set_(self, "payload", payload)
        set_(self, "contributors", tuple(contributors))
        set_(self, "_global", global_weights)
        set_(self, "_weights", weights)
        set_(self, "_extras", extras)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"ClientUpdate is read-only (cannot set {key!r})")

    def _resolve(self, slot: str) -> tuple[np.ndarray, ...]:
        v = object.__getattribute__(self, slot)
        if not isinstance(v, tuple) or (v and v[0].flags.writeable):
            v = _frozen(v() if callable(v) else v)
            object.__setattr__(self, slot, v)
        return v

    @property
    def global_weights(self) -> tuple[np.ndarray, ...]:
        """What the server sent this client (empty when the server cannot read the model)."""
        return self._resolve("_global")

    @property
    def weights(self) -> tuple[np.ndarray, ...]:
        """What the client returned, before aggregation (empty for ``kind = "ciphertext"``)."""
        return self._resolve("_weights")

    @property
    def extras(self) -> Mapping[str, np.ndarray]:
        """The reply's extra arrays by name (read-only; empty when the client sent none)."""
        v = object.__getattribute__(self, "_extras")
        if not isinstance(v, MappingProxyType):
            v = v() if callable(v) else (v or {})
            names = list(v)
            v = MappingProxyType(dict(zip(names, _frozen([v[n] for n in names]))))
            object.__setattr__(self, "_extras", v)
        return v

    @classmethod
    def create(cls, **kw: Any) -> "ClientUpdate":
        return cls(**kw)

    def delta(self) -> list[np.ndarray]:
        """The update: returned weights minus the global weights it started from (fresh arrays)."""
        return [w - g for w, g in zip(self.weights, self.global_weights)]


class Observer(Component):
    """Base class: override what you need. Called in the server process, in round order.

    Observers are plugins: register a subclass in :data:`fedsim.components.OBSERVERS` (with a ``name``)
    and list it in ``output.observers``. The lifecycle - ``validate_config``, ``setup``, ``state`` /
    ``load_state`` (failing closed: an observer that keeps nothing across rounds declares
    ``stateless = True``, else the run writes no checkpoint) - is the components' (:class:`fedsim.lifecycle.Component`)."""

    def on_start(self, out_dir: Path | None) -> None:  # before round 1
        pass

    def observe(self, update: ClientUpdate) -> None:  # every reply, every round, before aggregation
        pass

    def on_global_model(self, round: int, arrays: Sequence[np.ndarray] | None) -> Mapping[str, Any]:
        """The global model at the end of a round (round 0: the initial model), or None when the server
        cannot read it (encrypted channels). Called after central evaluation, before ``on_round_end``;
        the items returned are added to the round's metrics row (prefix them with the observer's name)."""
        return {}

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:  # after central evaluation
        pass

    def on_finish(self) -> dict[str, Any]:  # after the last round; returns items for summary.json
        return {}

    def report_markdown(self) -> str:  # a section appended to report.md
        return ""

    # state() / load_state(): what the observer has gathered so far, for the run's checkpoint (restored
    # after ``on_start``, so the observer knows its folder and may bring its files back to the
    # checkpointed round); see Component


OBSERVERS.base = Observer  # an import reference in output.observers must name an Observer


@OBSERVERS.register
class UpdateNormObserver(Observer):
    """Writes the L2 norm of every client's update to ``updates.jsonl`` (proves the seam).

    Under an encrypted channel there is nothing to measure: the row says ``"ciphertext"``."""

    name = "update-norms"

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.path: Path | None = None
        self._written = 0

    def on_start(self, out_dir: Path | None) -> None:
        self.path = out_dir / "updates.jsonl" if out_dir else None

    def observe(self, update: ClientUpdate) -> None:
        row: dict[str, Any] = {"round": update.round, "client": update.client_id,
                               "num_examples": update.num_examples, "kind": update.kind}
        if update.contributors:  # secure aggregation: one row for the round's aggregate
            row["contributors"] = list(update.contributors)
        if update.weights and update.global_weights:
            row["update_norm"] = float(np.sqrt(sum(float(np.sum(d.astype(np.float64) ** 2))
                                                   for d in update.delta())))
        self.rows.append(row)

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        if self.path is not None:
            from fedsim.reports import append_jsonl

            append_jsonl(self.path, self.rows[self._written:])
            self._written = len(self.rows)

    def on_finish(self) -> dict[str, Any]:
        return {"updates_observed": len(self.rows)}

    def state(self) -> dict[str, Any]:
        return {"rows": len(self.rows)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Re-read the first ``rows`` rows of ``updates.jsonl`` (rows of an interrupted round after the
        checkpoint are dropped from the file)."""
        from fedsim.reports import read_jsonl, write_jsonl

        n = int(state.get("rows", 0))
        rows = read_jsonl(self.path, skip_bad=True) if self.path is not None and self.path.exists() else []
        if len(rows) < n:
            raise ValueError(f"{self.path} has {len(rows)} rows, the checkpoint counts {n}")
        self.rows = rows[:n]
        self._written = n
        if self.path is not None and len(rows) != n:
            write_jsonl(self.path, self.rows)
