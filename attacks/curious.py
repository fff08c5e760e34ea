"""The honest-but-curious server: an observer that attacks intercepted client updates.

It plugs into the interception point of step 1 (``fedsim.observers.Observer``): on the configured
rounds and victims it builds an :class:`attacks.base.AttackInput` from the intercepted update (the
global weights sent, the returned weights, the configured recipe, the reported example count) and
runs each configured attack. Attacks never see ground truth.

Scoring (the only place that sees truth) re-creates the victim's local batches without any channel
from the client: the client's batch order is a pure function of (seed, round, client)
(``fedsim.training.batch_schedule``) and its partition a pure function of the config, so the
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
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from attacks.base import AttackInput
from fedsim import progress
from fedsim.components import ATTACKS, KNOWLEDGE, OBSERVERS
from fedsim.config import attack_data_problem
from fedsim.factories import client_data, dataset_for, model_for
from fedsim.metrics.records import MSE_THRESHOLD
from fedsim.observers import ClientUpdate, Observer
from fedsim.protocol import BATCH_SIZE, NOISE_VARIANCE
from fedsim.training import Recipe, derive_seed, iter_batches, resolve_device


def select_truth(recon: torch.Tensor, truth_x: torch.Tensor, truth_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From more candidate truths than reconstructions, keep the best-matching subset (min total MSE)."""
    if len(truth_x) <= len(recon):
        return truth_x, truth_y
    from scipy.optimize import linear_sum_assignment  # here: the import costs a second at start-up

    cost = ((recon.flatten(1)[:, None, :] - truth_x.flatten(1)[None, :, :]) ** 2).mean(-1).numpy()
    _, cols = linear_sum_assignment(cost)
    idx = torch.as_tensor(np.sort(cols))
    return truth_x[idx], truth_y[idx]


def _mean(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the rows that have it; None where none has (SSIM/PSNR of records)."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else None


@OBSERVERS.register
class CuriousServer(Observer):
    """Runs the configured attacks on intercepted updates and records leakage metrics."""

    name = "curious-server"

    def __init__(self, *, cfg: Mapping[str, Any], name: str | list[str] = "dlg", rounds: str | list[int] | None = None,
                 every: int = 0, victims: str | int | list[int] = "sampled", seed: int = 0, device: str = "auto",
                 psnr_threshold: float | None = None, ssim_threshold: float = 0.5, max_truth: int = 64,
                 max_images: int = 8, mse_threshold: float = MSE_THRESHOLD, compensate: bool = False, compensate_Q: float = 6.0,
                 compensate_noise_variance: float | None = None, params: Mapping[str, Any] | None = None,
                 knowledge: list[Any] | None = None, stack: int = 16, enabled: bool = True):
        self.cfg = cfg
        self.names = [name] if isinstance(name, str) else list(name)
        if not self.names or not all(isinstance(n, str) for n in self.names):
            raise ValueError(f"attack.name must be an attack name or a list of names, got {name!r}")
        for n in self.names:
            problem = ATTACKS.lookup(n, "attack.name").config_problem(cfg)
            if problem:
                raise ValueError(problem)
        params = {} if params is None else params
        if not isinstance(params, Mapping):
            raise ValueError("attack.params must be a table of per-attack tables ([attack.params.dlg])")
        for n in params:
            if n not in self.names:
                raise ValueError(f"attack.params.{n}: {n!r} is not in attack.name {self.names}")
        self.params = {n: dict(params.get(n, {})) for n in self.names}
        for n in self.names:  # validates the hyper-parameters (errors name the key)
            ATTACKS.build_named(n, self.params[n], f"attack.params.{n}")
        rounds = [1] if rounds is None else rounds
        if not (rounds == "all" or (isinstance(rounds, list) and all(isinstance(r, int) and r >= 1 for r in rounds))):
            raise ValueError(f"attack.rounds must be \"all\" or a list of round numbers >= 1, got {rounds!r}")
        if every < 0:
            raise ValueError(f"attack.every must be an integer >= 0, got {every!r}")
        n_rounds = cfg["federation"]["rounds"]
        if isinstance(rounds, list) and any(r > n_rounds for r in rounds):
            raise ValueError(f"attack.rounds {sorted(r for r in rounds if r > n_rounds)} are after the last round "
                             f"(federation.rounds = {n_rounds}): nothing would be attacked there")
        n_clients = cfg["federation"]["num_clients"]
        if isinstance(victims, int) and not isinstance(victims, bool) and victims > n_clients:
            raise ValueError(f"attack.victims = {victims} asks for more victims than the federation has clients "
                             f"(federation.num_clients = {n_clients})")
        ok = victims == "sampled" or (isinstance(victims, int) and not isinstance(victims, bool) and victims >= 1) \
            or (isinstance(victims, list) and all(isinstance(v, int) and 0 <= v < n_clients for v in victims))
        if not ok:
            raise ValueError(f"attack.victims must be \"sampled\", a positive integer k, or a list of client ids in "
                             f"0..{n_clients - 1}, got {victims!r}")
        if compensate_Q < 1:
            raise ValueError(f"attack.compensate_Q must be a number >= 1, got {compensate_Q!r}")
        if compensate_noise_variance is not None and compensate_noise_variance < 0:
            raise ValueError(f"attack.compensate_noise_variance must be a number >= 0, got {compensate_noise_variance!r}")
        for k, v, lo in (("seed", seed, 0), ("max_truth", max_truth, 1), ("max_images", max_images, 1),
                         ("stack", stack, 1)):
            if v < lo:
                raise ValueError(f"attack.{k} must be an integer >= {lo}, got {v!r}")
        self.rounds, self.every, self.victims, self.seed = rounds, int(every), victims, int(seed)
        self.device = resolve_device(device)
        self.psnr_threshold = float(psnr_threshold) if psnr_threshold is not None else None
        self.ssim_threshold = float(ssim_threshold)
        if isinstance(mse_threshold, bool) or not isinstance(mse_threshold, (int, float)) or not mse_threshold > 0:
            raise ValueError(f"attack.mse_threshold must be a number > 0, got {mse_threshold!r}")
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
        self._images: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "CuriousServer":
        return OBSERVERS.build_named(cls.name, cfg["attack"], "attack", cfg=cfg)

    # ---- which updates ------------------------------------------------------------------------
    def attacks_round(self, rnd: int) -> bool:
        if self.every:
            return (rnd - 1) % self.every == 0
        return self.rounds == "all" or rnd in self.rounds

    def _chosen_victims(self, rnd: int, sampled: list[int]) -> list[int]:
        if self.victims == "sampled":
            return sorted(sampled)
        if isinstance(self.victims, int):
            rng = np.random.default_rng(derive_seed(self.seed, rnd, 0xC0))
            return sorted(rng.choice(sorted(sampled), size=min(self.victims, len(sampled)), replace=False).tolist())
        return sorted(v for v in self.victims if v in sampled)

    # ---- Observer API ---------------------------------------------------------------------------
    def on_start(self, out_dir: Path | None) -> None:
        self.out = out_dir
        problem = attack_data_problem(self.cfg, dataset_for(self.cfg).in_shape)
        if problem:  # before any training (check_data reports it before the run starts)
            raise ValueError(problem)

    @property
    def records(self) -> bool:
        """Whether the data are records (tabular, inputs (F,)) rather than images (C, H, W)."""
        if self._is_records is None:
            self._is_records = len(dataset_for(self.cfg).in_shape) != 3
        return self._is_records

    def _attacks_aggregate(self, update: ClientUpdate) -> bool:
        """An aggregate is attacked when every contributor may be a victim, or a chosen victim is one."""
        if self.victims == "sampled" or isinstance(self.victims, int):
            return True
        return any(v in update.contributors for v in self.victims)

    def observe(self, update: ClientUpdate) -> None:
        if not self.attacks_round(update.round):
            return
        if update.kind == "ciphertext":  # nothing to attack: the channel gives the server ciphertexts only
            self.unreadable += 1
            return
        self._pending.setdefault(update.round, []).append(update)

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        pending = self._pending.pop(round, [])
        individual = [u for u in pending if u.kind != "aggregate"]
        if self.attacks_round(round) and round >= 1 and not any(u.kind == "aggregate" for u in pending):
            got = sorted({u.client_id for u in individual})
            if isinstance(self.victims, list):
                missed = [v for v in self.victims if v not in got]
                if missed:
                    self.warnings.append(f"round {round}: victims {missed} sent no readable update (not sampled, "
                                         "or failed); not attacked")
            elif isinstance(self.victims, int) and not isinstance(self.victims, bool) and len(got) < self.victims:
                self.warnings.append(f"round {round}: {self.victims} victims asked for, {len(got)} readable "
                                     "updates; attacked those")
        if individual:
            by_client = {u.client_id: u for u in individual}
            chosen = [by_client[cid] for cid in self._chosen_victims(round, list(by_client))]
            for name in self.names:  # every victim of the round at once (stacked where the attack can)
                self.rows.extend(self.attack_many(chosen, name))
        for u in pending:  # secure aggregation: the aggregate of k clients, attacked as one large batch
            if u.kind == "aggregate" and self._attacks_aggregate(u):
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
        out: dict[str, Any] = {"leakage": self.summary_rows()}
        if self.unreadable:
            out["leakage_note"] = self.unreadable_note()
        elif self.aggregate_note():
            out["leakage_note"] = self.aggregate_note()
        if self.warnings:
            out["leakage_warnings"] = list(self.warnings)
        return out

    def aggregate_note(self) -> str:
        """Says what was attacked when the channel gave the server aggregates only ("" otherwise)."""
        agg = [r for r in self.rows if r.get("aggregate_of")]
        if not agg:
            return ""
        ks = sorted({r["aggregate_of"] for r in agg})
        batches = sorted({r["batch_size"] for r in agg})
        return (f"the channel gave the server only the secure aggregate: it attacked the aggregate of "
                f"{' / '.join(map(str, ks))} clients as one batch of {' / '.join(map(str, batches))} images "
                f"({len(agg)} attacks; scored against the union of the contributors' samples)")

    # ---- checkpoints (resuming a run) -------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"rows": [dict(r) for r in self.rows], "unreadable": self.unreadable, "warnings": list(self.warnings),
                "images": {k: [tx, rx] for k, (tx, rx) in self._images.items()}}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.rows = [dict(r) for r in state.get("rows", [])]
        self.unreadable = int(state.get("unreadable", 0))
        self.warnings = list(state.get("warnings", []))
        self._images = {k: (torch.as_tensor(tx), torch.as_tensor(rx)) for k, (tx, rx) in state.get("images", {}).items()}
        if self.out is not None and self.rows:
            self.write_outputs()

    def unreadable_note(self) -> str:
        return (f"attacked nothing on {self.unreadable} intercepted replies: the channel gave the server "
                "ciphertexts only (no plaintext update, no plaintext aggregate)")

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
        if update.kind == "aggregate":
            parts = [self.client_truth(c, update.round, update.recipe) for c in update.contributors]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        return self.client_truth(update.client_id, update.round, update.recipe)

    def client_truth(self, client: int, rnd: int, recipe: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = client_data(self.cfg, client)
        want = min(self.max_truth, len(y))
        seen: dict[int, None] = {}  # first-seen order; stop once enough samples are known (any local_steps)
        for b in iter_batches(self.cfg["seed"], rnd, client, len(y), Recipe.from_mapping(recipe)):
            for i in b.tolist():
                seen.setdefault(i)
            if len(seen) >= want:
                break
        idx = torch.as_tensor(list(seen)[: self.max_truth])
        return x[idx], y[idx]

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
        from fedsim.metrics import score_reconstruction, score_records

        rx, ry = result.inputs.detach().cpu(), result.labels.detach().cpu()
        tx, ty = self.ground_truth(update)
        if self.records:  # standardised features: no [0, 1] box, MSE threshold instead of SSIM
            rx = rx.float()
            tx, ty = select_truth(rx, tx, ty)
            score = score_records(rx, ry, tx, ty, mse_threshold=self.mse_threshold)
        else:
            rx = rx.clamp(0, 1)
            tx, ty = select_truth(rx, tx, ty)
            score = score_reconstruction(rx, ry, tx, ty, psnr_threshold=self.psnr_threshold,
                                         ssim_threshold=self.ssim_threshold)
        matched = rx[torch.as_tensor(score["assignment"])]
        who = f"agg{len(update.contributors)}" if update.kind == "aggregate" else f"c{update.client_id}"
        self._images[f"{name}-r{update.round}-{who}"] = (tx, matched)
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
    def summary_rows(self) -> list[dict[str, Any]]:
        out = []
        for name in self.names:
            rs = [r for r in self.rows if r["attack"] == name]
            if not rs:
                continue
            conv = [r["converged_at"] + 1 for r in rs if r.get("converged_at") is not None]

            out.append({"attack": name, "attacks_run": len(rs),
                        **{k: _mean(rs, k) for k in ("psnr", "ssim", "mse", "label_acc", "success_content", "success_label",
                                                "iterations", "seconds")},
                        # the columns a comparison table shows (fedsim.comparison.run_row)
                        **({"columns": ["mse", "label_acc", "success_content"]} if self.records else {}),
                        # seed 001's "attack iterations": iterations until the gradient distance fell below the
                        # attack's threshold, over the attacks that got there (share: ``converged``)
                        "converged_iterations": float(np.mean(conv)) if conv else None,
                        # seed 001 Table 5: the spread of those iterations over the attacked updates
                        "converged_iterations_min": float(min(conv)) if conv else None,
                        "converged_iterations_max": float(max(conv)) if conv else None,
                        "converged_iterations_var": float(np.var(conv)) if conv else None,
                        "converged": len(conv) / len(rs)})
        return out

    def write_outputs(self, final: bool = False) -> None:
        from fedsim.export import write_csv
        from fedsim.reports import write_jsonl

        assert self.out is not None
        write_jsonl(self.out / "leakage.jsonl", self.rows)
        write_csv(self.out / "leakage.csv", self.rows)
        self._write_grids()
        if final:
            self._write_plots()

    def _write_grids(self) -> None:
        import matplotlib

        from fedsim.reports import save_figure

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if self.records:
            self._write_record_maps(plt, save_figure)
            return
        for name in self.names:
            keys = [k for k in self._images if k.startswith(name + "-")]
            if not keys:
                continue
            # one grid per attack: every attacked (round, client), truth row above reconstruction row
            pairs = []
            for k in keys:
                tx, rx = self._images[k]
                for i in range(min(len(rx), self.max_images)):
                    pairs.append((k, tx[i], rx[i]))
            pairs = pairs[: 4 * self.max_images]
            fig, axes = plt.subplots(2, len(pairs), figsize=(1.3 * len(pairs) + 0.6, 3.0), squeeze=False)
            for j, (k, t, r) in enumerate(pairs):
                for row, img in ((0, t), (1, r)):
                    ax = axes[row][j]
                    arr = img.permute(1, 2, 0).numpy()
                    ax.imshow(arr.squeeze(-1) if arr.shape[-1] == 1 else arr, cmap="gray", vmin=0, vmax=1)
                    ax.set_xticks([])
                    ax.set_yticks([])
                axes[0][j].set_title(k.split("-", 1)[1], fontsize=7)
            axes[0][0].set_ylabel("truth")
            axes[1][0].set_ylabel(name)
            save_figure(fig, self.out / f"reconstruction_{name}.png")
            plt.close(fig)

    def _write_record_maps(self, plt: Any, save_figure: Any) -> None:
        """Records: per attack a heat map of up to ``max_images`` true records (rows 'truth') above their
        matched reconstructions, one column per standardised feature (colour clipped at +-3)."""
        for name in self.names:
            keys = [k for k in self._images if k.startswith(name + "-")]
            if not keys:
                continue
            rows, labels = [], []
            for k in keys:
                tx, rx = self._images[k]
                for i in range(len(rx)):
                    if len(rows) >= 2 * self.max_images:
                        break
                    rows += [tx[i].flatten().numpy(), rx[i].flatten().numpy()]
                    labels += [f"{k.split('-', 1)[1]} truth", f"{name}"]
            fig, ax = plt.subplots(figsize=(min(2 + 0.22 * len(rows[0]), 12), 0.9 + 0.28 * len(rows)))
            im = ax.imshow(np.stack(rows), cmap="coolwarm", vmin=-3, vmax=3, aspect="auto", interpolation="nearest")
            ax.set_yticks(range(len(rows)), labels, fontsize=6)
            ax.set_xlabel("feature (standardised)", fontsize=7)
            ax.tick_params(axis="x", labelsize=6)
            fig.colorbar(im, ax=ax, fraction=0.03)
            ax.set_title(f"{name}: true records and their reconstructions", fontsize=8)
            save_figure(fig, self.out / f"reconstruction_{name}.png")
            plt.close(fig)

    def _metric(self) -> str:
        """The leakage measure the plots show: SSIM for images, MSE for records."""
        return "mse" if self.records else "ssim"

    def plot_series(self) -> dict[str, tuple[list[int], list[float], list[float]]]:
        """What leakage.png plots, per attack: attacked rounds, mean SSIM (records: MSE) per round, mean
        accuracy per round."""
        out = {}
        metric = self._metric()
        for name in self.names:
            rs = [r for r in self.rows if r["attack"] == name]
            rounds = sorted({r["round"] for r in rs})
            ssim = [float(np.mean([r[metric] for r in rs if r["round"] == k])) for k in rounds]
            acc = [float(np.mean([r["accuracy"] for r in rs if r["round"] == k and r.get("accuracy") is not None]
                                 or [np.nan])) for k in rounds]
            out[name] = (rounds, ssim, acc)
        return out

    def _write_plots(self) -> None:
        import matplotlib

        from fedsim.reports import save_figure

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if len({r["round"] for r in self.rows}) < 2:  # one attacked round: a line per attack would be a dot
            self._write_single_round_plot(plt, save_figure)
            return
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
        for name, (rounds, ssim, acc) in self.plot_series().items():
            a1.plot(rounds, ssim, marker="o", label=name)
            a2.plot(acc, ssim, marker="o", label=name)
        what = "MSE of reconstruction (standardised)" if self.records else "SSIM of reconstruction"
        a1.set_xlabel("round")
        a1.xaxis.get_major_locator().set_params(integer=True)  # rounds, not 2.5
        a1.set_ylabel(what)
        a2.set_xlabel("global test accuracy")
        a2.set_ylabel(what)
        for a in (a1, a2):
            if self.records:
                a.set_yscale("log")
            else:
                a.set_ylim(-0.1, 1.05)
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        save_figure(fig, self.out / "leakage.png")
        plt.close(fig)

    def _write_single_round_plot(self, plt: Any, save_figure: Any) -> None:
        """One attacked round: SSIM and PSNR (records: MSE and label accuracy) of every (attack, victim) as
        bars, with the mean per attack."""
        rnd = self.rows[0]["round"]
        keys = (("mse", "MSE of reconstruction (standardised)"), ("label_acc", "label accuracy")) if self.records \
            else (("ssim", "SSIM of reconstruction"), ("psnr", "PSNR (dB)"))
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
        width = min(0.8 / max(len(self.names), 1), 0.35)
        victims = sorted({r["client"] for r in self.rows})
        for j, name in enumerate(self.names):
            rs = {r["client"]: r for r in self.rows if r["attack"] == name}
            xs = [i + j * width for i in range(len(victims))]
            for ax, (key, _) in zip((a1, a2), keys):
                vals = [rs[v][key] if v in rs and rs[v][key] is not None else np.nan for v in victims]
                mean = np.nanmean(vals) if np.isfinite(vals).any() else np.nan
                ax.bar(xs, vals, width, label=f"{name} (mean {mean:.3g})")
        for ax, (_, key) in zip((a1, a2), keys):
            centre = (len(self.names) - 1) * width / 2  # the middle of a victim's group of bars
            ax.set_xticks([i + centre for i in range(len(victims))], [f"client {v}" for v in victims], fontsize=7)
            ax.set_ylabel(key)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=7)
        if self.records:
            a1.set_yscale("log")
            a2.set_ylim(-0.05, 1.05)
        else:
            a1.set_ylim(-0.1, 1.05)
        acc = self.rows[0].get("accuracy")
        fig.suptitle(f"leakage of round {rnd}" + (f" (global accuracy after it: {acc:.3f})" if acc is not None else ""),
                     fontsize=9)
        save_figure(fig, self.out / "leakage.png")
        plt.close(fig)

    def report_markdown(self) -> str:
        from fedsim.reports import md_table

        if not self.rows:
            head = [f"The curious server {self.unreadable_note()}.\n"] if self.unreadable else []
            head += [f"- {w}" for w in self.warnings]
            return "\n".join(["## Gradient leakage (curious server)\n", *head, ""]) if head else ""
        quality = ["mse"] if self.records else ["psnr", "ssim", "mse"]  # records: no SSIM/PSNR (image measures)
        text = ["## Gradient leakage (curious server)\n",
                f"Attacks {', '.join(self.names)} on rounds {self.rounds if not self.every else f'every {self.every}'}"
                f", victims {self.victims}. Reconstructions are matched to the victim's samples by optimal "
                + (f"assignment; the data are records (tabular): MSE over the standardised features, content success "
                   f"(ASR_c) = share of records with MSE <= {self.mse_threshold:g} (fedsim.metrics.records); SSIM and "
                   f"PSNR are image measures, not reported; " if self.records else
                   f"assignment; content success (ASR_c) = share of images with SSIM >= {self.ssim_threshold}"
                   f"{f' and PSNR >= {self.psnr_threshold} dB' if self.psnr_threshold is not None else ''}; ")
                + "label success (ASR_l) = share of labels recovered."
                + (f" Attacker knowledge beyond the update (threat-model ablation): "
                   f"{', '.join(k.label() for k in self.knowledge)}." if self.knowledge else "") + "\n",
                *([f"Secure aggregation: {self.aggregate_note()}.\n"] if self.aggregate_note() else []),
                *(["**Threat model: a malicious server** for " + ", ".join(sorted({r["attack"] for r in self.rows
                   if r.get("threat_model") == "malicious"})) + ": it changed the model it sent (an imprint "
                   "block, Robbing the Fed) - not the honest-but-curious server of the other attacks.\n"]
                  if any(r.get("threat_model") == "malicious" for r in self.rows) else []),
                "### Per attack (mean over attacked updates)\n",
                md_table(self.summary_rows(), ["attack", "attacks_run", *quality, "label_acc",
                                               "success_content", "success_label", "iterations", "seconds"],
                         {"psnr": ".2f", "ssim": ".3f", "mse": ".4g", "label_acc": ".2f", "seconds": ".2f",
                          "iterations": ".0f", "success_content": ".2f", "success_label": ".2f"}),
                "### Per round and victim\n",
                md_table(self.rows, ["round", "client", *(["aggregate_of"] if self.aggregate_note() else []), "attack",
                                     "batch_size", *quality, "label_acc", "iterations", "seconds",
                                     "accuracy"],
                         {"psnr": ".2f", "ssim": ".3f", "label_acc": ".2f", "seconds": ".2f", "accuracy": ".4f"}),
                "![leakage](leakage.png)\n"]
        text += [f"![{n}](reconstruction_{n}.png)\n" for n in self.names
                 if any(k.startswith(n + "-") for k in self._images)]
        if self.warnings:
            text += ["### Warnings\n", *(f"- {w}" for w in self.warnings), ""]
        return "\n".join(text)
