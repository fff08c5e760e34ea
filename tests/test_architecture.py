"""The layers of the tree (docs/architecture.md) and the message protocol.

* the core (``fedsim`` without ``fedsim.app``) imports no plugin and not the composition root;
* plugins (``strategies``, ``channels``, ``clients``, ``attacks``) import only the core: no plugin
  package imports another (a channel holds both its halves, so neither ``strategies`` nor ``clients``
  needs it);
* the composition root (``fedsim.app``, ``fedsim.__main__``) may import anything but ``experiments``;
* ``experiments`` (experiment scripts on top of the root) imports only the root and the core (plugins
  come in through ``fedsim.app``), and nothing in the tree imports it.

Every import counts: module-level, function-level, relative, and ``importlib.import_module`` /
``__import__`` with a constant name. A second test checks that every key that crosses the wire is
spelled only in ``fedsim/protocol.py``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedsim", "strategies", "channels", "clients", "attacks", "experiments")
PLUGINS = ("strategies", "channels", "clients", "attacks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer(module: str) -> str | None:
    """``core``, ``root``, ``experiments``, a plugin package name, or None (third-party / stdlib)."""
    top = module.split(".")[0]
    if top in PLUGINS or top == "experiments":
        return top
    if top == "fedsim":
        return "root" if module == "fedsim.__main__" or module.startswith("fedsim.app") else "core"
    return None


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in ``source``, wherever it stands."""
    found = []
    pkg = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names]  # from pkg import submodule
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def allowed(src_layer: str, dst_layer: str | None) -> bool:
    if dst_layer is None or src_layer == dst_layer:
        return True
    if dst_layer == "experiments":
        return False  # the top: nothing in the tree imports it
    if src_layer in ("root", "experiments"):
        return src_layer == "root" or dst_layer in ("root", "core")  # experiments: plugins via fedsim.app
    if src_layer == "core":
        return False  # the core imports no plugin and not the root
    return dst_layer == "core"  # a plugin imports only the core


def violations(files: dict[str, str]) -> list[str]:
    """Layer violations in ``{path: source}`` (paths relative to the repository root)."""
    out = []
    for rel, source in files.items():
        path = ROOT / rel
        module = module_name(path)
        src = layer(module)
        if src is None:
            continue
        for line, target in imports_of(source, module, path.name == "__init__.py"):
            dst = layer(target)
            if not allowed(src, dst):
                out.append(f"{rel}:{line}: {src} imports {target} ({dst})")
    return out


def package_files() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_every_import_follows_the_layers():
    files = package_files()
    assert len(files) > 40  # the scan sees the tree at all
    assert violations(files) == []


def test_every_package_of_the_tree_has_a_layer():
    """A new top-level package must be placed in the layer map (and in docs/architecture.md)."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == set(PACKAGES)
    assert all(layer(module_name(ROOT / rel)) is not None for rel in package_files())


@pytest.mark.parametrize("path,source", [
    ("fedsim/rounds.py", "def f():\n    from strategies.fedavg import FedAvg\n"),  # core -> plugin, in a function
    ("fedsim/data/registry.py", "import attacks\n"),
    ("fedsim/seams.py", "from .app import load_plugins\n"),  # core -> root, relative
    ("fedsim/factories.py", "import importlib\nimportlib.import_module('clients.noise')\n"),
    ("strategies/fedavg.py", "def f():\n    import attacks.curious\n"),  # strategies <-> attacks
    ("attacks/dlg.py", "from strategies import compensation\n"),
    ("clients/noise.py", "from attacks.base import Attack\n"),
    ("attacks/curious.py", "from fedsim.app.server import Server\n"),  # plugin -> root
    ("fedsim/app/experiment.py", "from experiments import fedboosting_table\n"),  # root -> experiments
    ("fedsim/tables.py", "def f():\n    import experiments.fedboosting_boundaries\n"),  # core -> experiments
    ("strategies/fedboosting.py", "from experiments.fedboosting_table import main\n"),  # plugin -> experiments
    ("experiments/fedboosting_table.py", "def f():\n    from strategies.fedboosting import FedBoosting\n"),
    ("fedsim/seams.py", "import channels.paillier\n"),  # core -> channel
    ("strategies/fedavg.py", "from channels.paillier import PaillierChannel\n"),  # plugin -> another plugin
    ("clients/noise.py", "def f():\n    from channels.secagg.client import SecAggPlusClientChannel\n"),
    ("channels/ckks.py", "from clients.noise import GaussianNoise\n"),
    ("channels/paillier/server.py", "from fedsim.app.client import channel_for\n"),  # channel -> root
])
def test_the_checker_catches_each_kind_of_violation(path, source):
    assert violations({path: source}), f"not caught: {path}: {source!r}"


@pytest.mark.parametrize("path,source", [
    ("fedsim/app/runner.py", "import strategies\nfrom attacks import curious\n"),
    ("strategies/fedavg.py", "from fedsim.seams import WeightedSumRule\nfrom . import compensation\n"),
    ("attacks/__init__.py", "from . import dlg\n"),
    ("fedsim/app/__init__.py", "import channels\n"),  # the composition root wires the channels
    ("channels/paillier/server.py", "from fedsim.seams import ServerChannel\nfrom .client import PaillierClientChannel\n"),
    ("experiments/fedboosting_table.py", "from fedsim.app.sweep import run_sweep\nfrom fedsim.reports import md_table\n"
                                         "from . import fedboosting_boundaries\n"),
])
def test_the_checker_allows_what_the_layers_allow(path, source):
    assert violations({path: source}) == []



def test_the_composition_root_loads_every_plugin_package():
    """``fedsim.app.load_plugins`` imports each plugin package (a package it forgot registers nothing: its
    names would be unknown to every config), and nothing else in the tree imports ``channels``."""
    tree = ast.parse((ROOT / "fedsim/app/__init__.py").read_text())
    [load] = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "load_plugins"]
    assert set(PLUGINS) <= {t for _, t in imports_of(ast.unparse(load), "fedsim.app", True)}
    importers = {rel for rel, src in package_files().items()
                 for _, t in imports_of(src, module_name(ROOT / rel), rel.endswith("__init__.py"))
                 if t.split(".")[0] == "channels" and not rel.startswith("channels/")}
    assert importers == {"fedsim/app/__init__.py"}


# ------------------------------------------------------------------------------ import cycles
CYCLE_PACKAGES = ("fedsim", "strategies", "channels", "clients", "attacks")


def import_cycles(files: dict[str, str]) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (strongly connected
    components of the import graph; every import counts, function-level ones too). An import names
    the module it resolves to (``from a.b import name`` -> ``a.b``, ``from a import b`` -> ``a.b``)."""
    modules = {module_name(ROOT / rel): rel for rel in files}
    graph: dict[str, set[str]] = {}
    for module, rel in modules.items():
        found = imports_of(files[rel], module, rel.endswith("__init__.py"))
        submodules = {(line, t.rpartition(".")[0]) for line, t in found if t in modules}
        deps = set()
        for line, target in found:
            if (line, target) in submodules:
                continue  # ``from pkg import submodule`` imports the submodule, not what pkg/__init__ adds
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                deps.add(target)
        graph[module] = deps
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    files = {str(p.relative_to(ROOT)): p.read_text() for pkg in CYCLE_PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert len(files) > 40
    assert import_cycles(files) == []


def test_the_cycle_checker_catches_a_cycle_through_a_function_level_import():
    files = {"attacks/__init__.py": "from . import base, batched, dlg\n",
             "attacks/base.py": "from attacks import batched\n",
             "attacks/batched.py": "from ._common import Target\n",
             "attacks/_common.py": "def f():\n    from .base import AttackInput\n",
             "attacks/dlg.py": "from attacks.base import Attack\n"}
    assert import_cycles(files) == [["attacks._common", "attacks.base", "attacks.batched"]]
    files["attacks/_common.py"] = "def f():\n    import math\n"  # the cycle broken
    assert import_cycles(files) == []

# ------------------------------------------------------------------------------ the message protocol
def wire_keys() -> dict[str, str]:
    """Every string constant of fedsim/protocol.py that names a record, key, state entry or message type."""
    import fedsim.protocol as protocol

    return {name: v for name, v in vars(protocol).items() if name.isupper() and isinstance(v, str)}


def config_spelled_keys() -> set[str]:
    """Recipe keys that are also ``[train]`` config keys (``lr``, ``batch_size``, ...): the config schema
    and config reads (``cfg["train"]["lr"]``) spell them too, so only where a wire key stands (a message's
    content, a recipe) must they be the protocol's constants. A recipe key that is no config key
    (FedProx's ``proximal-mu``) counts everywhere."""
    from fedsim.config import SCHEMA
    from fedsim.protocol import RECIPE_KEYS

    return {k for k in RECIPE_KEYS if f"train.{k}" in SCHEMA}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


MESSAGE_CATEGORIES = ("train", "evaluate", "query")  # ClientApp.<category>(action) registers a handler


def _wire_positions(tree: ast.AST) -> set[int]:
    """Constants that stand where a wire key goes: the index of ``<...>.content[...]`` (or of a record
    taken from it) and of a recipe (``<...>.recipe[...]``, ``recipe[...]``), ``.content.get(...)`` and
    ``.recipe.get(...)``, the left side of ``... in <...>.recipe``, a key of a ``RecordDict({...})``
    literal, ``message_type=``, and the action of a handler decorator ``@<app>.train/evaluate/query(...)``."""
    ids: set[int] = set()

    def mentions_wire(e: ast.AST) -> bool:
        return any((isinstance(n, ast.Attribute) and n.attr in ("content", "recipe"))
                   or (isinstance(n, ast.Name) and n.id == "recipe") for n in ast.walk(e))

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and mentions_wire(node.value):
            ids.add(id(node.slice))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and mentions_wire(node.comparators[0]):
            ids.add(id(node.left))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) \
                        and d.func.attr in MESSAGE_CATEGORIES:
                    ids |= {id(a) for a in d.args} | {id(k.value) for k in d.keywords if k.arg == "action"}
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get" and mentions_wire(f.value) and node.args:
                ids.add(id(node.args[0]))
            if getattr(f, "id", getattr(f, "attr", "")) == "RecordDict" and node.args \
                    and isinstance(node.args[0], ast.Dict):
                ids |= {id(k) for k in node.args[0].keys if k is not None}
            ids |= {id(k.value) for k in node.keywords if k.arg == "message_type"}
    return ids


def stray_literals(files: dict[str, str], keys: dict[str, str], config_keys: set[str] = frozenset()) -> list[str]:
    """Wire keys spelled outside fedsim/protocol.py. Keys with a ``-``, ``_`` or ``.`` (``partition-id``,
    ``noise_variance``, ...) count anywhere but in docstrings, except ``config_keys`` (also config key
    names); plain words that are also ordinary names (``arrays``, ``config``, ``train``, ``lr``, ...) and
    ``config_keys`` count where a wire key stands (:func:`_wire_positions`)."""
    values: dict[str, list[str]] = {}
    for k, v in keys.items():
        values.setdefault(v, []).append(k)
    out = []
    for rel, source in files.items():
        if rel == "fedsim/protocol.py":
            continue
        tree = ast.parse(source)
        docs, wire = _docstring_nodes(tree), _wire_positions(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in values \
                    and id(node) not in docs and (id(node) in wire
                                                  or not (node.value.isalpha() or node.value in config_keys)):
                names = " or ".join(f"fedsim.protocol.{n}" for n in values[node.value])
                out.append(f"{rel}:{node.lineno}: {node.value!r} (use {names})")
    return out


def test_every_wire_key_is_spelled_only_in_the_protocol_module():
    keys, config_keys = wire_keys(), config_spelled_keys()
    assert {"ARRAYS", "METRICS", "CONFIG", "PARTITION_ID", "NUM_EXAMPLES", "NOISE_VARIANCE", "FEDSIM_CONFIG",
            "SERVER_ROUND", "TRAIN", "QUERY", "EVALUATE", "CHANNEL_SETUP", "CHANNEL_SETUP_ACTION",
            "CROSS_VALIDATE_ACTION", "PROXIMAL_MU", "LR"} <= set(keys)
    assert config_keys == {"lr", "batch_size", "local_steps", "local_epochs", "momentum", "weight_decay"}
    assert stray_literals(package_files(), keys, config_keys) == []
    # the check itself sees stray keys in each position
    for source in ('n = reply.content["metrics"]\n', 'n = metrics["num-examples"]\n',
                   'm = Message(RecordDict({"arrays": a}), message_type="train")\n',
                   'c = msg.content.get("config")\n', 'r = msg.content["metrics"]["partition-id"]\n',
                   '@client_app.query("channel")\ndef setup(msg, context): ...\n',
                   '@app.evaluate(action="crossval")\ndef cv(msg, context): ...\n',
                   'lr = float(ctx.recipe["lr"])\n', 'bs = recipe.get("batch_size", 8)\n',
                   'known = "lr" in update.recipe\n', 'mu = config["proximal-mu"]\n'):
        assert stray_literals({"strategies/x.py": source}, keys, config_keys), source
    for source in ('cfg["train"]["lr"]\n', 'bs = int(train["batch_size"])\n',  # config reads
                   '@client_app.query()\ndef q(msg, context): ...\n'):
        assert stray_literals({"strategies/x.py": source}, keys, config_keys) == [], source


def test_flower_app_components_exist():
    """pyproject's [tool.flwr.app.components] point at a real ServerApp and ClientApp."""
    import importlib
    import tomllib

    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    comps = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["components"]
    for key, cls in (("serverapp", ServerApp), ("clientapp", ClientApp)):
        mod, attr = comps[key].split(":")
        assert isinstance(getattr(importlib.import_module(mod), attr), cls)


def test_python_floor_matches_the_dependencies():
    """requires-python is no lower than what the installed Flower requires (Flower >= 1.31: 3.11) and
    than the stdlib fedsim uses (tomllib: 3.11), and ruff lints for that same floor."""
    import tomllib
    from importlib.metadata import metadata

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())

    def floor(spec: str) -> tuple[int, ...]:
        (low,) = [s.strip()[2:] for s in spec.split(",") if s.strip().startswith(">=")]
        return tuple(int(x) for x in low.split("."))

    ours = floor(project["project"]["requires-python"])
    assert ours >= floor(metadata("flwr")["Requires-Python"]) and ours >= (3, 11)
    assert project["tool"]["ruff"]["target-version"] == "py" + "".join(map(str, ours[:2]))
