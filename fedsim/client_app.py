"""The fedsim ClientApp (Flower Message API).

Stateless apart from Flower's per-node ``Context.state``: the server sends the resolved fedsim
config (JSON) with every message, so the same ClientApp serves ``fedsim run`` (``run_simulation``),
``flwr run .`` and the in-process grid. Data and partitions are loaded once per process (cached).

Messages handled:
* ``query``: reply with the node's partition id (and warm the data cache).
* ``train``: load the global weights, run local SGD through the defense pipeline, reply with the
  new weights, ``num-examples``, ``partition-id`` and training/defense metrics. Defense state that
  must persist (residuals, keys) is kept in ``Context.state`` and never put in a reply.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.base import build_pipeline
from clients.flower_mods import build_flower_mods, wrap
from fedsim.data import load_dataset, partition
from fedsim.models import build_model
from fedsim.training import Recipe, derive_seed, local_train, resolve_device, set_weights

CONFIG_KEY = "fedsim-config"
STATE_KEY = "fedsim.defense-state"

client_app = ClientApp()


@lru_cache(maxsize=4)
def parse_config(text: str) -> dict[str, Any]:
    return json.loads(text)


def dataset_for(cfg: dict[str, Any]):
    d = cfg["data"]
    return load_dataset(d["dataset"], d.get("data_dir"), bool(d.get("download", False)), int(d["root_size"]))


@lru_cache(maxsize=4)
def _partitions(text: str) -> list[np.ndarray]:
    cfg = parse_config(text)
    d = cfg["data"]
    params: dict[str, Any] = {}
    if d["partition"] == "dirichlet":
        params = {"alpha": d["alpha"]}
    elif d["partition"] == "pathological":
        params = {k: d[k] for k in ("classes_per_client", "min_per_class", "max_per_class")}
    ds = dataset_for(cfg)
    return partition(ds.y_train.numpy(), cfg["federation"]["num_clients"], d["partition"], cfg["seed"], **params)


def client_data(text: str, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = parse_config(text)
    ds = dataset_for(cfg)
    idx = torch.as_tensor(_partitions(text)[pid])
    return ds.x_train[idx], ds.y_train[idx]


def model_for(cfg: dict[str, Any]) -> torch.nn.Module:
    ds = dataset_for(cfg)
    m = cfg["model"]
    return build_model(m["name"], ds.in_shape, ds.num_classes, activation=m.get("activation"), norm=m.get("norm"),
                       init=m.get("init", "default"), width=m.get("width"), hidden=m.get("hidden"))


def _partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


@client_app.query()
def query(msg: Message, context: Context) -> Message:
    pid = _partition_id(context)
    return Message(RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training, wrapped by the Flower mods the config names (``[[client.flower_mods]]``)."""
    cfg = parse_config(str(msg.content["config"][CONFIG_KEY]))
    mods = build_flower_mods(cfg.get("client", {}).get("flower_mods", []))
    return wrap(_train, mods)(msg, context) if mods else _train(msg, context)


def _train(msg: Message, context: Context) -> Message:
    conf = msg.content["config"]
    text = str(conf[CONFIG_KEY])
    cfg = parse_config(text)
    pid = _partition_id(context)
    rnd = int(conf["server-round"])
    x, y = client_data(text, pid)
    torch.manual_seed(derive_seed(cfg["seed"], rnd, pid, 0x11))
    model = model_for(cfg)
    set_weights(model, msg.content["arrays"].to_numpy_ndarrays())
    names = list(model.state_dict().keys())
    state = {}
    if STATE_KEY in context.state:
        state = {k: v.numpy() for k, v in context.state[STATE_KEY].items()}
    pipeline = build_pipeline(cfg.get("defenses", []))
    ds = dataset_for(cfg)
    res = local_train(model, x, y, Recipe.from_mapping(cfg["train"]), seed=cfg["seed"], round=rnd, client=pid,
                      pipeline=pipeline, state=state, device=resolve_device(cfg.get("device", "auto")),
                      public_data=(ds.x_root, ds.y_root))
    if res.state:
        context.state[STATE_KEY] = ArrayRecord(OrderedDict((k, Array(np.ascontiguousarray(v)))
                                                           for k, v in res.state.items()))
    metrics = {"num-examples": res.num_examples, "partition-id": pid,
               **{k: float(v) for k, v in res.metrics.items()}}
    arrays = ArrayRecord(OrderedDict((n, Array(np.ascontiguousarray(w))) for n, w in zip(names, res.weights)))
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}), reply_to=msg)
