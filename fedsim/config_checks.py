"""The checks of a config against what it names: the data it loads and partitions, the model and
dataset it builds (built-in or a user's own, :mod:`fedsim.components`); and the resources a Ray run asks of this machine (CPUs, GPUs).
:func:`fedsim.config.precheck` / :func:`fedsim.config.validate` run them; every problem is a
:class:`ConfigError` naming the key."""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping

from fedsim.components import ConfigError


def check_data(cfg: Mapping[str, Any], require_available: bool = True) -> None:
    """Everything the run needs from its data, checked now rather than inside every client: the dataset
    loads (its files are present and intact), the public root split fits, and the client partition can
    be drawn (``data.classes_per_client``, ``data.alpha``, ``data.max_per_class``,
    ``federation.num_clients`` against the training set). The partition computed here is cached for the
    run. Raises ConfigError naming the key, or DatasetUnavailable (only with ``require_available``:
    validation alone tolerates a dataset that is missing here, since the runner reports it before
    anything is written)."""
    from fedsim.data import DatasetUnavailable
    from fedsim.factories import dataset_for, partitions_for

    try:
        ds = dataset_for(cfg)
    except DatasetUnavailable:
        if require_available:
            raise
        return
    except ValueError as exc:  # root_size and other dataset parameters
        raise ConfigError(str(exc)) from None
    problem = model_problem(cfg)  # (what the attacks need of the data and model: Attack.validate_config)
    if problem:
        raise ConfigError(problem)
    try:
        parts = partitions_for(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ConfigError(f"data.partition = {cfg['data']['partition']!r} leaves clients {empty[:5]} without "
                          f"samples ({len(ds.y_train)} training samples, federation.num_clients = "
                          f"{cfg['federation']['num_clients']})")


def model_problem(cfg: Mapping[str, Any]) -> str | None:
    """What is wrong with the model the config describes on its data, found before anything runs: it
    cannot be built (a plugin raising, returning something that is not an ``nn.Module``), or its forward
    on two examples raises or does not return ``(batch, num_classes)`` logits. The message names
    ``model.name``; None when the model works. Cached per (model, data) sections."""
    import json

    return _model_problem(json.dumps({"model": cfg["model"], "data": cfg["data"]}, sort_keys=True, default=str))


@functools.lru_cache(maxsize=16)
def _model_problem(text: str) -> str | None:
    import json

    import torch

    from fedsim.data import DatasetUnavailable
    from fedsim.factories import dataset_for, model_for

    cfg = json.loads(text)
    name = cfg["model"]["name"]
    try:
        ds = dataset_for(cfg)
    except DatasetUnavailable:
        return None  # reported where the data is needed
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
        try:
            model = model_for(cfg)
        except ConfigError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - a plugin's (or the data's) failure: one line naming the key
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return msg[len("ValueError: "):] if msg.startswith("ValueError: model.") else f"model.name {name!r}: {msg}"
        x = ds.x_test[:2] if len(ds.x_test) else ds.x_train[:2]
        try:
            model.train()
            with torch.no_grad():
                out = model(x)
        except Exception as exc:  # noqa: BLE001
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return f"model.name {name!r}: its forward on {len(x)} inputs of shape {tuple(x.shape[1:])} raised {msg}"
    want = (len(x), ds.num_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return (f"model.name {name!r}: its forward on {len(x)} inputs of shape {tuple(x.shape[1:])} returned "
                f"{got}; fedsim needs logits of shape (batch, num_classes) = {want}")
    return None


def check_model_and_data(cfg: Mapping[str, Any]) -> None:
    """``model.name`` / ``data.dataset``: a built-in name, or a user's own model / dataset (a name
    registered in :data:`fedsim.components.MODELS` / ``DATASETS`` or an import reference), whose
    ``params`` are checked against the keyword parameters it declares - the same mechanism, and the
    same messages, as every other component."""
    from fedsim.components import DATASETS as DATASETS
    from fedsim.components import MODELS
    from fedsim.models import BUILTIN_ONLY, is_builtin_model

    m, d = cfg["model"], cfg["data"]
    if is_builtin_model(m["name"]):
        if m.get("params"):
            raise ConfigError(f"model.params is for your own model; the built-in {m['name']!r} takes "
                              f"{list(BUILTIN_ONLY)} in [model]")
    else:
        if m["name"] not in MODELS:
            raise ConfigError(f"model.name must be one of {MODELS.names()} or "
                              f"an import reference ('module:attribute' or 'path/file.py:attribute'), got {m['name']!r}")
        builder = MODELS.lookup(m["name"], "model.name")
        MODELS.check_params(builder, m["name"], m.get("params") or {}, "model.params")
        given = [k for k in BUILTIN_ONLY if m.get(k) is not None]
        if given:
            raise ConfigError(f"model.{given[0]} applies to the built-in models only; give your model's own "
                              f"parameters in model.params")
    from fedsim.data import builtin_datasets

    builtin = sorted(builtin_datasets())
    if d["dataset"] in builtin:
        if d.get("params"):
            raise ConfigError(f"data.params is for your own dataset; the built-in {d['dataset']!r} takes none")
    else:
        if d["dataset"] not in DATASETS:
            raise ConfigError(f"data.dataset must be one of {DATASETS.names()} or "
                              f"an import reference ('module:attribute' or 'path/file.py:attribute'), got "
                              f"{d['dataset']!r}")
        loader = DATASETS.lookup(d["dataset"], "data.dataset")
        DATASETS.check_params(loader, d["dataset"], d.get("params") or {}, "data.params")


def check_simulation(sim: Mapping[str, Any]) -> None:
    """Resources a local Ray cluster can never give (Flower's engine would stall waiting for clients):
    the CPUs here; the GPUs in :func:`check_gpus` (they need torch)."""
    if sim.get("ray_address") and sim["backend"] != "ray":
        raise ConfigError(f"simulation.ray_address = {sim['ray_address']!r} joins a Ray cluster, but "
                          f"simulation.backend = {sim['backend']!r} runs no Ray: set simulation.backend = \"ray\"")
    if sim["backend"] != "ray" or sim.get("ray_address"):
        return
    cpus = os.cpu_count() or 1
    if sim["num_cpus"] > cpus:
        raise ConfigError(f"simulation.num_cpus = {sim['num_cpus']} is more than this machine's {cpus} CPUs: "
                          "no client actor could start")


def check_gpus(sim: Mapping[str, Any]) -> None:
    if sim["backend"] != "ray" or sim.get("ray_address") or not sim["num_gpus"] > 0:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"simulation.num_gpus = {sim['num_gpus']} but this machine has no GPU "
                          "(CUDA is not available): no client actor could start")
    if sim["num_gpus"] > torch.cuda.device_count():
        raise ConfigError(f"simulation.num_gpus = {sim['num_gpus']} is more than this machine's "
                          f"{torch.cuda.device_count()} GPUs")
