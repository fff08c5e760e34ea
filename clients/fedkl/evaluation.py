"""Server-side evaluation for FedKL (seed 003, Table 5.3) and the config check of the key-lock module.

The FedKL defense (:mod:`clients.fedkl.defense`) keeps every key and lock on its client, so the server's global
model is the base architecture. :class:`RandomKeyEvaluation` (observer ``fedkl-random-key``, added by
the defense through ``Defense.server_observers``) evaluates, after every round, the global model with a
key-lock module fed a *random* key (:func:`fedsim.models.keylock.random_key`, a key no client holds)
and the *initial* lock (:func:`fedsim.models.keylock.init_lock`): the thesis's "Random" row. It adds to
each ``metrics.jsonl`` row

* ``fedkl.random_key_accuracy`` / ``fedkl.random_key_loss`` - that model on the common test split;
* ``fedkl.own_key_accuracy_mean`` / ``_min`` / ``_max`` - over the clients of the round, the accuracy
  each reported with its own key and lock before local training (the defense's ``own_key_accuracy``
  metric; the row's ``defense.<i>.fedkl.own_key_accuracy`` is the example-weighted mean of the same
  numbers), and ``fedkl.own_key_after_training_accuracy_mean`` - the same after local training;
* ``fedkl.best_own_key_accuracy`` - the thesis's Table 5.1 "FedKL" number: the best so far, over the
  rounds, of the round's mean own-key accuracy before local training (its Table 5.3 "Average" row),

and writes a Table 5.3-like section (per client, average, random key, plain global model; at the last
round and at the round the thesis reports, the best average) into the run's report. Normalisation layers that the key-lock inserted where the base model has none have no
running statistics on the server; they normalise with the test batch's statistics here.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from fedsim.components import OBSERVERS
from fedsim.models import keylock
from fedsim.observers import ClientUpdate, Observer

# the FedKL defense's metrics (prefixed defense.<i>.fedkl.): own key and lock, before / after local training
OWN_KEY_ACCURACY = "own_key_accuracy"
OWN_KEY_AFTER = "own_key_after_training_accuracy"


def _model(cfg: Mapping[str, Any]) -> torch.nn.Module:
    from fedsim.factories import model_for

    with torch.random.fork_rng(devices=[]):  # building a model must not move anyone's RNG
        return model_for(cfg)


@lru_cache(maxsize=32)
def _check(text: str, blocks: str) -> None:
    cfg = json.loads(text)
    keylock.select_blocks(_model(cfg), json.loads(blocks))


def check_model(cfg: Mapping[str, Any], blocks: Any) -> None:
    """Raise ValueError unless the config's model has the normalisation slots ``blocks`` names."""
    text = json.dumps({"model": cfg["model"], "data": cfg["data"]}, sort_keys=True)
    _check(text, json.dumps(blocks))


def use_batch_statistics(model: torch.nn.Module, blocks: Sequence[str]) -> None:
    """Make the given key-lock blocks normalise with the batch's statistics even in eval mode."""
    for name in blocks:
        kl = model.get_submodule(name)
        kl.track_running_stats = False
        kl.running_mean = None
        kl.running_var = None
        kl.num_batches_tracked = None


def random_key_model(cfg: Mapping[str, Any], arrays: Sequence[np.ndarray], blocks: Any, key_length: int,
                     salt: int = 0, activation: str = "none") -> torch.nn.Module:
    """The global model (``arrays``, base architecture) with a random key and the initial lock."""
    from fedsim.models.weights import set_weights

    model = _model(cfg)
    base = set(model.state_dict())
    set_weights(model, arrays)
    seed = int(cfg["seed"])
    names = keylock.lock_model(model, keylock.random_key(seed, key_length, salt), blocks, init_seed=seed,
                               activation=activation)
    use_batch_statistics(model, [n for n in names if f"{n}.running_mean" not in base])
    return model


@OBSERVERS.register
class RandomKeyEvaluation(Observer):
    """FedKL's server-side numbers: the global model with a random key, and the clients' own-key
    accuracies (see the module doc). ``key_salt`` picks another random key; ``lock_activation`` is the
    defense's (the random-key model is built like the clients')."""

    name = "fedkl-random-key"

    def __init__(self, *, cfg: Mapping[str, Any], blocks: str | list[Any] = keylock.DEFAULT_BLOCKS,
                 key_length: int = keylock.DEFAULT_KEY_LENGTH, key_salt: int = 0, lock_activation: str = "none"):
        self.cfg = cfg
        self.blocks = keylock.check_blocks(blocks)
        key_length = keylock.check_key_length(key_length)
        self.key_length, self.key_salt = int(key_length), int(key_salt)
        self.lock_activation = keylock.check_activation(lock_activation)
        self.own: dict[int, dict[int, float]] = {}  # round -> client -> own-key accuracy before local training
        self.after: dict[int, dict[int, float]] = {}  # the same after local training
        self.lock_fraction: float | None = None
        self.rows: list[dict[str, Any]] = []

    def on_start(self, out_dir: Path | None) -> None:
        self.rows.clear()
        self.own.clear()
        self.after.clear()

    def observe(self, update: ClientUpdate) -> None:
        for k, v in update.metrics.items():
            if k.endswith(f".fedkl.{OWN_KEY_ACCURACY}"):
                self.own.setdefault(update.round, {})[update.client_id] = float(v)
            elif k.endswith(f".fedkl.{OWN_KEY_AFTER}"):
                self.after.setdefault(update.round, {})[update.client_id] = float(v)
            elif k.endswith(".fedkl.lock_fraction"):
                self.lock_fraction = float(v)

    def _best_round(self) -> int | None:
        """The round with the highest mean own-key accuracy before local training (the thesis's)."""
        means = {r: float(np.mean(list(c.values()))) for r, c in self.own.items() if c}
        return max(means, key=lambda r: (means[r], -r)) if means else None

    def on_global_model(self, round: int, arrays: Sequence[np.ndarray] | None) -> Mapping[str, Any]:
        from fedsim.device import resolve_device
        from fedsim.factories import dataset_for
        from fedsim.training.evaluation import evaluate

        out: dict[str, Any] = {}
        if arrays is not None:
            model = random_key_model(self.cfg, arrays, self.blocks, self.key_length, self.key_salt,
                                     self.lock_activation)
            ds = dataset_for(self.cfg)
            loss, acc = evaluate(model, ds.x_test, ds.y_test, resolve_device(self.cfg.get("device", "auto")))
            out.update({"fedkl.random_key_accuracy": acc, "fedkl.random_key_loss": loss})
        own = list(self.own.get(round, {}).values())
        if own:
            out.update({"fedkl.own_key_accuracy_mean": float(np.mean(own)),
                        "fedkl.own_key_accuracy_min": float(np.min(own)),
                        "fedkl.own_key_accuracy_max": float(np.max(own))})
        best = self._best_round()
        if best is not None:
            out["fedkl.best_own_key_accuracy"] = float(np.mean(list(self.own[best].values())))
        after = list(self.after.get(round, {}).values())
        if after:
            out["fedkl.own_key_after_training_accuracy_mean"] = float(np.mean(after))
        return out

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        self.rows.append({"round": round, "accuracy": metrics.get("accuracy"),
                          "random_key_accuracy": metrics.get("fedkl.random_key_accuracy"),
                          "own": dict(sorted(self.own.get(round, {}).items())),
                          "after": dict(sorted(self.after.get(round, {}).items()))})

    @staticmethod
    def _numbers(row: Mapping[str, Any]) -> dict[str, Any]:
        own, after = row["own"], row["after"]
        return {"round": row["round"], "random_key_accuracy": row["random_key_accuracy"],
                "global_accuracy": row["accuracy"], "own_key_accuracy": {str(c): a for c, a in own.items()},
                "own_key_accuracy_mean": float(np.mean(list(own.values()))) if own else None,
                "own_key_after_training_accuracy": {str(c): a for c, a in after.items()},
                "own_key_after_training_accuracy_mean": float(np.mean(list(after.values()))) if after else None}

    def final(self) -> dict[str, Any]:
        """Table 5.3's numbers at the last round, and at the round with the best mean own-key accuracy
        before local training (``best``: what the thesis reports)."""
        if not self.rows:
            return {}
        out = {**self._numbers(self.rows[-1]), "lock_fraction": self.lock_fraction}
        best = self._best_round()
        out["best"] = next((self._numbers(r) for r in self.rows if r["round"] == best), None)
        return out

    def on_finish(self) -> dict[str, Any]:
        return {"fedkl": self.final()}

    def report_markdown(self) -> str:
        from fedsim.reports import md_table

        f = self.final()
        if not f:
            return ""
        sections = ["## FedKL: accuracy by key (thesis Table 5.3)\n",
                    "Clients: their own key and trained lock on the common test split (as the defense's `evaluate` "
                    "option says): `accuracy` before local training (the thesis's measurement: the received global "
                    "model merged with the client's lock), and after it (the client's trained model). Random key: the global "
                    "model with a key no client holds and the initial lock. Global model as is: the base "
                    "architecture the server holds (no key-lock; a replaced BatchNorm keeps its initial affine "
                    "parameters 1 and 0, a normalisation the lock inserted is absent unless `average_norm_stats` "
                    "puts its statistics there). Gap: accuracy - random-key accuracy."
                    + (f" Lock parameters: {100 * f['lock_fraction']:.2f}% of the locked model's parameters."
                       if f["lock_fraction"] is not None else "") + "\n"]
        thesis = "the best mean before local training (the thesis's Table 5.1 \"FedKL\" and Table 5.3 \"Average\")"
        best = f["best"]
        same = best is not None and best["round"] == f["round"]
        for title, n in ((f"Round {f['round']} (the last{'; also ' + thesis if same else ''})", f),
                         (f"Round {best['round']}: {thesis}" if best and not same else "", None if same else best)):
            if not n:
                continue
            rnd = n["random_key_accuracy"]
            after = n["own_key_after_training_accuracy"]
            rows = [{"key": f"client {c}", "accuracy": a, "after local training": after.get(c)}
                    for c, a in n["own_key_accuracy"].items()]
            rows += [{"key": f"client {c}", "after local training": a} for c, a in after.items()
                     if c not in n["own_key_accuracy"]]
            rows.append({"key": "average", "accuracy": n["own_key_accuracy_mean"],
                         "after local training": n["own_key_after_training_accuracy_mean"]})
            rows.append({"key": "random key, initial lock", "accuracy": rnd})
            rows.append({"key": "global model as is (no key-lock)", "accuracy": n["global_accuracy"]})
            for r in rows:
                a = r.get("accuracy")
                r["gap"] = a - rnd if a is not None and rnd is not None else None
            sections += [f"{title}:\n", md_table(rows, ["key", "accuracy", "after local training", "gap"],
                                                  {"accuracy": ".4f", "after local training": ".4f",
                                                   "gap": ".4f"}),
                         ""]
        return "\n".join(sections)
