"""The honest-but-curious server: an observer that attacks intercepted client updates.

It plugs into the interception point of step 1 (``fedsim.observers.Observer``): on the configured
rounds and victims it builds an :class:`attacks.base.AttackInput` from the intercepted update (the
global weights sent, the returned weights, the configured recipe, the reported example count) and
runs each configured attack. Attacks never see ground truth.

Scoring (the only place that sees truth) re-creates the victim's local batches without any channel
from the client: the client's batch order is a pure function of (seed, round, client)
(``fedsim.training.batch_schedule``) and its partition a pure function of the config, so the
scorer recomputes exactly which samples the victim trained on. Reconstructions are matched to those
samples by optimal assignment before PSNR/SSIM/MSE/label accuracy are computed.

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
    max_truth = 64               # most samples considered as truth for multi-step updates
    compensate = false           # seed 000 §V-C abuse: apply global update compensation to the single
    compensate_Q = 6.0           #   victim's update (noise variance from its reply, or compensate_noise_variance)
    [attack.params.dlg]          # per-attack hyper-parameters
    iterations = 300
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from attacks import ATTACKS, AttackInput, build_attack
from fedsim.observers import ClientUpdate, Observer

ATTACK_KEYS = {"enabled", "name", "rounds", "every", "victims", "seed", "device", "psnr_threshold",
               "ssim_threshold", "max_truth", "params", "max_images", "compensate", "compensate_Q",
               "compensate_noise_variance"}


def _names(section: Mapping[str, Any]) -> list[str]:
    name = section.get("name", "dlg")
    return [name] if isinstance(name, str) else list(name)


def validate_attack_section(cfg: Mapping[str, Any]) -> None:
    """Raise ValueError naming the bad ``attack.*`` key."""
    sec = cfg["attack"]
    if not isinstance(sec, Mapping):
        raise ValueError("attack must be a table ([attack])")
    for k in sec:
        if k not in ATTACK_KEYS:
            raise ValueError(f"unknown config key 'attack.{k}'; allowed: {sorted(ATTACK_KEYS)}")
    names = _names(sec)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"attack.name must be an attack name or a list of names, got {sec.get('name')!r}")
    for n in names:
        if n not in ATTACKS:
            raise ValueError(f"attack.name {n!r} is not an attack; allowed: {sorted(ATTACKS)}")
    params = sec.get("params", {})
    if not isinstance(params, Mapping):
        raise ValueError("attack.params must be a table of per-attack tables ([attack.params.dlg])")
    for n, p in params.items():
        if n not in names:
            raise ValueError(f"attack.params.{n}: {n!r} is not in attack.name {names}")
        build_attack(n, **dict(p))  # validates the hyper-parameters (errors name the key)
    rounds = sec.get("rounds", [1])
    if not (rounds == "all" or (isinstance(rounds, list) and all(isinstance(r, int) and r >= 1 for r in rounds))):
        raise ValueError(f"attack.rounds must be \"all\" or a list of round numbers >= 1, got {rounds!r}")
    every = sec.get("every", 0)
    if not isinstance(every, int) or every < 0:
        raise ValueError(f"attack.every must be an integer >= 0, got {every!r}")
    victims = sec.get("victims", "sampled")
    ok = victims == "sampled" or (isinstance(victims, int) and not isinstance(victims, bool) and victims >= 1) or (
        isinstance(victims, list) and all(isinstance(v, int) and 0 <= v < cfg["federation"]["num_clients"]
                                          for v in victims))
    if not ok:
        raise ValueError(f"attack.victims must be \"sampled\", a positive integer k, or a list of client ids in "
                         f"0..{cfg['federation']['num_clients'] - 1}, got {victims!r}")
    for k in ("psnr_threshold", "ssim_threshold"):
        if k in sec and not isinstance(sec[k], (int, float)):
            raise ValueError(f"attack.{k} must be a number, got {sec[k]!r}")
    if not isinstance(sec.get("compensate", False), bool):
        raise ValueError(f"attack.compensate must be true or false, got {sec['compensate']!r}")
    for k in ("compensate_Q", "compensate_noise_variance"):
        if k in sec and (not isinstance(sec[k], (int, float)) or sec[k] < (1 if k == "compensate_Q" else 0)):
            raise ValueError(f"attack.{k} must be a number >= {1 if k == 'compensate_Q' else 0}, got {sec[k]!r}")
    for k in ("seed", "max_truth", "max_images"):
        if k in sec and (not isinstance(sec[k], int) or sec[k] < (0 if k == "seed" else 1)):
            raise ValueError(f"attack.{k} must be a {'non-negative' if k == 'seed' else 'positive'} integer, "
                             f"got {sec[k]!r}")


def select_truth(recon: torch.Tensor, truth_x: torch.Tensor, truth_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From more candidate truths than reconstructions, keep the best-matching subset (min total MSE)."""
    if len(truth_x) <= len(recon):
        return truth_x, truth_y
    cost = ((recon.flatten(1)[:, None, :] - truth_x.flatten(1)[None, :, :]) ** 2).mean(-1).numpy()
    _, cols = linear_sum_assignment(cost)
    idx = torch.as_tensor(np.sort(cols))
    return truth_x[idx], truth_y[idx]


class CuriousServer(Observer):
    """Runs the configured attacks on intercepted updates and records leakage metrics."""

    def __init__(self, cfg: Mapping[str, Any]):
        from fedsim.training import resolve_device

        self.cfg = cfg
        sec = dict(cfg["attack"])
        self.names = _names(sec)
        self.params = {n: dict(sec.get("params", {}).get(n, {})) for n in self.names}
        self.rounds = sec.get("rounds", [1])
        self.every = int(sec.get("every", 0))
        self.victims = sec.get("victims", "sampled")
        self.seed = int(sec.get("seed", 0))
        self.device = resolve_device(sec.get("device", "auto"))
        self.psnr_threshold = float(sec["psnr_threshold"]) if "psnr_threshold" in sec else None
        self.ssim_threshold = float(sec.get("ssim_threshold", 0.5))
        self.max_truth = int(sec.get("max_truth", 64))
        self.max_images = int(sec.get("max_images", 8))
        self.compensate = bool(sec.get("compensate", False))
        self.compensate_Q = float(sec.get("compensate_Q", 6.0))
        self.compensate_var = sec.get("compensate_noise_variance")
        self.rows: list[dict[str, Any]] = []
        self.out: Path | None = None
        self._pending: dict[int, list[ClientUpdate]] = {}
        self._images: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "CuriousServer":
        return cls(cfg)

    # ---- which updates ------------------------------------------------------------------------
    def attacks_round(self, rnd: int) -> bool:
        if self.every:
            return (rnd - 1) % self.every == 0
        return self.rounds == "all" or rnd in self.rounds

    def _chosen_victims(self, rnd: int, sampled: list[int]) -> list[int]:
        if self.victims == "sampled":
            return sorted(sampled)
        if isinstance(self.victims, int):
            from fedsim.training import derive_seed

            rng = np.random.default_rng(derive_seed(self.seed, rnd, 0xC0))
            return sorted(rng.choice(sorted(sampled), size=min(self.victims, len(sampled)), replace=False).tolist())
        return sorted(v for v in self.victims if v in sampled)

    # ---- Observer API ---------------------------------------------------------------------------
    def on_start(self, out_dir: Path | None) -> None:
        self.out = out_dir

    def observe(self, update: ClientUpdate) -> None:
        if self.attacks_round(update.round):
            self._pending.setdefault(update.round, []).append(update)

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        pending = self._pending.pop(round, [])
        if pending:
            by_client = {u.client_id: u for u in pending}
            for cid in self._chosen_victims(round, list(by_client)):
                for name in self.names:
                    self.rows.append(self.attack_one(by_client[cid], name))
        for r in self.rows:  # the global model's accuracy at the end of the attacked round
            if r["round"] == round and "accuracy" not in r:
                r["accuracy"] = metrics.get("accuracy")
        if self.out is not None and pending:
            self.write_outputs()

    def on_finish(self) -> dict[str, Any]:
        if self.out is not None and self.rows:
            self.write_outputs(final=True)
        return {"leakage": self.summary_rows()}

    # ---- attacking and scoring -------------------------------------------------------------------
    def attack_input(self, update: ClientUpdate) -> AttackInput:
        from fedsim.client_app import dataset_for, model_for

        ds = dataset_for(self.cfg)
        names = update.param_names
        glob = {n: torch.as_tensor(np.array(a)) for n, a in zip(names, update.global_weights)}
        delta = update.delta()
        if self.compensate:
            delta = self.compensated(update, delta)
        upd = {n: torch.as_tensor(d) for n, d in zip(names, delta)}
        return AttackInput(model_fn=lambda: model_for(self.cfg), global_state=glob, update=upd,
                           recipe=dict(update.recipe), input_shape=ds.in_shape, num_classes=ds.num_classes,
                           num_examples=update.num_examples, device=self.device,
                           seed=self.seed * 1000003 + update.round * 1009 + update.client_id)

    def compensated(self, update: ClientUpdate, delta: list[np.ndarray]) -> list[np.ndarray]:
        """Random-matrix compensation of one client's update (the abuse seed 000 §V-C discusses)."""
        from fedsim.compensation import GlobalUpdateCompensation

        var = self.compensate_var if self.compensate_var is not None else update.metrics.get("noise_variance")
        if not var:
            return delta
        return GlobalUpdateCompensation(Q=self.compensate_Q).apply(delta, float(var), names=list(update.param_names))

    def ground_truth(self, update: ClientUpdate) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples the victim trained on this round, re-created from (seed, round, client)."""
        import json

        from fedsim.client_app import client_data
        from fedsim.training import Recipe, batch_schedule

        x, y = client_data(json.dumps(dict(self.cfg), sort_keys=True), update.client_id)
        sched = batch_schedule(self.cfg["seed"], update.round, update.client_id, len(y),
                               Recipe.from_mapping(update.recipe))
        seen: list[int] = []
        for b in sched:
            for i in b.tolist():
                if i not in seen:
                    seen.append(i)
        idx = torch.as_tensor(seen[: self.max_truth])
        return x[idx], y[idx]

    def attack_one(self, update: ClientUpdate, name: str) -> dict[str, Any]:
        from fedsim.metrics import score_reconstruction

        inp = self.attack_input(update)
        attack = build_attack(name, **self.params[name])
        t0 = time.perf_counter()
        result = attack.run(inp)
        seconds = time.perf_counter() - t0
        rx, ry = result.inputs.detach().cpu().clamp(0, 1), result.labels.detach().cpu()
        tx, ty = self.ground_truth(update)
        tx, ty = select_truth(rx, tx, ty)
        score = score_reconstruction(rx, ry, tx, ty, psnr_threshold=self.psnr_threshold,
                                     ssim_threshold=self.ssim_threshold)
        matched = rx[torch.as_tensor(score["assignment"])]
        self._images[f"{name}-r{update.round}-c{update.client_id}"] = (tx, matched)
        row = {"round": update.round, "client": update.client_id, "attack": name, "batch_size": len(rx),
               "psnr": score["psnr"], "ssim": score["ssim"], "mse": score["mse"], "label_acc": score["label_acc"],
               "success_content": score["success_content"], "success_label": score["success_label"],
               "iterations": result.trace.get("iterations"), "converged_at": result.trace.get("converged_at"),
               "seconds": seconds, "final_loss": (result.trace.get("loss") or [None])[-1]}
        return row

    # ---- outputs ------------------------------------------------------------------------------------
    def summary_rows(self) -> list[dict[str, Any]]:
        out = []
        for name in self.names:
            rs = [r for r in self.rows if r["attack"] == name]
            if not rs:
                continue
            out.append({"attack": name, "attacks_run": len(rs),
                        **{k: float(np.mean([r[k] for r in rs if r[k] is not None]))
                           for k in ("psnr", "ssim", "mse", "label_acc", "success_content", "success_label",
                                     "iterations", "seconds")}})
        return out

    def write_outputs(self, final: bool = False) -> None:
        from fedsim.reports import write_jsonl

        assert self.out is not None
        write_jsonl(self.out / "leakage.jsonl", self.rows)
        self._write_grids()
        if final:
            self._write_plots()

    def _write_grids(self) -> None:
        import matplotlib

        from fedsim.reports import save_figure

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

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

    def _write_plots(self) -> None:
        import matplotlib

        from fedsim.reports import save_figure

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
        for name in self.names:
            rs = [r for r in self.rows if r["attack"] == name]
            rounds = sorted({r["round"] for r in rs})
            a1.plot(rounds, [np.mean([r["ssim"] for r in rs if r["round"] == k]) for k in rounds], marker="o",
                    label=name)
            acc = [np.mean([r["accuracy"] for r in rs if r["round"] == k and r.get("accuracy") is not None] or [np.nan])
                   for k in rounds]
            a2.plot(acc, [np.mean([r["ssim"] for r in rs if r["round"] == k]) for k in rounds], marker="o", label=name)
        a1.set_xlabel("round")
        a1.set_ylabel("SSIM of reconstruction")
        a2.set_xlabel("global test accuracy")
        a2.set_ylabel("SSIM of reconstruction")
        for a in (a1, a2):
            a.set_ylim(-0.1, 1.05)
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        save_figure(fig, self.out / "leakage.png")
        plt.close(fig)

    def report_markdown(self) -> str:
        from fedsim.reports import md_table

        if not self.rows:
            return ""
        text = ["## Gradient leakage (curious server)\n",
                f"Attacks {', '.join(self.names)} on rounds {self.rounds if not self.every else f'every {self.every}'}"
                f", victims {self.victims}. Reconstructions are matched to the victim's samples by optimal "
                f"assignment; content success (ASR_c) = share of images with SSIM >= {self.ssim_threshold}"
                f"{f' and PSNR >= {self.psnr_threshold} dB' if self.psnr_threshold is not None else ''}; "
                f"label success (ASR_l) = share of labels recovered.\n",
                "### Per attack (mean over attacked updates)\n",
                md_table(self.summary_rows(), ["attack", "attacks_run", "psnr", "ssim", "mse", "label_acc",
                                               "success_content", "success_label", "iterations", "seconds"],
                         {"psnr": ".2f", "ssim": ".3f", "mse": ".4g", "label_acc": ".2f", "seconds": ".2f",
                          "iterations": ".0f", "success_content": ".2f", "success_label": ".2f"}),
                "### Per round and victim\n",
                md_table(self.rows, ["round", "client", "attack", "batch_size", "psnr", "ssim", "mse", "label_acc",
                                     "iterations", "seconds", "accuracy"],
                         {"psnr": ".2f", "ssim": ".3f", "label_acc": ".2f", "seconds": ".2f", "accuracy": ".4f"}),
                "![leakage](leakage.png)\n"]
        text += [f"![{n}](reconstruction_{n}.png)\n" for n in self.names
                 if any(k.startswith(n + "-") for k in self._images)]
        return "\n".join(text)
