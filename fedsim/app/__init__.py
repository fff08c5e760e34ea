"""The composition root: the one place that wires fedsim's plugins into its core.

Layers (``tests/test_architecture.py`` checks every import, function-level ones included):

* the core (``fedsim`` minus this package): config schema, data, models, local training, metrics,
  the message protocol, the seams and registries, the round engine, observers, reports. It imports
  no plugin.
* plugins: ``strategies`` (aggregation rules, server transforms), ``channels`` (each channel's server
  and client halves), ``clients`` (defenses, Flower mods), ``attacks`` (attacks and the curious server).
  Each imports only the core; plugin packages never import each other.
* this package: the runner, the CLI, the Flower ServerApp/ClientApp, sweeps and the one-shot attack
  command. Importing it registers the built-in plugins (:func:`load_plugins`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

_LOADED = False


ENTRY_POINT_GROUP = "fedsim.plugins"


def load_plugins() -> None:
    """Import the built-in plugin packages (each registers its components in fedsim.components), then
    every installed package's ``fedsim.plugins`` entry points (modules that register their own models,
    datasets, defenses, attacks, rules or observers; docs/plugins.md)."""
    global _LOADED
    if _LOADED:
        return
    import attacks  # noqa: F401
    import channels  # noqa: F401
    import clients  # noqa: F401
    import fedsim.export  # noqa: F401  (the tensorboard observer)
    import strategies  # noqa: F401

    _LOADED = True
    load_entry_points()


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Load every entry point of ``group`` (each names a module, or an object in one, whose import
    registers components). Returns their names; a failing one raises ConfigError naming it."""
    from importlib.metadata import entry_points

    from fedsim.components import ConfigError

    loaded = []
    for ep in entry_points(group=group):
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001 - reported with the entry point's name
            raise ConfigError(f"fedsim plugin entry point {ep.name!r} ({ep.value}) failed to load: "
                              f"{type(exc).__name__}: {exc}") from exc
        loaded.append(ep.name)
    return loaded


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Defaults <- TOML file <- overrides, validated with every plugin registered (:func:`validate`)."""
    from fedsim import config

    cfg = config.read_config(path, overrides)
    validate(cfg)
    return cfg


def validate(cfg: dict[str, Any]) -> None:
    """:func:`fedsim.config.precheck` first - a bad key or a missing file is reported before torch,
    Flower or a plugin is imported - then the plugins, then :func:`fedsim.config.validate`."""
    from fedsim import config

    config.precheck(cfg)
    load_plugins()
    config.validate(cfg)


def build_components(cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's components (rule, channel, transforms, defenses, Flower mods, observers)."""
    from fedsim import build

    load_plugins()
    return build.build_components(cfg)
