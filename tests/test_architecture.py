"""The direction of imports: attacks and strategies never import each other; clients neither."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_packages(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package,forbidden", [
    ("strategies", {"attacks", "clients"}),
    ("attacks", {"strategies"}),
    ("clients", {"attacks", "strategies"}),
])
def test_import_direction(package, forbidden):
    assert imported_packages(package)  # the scan sees the package's imports at all
    assert not (imported_packages(package) & forbidden)


def test_flower_app_components_exist():
    """pyproject's [tool.flwr.app.components] point at a real ServerApp and ClientApp."""
    import tomllib
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    comps = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["components"]
    import importlib

    for key, cls in (("serverapp", ServerApp), ("clientapp", ClientApp)):
        mod, attr = comps[key].split(":")
        assert isinstance(getattr(importlib.import_module(mod), attr), cls)
