"""Membership inference by the honest-but-curious server (``curious-server-mia``), with a researcher's audit.

The server intercepts each sampled client's update (``ClientUpdate``): the model it sent (the global
model of the round) and the model the client returned. For every attacked (round, victim) it asks which of
a set of candidate records the victim trained on in that round - the records of its local batches
(members) and as many test records (non-members) - and scores each candidate with the attacks of
:mod:`attacks.membership`:

* ``loss`` - the loss of the returned model (Yeom et al. 2018);
* ``calibrated`` - the loss drop from the sent model to the returned one (difficulty calibration, Watson
  et al. 2022: the sent model is a reference that did not train on the round's batches);
* ``lira`` - online LiRA (Carlini et al. 2022): ``shadows`` shadow clients, each trained from the sent
  model with the victim's recipe (learning rate, batch size, local steps or epochs, momentum, weight
  decay) and the configured ``[[defenses]]`` on a random half of the candidates (every candidate is IN for
  half of them), give per-candidate Gaussians of the logit-scaled confidence with and without the record;
  the returned model's confidence is scored by the likelihood ratio. The attacker knows the candidates,
  never which are members. Flower mods and the strategy's central clipping are not mimicked.

Each (round, victim) and, pooled over the round's victims (scores of calibrated attacks are comparable
across victims), each round give the audit researchers quote: ROC AUC and TPR at 0.1% and 1% FPR, with
the ROC curve (:func:`attacks.membership.roc`). With n non-members the smallest measurable FPR is 1/n.

The server sees the updates *before* any central-DP noise (Flower's wrappers add it to the aggregate), so
central DP does not protect against this attacker; client-side mechanisms (DP-SGD, LocalDpMod, clipping +
noise) do. Under secure aggregation the server attacks the aggregate of the round (members: every
contributor's records; ``loss`` and ``calibrated`` only: a shadow of an aggregate would have to simulate
every contributor); ciphertexts are not attacked.

Truth (which records are members) comes from the scorer only, as for the reconstruction attacks: the
victim's batches are a function of (seed, round, client) (``fedsim.training.batches.iter_batches``).

Config (an ``output.observers`` entry)::

    [[output.observers]]
    name = "curious-server-mia"
    rounds = [1]                 # or "all"
    victims = "sampled"          # or a list of client ids
    attacks = ["loss", "calibrated", "lira"]
    shadows = 16                 # LiRA's shadow clients (even)
    max_members = 256            # at most this many of the victim's records of the round are candidates
    seed = 0                     # the attacker's randomness (non-members, shadow halves)

Outputs: ``membership.jsonl`` (a row per round, attack and victim, and the pooled ``client = "all"`` row),
``membership_roc.json`` (the pooled ROC curves), ``membership_roc.png``, a ``report.md`` section and
``summary.json["membership"]`` (shown by ``fedsim sweep`` / ``compare`` as ``mia-<attack>.auc``, ...).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from fedsim import progress
from fedsim.components import OBSERVERS
from fedsim.device import resolve_device
from fedsim.factories import client_data, dataset_for, model_for
from fedsim.models.weights import set_weights
from fedsim.observers import ClientUpdate, Observer
from fedsim.seeding import derive_seed
from fedsim.training.batches import iter_batches
from fedsim.training.local import local_train
from fedsim.training.recipe import Recipe

from .membership import (
    AUDIT_COLUMNS,
    TPR_KEYS,
    balanced_halves,
    calibrated_scores,
    lira_scores,
    loss_scores,
    roc,
    scaled_confidence,
)

ATTACKS = ("loss", "calibrated", "lira")
log = logging.getLogger("fedsim")


class _Target:
    """What the server holds of one attacked update (copied: ClientUpdate arrays are views)."""

    __slots__ = ("round", "client", "kind", "sent", "returned", "recipe", "contributors")

    def __init__(self, u: ClientUpdate):
        self.round, self.client, self.kind = u.round, u.client_id, u.kind
        self.sent = [np.array(a) for a in u.global_weights]
        self.returned = [np.array(a) for a in u.weights]
        self.recipe = dict(u.recipe)
        self.contributors = list(u.contributors) or [u.client_id]


@OBSERVERS.register
class CuriousServerMIA(Observer):
    """Membership inference on intercepted updates, with ROC AUC and TPR at low FPR (see the module docstring)."""

    name = "curious-server-mia"

    def __init__(self, *, cfg: Mapping[str, Any], rounds: str | list[int] | None = None,
                 victims: str | list[int] = "sampled", attacks: list[str] | None = None, shadows: int = 16,
                 max_members: int = 256, seed: int = 0, device: str = "auto"):
        self.cfg = cfg
        n_rounds, n_clients = int(cfg["federation"]["rounds"]), int(cfg["federation"]["num_clients"])
        rounds = [1] if rounds is None else rounds
        if not (rounds == "all" or (isinstance(rounds, list) and rounds and all(
                isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= n_rounds for r in rounds))):
            raise ValueError(f"rounds must be \"all\" or a list of rounds in 1..{n_rounds}, got {rounds!r}")
        if not (victims == "sampled" or (isinstance(victims, list) and victims and all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_clients for v in victims))):
            raise ValueError(f"victims must be \"sampled\" or a list of client ids in 0..{n_clients - 1}, got {victims!r}")
        attacks = list(ATTACKS) if attacks is None else attacks
        if not isinstance(attacks, list) or not attacks or any(a not in ATTACKS for a in attacks):
            raise ValueError(f"attacks must be a non-empty list of {list(ATTACKS)}, got {attacks!r}")
        if "lira" in attacks and (isinstance(shadows, bool) or not isinstance(shadows, int) or shadows < 2
                                  or shadows % 2):
            raise ValueError(f"shadows must be an even integer >= 2 (LiRA: every candidate IN for half), got {shadows!r}")
        for key, v, lo in (("max_members", max_members, 1), ("seed", seed, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{key} must be an integer >= {lo}, got {v!r}")
        self.rounds, self.victims, self.attacks = rounds, victims, list(attacks)
        self.shadows, self.max_members, self.seed = int(shadows), int(max_members), int(seed)
        self.device = resolve_device(device)
        self.rows: list[dict[str, Any]] = []
        self.curves: dict[str, dict[str, list[float]]] = {}  # "<attack> r<round>" -> pooled fpr/tpr
        self.notes: list[str] = []
        self.unreadable = 0
        self.out: Path | None = None
        self._pending: dict[int, list[_Target]] = {}

    # ---- Observer API -----------------------------------------------------------------------------------
    def on_start(self, out_dir: Path | None) -> None:
        self.out = out_dir

    def attacks_round(self, rnd: int) -> bool:
        return self.rounds == "all" or rnd in self.rounds

    def observe(self, update: ClientUpdate) -> None:
        if not self.attacks_round(update.round):
            return
        if update.kind == "ciphertext":
            self.unreadable += 1
            return
        if update.kind != "aggregate" and self.victims != "sampled" and update.client_id not in self.victims:
            return
        self._pending.setdefault(update.round, []).append(_Target(update))

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        targets = self._pending.pop(round, [])
        if not targets:
            return
        with progress.task(f"curious-server-mia round {round}", total=len(targets), unit="victim"):
            per_attack: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {a: [] for a in self.attacks}
            for i, t in enumerate(targets):
                for attack, (sm, sn, extra) in self.attack(t).items():
                    per_attack[attack].append((sm, sn))
                    self.rows.append(self._row(t, attack, roc(sm, sn), extra))
                progress.tick(i + 1)
        for attack, scores in per_attack.items():
            if not scores:
                continue
            audit = roc(torch.cat([m for m, _ in scores]), torch.cat([n for _, n in scores]))
            self.curves[f"mia-{attack} r{round}"] = {"fpr": audit["fpr"], "tpr": audit["tpr"]}
            self.rows.append({"round": round, "client": "all", "attack": f"mia-{attack}", "victims": len(scores),
                              **{k: audit[k] for k in ("members", "non_members", *AUDIT_COLUMNS)},
                              "accuracy": metrics.get("accuracy")})
        if self.out is not None:
            self.write_outputs()

    def _row(self, t: _Target, attack: str, audit: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
        return {"round": t.round, "client": t.client if t.kind != "aggregate" else "aggregate", "attack": f"mia-{attack}",
                "kind": t.kind, **{k: audit[k] for k in ("members", "non_members", *AUDIT_COLUMNS)}, **extra}

    # ---- the attacks --------------------------------------------------------------------------------------
    def candidates(self, t: _Target) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(x, y, number of members): the victim's records of the round (scorer's truth), then as many test
        records (drawn with the attacker's seed)."""
        recipe = Recipe.from_mapping({**self.cfg["train"], **t.recipe})
        xs, ys = [], []
        for c in t.contributors:
            x, y = client_data(self.cfg, c)
            used = np.unique(np.concatenate(list(iter_batches(int(self.cfg["seed"]), t.round, c, len(y), recipe))))
            xs.append(x[torch.as_tensor(used)])
            ys.append(y[torch.as_tensor(used)])
        xm, ym = torch.cat(xs), torch.cat(ys)
        gen = torch.Generator().manual_seed(derive_seed(self.seed, t.round, t.client, 0x3E3))
        if len(ym) > self.max_members:
            keep = torch.randperm(len(ym), generator=gen)[: self.max_members]
            xm, ym = xm[keep], ym[keep]
        ds = dataset_for(self.cfg)
        k = min(len(ym), len(ds.y_test))
        non = torch.randperm(len(ds.y_test), generator=gen)[:k]
        if k < len(ym):
            self.notes.append(f"round {t.round}: {len(ym)} members but only {k} test records; scored {k} of each")
            xm, ym = xm[:k], ym[:k]
        return torch.cat([xm, ds.x_test[non]]), torch.cat([ym, ds.y_test[non]]), k

    def _logits(self, weights: Sequence[np.ndarray], x: torch.Tensor) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            model = model_for(self.cfg)
        set_weights(model, weights)
        model.to(self.device).eval()
        with torch.no_grad():
            return torch.cat([model(x[i:i + 512].to(self.device)).cpu() for i in range(0, len(x), 512)])

    def attack(self, t: _Target) -> dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
        x, y, k = self.candidates(t)
        out: dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = {}
        target = self._logits(t.returned, x)
        for attack in self.attacks:
            t0 = time.perf_counter()
            extra: dict[str, Any] = {}
            if attack == "loss":
                s = loss_scores(target, y)
            elif attack == "calibrated":
                s = calibrated_scores(target, self._logits(t.sent, x), y)
            else:
                if t.kind == "aggregate":
                    if not any("lira" in n for n in self.notes):
                        self.notes.append("lira: not run on secure aggregates (a shadow would have to simulate every "
                                          "contributor)")
                    continue
                s, extra = self.lira(t, x, y, target)
            out[attack] = (s[:k], s[k:], {**extra, "seconds": time.perf_counter() - t0})
        return out

    def lira(self, t: _Target, x: torch.Tensor, y: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Shadow clients from the sent model, the victim's recipe and defenses, on balanced halves of the
        candidates; returns the scores and what the shadows mimicked."""
        from fedsim.build import client_pipeline

        recipe = Recipe.from_mapping({**self.cfg["train"], **t.recipe})
        gen = torch.Generator().manual_seed(derive_seed(self.seed, t.round, t.client, 0x11A))
        mask = balanced_halves(len(y), self.shadows, gen)
        mimic = "recipe + defenses"
        conf = torch.empty(self.shadows, len(y), dtype=torch.float64)
        with torch.random.fork_rng(devices=[]):
            model = model_for(self.cfg)
        for k in range(self.shadows):
            idx = mask[k].nonzero().flatten()
            pipeline = None
            if self.cfg.get("defenses"):
                try:
                    pipeline = client_pipeline(self.cfg)
                except Exception as exc:  # noqa: BLE001 - a defense the server cannot rebuild: recipe only
                    pipeline, mimic = None, f"recipe only ({type(exc).__name__}: {exc})"
            set_weights(model, t.sent)
            seed = derive_seed(self.seed, t.round, t.client, 0x5AD0 + k)
            try:
                res = local_train(model, x[idx], y[idx], recipe, seed=seed, round=t.round, client=k, pipeline=pipeline,
                                  device=self.device, loss=self.cfg["train"].get("loss", "cross-entropy"))
            except Exception as exc:  # noqa: BLE001 - e.g. a defense that needs what only the real client has
                if pipeline is None:
                    raise
                mimic = f"recipe only ({type(exc).__name__}: {exc})"
                set_weights(model, t.sent)
                res = local_train(model, x[idx], y[idx], recipe, seed=seed, round=t.round, client=k, device=self.device,
                                  loss=self.cfg["train"].get("loss", "cross-entropy"))
            conf[k] = scaled_confidence(self._logits(res.weights, x), y)
        return lira_scores(scaled_confidence(target, y), conf, mask), {"shadows": self.shadows, "shadows_mimic": mimic}

    # ---- outputs ------------------------------------------------------------------------------------------
    def summary_rows(self) -> list[dict[str, Any]]:
        out = []
        for attack in self.attacks:
            rs = [r for r in self.rows if r["attack"] == f"mia-{attack}" and r["client"] == "all"]
            if rs:
                out.append({"attack": f"mia-{attack}", "rounds_attacked": len(rs),
                            **{k: float(np.mean([r[k] for r in rs])) for k in AUDIT_COLUMNS},
                            "columns": ["auc", TPR_KEYS[1e-3], TPR_KEYS[1e-2]]})
        return out

    def on_finish(self) -> dict[str, Any]:
        if self.out is not None and self.rows:
            self.write_outputs()
        out: dict[str, Any] = {"membership": self.summary_rows()}
        notes = list(dict.fromkeys(self.notes))
        if self.unreadable:
            notes.append(f"{self.unreadable} intercepted replies were ciphertexts: not attacked")
        if notes:
            out["membership_notes"] = notes
        return out

    def state(self) -> dict[str, Any]:
        return {"rows": [dict(r) for r in self.rows], "curves": self.curves, "notes": list(self.notes),
                "unreadable": self.unreadable}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.rows = [dict(r) for r in state.get("rows", [])]
        self.curves = {k: dict(v) for k, v in state.get("curves", {}).items()}
        self.notes = list(state.get("notes", []))
        self.unreadable = int(state.get("unreadable", 0))
        if self.out is not None and self.rows:
            self.write_outputs()

    def write_outputs(self) -> None:
        from fedsim.reports import atomic_write_text, write_jsonl

        assert self.out is not None
        write_jsonl(self.out / "membership.jsonl", self.rows)
        atomic_write_text(self.out / "membership_roc.json", json.dumps(self.curves))
        if self.curves:
            plot_roc(self.curves, self.out / "membership_roc.png", "curious server: membership of the round's batches")

    def report_markdown(self) -> str:
        from fedsim.reports import md_table

        if not self.rows:
            return ""
        fmt = {"auc": ".3f", TPR_KEYS[1e-3]: ".3f", TPR_KEYS[1e-2]: ".3f", "seconds": ".2f", "accuracy": ".4f"}
        pooled = [r for r in self.rows if r["client"] == "all"]
        each = [r for r in self.rows if r["client"] != "all"]
        text = ["## Membership inference by the curious server\n",
                "Which candidate records each attacked client trained on in the round, from its intercepted update "
                "(members: the records of its local batches; non-members: as many test records). `mia-loss`: the "
                "returned model's loss; `mia-calibrated`: the loss drop from the sent model; `mia-lira`: online LiRA "
                "with shadow clients (the victim's recipe and defenses, from the sent model). AUC 0.5 is chance; TPR "
                "at a low FPR is what a confident attacker gets (with n non-members the smallest FPR is 1/n). The "
                "server sees each update before any central-DP noise.\n",
                "Pooled over the round's victims:\n",
                md_table(pooled, ["round", "attack", "victims", "members", "non_members", *AUDIT_COLUMNS, "accuracy"], fmt),
                "\nPer victim:\n",
                md_table(each, ["round", "client", "attack", "members", "non_members", *AUDIT_COLUMNS, "seconds"], fmt),
                "\n![membership ROC](membership_roc.png)\n"]
        for n in dict.fromkeys(self.notes):
            text.append(f"- {n}")
        return "\n".join(text)


def plot_roc(curves: Mapping[str, Mapping[str, Sequence[float]]], path: Path, title: str) -> None:
    """ROC curves on log-log axes (LiRA's plot: the low-FPR region is what matters), with chance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedsim.reports import save_figure

    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    lo = 1e-4
    for label, c in curves.items():
        fpr, tpr = np.maximum(np.asarray(c["fpr"]), lo), np.maximum(np.asarray(c["tpr"]), lo)
        ax.plot(fpr, tpr, label=label, linewidth=1.2)
    ax.plot([lo, 1], [lo, 1], "k--", linewidth=0.8, label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, 1)
    ax.set_ylim(lo, 1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    ax.set_title(title, fontsize=8)
    save_figure(fig, path)
    plt.close(fig)
