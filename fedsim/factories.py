"""Build what a config describes: the dataset, the client partition, a client's data, the model.

One neutral place used by the server (initial model, central evaluation), the ClientApp (local data,
the model it trains) and the attacker's scorer (re-creating a victim's samples). Data and partitions
are computed once per process and config (cached by the config's JSON text, which every message
carries).
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Mapping

import numpy as np
import torch

from fedsim.components import DEFENSES
from fedsim.data import Dataset, load_dataset, partition
from fedsim.models import build_model
from fedsim.protocol import config_text


def dataset_for(cfg: Mapping[str, Any]) -> Dataset:
    """The config's dataset (``data.*``); cached by ``load_dataset``."""
    d = cfg["data"]
    return load_dataset(d["dataset"], d.get("data_dir"), bool(d.get("download", False)), int(d["root_size"]),
                        json.dumps(d.get("params") or {}, sort_keys=True), tuple(d.get("styles") or ()))


def partition_params(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The partitioner's parameters for ``data.partition`` (``alpha``, or the pathological counts)."""
    d = cfg["data"]
    if d["partition"] == "dirichlet":
        return {"alpha": d["alpha"]}
    if d["partition"] == "pathological":
        return {k: d[k] for k in ("classes_per_client", "min_per_class", "max_per_class")}
    if d["partition"] == "natural":
        sources = dataset_for(cfg).sources
        return {"sources": None if sources is None else sources.numpy()}
    return {}


@lru_cache(maxsize=4)
def _partitions(text: str) -> tuple[np.ndarray, ...]:
    cfg = json.loads(text)
    ds = dataset_for(cfg)
    return tuple(partition(ds.y_train.numpy(), cfg["federation"]["num_clients"], cfg["data"]["partition"],
                           cfg["seed"], **partition_params(cfg)))


def partitions_for(cfg: Mapping[str, Any]) -> tuple[np.ndarray, ...]:
    """Every client's training-set indices (a pure function of the config and its seed)."""
    return _partitions(config_text(cfg))


def validation_split(cfg: Mapping[str, Any], partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) indices of client ``partition_id``'s partition.

    ``data.val_fraction = f > 0`` holds ``round(f * n)`` of the client's ``n`` samples out of its training
    data (at least one, and at least one left to train on, when ``n >= 2``), drawn from (seed, client);
    with ``f = 0`` (the default) the validation split is empty and the training data is the partition."""
    idx = partitions_for(cfg)[partition_id]
    f = float(cfg["data"].get("val_fraction") or 0.0)
    if f <= 0 or len(idx) < 2:
        return idx, idx[:0]
    n_val = min(max(int(round(f * len(idx))), 1), len(idx) - 1)
    perm = np.random.default_rng([int(cfg["seed"]), int(partition_id), 0x7A1]).permutation(len(idx))
    return np.sort(idx[perm[n_val:]]), np.sort(idx[perm[:n_val]])


def client_data(cfg: Mapping[str, Any], partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition_id``'s local training data (its partition minus its validation split)."""
    ds = dataset_for(cfg)
    idx = torch.as_tensor(validation_split(cfg, partition_id)[0])
    return ds.x_train[idx], ds.y_train[idx]


def client_validation_data(cfg: Mapping[str, Any], partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition_id``'s local validation split (``data.val_fraction``; empty by default)."""
    ds = dataset_for(cfg)
    idx = torch.as_tensor(validation_split(cfg, partition_id)[1])
    return ds.x_train[idx], ds.y_train[idx]


def model_for(cfg: Mapping[str, Any]) -> torch.nn.Module:
    """A fresh model of the config's architecture (weights from the current torch RNG state).

    Every party builds its model here (the server's global model, the clients' received model, the
    attacker's), so a configured defense that changes the architecture all of them share does it here
    (:meth:`fedsim.defense.Defense.global_model`, e.g. FedKL's averaged lock statistics)."""
    ds = dataset_for(cfg)
    m = cfg["model"]
    model = build_model(m["name"], ds.in_shape, ds.num_classes, activation=m.get("activation"), norm=m.get("norm"),
                        init=m.get("init", "default"), width=m.get("width"), hidden=m.get("hidden"),
                        params=m.get("params") or None)
    if m.get("imprint_bins"):  # a malicious server's architecture (Robbing the Fed): the client builds it too
        from fedsim.models.imprint import build_imprinted

        model = build_imprinted(model, ds.in_shape, int(m["imprint_bins"]))
    for i, entry in enumerate(cfg.get("defenses") or ()):
        if isinstance(entry, Mapping) and entry.get("name") in DEFENSES:
            hook = getattr(DEFENSES.lookup(entry["name"], f"defenses[{i}].name"), "global_model", None)
            if hook is not None:
                model = hook(model, entry)
    return model
