"""The honest-but-curious server: an observer that attacks intercepted client updates.

It plugs into the interception point of step 1 (``fedsim.observers.Observer``): on the configured
rounds and victims it builds an :class:`attacks.base.AttackInput` from the intercepted update (the
global weights sent, the returned weights, the configured recipe, the reported example count) and
runs each configured attack. Attacks never see ground truth.

Scoring (the only place that sees truth) re-creates the victim's local batches without any channel
from the client: the client's batch order is a pure function of (seed, round, client)
(``fedsim.training.batches.batch_schedule``) and its partition a pure function of the config, so the
scorer recomputes exactly which samples the victim trained on. Reconstructions are matched to those
samples by optimal assignment before PSNR/SSIM/MSE/label accuracy are computed. Records (tabular data,
inputs ``(F,)``, e.g. ``breast-cancer``; seed 001 Table 3) are scored by :func:`fedsim.metrics.score_records`:
MSE on the standardised features, content success ``MSE <= mse_threshold``, label accuracy (no SSIM or
PSNR: image measures); the attacker assumes no [0, 1] box for them (``AttackInput.bounds``), the
reconstruction figure is a heat map of records, and only the attacks that reconstruct records
(``supports_records``: dlg, idlg, cpl, ig) may be configured (checked when the run starts).

Under secure aggregation (SecAgg+) the server sees only the round's aggregate of k clients (an update
of kind ``"aggregate"`` with its ``contributors``): it attacks it as one large batch (seed 004 §3.3) of
k times the configured batch size, scored against the union of the contributors' samples; the report
says it attacked an aggregate of k clients. Ciphertexts (Paillier) are not attacked at all.

The observer is this module; its parts are in their own: which rounds and victims
(:mod:`attacks.curious_plan`), truth and scores (:mod:`attacks.leakage_scoring`, shared with the curious
client), figures (:mod:`attacks.leakage_figures`) and the report (:mod:`attacks.leakage_report`).

Config (``[attack]``)::

    [attack]
    name = ["dlg", "ig"]         # one attack or a list
    rounds = [1]                 # list of rounds, or "all"
    every = 0                    # alternatively: every k-th round (1, 1+k, ...)
    victims = "sampled"          # "sampled" (every client of the round), a list of client ids, or k (k random)
    seed = 0                     # the attacker's randomness (victim choice, initialisation)
    device = "auto"
    ssim_threshold = 0.5         # content success (ASR_c) needs SSIM >= this ...
    psnr_threshold = 20.0        # ... and PSNR >= this, when set (default: not used)
    mse_threshold = 0.005        # records: content success needs MSE <= this (fedsim.metrics.records)
    max_truth = 64               # most samples considered as truth for multi-step updates
    compensate = false           # seed 000 §V-C abuse: apply global update compensation to the single
    compensate_Q = 6.0           #   victim's update (noise variance from its reply, or compensate_noise_variance)
    [[attack.knowledge]]         # threat-model ablations: grant the attacker a defense's secret
    name = "fedkl"               #   (attacks/knowledge.py; e.g. attacks/fedkl.py: key = true, lock = true)
    [attack.params.dlg]          # per-attack hyper-parameters
    iterations = 300
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Mapping, Sequence

import numpy as np
import torch

from attacks.base import AttackInput
from fedsim import progress
from fedsim.components import ATTACKS, KNOWLEDGE, OBSERVERS, ConfigError
from fedsim.device import resolve_device
from fedsim.factories import dataset_for, model_for
from fedsim.metrics.records import MSE_THRESHOLD
from fedsim.observers import ClientUpdate, Observer
from fedsim.params import Range
from fedsim.protocol import BATCH_SIZE, NOISE_VARIANCE

from . import leakage_figures, leakage_report
from .curious_plan import AttackPlan
from .leakage_scoring import match_and_score, update_truth


@OBSERVERS.register
class CuriousServer(Observer):
    """Runs the configured attacks on intercepted updates and records leakage metrics."""

    name = "curious-server"

    def __init__(self, *, cfg: Mapping[str, Any], name: str | list[str] = "dlg", rounds: str | list[int] | None = None,
                 every: Annotated[int, Range(0)] = 0, victims: str | int | list[int] = "sampled",
                 seed: Annotated[int, Range(0)] = 0, device: str = "auto", psnr_threshold: float | None = None,
                 ssim_threshold: float = 0.5, max_truth: Annotated[int, Range(1)] = 64,
                 max_images: Annotated[int, Range(1)] = 8,
                 mse_threshold: Annotated[float, Range(0, open_low=True)] = MSE_THRESHOLD, compensate: bool = False,
                 compensate_Q: Annotated[float, Range(1)] = 6.0,
                 compensate_noise_variance: Annotated[float | None, Range(0)] = None,
                 params: Mapping[str, Any] | None = None, knowledge: list[Any] | None = None,
                 stack: Annotated[int, Range(1)] = 16, enabled: bool = True):
        self.cfg = cfg
        self.names = [name] if isinstance(name, str) else list(name)
        if not self.names or not all(isinstance(n, str) for n in self.names):
            raise ValueError(f"attack.name must be an attack name or a list of names, got {name!r}")
        for n in self.names:
            ATTACKS.lookup(n, "attack.name")
        params = {} if params is None else params
        if not isinstance(params, Mapping):
            raise ValueError("attack.params must be a table of per-attack tables ([attack.params.dlg])")
        for n in params:
            if n not in self.names:
                raise ValueError(f"attack.params.{n}: {n!r} is not in attack.name {self.names}")
        self.params = {n: dict(params.get(n, {})) for n in self.names}
        # validates the hyper-parameters (errors name the key); validate_config asks each about the config
        self.attacks = {n: ATTACKS.build_named(n, self.params[n], f"attack.params.{n}") for n in self.names}
        self.plan = AttackPlan(cfg["federation"], rounds, every, victims, seed)
        self.seed = int(seed)
        self.device = resolve_device(device)
        self.psnr_threshold = float(psnr_threshold) if psnr_threshold is not None else None
        self.ssim_threshold = float(ssim_threshold)
        self.mse_threshold = float(mse_threshold)
        self._is_records: bool | None = None  # set from the dataset when first needed
        self.max_truth, self.max_images = int(max_truth), int(max_images)
        self.stack = int(stack)  # victims of a round attacked as one stacked optimisation (1: one by one)
        self.compensate, self.compensate_Q = bool(compensate), float(compensate_Q)
        self.compensate_var = compensate_noise_variance
        self.knowledge = KNOWLEDGE.build_list(knowledge or [], "attack.knowledge", cfg=cfg)
        self.rows: list[dict[str, Any]] = []
        self.out: Path | None = None
        self._pending: dict[int, list[ClientUpdate]] = {}
        self.unreadable = 0  # replies the server could not read (encrypted channels)
        self.warnings: list[str] = []  # victims asked for but not attacked (not sampled, or failed)
        self.images: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # "<attack>-r<round>-<who>": (truth, recon)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "CuriousServer":
        return OBSERVERS.build_named(cls.name, cfg["attack"], "attack", cfg=cfg)

    # ---- Observer API ---------------------------------------------------------------------------
    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        """Each attack's own checks against the config (``Attack.validate_config``), naming the attack."""
        for n, attack in self.attacks.items():
            try:
                attack.validate_config(cfg)
            except ConfigError:
                raise
            except ValueError as exc:
                raise ConfigError(f"attack.name {n!r}: {exc}") from exc

    def on_start(self, out_dir: Path | None) -> None:
        self.out = out_dir
        self.validate_config(self.cfg)  # again, before any training: the dataset is there now

    @property
    def records(self) -> bool:
        """Whether the data are records (tabular, inputs (F,)) rather than images (C, H, W)."""
        if self._is_records is None:
            self._is_records = len(dataset_for(self.cfg).in_shape) != 3
        return self._is_records

    def observe(self, update: ClientUpdate) -> None:
        if not self.plan.attacks_round(update.round):
            return
        if update.kind == "ciphertext":  # nothing to attack: the channel gives the server ciphertexts only
            self.unreadable += 1
            return
        self._pending.setdefault(update.round, []).append(update)

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        pending = self._pending.pop(round, [])
        individual = [u for u in pending if u.kind != "aggregate"]
        if self.plan.attacks_round(round) and round >= 1 and not any(u.kind == "aggregate" for u in pending):
            missing = self.plan.missing(round, sorted({u.client_id for u in individual}))
            if missing:
                self.warnings.append(missing)
        if individual:
            by_client = {u.client_id: u for u in individual}
            chosen = [by_client[cid] for cid in self.plan.chosen_victims(round, list(by_client))]
            for name in self.names:  # every victim of the round at once (stacked where the attack can)
                self.rows.extend(self.attack_many(chosen, name))
        for u in pending:  # secure aggregation: the aggregate of k clients, attacked as one large batch
            if u.kind == "aggregate" and self.plan.attacks_aggregate(u):
                for name in self.names:
                    self.rows.append(self.attack_one(u, name))
        for r in self.rows:  # the global model's accuracy at the end of the attacked round
            if r["round"] == round and "accuracy" not in r:
                r["accuracy"] = metrics.get("accuracy")
        if self.out is not None and pending:
            self.write_outputs()

    def on_finish(self) -> dict[str, Any]:
        if self.out is not None and self.rows:
            self.write_outputs(final=True)
        out: dict[str, Any] = {"leakage": leakage_report.summary_rows(self.rows, self.names, self.records)}
        if self.unreadable:
            out["leakage_note"] = leakage_report.unreadable_note(self.unreadable)
        elif leakage_report.aggregate_note(self.rows):
            out["leakage_note"] = leakage_report.aggregate_note(self.rows)
        if self.warnings:
            out["leakage_warnings"] = list(self.warnings)
        return out

    # ---- checkpoints (resuming a run) -------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"rows": [dict(r) for r in self.rows], "unreadable": self.unreadable, "warnings": list(self.warnings),
                "images": {k: [tx, rx] for k, (tx, rx) in self.images.items()}}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.rows = [dict(r) for r in state.get("rows", [])]
        self.unreadable = int(state.get("unreadable", 0))
        self.warnings = list(state.get("warnings", []))
        self.images = {k: (torch.as_tensor(tx), torch.as_tensor(rx)) for k, (tx, rx) in state.get("images", {}).items()}
        if self.out is not None and self.rows:
            self.write_outputs()

    # ---- attacking and scoring -------------------------------------------------------------------
    @staticmethod
    def aggregate_recipe(update: ClientUpdate) -> dict[str, Any]:
        """The recipe an aggregate of k clients looks like to the attacker (seed 004 §3.3): FedAvg's
        example-weighted mean of k one-batch updates is, for equal example counts, the update of one batch
        of the k clients' images, so the batch is k times the configured one (at most the examples)."""
        recipe = dict(update.recipe)
        k = max(1, len(update.contributors))
        recipe[BATCH_SIZE] = int(min(k * int(recipe[BATCH_SIZE]), max(update.num_examples, 1)))
        return recipe

    def attack_input(self, update: ClientUpdate) -> AttackInput:
        ds = dataset_for(self.cfg)
        names = update.param_names
        glob = {n: torch.as_tensor(np.array(a)) for n, a in zip(names, update.global_weights)}
        delta = update.delta()
        if self.compensate:
            delta = self.compensated(update, delta)
        upd = {n: torch.as_tensor(d) for n, d in zip(names, delta)}
        recipe = self.aggregate_recipe(update) if update.kind == "aggregate" else dict(update.recipe)
        inp = AttackInput(model_fn=lambda: model_for(self.cfg), global_state=glob, update=upd,
                          recipe=recipe, input_shape=ds.in_shape, num_classes=ds.num_classes,
                          num_examples=update.num_examples, device=self.device,
                          seed=self.seed * 1000003 + update.round * 1009 + update.client_id,
                          bounds=None if len(ds.in_shape) != 3 else (0.0, 1.0))
        for k in self.knowledge:  # threat-model ablations: what the attacker is granted beyond the update
            inp = k.grant(inp, update)
        return inp

    def compensated(self, update: ClientUpdate, delta: list[np.ndarray]) -> list[np.ndarray]:
        """Random-matrix compensation of one client's update (the abuse seed 000 §V-C discusses)."""
        from fedsim.compensation import GlobalUpdateCompensation

        var = self.compensate_var if self.compensate_var is not None else update.metrics.get(NOISE_VARIANCE)
        if not var:
            return delta
        return GlobalUpdateCompensation(Q=self.compensate_Q).apply(delta, float(var), names=list(update.param_names))

    def ground_truth(self, update: ClientUpdate) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples the victim trained on this round, re-created from (seed, round, client); for an
        aggregate, the union of every contributor's samples."""
        return update_truth(self.cfg, update, self.max_truth)

    def attack_one(self, update: ClientUpdate, name: str) -> dict[str, Any]:
        return self.attack_many([update], name)[0]

    def attack_many(self, updates: Sequence[ClientUpdate], name: str) -> list[dict[str, Any]]:
        """Attack several intercepted updates with one attack; victims that share the global model and
        recipe are solved as one stacked optimisation of at most ``attack.stack`` (``Attack.run_many``;
        the same reconstructions as one by one up to float rounding), the rest one by one."""
        if not updates:
            return []
        inputs = [self.attack_input(u) for u in updates]
        attack = ATTACKS.build_named(name, self.params[name], f"attack.params.{name}")
        who = ", ".join(str(u.client_id) for u in updates)
        label = f"attack {name}: client{'s' if len(updates) > 1 else ''} {who}, round {updates[0].round}"
        progress.say(f"{label}: started ({len(updates[0].param_names)} tensors, "
                     f"{sum(u.num_examples for u in updates)} examples)")
        t0 = time.perf_counter()
        with progress.task(label, total=getattr(attack, "iterations", None), unit="it"):
            results = attack.run_many(inputs, max_group=self.stack)
        wall = time.perf_counter() - t0
        return [self._score(u, name, r, r.trace.get("seconds", wall / len(updates)) if len(updates) > 1 else wall)
                for u, r in zip(updates, results)]

    def _score(self, update: ClientUpdate, name: str, result: Any, seconds: float) -> dict[str, Any]:
        rx, ry = result.inputs.detach().cpu(), result.labels.detach().cpu()
        tx, ty = self.ground_truth(update)
        # records (standardised features): no [0, 1] box, MSE threshold instead of SSIM
        score, tx, matched = match_and_score(rx, ry, tx, ty, records=self.records, mse_threshold=self.mse_threshold,
                                             psnr_threshold=self.psnr_threshold, ssim_threshold=self.ssim_threshold)
        who = f"agg{len(update.contributors)}" if update.kind == "aggregate" else f"c{update.client_id}"
        self.images[f"{name}-r{update.round}-{who}"] = (tx, matched)
        row = {"round": update.round, "client": update.client_id, "attack": name, "batch_size": len(rx),
               "psnr": score["psnr"], "ssim": score["ssim"], "mse": score["mse"], "label_acc": score["label_acc"],
               "success_content": score["success_content"], "success_label": score["success_label"],
               "iterations": result.trace.get("iterations"), "converged_at": result.trace.get("converged_at"),
               "seconds": seconds, "final_loss": (result.trace.get("loss") or [None])[-1],
               "threat_model": result.trace.get("threat_model", "curious"),
               "stacked": int(result.trace.get("group_size", 1))}
        if update.kind == "aggregate":  # secure aggregation: one batch made of k clients' images
            row["aggregate_of"] = len(update.contributors)
            row["contributors"] = list(update.contributors)
        if self.knowledge:
            row["knowledge"] = ", ".join(k.label() for k in self.knowledge)
        quality = (f"MSE {row['mse']:.3g}" if self.records else f"PSNR {row['psnr']:.2f} dB  SSIM {row['ssim']:.3f}")
        progress.say(f"attack {name}: client {update.client_id}, round {update.round}: {quality}  "
                     f"label acc {row['label_acc']:.2f}  {row['iterations']} it  {seconds:.1f}s")
        return row

    # ---- outputs ------------------------------------------------------------------------------------
    def write_outputs(self, final: bool = False) -> None:
        from fedsim.export import write_csv
        from fedsim.reports import write_jsonl

        assert self.out is not None
        write_jsonl(self.out / "leakage.jsonl", self.rows)
        write_csv(self.out / "leakage.csv", self.rows)
        leakage_figures.reconstruction_figures(self.names, self.images, self.records, self.max_images, self.out)
        if final:
            leakage_figures.leakage_plot(self.rows, self.names, self.records, self.out / "leakage.png")

    def report_markdown(self) -> str:
        return leakage_report.report_markdown(self)
