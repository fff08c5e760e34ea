"""Experiment configuration: TOML files, ``--set section.key=value`` overrides, validation.

A config is a nested dict. :data:`SCHEMA` lists every fixed key with its type, default and allowed
values. The component sections - ``[strategy]`` (aggregation rule), ``[channel]``, ``[[transforms]]``,
``[[defenses]]``, ``[[client.flower_mods]]``, ``output.observers``, ``[attack]`` (the curious
server) - are checked by one mechanism, :mod:`fedsim.components`, against the parameters each
component declares. Every bad value raises :class:`ConfigError` naming the key and what is allowed,
before anything is written. Validation needs the plugins registered: load configs through
``fedsim.app.load_config`` (the composition root), which imports them first.
"""
from __future__ import annotations

import copy
import math
import tomllib
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedsim import build
from fedsim.components import ConfigError
from fedsim.config_checks import check_data, check_gpus, check_model_and_data, check_simulation
from fedsim.params import Constraint, OneOf, Range, check_constraints
from fedsim.references import missing_plugin_file


class Field:
    """One fixed key of the schema: its type, default, and the constraints on its value - the same
    objects (:mod:`fedsim.params`) components use in their signatures, checked by the same function."""

    def __init__(self, type: type | tuple[type, ...], default: Any = None, *constraints: Constraint,
                 nullable: bool = False, help: str = ""):
        self.type, self.default, self.constraints = type, default, tuple(constraints)
        self.nullable, self.help = nullable, help


NUM = (int, float)

SCHEMA: dict[str, Field] = {
    "name": Field(str, "run", help="run name (prefix of the run folder)"),
    "seed": Field(int, 0, Range(0), help="fixes partitions, initial weights, client sampling, local shuffles"),
    "device": Field(str, "auto", help="auto (CUDA when present) | cpu | cuda | cuda:N"),
    "federation.rounds": Field(int, 5, Range(1)),
    "federation.num_clients": Field(int, 10, Range(1)),
    "federation.clients_per_round": Field(int, 0, Range(0), help="0 = all clients every round"),
    "federation.round_timeout": Field(NUM, 3600.0, Range(1.0), help="seconds a round waits for its replies; "
                                      "clients that have not answered by then are recorded as failed"),
    "federation.max_examples": Field(int, None, Range(1), nullable=True,
                                     help="the largest example count (num-examples) a client's reply may report; "
                                     "a reply above it, or below 1, is that client's failure (unset: the "
                                     "training set's size)"),
    "federation.max_update_norm": Field(NUM, None, Range(0, open_low=True), nullable=True,
                                        help="robustness: a reply whose update (its model minus the model it was "
                                        "sent) has a larger L2 norm is that client's failure (unset: no bound; "
                                        "needs a channel that shows the server each model, e.g. plain)"),
    "data.dataset": Field(str, "fmnist-small", help="a built-in dataset, or your own: a registered name or an "
                          "import reference 'module:function' / 'path/file.py:function' (docs/plugins.md)"),
    "data.params": Field(dict, {}, help="keyword parameters of your own dataset function"),
    "data.partition": Field(str, "iid", OneOf("iid", "dirichlet", "pathological", "natural"),
                            help="natural: one source per client (datasets with sources, e.g. synthetic-2d, "
                            "or data.styles)"),
    "data.styles": Field(list, [], help="feature shift: the images drawn in one style per source, e.g. "
                         "[\"plain\", \"inverted\"] (with partition = \"natural\": one style per client); "
                         "styles: plain, inverted, rotated, low-contrast, blurred, thick"),
    "data.alpha": Field(NUM, 0.5, Range(1e-6), help="Dirichlet concentration"),
    "data.classes_per_client": Field(int, 2, Range(1), help="pathological: classes per client"),
    "data.min_per_class": Field(int, 10, Range(1), help="pathological: fewest samples per class"),
    "data.max_per_class": Field(int, 50, Range(1), help="pathological: most samples per class"),
    "data.root_size": Field(int, 100, Range(1), help="public root split held out from client data"),
    "data.val_fraction": Field(NUM, 0.0, Range(0.0, 0.9), help="share of each client's data held out as its "
                               "local validation split (FedBoosting's cross-validation); 0 = none"),
    "data.data_dir": Field(str, None, nullable=True, help="folder with dataset files"),
    "data.download": Field(bool, False, help="let torchvision download (needs internet)"),
    "model.name": Field(str, "lenet", help="a built-in model, or your own: a registered name or an import "
                        "reference 'module:Class' / 'path/file.py:build' (docs/plugins.md)"),
    "model.params": Field(dict, {}, help="keyword parameters of your own model"),
    "model.activation": Field(str, None, OneOf("sigmoid", "tanh", "relu", "leakyrelu"), nullable=True),
    "model.norm": Field(str, None, OneOf("none", "batch"), nullable=True),
    "model.init": Field(str, "default", OneOf("default", "uniform")),
    "model.width": Field(int, None, Range(1), nullable=True),
    "model.hidden": Field(list, None, nullable=True),
    "model.imprint_bins": Field(int, 0, Range(0), help="MALICIOUS-server scenario (Robbing the Fed): an imprint "
                                "block of this many bins in front of the model (0 = none); see [[transforms]] "
                                "robbing-imprint"),
    "train.lr": Field(NUM, 0.1, Range(1e-12)),
    "train.batch_size": Field(int, 32, Range(1)),
    "train.local_steps": Field(int, None, Range(1), nullable=True, help="SGD steps per round (FedSGD: 1)"),
    "train.local_epochs": Field(int, None, Range(1), nullable=True, help="local passes over the data"),
    "train.loss": Field(str, "cross-entropy", OneOf("cross-entropy", "mse"),
                        help="local training loss (mse: on one-hot targets)"),
    "train.momentum": Field(NUM, 0.0, Range(0, 1, open_high=True), help="local SGD momentum (0: plain SGD)"),
    "train.weight_decay": Field(NUM, 0.0, Range(0.0), help="local L2 weight decay"),
    "train.lr_schedule": Field(str, "constant", OneOf("constant", "step", "exponential", "cosine"),
                               help="the clients' learning rate over rounds"),
    "train.lr_gamma": Field(NUM, 0.5, Range(1e-12, 1.0), help="step/exponential: factor per step/round"),
    "train.lr_step_rounds": Field(int, 10, Range(1), help="step: rounds between two decays"),
    "train.lr_min": Field(NUM, 0.0, Range(0.0), help="cosine: the rate in the last round"),
    "evaluate.client_fraction": Field(NUM, 0.0, Range(0.0, 1.0),
                                      help="client-side evaluation: share of the clients that evaluate the "
                                      "global model on their own data after every round (0: off)"),
    "strategy.name": Field(str, "fedavg", help="aggregation rule (+ its parameters in [strategy])"),
    "channel.name": Field(str, "plain", help="how models travel (+ its parameters in [channel])"),
    "simulation.backend": Field(str, "ray", OneOf("ray", "inprocess"),
                                help="ray: Flower's simulation engine; inprocess: in-process grid (tests)"),
    "simulation.num_cpus": Field(int, 1, Range(1), help="CPUs per client actor"),
    "simulation.clients_per_node": Field(int, 1, Range(1), help="virtual clients (partitions) each simulated "
                                         "node serves; >1 cuts Flower's per-message cost at scale"),
    "simulation.discovery_timeout": Field(NUM, 120.0, Range(0, open_low=True),
                                          help="seconds the server waits for every client node to register "
                                          "before the run fails naming how many did"),
    "simulation.num_gpus": Field(NUM, 0.0, Range(0.0), help="GPUs per client actor (fractions allowed)"),
    "simulation.ray_address": Field(str, None, nullable=True, help="join an existing Ray cluster"),
    "simulation.threads": Field(int, 1, Range(0), help="torch threads of the fedsim process (server, attacks, "
                                "in-process clients); 0 = torch's default (all cores)"),
    "client.flower_mods": Field(list, [], help="Flower client mods wrapping local training, e.g. local-dp"),
    "output.dir": Field(str, "runs", help="parent folder of run folders"),
    "output.observers": Field(list, ["update-norms"], help="observers at the interception point"),
    "output.checkpoint": Field(bool, True, help="write checkpoint.npz after every round (resume with --resume)"),
}
OPEN_SECTIONS = ("strategy", "channel", "attack")  # parameters checked by their component
LIST_SECTIONS = ("defenses", "transforms")


def defaults() -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    for key, f in SCHEMA.items():
        _set(cfg, key, copy.deepcopy(f.default))
    cfg["defenses"] = []
    cfg["transforms"] = []
    return cfg


def _set(cfg: dict, dotted: str, value: Any) -> None:
    *path, leaf = dotted.split(".")
    node = cfg
    for p in path:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{p} is a value, not a section: cannot set {dotted}")
        node = nxt
    node[leaf] = value


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        table = key in SCHEMA and SCHEMA[key].type is dict  # a parameter table (model.params): one value
        if isinstance(v, Mapping) and key.split(".")[0] not in ("attack",) and not table:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _merge(base: dict, over: Mapping[str, Any], where: str = "") -> None:
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _merge(base[k], v, f"{where}{k}.")
        else:
            base[k] = copy.deepcopy(v)


def parse_value(text: str) -> Any:
    """A --set value: TOML syntax when it parses (numbers, booleans, lists, quoted strings), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(cfg: dict, overrides: Sequence[str]) -> None:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key or key.startswith(".") or key.endswith("."):
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        if key.split(".")[0] in LIST_SECTIONS:
            _set_list_entry(cfg, key, parse_value(text.strip()))
        else:
            _set(cfg, key, parse_value(text.strip()))


def _set_list_entry(cfg: dict, key: str, value: Any) -> None:
    # defenses.0.sigma=0.1  or defenses=[{name="prune", ratio=0.9}]  (also transforms)
    section, *parts = key.split(".")
    if not parts:
        cfg[section] = value
        return
    try:
        i = int(parts[0])
        cfg[section][i][".".join(parts[1:])] = value
    except (ValueError, IndexError, TypeError, KeyError):
        raise ConfigError(f"--set {key}: use {section}.<index>.<param> with an existing index "
                          f"(there are {len(cfg.get(section) or [])} {section})") from None


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """Parse a TOML file; a missing, unreadable, non-UTF-8 or malformed file is a ConfigError naming it."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} {str(p)!r} is a folder, not a file")
    if not p.exists():
        raise ConfigError(f"{what} {str(p)!r} does not exist")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {str(p)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {str(p)!r} is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
                          f"{exc.start}); TOML files must be UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {str(p)!r} is not valid TOML: {exc}") from exc


def read_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Defaults <- TOML file <- overrides, plugin file references made absolute, then the first pass
    (:func:`precheck`: no heavy import). The config still needs :func:`validate`."""
    cfg = defaults()
    if path is not None:
        _merge(cfg, read_toml(path))
    apply_overrides(cfg, overrides)
    absolute_references(cfg)
    precheck(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Defaults <- TOML file <- overrides, then :func:`validate`. Returns the resolved config."""
    cfg = read_config(path, overrides)
    validate(cfg)
    return cfg


def _check_field(key: str, f: Field, v: Any) -> None:
    if v is None:
        if not f.nullable:
            raise ConfigError(f"{key} must be set ({_typename(f.type)})")
        return
    types = f.type if isinstance(f.type, tuple) else (f.type,)
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
    if not ok:
        raise ConfigError(f"{key} must be {_typename(f.type)}, got {v!r} ({type(v).__name__})")
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{key} must be a finite number, got {v!r}")
    check_constraints(key, v, f.constraints)  # the components' constraint objects and check (fedsim.params)


def _typename(t: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
             dict: "a table"}
    if isinstance(t, tuple):
        return "a number" if set(t) == {int, float} else " or ".join(names.get(x, x.__name__) for x in t)
    return names.get(t, t.__name__)


def precheck(cfg: dict[str, Any]) -> None:
    """The first pass of :func:`validate`: everything that can be checked without importing torch, Flower,
    Ray or a plugin, so that a typo is reported at once: the sections and every key of :data:`SCHEMA`
    (names, types, ranges, choices), the rules between them, the shape of the component sections, the
    local CPUs a Ray run asks for, and that every plugin file a component name refers to exists. The
    components' names and parameters need the plugins: :func:`validate` checks them next."""
    for section, _value in cfg.items():
        if section == "variants":
            raise ConfigError("this is a sweep file ([[variants]]): run it with `fedsim sweep FILE`")
        known = section in LIST_SECTIONS or any(k == section or k.startswith(section + ".") for k in SCHEMA)
        if not known and section not in OPEN_SECTIONS:
            raise ConfigError(f"unknown config key {section!r}; allowed top-level keys: "
                              f"{sorted({k.split('.')[0] for k in SCHEMA} | set(OPEN_SECTIONS) | set(LIST_SECTIONS))}")
    flat = _flatten({k: v for k, v in cfg.items() if k not in LIST_SECTIONS})
    for key, v in flat.items():
        if key in SCHEMA:
            _check_field(key, SCHEMA[key], v)
        elif key.split(".")[0] not in OPEN_SECTIONS:
            section = key.split(".")[0]
            allowed = sorted(k for k in SCHEMA if k.startswith(section + "."))
            raise ConfigError(f"unknown config key {key!r}; allowed in [{section}]: {allowed}")
    for key, f in SCHEMA.items():
        if key not in flat:
            _check_field(key, f, None)
    fed, train, data = cfg["federation"], cfg["train"], cfg["data"]
    if fed["clients_per_round"] > fed["num_clients"]:
        raise ConfigError(f"federation.clients_per_round ({fed['clients_per_round']}) must be <= "
                          f"federation.num_clients ({fed['num_clients']})")
    if (train["local_steps"] is None) == (train["local_epochs"] is None):
        raise ConfigError("set exactly one of train.local_steps and train.local_epochs "
                          f"(got local_steps={train['local_steps']}, local_epochs={train['local_epochs']})")
    if data["min_per_class"] > data["max_per_class"]:
        raise ConfigError(f"data.min_per_class ({data['min_per_class']}) must be <= data.max_per_class "
                          f"({data['max_per_class']})")
    if data["styles"] and not all(isinstance(x, str) for x in data["styles"]):
        raise ConfigError(f"data.styles must be a list of style names, got {data['styles']!r}")
    if cfg["model"]["hidden"] is not None and not all(isinstance(h, int) and h > 0 for h in cfg["model"]["hidden"]):
        raise ConfigError(f"model.hidden must be a list of positive integers, got {cfg['model']['hidden']!r}")
    for section in LIST_SECTIONS:
        if not isinstance(cfg.get(section, []), list) or not all(isinstance(d, dict) for d in cfg.get(section, [])):
            raise ConfigError(f"{section} must be a list of tables ([[{section}]] with name = ...)")
    check_simulation(cfg["simulation"])
    for where, name in component_names(cfg):
        problem = missing_plugin_file(name)
        if problem:
            raise ConfigError(f"{where}: {problem}")


def validate(cfg: dict[str, Any]) -> dict[str, Any]:
    """Check every key; raise ConfigError naming the first bad one. :func:`precheck` first (no heavy
    imports), then what needs the plugins, torch and the data: model and dataset names and parameters,
    the device, every component section (:func:`fedsim.build.build_components`) and the data. Returns the
    components built to check them: a run is handed these (``run_experiment(components=...)``) and
    builds none of its own."""
    precheck(cfg)
    data = cfg["data"]
    if data["styles"]:  # (the styles module imports torch: not in precheck)
        from fedsim.data.styles import check_styles

        try:
            check_styles(data["styles"])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if data["partition"] == "natural" and not data["styles"]:
        from fedsim.data import builtin_datasets

        builtin = builtin_datasets()
        if data["dataset"] not in builtin or not builtin[data["dataset"]].sources:
            raise ConfigError(f"data.partition = 'natural' needs a dataset with natural sources "
                              f"({sorted(n for n, e in builtin.items() if e.sources)}), got {data['dataset']!r}")
    check_model_and_data(cfg)
    if cfg["device"] != "auto":
        from fedsim.device import resolve_device

        try:
            resolve_device(cfg["device"])
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(f"device: {exc}") from exc
    check_gpus(cfg["simulation"])
    components = build.build_components(cfg)
    check_data(cfg, require_available=False)
    return components


def _name_slots(cfg: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every place where ``cfg`` names a component by a string - model, dataset, rule, channel,
    transforms, defenses, Flower mods, observers, attacks: (its key, the table or list holding the
    name, the name's key or index there). Malformed sections are skipped (validation reports them)."""
    slots: list[tuple[str, Any, Any]] = []
    for section, key in (("model", "name"), ("data", "dataset"), ("strategy", "name"), ("channel", "name")):
        if isinstance(cfg.get(section), dict) and isinstance(cfg[section].get(key), str):
            slots.append((f"{section}.{key}", cfg[section], key))
    client = cfg.get("client")
    lists = [(section, cfg.get(section)) for section in LIST_SECTIONS]
    lists.append(("client.flower_mods", client.get("flower_mods") if isinstance(client, dict) else None))
    for where, entries in lists:
        for i, e in enumerate(entries if isinstance(entries, list) else []):
            if isinstance(e, dict) and isinstance(e.get("name"), str):
                slots.append((f"{where}[{i}].name", e, "name"))
    obs = cfg["output"].get("observers") if isinstance(cfg.get("output"), dict) else None
    for i, o in enumerate(obs if isinstance(obs, list) else []):
        if isinstance(o, str):
            slots.append((f"output.observers[{i}]", obs, i))
        elif isinstance(o, dict) and isinstance(o.get("name"), str):
            slots.append((f"output.observers[{i}].name", o, "name"))
    att = cfg.get("attack")
    if isinstance(att, dict) and isinstance(att.get("name"), str):
        slots.append(("attack.name", att, "name"))
    elif isinstance(att, dict) and isinstance(att.get("name"), list):
        slots += [(f"attack.name[{i}]", att["name"], i) for i, n in enumerate(att["name"]) if isinstance(n, str)]
    return slots


def _attack_params(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    att = cfg.get("attack")
    params = att.get("params") if isinstance(att, dict) else None
    return params if isinstance(params, dict) else None


def component_names(cfg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, name) of every component ``cfg`` names, the attacks' parameter tables included."""
    names = [(where, holder[k]) for where, holder, k in _name_slots(cfg)]
    return names + [(f"attack.params.{k!r}", k) for k in (_attack_params(cfg) or {})]


def absolute_references(cfg: dict[str, Any], base: str | None = None) -> None:
    """Make every plugin file reference in ``cfg`` absolute (relative paths are taken from ``base``,
    default the working directory), so that processes started elsewhere (Ray workers, ``flwr run``'s
    ServerApp) import the same files. Called by :func:`load_config` before validation."""
    from fedsim.references import absolute_reference as ab

    for _, holder, k in _name_slots(cfg):
        holder[k] = ab(holder[k], base)
    params = _attack_params(cfg)
    if params is not None:
        cfg["attack"]["params"] = {ab(k, base): v for k, v in params.items()}


def dump_toml(cfg: Mapping[str, Any]) -> str:
    import tomli_w

    def clean(x: Any) -> Any:  # TOML has no null: drop unset keys
        if isinstance(x, Mapping):
            return {k: clean(v) for k, v in x.items() if v is not None}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return tomli_w.dumps(clean(cfg))


def with_nulls(cfg: dict[str, Any]) -> dict[str, Any]:
    """Re-add keys dropped by :func:`dump_toml` (for configs read back from a run folder)."""
    out = defaults()
    _merge(out, cfg)
    return out
