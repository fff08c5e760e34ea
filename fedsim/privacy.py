"""Privacy accounting: the (epsilon, delta) every differential-privacy setting of a run gives, per round.

One accountant for everything: Opacus's RDP accountant (``opacus.accountants.RDPAccountant``; Mironov
2017, Mironov et al. 2019 for the subsampled Gaussian mechanism, the RDP -> (epsilon, delta) conversion
of Balle et al. 2020). Each mechanism is a sequence of Gaussian releases, an *event* being
``(noise_multiplier, sample_rate, steps)`` (noise standard deviation / L2 sensitivity; the probability
that the protected unit takes part in a release, 1 = no amplification by sampling; how many identical
releases). Why this one (docs/defenses.md): it is the accountant fedsim's DP-SGD already used, it needs
no new dependency, and it models every mechanism here under one neighbouring relation (add or remove
one unit).

A component that gives (or claims to give) differential privacy declares it as a :class:`Mechanism`:

* ``level`` - what a neighbouring pair of federations differs in: one training example (``"sample"``:
  DP-SGD) or one client's whole data (``"client"``: the central-DP strategies, Flower's LocalDpMod,
  clip-update + gaussian-noise);
* ``against`` - who the guarantee holds against: mechanisms that act on the client hold against the
  server and everyone after it; central DP (noise added by the server) holds only against whoever sees
  the global models, not against the server that adds the noise;
* its events: per *participation* (each round a client's reply reaches the server, that client's data
  goes through one more release: LocalDpMod, DP-SGD's local steps) or per *round* (one release of the
  aggregate, whoever took part: central DP);
* or ``reason``: the mechanism adds noise but gives no formal guarantee (no clipping bound, no noise) -
  reported as ``"no formal guarantee"``, never as a number.

:class:`PrivacyLedger` composes the events round by round (the round engine calls it after every
aggregation) and puts ``privacy.<key>.epsilon`` / ``.delta`` in the round's row: for per-participation
mechanisms the largest epsilon of any client (the guarantee every client's data has), for central DP
the epsilon of the sequence of releases. Reply metrics and the training metrics the clients send are
outside every guarantee (as in Flower's own accounting).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

ACCOUNTANT = "Opacus RDP accountant"
NO_GUARANTEE = "no formal guarantee"
LEVELS = ("sample", "client")
AGAINST_SERVER = "the server and everyone after it"
AGAINST_RELEASE = "whoever sees the global models (not the server, which adds the noise)"

Event = tuple[float, float, int]  # (noise multiplier, sample rate, steps)


def check_event(event: Sequence[Any]) -> Event:
    z, q, n = event
    z, q, n = float(z), float(q), int(n)
    if not (z >= 0 and math.isfinite(z)):
        raise ValueError(f"noise multiplier must be a finite number >= 0, got {z!r}")
    if not 0 < q <= 1:
        raise ValueError(f"sample rate must be in (0, 1], got {q!r}")
    if n < 0:
        raise ValueError(f"steps must be >= 0, got {n!r}")
    return z, q, n


def epsilon(events: Sequence[Sequence[Any]], delta: float) -> float:
    """Epsilon at ``delta`` of the composition of ``events`` (Opacus RDP accountant): 0 without events,
    infinite when a release had no noise."""
    from opacus.accountants import RDPAccountant

    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    hist = [check_event(e) for e in events]
    hist = [e for e in hist if e[2] > 0]
    if not hist:
        return 0.0
    if any(z == 0 for z, _, _ in hist):
        return math.inf
    acct = RDPAccountant()
    acct.history = list(hist)
    return float(acct.get_epsilon(delta=delta))


def compose(events: Sequence[Sequence[Any]]) -> list[Event]:
    """Identical events merged (their steps added), in first-seen order: a short, canonical history."""
    steps: dict[tuple[float, float], int] = {}
    for e in events:
        z, q, n = check_event(e)
        steps[(z, q)] = steps.get((z, q), 0) + n
    return [(z, q, n) for (z, q), n in steps.items() if n > 0]


@dataclass
class Mechanism:
    """One DP mechanism of a run, as the component that implements it declares it (see the module docstring)."""

    key: str  # row prefix: privacy.<key>.epsilon (e.g. "strategy", "defense.0.dp-sgd", "mod.0.local-dp")
    description: str  # one line: what it does, with its parameters
    level: str = "client"  # "sample" | "client"
    against: str = AGAINST_SERVER
    delta: float | None = None
    reason: str | None = None  # set: no formal guarantee, and why
    # one client's events for one round it took part in: (round, client, the round's train config) -> events
    per_participation: Callable[[int, int, Mapping[str, Any]], list[Event]] | None = None
    # events of every release so far (a component that keeps its own history, e.g. a central-DP strategy)
    per_round: Callable[[], list[Event]] | None = None
    notes: list[str] = field(default_factory=list)  # caveats shown in the report

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"privacy level must be one of {LEVELS}, got {self.level!r}")
        if self.reason is None:
            if self.delta is None or not 0 < self.delta < 1:
                raise ValueError(f"{self.key}: a mechanism with a guarantee needs delta in (0, 1), got {self.delta!r}")
            if (self.per_participation is None) == (self.per_round is None):
                raise ValueError(f"{self.key}: give exactly one of per_participation or per_round")

    @property
    def formal(self) -> bool:
        return self.reason is None


class PrivacyLedger:
    """Composes the run's mechanisms round by round (see the module docstring)."""

    def __init__(self, mechanisms: Sequence[Mechanism] = ()):
        keys = [m.key for m in mechanisms]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"two privacy mechanisms report under the same key: {dup}")
        self.mechanisms = list(mechanisms)
        # per-participation mechanisms: key -> client -> merged events
        self.history: dict[str, dict[int, list[Event]]] = {m.key: {} for m in self.mechanisms if m.per_participation}
        self.last: dict[str, float | None] = {}
        self._cache: dict[tuple[tuple[Event, ...], float], float] = {}

    def __bool__(self) -> bool:
        return bool(self.mechanisms)

    def _eps(self, events: Sequence[Event], delta: float) -> float:
        key = (tuple(compose(events)), delta)
        if key not in self._cache:
            self._cache[key] = epsilon(key[0], delta)
        return self._cache[key]

    def after_round(self, server_round: int, contributors: Sequence[int], config: Mapping[str, Any]) -> dict[str, Any]:
        """Compose the round's releases; the row's ``privacy.*`` items. ``contributors``: the clients whose
        reply reached the aggregate; ``config``: the round's train config (the recipe)."""
        for m in self.mechanisms:
            if m.per_participation is not None:
                clients = self.history[m.key]
                for c in contributors:
                    clients[c] = compose([*clients.get(c, []), *m.per_participation(server_round, c, config)])
        return self.row()

    def epsilons(self) -> dict[str, float | None]:
        """Each mechanism's epsilon so far (None: no formal guarantee; inf: a release without noise)."""
        out: dict[str, float | None] = {}
        for m in self.mechanisms:
            if not m.formal:
                out[m.key] = None
            elif m.per_round is not None:
                out[m.key] = self._eps(m.per_round(), m.delta)
            else:
                groups = {tuple(ev) for ev in self.history[m.key].values()}
                out[m.key] = max((self._eps(list(g), m.delta) for g in groups), default=0.0)
        return out

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self.last = self.epsilons()
        for m in self.mechanisms:
            eps = self.last[m.key]
            if eps is None:
                out[f"privacy.{m.key}.epsilon"] = None
                out[f"privacy.{m.key}.guarantee"] = NO_GUARANTEE
            else:  # no noise at all: no guarantee either (infinity is not a number a row can carry)
                finite = math.isfinite(eps)
                out[f"privacy.{m.key}.epsilon"] = eps if finite else None
                out[f"privacy.{m.key}.delta"] = m.delta
                if not finite:
                    out[f"privacy.{m.key}.guarantee"] = NO_GUARANTEE
        return out

    # ---- checkpoints ----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"history": {k: {str(c): [list(e) for e in ev] for c, ev in v.items()} for k, v in self.history.items()}}

    def load_state(self, state: Mapping[str, Any]) -> None:
        hist = state.get("history", {})
        for k in self.history:
            self.history[k] = {int(c): [check_event(e) for e in ev] for c, ev in (hist.get(k) or {}).items()}

    # ---- what the run gives, for summary.json and the report ----------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        eps = self.epsilons() if self.mechanisms else {}
        out = []
        for m in self.mechanisms:
            e = eps.get(m.key)
            entry: dict[str, Any] = {"mechanism": m.key, "description": m.description, "level": m.level,
                                     "against": m.against}
            if e is None or not math.isfinite(e):
                entry["guarantee"] = NO_GUARANTEE
                entry["reason"] = m.reason or "a release without noise (noise multiplier 0)"
                entry["epsilon"] = None
            else:
                entry.update(guarantee=f"({e:.3g}, {m.delta:g})-DP, {m.level}-level", epsilon=e, delta=m.delta,
                             accountant=ACCOUNTANT)
            if m.notes:
                entry["notes"] = list(m.notes)
            out.append(entry)
        return out

    def report_markdown(self, rows: Sequence[Mapping[str, Any]] = ()) -> str:
        """The report's section: every mechanism's guarantee after the last round and, with the run's
        metrics ``rows``, epsilon round by round."""
        if not self.mechanisms:
            return ""
        from fedsim.reports import md_table

        rows = self.describe()
        for r in rows:
            r["epsilon (final)"] = r["epsilon"]
            r["delta"] = r.get("delta")
        text = ["## Privacy guarantees\n",
                f"Differential privacy of the run's mechanisms after the last round ({ACCOUNTANT}; per-round values "
                "are `privacy.<mechanism>.epsilon` in metrics.jsonl). `level`: what neighbouring federations differ in "
                "(one example, or one client's data); `against`: who the guarantee holds against. Per-client "
                "mechanisms report the largest epsilon of any client. Reply metrics are outside every guarantee.\n",
                md_table(rows, ["mechanism", "description", "level", "against", "guarantee", "epsilon (final)", "delta"],
                         {"epsilon (final)": ".4g", "delta": ".1e"})]
        reasons = [f"- `{r['mechanism']}`: {NO_GUARANTEE}: {r['reason']}" for r in rows if r.get("reason")]
        notes = [f"- `{r['mechanism']}`: {n}" for r in rows for n in r.get("notes", [])]
        if reasons or notes:
            text.append("\n".join(reasons + notes) + "\n")
        formal = [m.key for m in self.mechanisms if m.formal]
        per_round = [r for r in rows if r.get("round", 0) >= 1 and any(f"privacy.{k}.epsilon" in r for k in formal)]
        if per_round:
            cols = {f"privacy.{k}.epsilon": f"epsilon {k}" for k in formal}
            shown = [{"round": r["round"], **{h: r.get(c) for c, h in cols.items()}} for r in per_round]
            text += ["Epsilon after each round (at each mechanism's delta; empty: no guarantee yet):\n",
                     md_table(shown, ["round", *cols.values()], {h: ".4g" for h in cols.values()})]
        return "\n".join(text)


def gaussian_noise_multiplier(std: float, sensitivity: float) -> float:
    """Noise standard deviation over L2 sensitivity."""
    if not sensitivity > 0:
        raise ValueError(f"sensitivity must be > 0, got {sensitivity!r}")
    return float(std) / float(sensitivity)


def classic_gaussian_std(sensitivity: float, eps: float, delta: float) -> float:
    """The classic Gaussian mechanism's standard deviation ``sensitivity sqrt(2 ln(1.25/delta)) / epsilon``
    (Dwork & Roth 2014, Thm A.1; what Flower's LocalDpMod adds)."""
    return float(sensitivity) * math.sqrt(2 * math.log(1.25 / float(delta))) / float(eps)


def build_ledger(rule: Any, pipeline: Any, mods: Sequence[Any], cfg: Mapping[str, Any]) -> PrivacyLedger:
    """The run's ledger from what its components declare: the aggregation rule's ``privacy(cfg)``, the
    defense pipeline's (:meth:`fedsim.defense.DefensePipeline.privacy`) and each Flower mod's ``privacy``
    (mods are Flower's classes; fedsim's registered subclasses add the declaration)."""
    mechanisms: list[Mechanism] = []
    declare = getattr(rule, "privacy", None)
    if callable(declare):
        mechanisms += list(declare(cfg))
    if pipeline is not None:
        mechanisms += pipeline.privacy(cfg)
    for i, mod in enumerate(mods):
        declare = getattr(mod, "privacy", None)
        if callable(declare):
            mechanisms += list(declare(cfg, f"mod.{i}"))
    return PrivacyLedger(mechanisms)
