"""The honest-but-curious *client* of seed 002 (§3, §6.4) as an observer (``curious-client``).

The threat model is a client, not the server: the observer sits at the server's interception point
only because that is where the simulation shows what each client received, and it reads nothing but
the chosen client's own updates (``ClientUpdate.client_id == client``; every other reply is dropped
on arrival). From those it has what that client has:

* the model it is sent every round (``global_weights``: the true ``W_t`` without a defence, the
  perturbed ``W^_t`` under ``lossless-perturbation``; in the model's dtype, float32 here, while a real
  client also gets the float64 copy - irrelevant except for the adaptive span attack's last digits);
* its own reply (``weights``) and the recipe, hence its own gradient ``(W_t - weights) / lr``;
* its own data (its own records are members it knows); and, generously to the attacker, the public
  facts of the simulated federation: the partition sizes and who is sampled (its own aggregation
  weight), and some non-members (test records) for membership inference.

Attacks, once the needed views exist:

* **gradient inversion** of round ``t`` (at the end of round ``t + 1``, when ``W_{t+1}`` has been
  received): the other clients' combined gradient from the two consecutive models
  (:func:`attacks.curious_client.others_gradient`), then :func:`~attacks.curious_client.invert_rows`
  (every first-layer row with one active example gives it exactly), or the single-example guess when
  no two rows agree. With ``adaptive = true`` also the span attack on the first layer
  (:func:`~attacks.curious_client.span_inversion`), which breaks the perturbation for one victim example;
* **membership inference** (§6.4.1, :mod:`attacks.membership`) at round ``T`` (default: the last):
  an attack model calibrated on the client's own records (members) and test records (non-members)
  with the model of round ``T - 1`` and applied to other clients' records and unseen test records with
  the model of round ``T`` (the paper's setting: fresh secrets every round), and with
  ``adaptive = true`` also calibrated on round ``T`` itself. (The paper's attacker knows half of the
  training set; a client knows its own part of it without any assumption.)

Scoring - the only place that sees truth - re-creates the other clients' batches from the config (as
the curious server's scorer does). Outputs: ``client_leakage.jsonl`` (one row per attack), a
``report.md`` section, ``client_reconstruction.png`` and ``summary.json["client_leakage"]`` (shown by
``fedsim sweep``).

Config (an ``output.observers`` entry)::

    [[output.observers]]            # or observers = [{ name = "curious-client", client = 0 }]
    name = "curious-client"
    client = 0                      # the curious client's partition id
    rounds = [1]                    # rounds whose other clients' gradient is inverted, or "all"
    inversion = true
    membership = true
    mia_round = 0                   # 0 = the last round
    mia_features = ["last", "second"]   # last, second, third, last3 (seed 002 Table 4's rows)
    mia_records = 200               # at most this many known members (and non-members), and scored ones
    mia_epochs = 100
    adaptive = false                # also the attacks the paper does not consider
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated, Any, Mapping, Sequence

import numpy as np
import torch

from fedsim import lossless as ll
from fedsim.components import OBSERVERS
from fedsim.factories import client_data, dataset_for, model_for, partitions_for
from fedsim.observers import ClientUpdate, Observer
from fedsim.params import Range, Satisfies
from fedsim.protocol import LR
from fedsim.rounds import sample_partitions
from fedsim.seeding import derive_seed
from fedsim.training.batches import batch_schedule, iter_batches
from fedsim.training.recipe import Recipe

from . import curious_client_report
from .curious_client import invert_rows, invert_single, others_gradient, span_inversion
from .leakage_figures import image_grid
from .leakage_scoring import match_and_score
from .membership import (
    AUDIT_COLUMNS,
    FEATURES,
    calibrated_scores,
    layer_features,
    loss_scores,
    membership_inference,
    roc,
)

_NEED = {"last": 1, "second": 2, "third": 3, "last3": 3}
ROUNDS = Satisfies(lambda v: v == "all" or (isinstance(v, list) and all(
    isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in v)), "\"all\" or a list of round numbers >= 1")
MIA_FEATURES = Satisfies(lambda v: isinstance(v, list) and bool(v) and all(f in FEATURES for f in v),
                         f"a non-empty list of {list(FEATURES)}")
log = logging.getLogger("fedsim")


class _View:
    """What the curious client holds of one round."""

    __slots__ = ("round", "sent", "own", "lr", "n")

    def __init__(self, u: ClientUpdate):
        self.round = u.round
        self.sent = [np.array(a, dtype=np.float64) for a in u.global_weights]
        self.own = [np.array(a, dtype=np.float64) for a in u.weights]
        self.lr = float(u.recipe[LR])
        self.n = int(u.num_examples)


@OBSERVERS.register
class CuriousClient(Observer):
    """Seed 002's curious client: gradient inversion and membership inference from one client's view."""

    name = "curious-client"

    def __init__(self, *, cfg: Mapping[str, Any], client: Annotated[int, Range(0)] = 0,
                 rounds: Annotated[str | list[int] | None, ROUNDS] = None, inversion: bool = True,
                 membership: bool = True, mia_round: Annotated[int, Range(0)] = 0,
                 mia_features: Annotated[list[str] | None, MIA_FEATURES] = None,
                 mia_records: Annotated[int, Range(2)] = 200, mia_epochs: Annotated[int, Range(1)] = 100,
                 adaptive: bool = False, rows_rtol: Annotated[float, Range(0, open_low=True)] = 1e-3,
                 exact_tol: Annotated[float, Range(0, open_low=True)] = 1e-3, ssim_threshold: float = 0.5,
                 seed: Annotated[int, Range(0)] = 0):
        # single values are checked from the signature; here what depends on the rest of the config
        self.cfg = cfg
        fed = cfg["federation"]
        n_clients, n_rounds = int(fed["num_clients"]), int(fed["rounds"])
        if n_clients < 2:
            raise ValueError("curious-client needs federation.num_clients >= 2 (other clients to attack)")
        if client >= n_clients:
            raise ValueError(f"client must be a client id in 0..{n_clients - 1}, got {client!r}")
        rounds = [1] if rounds is None else rounds
        if inversion and cfg["train"].get("local_steps") != 1:
            raise ValueError("inversion needs train.local_steps = 1 (FedSGD: the model difference is one "
                             "gradient step); set inversion = false to run membership inference only")
        features = ["last", "second"] if mia_features is None else mia_features
        if mia_round > n_rounds:
            raise ValueError(f"mia_round must be 0 (the last round) or a round in 1..{n_rounds}, got {mia_round!r}")
        self.mia_round = mia_round or n_rounds
        if membership and self.mia_round < 2:
            raise ValueError("membership inference needs mia_round >= 2 (it is calibrated on the round before)")
        with torch.random.fork_rng(devices=[]):
            model = model_for(cfg)
        try:
            self.spec = ll.fc_spec(model)
        except ValueError as exc:
            raise ValueError(f"curious-client attacks fully connected ReLU models (model.name = 'mlp'): {exc}") from None
        depth = len(self.spec.shapes)
        for f in features:
            if _NEED[f] > depth:
                raise ValueError(f"mia_features {f!r} needs a model with at least {_NEED[f]} layers, this one has {depth}")
        self.names = list(model.state_dict().keys())
        pos = {n: i for i, n in enumerate(self.names)}
        self.index = [(pos[w], pos[b] if b is not None else None) for w, b in self.spec.names]
        self.client, self.rounds = client, rounds
        self.inversion, self.membership, self.adaptive = bool(inversion), bool(membership), bool(adaptive)
        self.features, self.mia_records, self.mia_epochs = features, mia_records, mia_epochs
        self.rows_rtol, self.exact_tol, self.ssim_threshold = float(rows_rtol), float(exact_tol), float(ssim_threshold)
        self.seed = seed
        self.views: dict[int, _View] = {}
        self._accuracy: dict[int, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.out: Path | None = None
        self._images: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._curves: dict[str, dict[str, list[float]]] = {}  # ROC curves of the membership attacks

    # ---- the client's view ----------------------------------------------------------------------------
    def observe(self, update: ClientUpdate) -> None:
        if update.client_id != self.client:
            return  # another client's reply: the curious client never sees it
        if not update.global_weights or not update.weights:
            return  # the channel hides the model from the server, so the simulation cannot show the view
        self.views[update.round] = _View(update)

    def on_start(self, out_dir: Path | None) -> None:
        self.out = out_dir

    def _layers(self, arrays: Sequence[np.ndarray]) -> list[ll.Layer]:
        return [(torch.from_numpy(arrays[i]), torch.from_numpy(arrays[j]) if j is not None else None)
                for i, j in self.index]

    def own_weight(self, rnd: int) -> float:
        """The attacker's aggregation weight ``n_own / n_round`` from the public partition sizes and the
        (seeded) sampling of the round (assumed known: generous to the attacker)."""
        fed = self.cfg["federation"]
        sizes = [len(p) for p in partitions_for(self.cfg)]
        sampled = sample_partitions(self.cfg["seed"], rnd, list(range(len(sizes))), int(fed["clients_per_round"]))
        return sizes[self.client] / float(sum(sizes[p] for p in sampled))

    def attacks_round(self, rnd: int) -> bool:
        return self.rounds == "all" or rnd in self.rounds

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        before = len(self.rows)
        t = round - 1
        if self.inversion and self.attacks_round(t) and t in self.views and round in self.views:
            self.rows.append(self.invert(self.views[t], self.views[round]))
            if self.adaptive:
                self.rows.append(self.span(self.views[t], self.views[round]))
        if self.membership and round == self.mia_round:
            if round - 1 in self.views and round in self.views:
                self.rows += self.infer_membership(self.views[round - 1], self.views[round])
            else:
                log.warning("curious-client: client %d was not sampled in rounds %d and %d; no membership "
                            "inference", self.client, round - 1, round)
        self._accuracy[round] = metrics.get("accuracy")
        for r in self.rows[before:]:  # the global model's accuracy at the end of the attacked round
            r["accuracy"] = self._accuracy.get(r["round"])
        for k in [k for k in self.views if k < round - 1 and not (self.membership and k == self.mia_round - 1)]:
            del self.views[k]
        if self.out is not None and len(self.rows) > before:
            self.write_outputs()

    # ---- scoring (truth) ---------------------------------------------------------------------------------
    def others_truth(self, rnd: int, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
        """The other sampled clients' batches of round ``rnd``, re-created from the config (scorer only)."""
        fed = self.cfg["federation"]
        sampled = sample_partitions(self.cfg["seed"], rnd, list(range(int(fed["num_clients"]))),
                                    int(fed["clients_per_round"]))
        xs, ys = [], []
        for p in sampled:
            if p == self.client:
                continue
            x, y = client_data(self.cfg, p)
            idx = torch.as_tensor(next(iter_batches(self.cfg["seed"], rnd, p, len(y), recipe)))  # the first batch only
            xs.append(x[idx])
            ys.append(y[idx])
        return torch.cat(xs), torch.cat(ys)

    def score(self, attack: str, rnd: int, recon: torch.Tensor, lr: float, extra: dict[str, Any]) -> dict[str, Any]:
        recipe = Recipe(lr, int(self.cfg["train"]["batch_size"]), local_steps=1)
        tx, ty = self.others_truth(rnd, recipe)
        flat_t = tx.reshape(len(tx), -1).double()
        flat_r = recon.reshape(len(recon), flat_t.shape[1]).double()
        err = (flat_r[:, None, :] - flat_t[None, :, :]).abs().amax(2)  # (candidates, truths)
        exact = float((err.amin(0) <= self.exact_tol).double().mean()) if len(recon) else 0.0
        row: dict[str, Any] = {"round": rnd, "client": self.client, "attack": attack, "victims": len(tx),
                               "candidates": len(recon), "exact": exact, "psnr": None, "ssim": None, "mse": None,
                               "success_content": 0.0 if not len(recon) else None, **extra}
        shape = tuple(dataset_for(self.cfg).in_shape)
        if len(shape) == 3 and len(recon):
            rx = recon.reshape(len(recon), *shape).float().clamp(0, 1)
            s, sx, matched = match_and_score(rx, torch.zeros(len(rx), dtype=torch.long), tx.float(), ty,
                                             ssim_threshold=self.ssim_threshold)
            row.update(psnr=s["psnr"], ssim=s["ssim"], mse=s["mse"], success_content=s["success_content"])
            if len(self._images) < 6:
                self._images.append((f"{attack} r{rnd}", sx, matched))
        elif len(recon):  # tabular records: the squared error to the closest record
            row["mse"] = float(((flat_r[:, None, :] - flat_t[None, :, :]) ** 2).mean(2).amin(1).mean())
        return row

    # ---- attacks --------------------------------------------------------------------------------------------
    def _others(self, prev: _View, new: _View) -> tuple[list[ll.Layer], list[ll.Layer], list[ll.Layer]]:
        own_grad = [(s - o) / prev.lr for s, o in zip(prev.sent, prev.own)]
        p, n = self._layers(prev.sent), self._layers(new.sent)
        return p, n, others_gradient(p, n, self._layers(own_grad), prev.lr, self.own_weight(prev.round))

    def invert(self, prev: _View, new: _View) -> dict[str, Any]:
        """Analytic inversion of the other clients' combined gradient of round ``prev.round``."""
        t0 = time.perf_counter()
        _, _, g = self._others(prev, new)
        recon = invert_rows(g, rtol=self.rows_rtol)
        rows_found = len(recon)
        if not rows_found:
            try:
                recon = invert_single(g)[None]
            except ValueError:
                recon = torch.zeros((0, g[0][0].shape[1]), dtype=torch.float64)
        return self.score("cc-invert", prev.round, recon, prev.lr,
                          {"rows_agreeing": rows_found, "seconds": time.perf_counter() - t0})

    def span(self, prev: _View, new: _View) -> dict[str, Any]:
        """The adaptive span attack on the first layer (one victim example; not in the paper)."""
        t0 = time.perf_counter()
        x, y = client_data(self.cfg, self.client)
        recipe = Recipe(prev.lr, int(self.cfg["train"]["batch_size"]), local_steps=1)
        own = x[torch.as_tensor(batch_schedule(self.cfg["seed"], prev.round, self.client, len(y), recipe)[0])]
        p, n = self._layers(prev.sent), self._layers(new.sent)
        try:
            rec, trace = span_inversion(p[0], n[0], own.double())
            recon, extra = rec[None], {"rows_used": trace["rows"], "residual": trace["residual"]}
        except ValueError as exc:
            recon, extra = torch.zeros((0, p[0][0].shape[1]), dtype=torch.float64), {"error": str(exc)}
        return self.score("cc-span", prev.round, recon, prev.lr, {**extra, "seconds": time.perf_counter() - t0})

    def infer_membership(self, prev: _View, cur: _View) -> list[dict[str, Any]]:
        """§6.4.1 at round ``cur.round``. The attack model is calibrated on records whose status the
        curious client knows - its own training records (members) and test records (non-members) - with
        the model of the calibration round, and scored on other clients' training records and as many
        unseen test records with the model of round ``cur.round``."""
        ds = dataset_for(self.cfg)
        parts = partitions_for(self.cfg)
        gen = torch.Generator(device="cpu").manual_seed(derive_seed(self.seed, cur.round, 0x3E3B))
        own = torch.as_tensor(parts[self.client])[torch.randperm(len(parts[self.client]), generator=gen)]
        others = torch.as_tensor(np.concatenate([p for k, p in enumerate(parts) if k != self.client]))
        others = others[torch.randperm(len(others), generator=gen)]
        non = torch.randperm(len(ds.y_test), generator=gen)
        n_cal = min(self.mia_records, len(own), len(non) // 2)
        n_eval = min(self.mia_records, len(others), len(non) - n_cal)
        cal_m, eval_m = own[:n_cal], others[:n_eval]
        cal_n, eval_n = non[:n_cal], non[n_cal:n_cal + n_eval]
        views = {"previous round": self._layers(prev.sent), "same round": self._layers(cur.sent)}
        target = views["same round"]
        rows = []
        slope, C = self.spec.negative_slope, ds.num_classes
        audit_cols = {k: None for k in AUDIT_COLUMNS}
        for f in self.features:
            def feats(layers, idx, test=False, f=f):
                x, y = (ds.x_test, ds.y_test) if test else (ds.x_train, ds.y_train)
                return layer_features(layers, x[idx].double(), y[idx], C, f, negative_slope=slope)

            tm, tn = feats(target, eval_m), feats(target, eval_n, True)
            for calib in ("previous round", "same round") if self.adaptive else ("previous round",):
                t0 = time.perf_counter()
                v = views[calib]
                res = membership_inference((feats(v, cal_m), feats(v, cal_n, True)), (tm, tn), features=f,
                                           seed=self.seed, epochs=self.mia_epochs)
                audit = res.audit or {}
                self._curves[f"cc-mia {f} ({calib})"] = {"fpr": audit.get("fpr", []), "tpr": audit.get("tpr", [])}
                rows.append({"round": cur.round, "client": self.client, "attack": "cc-mia", "features": f,
                             "calibration": calib, "known": 2 * n_cal, "scored": 2 * n_eval, "asr": res.accuracy,
                             "calibration_asr": res.calibration_accuracy,
                             **{k: audit.get(k) for k in audit_cols}, "seconds": time.perf_counter() - t0})
        # score attacks on the model's outputs (no attack model): the loss under the attacked round's model
        # (Yeom et al.) and its drop from the previous round's (difficulty calibration, Watson et al.)
        def logits(layers, idx, test=False):
            x = (ds.x_test if test else ds.x_train)[idx].double()
            return ll.forward(layers, x, negative_slope=slope)[0]

        ym, yn = ds.y_train[eval_m], ds.y_test[eval_n]
        tgt = (logits(target, eval_m), logits(target, eval_n, True))
        ref = (logits(views["previous round"], eval_m), logits(views["previous round"], eval_n, True))
        for attack, (sm, sn) in (("cc-loss", (loss_scores(tgt[0], ym), loss_scores(tgt[1], yn))),
                                 ("cc-calibrated", (calibrated_scores(tgt[0], ref[0], ym),
                                                    calibrated_scores(tgt[1], ref[1], yn)))):
            audit = roc(sm, sn)
            self._curves[attack] = {"fpr": audit["fpr"], "tpr": audit["tpr"]}
            rows.append({"round": cur.round, "client": self.client, "attack": attack, "features": "output",
                         "calibration": "previous round" if attack == "cc-calibrated" else "-", "known": 0,
                         "scored": 2 * n_eval, "asr": None, "calibration_asr": None,
                         **{k: audit[k] for k in audit_cols}, "seconds": 0.0})
        return rows

    # ---- outputs ------------------------------------------------------------------------------------------
    def summary_rows(self) -> list[dict[str, Any]]:
        """One entry per attack for ``summary.json["client_leakage"]``; ``columns`` names what a sweep shows."""
        return curious_client_report.summary_rows(self)

    def on_finish(self) -> dict[str, Any]:
        if self.out is not None and self.rows:
            self.write_outputs()
        return {"client_leakage": self.summary_rows()}

    def write_outputs(self) -> None:
        from fedsim.reports import write_jsonl

        assert self.out is not None
        write_jsonl(self.out / "client_leakage.jsonl", self.rows)
        if self._images:
            pairs = [(k, t, r) for k, ts, rs in self._images for t, r in zip(ts, rs)][:12]
            image_grid(pairs, "client's guess", self.out / "client_reconstruction.png")
        if self._curves:
            from .membership_server import plot_roc

            plot_roc(self._curves, self.out / "client_membership_roc.png",
                     f"curious client {self.client}: membership in the other clients' data")

    def report_markdown(self) -> str:
        return curious_client_report.report_markdown(self)
