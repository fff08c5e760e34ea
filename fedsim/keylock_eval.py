"""Server-side evaluation for FedKL (seed 003, Table 5.3) and the config check of the key-lock module.

The FedKL defense (``clients/fedkl.py``) keeps every key and lock on its client, so the server's global
model is the base architecture. :class:`RandomKeyEvaluation` (observer ``fedkl-random-key``, added by
the defense through ``Defense.server_observers``) evaluates, after every round, the global model with a
key-lock module fed a *random* key (:func:`fedsim.models.keylock.random_key`, a key no client holds)
and the *initial* lock (:func:`fedsim.models.keylock.init_lock`): the thesis's "Random" row. It adds to
each ``metrics.jsonl`` row

* ``fedkl.random_key_accuracy`` / ``fedkl.random_key_loss`` - that model on the common test split;
* ``fedkl.own_key_accuracy_mean`` / ``_min`` / ``_max`` - over the clients of the round, the accuracy
  each reported with its own key and lock (the defense's ``own_key_accuracy`` metric; the row's
  ``defense.<i>.fedkl.own_key_accuracy`` is the example-weighted mean of the same numbers),

and writes a Table 5.3-like section (per client, average, random key, plain global model) into the
run's report. Normalisation layers that the key-lock inserted where the base model has none have no
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

OWN_KEY_ACCURACY = "own_key_accuracy"  # the FedKL defense's metric (prefixed defense.<i>.fedkl.)


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
                     salt: int = 0) -> torch.nn.Module:
    """The global model (``arrays``, base architecture) with a random key and the initial lock."""
    from fedsim.training import set_weights

    model = _model(cfg)
    base = set(model.state_dict())
    set_weights(model, arrays)
    seed = int(cfg["seed"])
    names = keylock.lock_model(model, keylock.random_key(seed, key_length, salt), blocks, init_seed=seed)
    use_batch_statistics(model, [n for n in names if f"{n}.running_mean" not in base])
    return model


@OBSERVERS.register
class RandomKeyEvaluation(Observer):
    """FedKL's server-side numbers: the global model with a random key, and the clients' own-key
    accuracies (see the module doc). ``key_salt`` picks another random key."""

    name = "fedkl-random-key"

    def __init__(self, *, cfg: Mapping[str, Any], blocks: str | list[Any] = keylock.DEFAULT_BLOCKS,
                 key_length: int = keylock.DEFAULT_KEY_LENGTH, key_salt: int = 0):
        self.cfg = cfg
        self.blocks = keylock.check_blocks(blocks)
        key_length = keylock.check_key_length(key_length)
        self.key_length, self.key_salt = int(key_length), int(key_salt)
        self.own: dict[int, dict[int, float]] = {}  # round -> client -> own-key accuracy
        self.lock_fraction: float | None = None
        self.rows: list[dict[str, Any]] = []

    def on_start(self, out_dir: Path | None) -> None:
        self.rows.clear()
        self.own.clear()

    def observe(self, update: ClientUpdate) -> None:
        for k, v in update.metrics.items():
            if k.endswith(f".fedkl.{OWN_KEY_ACCURACY}"):
                self.own.setdefault(update.round, {})[update.client_id] = float(v)
            elif k.endswith(".fedkl.lock_fraction"):
                self.lock_fraction = float(v)

    def on_global_model(self, round: int, arrays: Sequence[np.ndarray] | None) -> Mapping[str, Any]:
        from fedsim.factories import dataset_for
        from fedsim.training import evaluate, resolve_device

        out: dict[str, Any] = {}
        if arrays is not None:
            model = random_key_model(self.cfg, arrays, self.blocks, self.key_length, self.key_salt)
            ds = dataset_for(self.cfg)
            loss, acc = evaluate(model, ds.x_test, ds.y_test, resolve_device(self.cfg.get("device", "auto")))
            out.update({"fedkl.random_key_accuracy": acc, "fedkl.random_key_loss": loss})
        own = list(self.own.get(round, {}).values())
        if own:
            out.update({"fedkl.own_key_accuracy_mean": float(np.mean(own)),
                        "fedkl.own_key_accuracy_min": float(np.min(own)),
                        "fedkl.own_key_accuracy_max": float(np.max(own))})
        return out

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        self.rows.append({"round": round, "accuracy": metrics.get("accuracy"),
                          "random_key_accuracy": metrics.get("fedkl.random_key_accuracy"),
                          "own": dict(sorted(self.own.get(round, {}).items()))})

    def final(self) -> dict[str, Any]:
        """The last round's numbers (Table 5.3's layout)."""
        if not self.rows:
            return {}
        last = self.rows[-1]
        own = last["own"] or next((r["own"] for r in reversed(self.rows) if r["own"]), {})
        return {"round": last["round"], "random_key_accuracy": last["random_key_accuracy"],
                "global_accuracy": last["accuracy"], "own_key_accuracy": {str(c): a for c, a in own.items()},
                "own_key_accuracy_mean": float(np.mean(list(own.values()))) if own else None,
                "lock_fraction": self.lock_fraction}

    def on_finish(self) -> dict[str, Any]:
        return {"fedkl": self.final()}

    def report_markdown(self) -> str:
        from fedsim.reports import md_table

        f = self.final()
        if not f:
            return ""
        rnd = f.get("random_key_accuracy")
        rows = [{"key": f"client {c}", "accuracy": a} for c, a in f["own_key_accuracy"].items()]
        if f["own_key_accuracy_mean"] is not None:
            rows.append({"key": "average", "accuracy": f["own_key_accuracy_mean"]})
        rows.append({"key": "random key, initial lock", "accuracy": rnd})
        rows.append({"key": "global model as is (no key-lock)", "accuracy": f["global_accuracy"]})
        for r in rows:
            r["gap"] = r["accuracy"] - rnd if r["accuracy"] is not None and rnd is not None else None
        frac = f["lock_fraction"]
        return "\n".join([
            "## FedKL: accuracy by key (thesis Table 5.3)\n",
            f"Round {f['round']}. Clients: their own key and trained lock on the common test split (as the defense's "
            "`evaluate` option says, after or before local training). Random key: the global model with a key no "
            "client holds and the initial lock. Global model as is: the base architecture the server holds (no "
            "key-lock; a replaced BatchNorm keeps its initial affine parameters 1 and 0, a normalisation the lock "
            "inserted is absent). Gap: accuracy - random-key accuracy."
            + (f" Lock parameters: {100 * frac:.2f}% of the locked model's parameters." if frac is not None else "")
            + "\n",
            md_table(rows, ["key", "accuracy", "gap"], {"accuracy": ".4f", "gap": ".4f"})])
