"""The composition root: the one place that wires fedsim's plugins into its core.

Layers (``tests/test_architecture.py`` checks every import, function-level ones included):

* the core (``fedsim`` minus this package): config schema, data, models, local training, metrics,
  the message protocol, the seams and registries, the round engine, observers, reports. It imports
  no plugin.
* plugins: ``strategies`` (aggregation rules, server channel halves, server transforms), ``clients``
  (defenses, Flower mods, client channel halves), ``attacks`` (attacks and the curious server). Each
  imports only the core; ``strategies`` and ``attacks`` never import each other.
* this package: the runner, the CLI, the Flower ServerApp/ClientApp, sweeps and the one-shot attack
  command. Importing it registers the built-in plugins (:func:`load_plugins`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

_LOADED = False


def load_plugins() -> None:
    """Import the built-in plugin packages (each registers its components in fedsim.components)."""
    global _LOADED
    if _LOADED:
        return
    import attacks  # noqa: F401
    import clients  # noqa: F401
    import strategies  # noqa: F401

    _LOADED = True


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Defaults <- TOML file <- overrides, validated with every plugin registered."""
    from fedsim import config

    load_plugins()
    return config.load_config(path, overrides)


def validate(cfg: dict[str, Any]) -> None:
    from fedsim import config

    load_plugins()
    config.validate(cfg)


def build_components(cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's components (rule, channel, transforms, defenses, Flower mods, observers)."""
    from fedsim import config

    load_plugins()
    return config.build_components(cfg)
