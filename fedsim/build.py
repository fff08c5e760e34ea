"""Components built from a config, through their registries (:mod:`fedsim.components`, one mechanism):
the aggregation rule, the channel, the server transforms, the clients' defense pipeline, the Flower
mods, the observers (the curious server last) and the privacy ledger. :func:`fedsim.config.validate`
builds them once to check a config; every problem is a :class:`ConfigError` naming the key."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from fedsim.components import (
    CHANNELS,
    DEFENSES,
    FLOWER_MODS,
    OBSERVERS,
    STRATEGIES,
    TRANSFORMS,
    ConfigError,
)

CURIOUS_SERVER = "curious-server"  # the observer the [attack] section configures

# keys that moved to another section: the error says where
MOVED = {
    "compensation": 'seed 000\'s compensation is a server transform now: [[transforms]] name = "mp-compensation"',
    "compensation_feedback": 'use [[transforms]] name = "mp-compensation" with feedback = true',
    "compensation_mode": 'use [[transforms]] name = "mp-compensation" with mode = ...',
    "Q": 'use [[transforms]] name = "mp-compensation" with Q = ...',
}


def client_pipeline(cfg: Mapping[str, Any], transforms: Sequence[Any] | None = None) -> Any:
    """The clients' defense pipeline: what the server transforms require of every client, then
    ``[[defenses]]`` in order."""
    from fedsim.defense import DefensePipeline

    if transforms is None:
        transforms = TRANSFORMS.build_list(cfg.get("transforms", []), "transforms")
    required = [e for t in transforms for e in t.client_defenses()]
    try:
        return DefensePipeline(DEFENSES.build_list(required, "defenses required by the transforms", cfg=cfg)
                               + DEFENSES.build_list(cfg.get("defenses", []), "defenses", cfg=cfg))
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def build_components(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Validate every component section through its registry and build the components (one mechanism).

    Returns ``rule``, ``channel``, ``transforms``, ``defenses``, ``flower_mods``, ``observers`` (the
    curious server last, when ``[attack]`` is set) and ``privacy`` (the :class:`fedsim.privacy.PrivacyLedger`
    of the mechanisms the rule, the defenses and the mods declare). Raises :class:`ConfigError` naming the key.
    """
    from fedsim.seams import ClientChannel, check_compatible

    strategy = dict(cfg["strategy"])
    for k in strategy:
        if k in MOVED:
            raise ConfigError(f"strategy.{k} moved: {MOVED[k]}")
    rule = STRATEGIES.build(strategy, "strategy")
    channel = CHANNELS.build(dict(cfg.get("channel") or {"name": "plain"}), "channel")
    transforms = TRANSFORMS.build_list(cfg.get("transforms", []), "transforms")
    check_compatible(type(channel), rule,
                     [(f"transforms[{i}]", type(t)) for i, t in enumerate(transforms)])
    half = getattr(type(channel), "client", None)
    if not (isinstance(half, type) and issubclass(half, ClientChannel)):  # the ClientApp builds it by the same name
        raise ConfigError(f"channel.name: {type(channel).__name__} names no client half (give the class "
                          f"client = a fedsim.seams.ClientChannel subclass)")
    from fedsim.seams import INDIVIDUAL, capabilities

    if cfg["federation"].get("max_update_norm") is not None and INDIVIDUAL not in capabilities(type(channel).provides):
        raise ConfigError(f"federation.max_update_norm needs each client's model in plaintext, which channel "
                          f"{channel.name!r} does not give the server (its own bounds apply: docs/failures.md)")
    for where, component in [("strategy", rule), ("channel", channel),
                             *((f"transforms[{i}]", t) for i, t in enumerate(transforms))]:
        _validate(where, component, cfg)  # checks that need the rest of the config
    defenses = client_pipeline(cfg, transforms)
    for i, d in enumerate(defenses.defenses):
        _validate(f"defenses[{i}]", d, cfg)
    mods = FLOWER_MODS.build_list(cfg["client"]["flower_mods"], "client.flower_mods")
    for i, mod in enumerate(mods):  # a mod may check the rest of the config (e.g. the strategy it belongs to)
        entry = cfg["client"]["flower_mods"][i]
        _validate(f"client.flower_mods[{i}]", mod, cfg, entry.get("name") if isinstance(entry, Mapping) else entry)
    from fedsim.privacy import build_ledger

    try:
        privacy = build_ledger(rule, defenses, mods, cfg)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"privacy accounting: {exc}") from exc
    observers = OBSERVERS.build_list(cfg["output"]["observers"], "output.observers", cfg=cfg)
    implied = [e for d in defenses.defenses for e in d.server_observers()]
    observers += OBSERVERS.build_list(implied, "observers implied by the defenses", cfg=cfg)
    checked = [(f"output.observers[{i}]" if i < len(cfg["output"]["observers"]) else
                "observers implied by the defenses", o) for i, o in enumerate(observers)]
    if cfg.get("attack"):  # [attack] configures the curious server (validated even when enabled = false)
        curious = OBSERVERS.build_named(CURIOUS_SERVER, cfg["attack"], "attack", cfg=cfg)
        checked.append(("attack", curious))  # its attacks' own checks (Attack.validate_config)
        if cfg["attack"].get("enabled", True) is not False:
            observers.append(curious)
    for where, obs in checked:
        _validate(where, obs, cfg)
    return {"rule": rule, "channel": channel, "transforms": transforms, "defenses": defenses,
            "flower_mods": mods, "observers": observers, "privacy": privacy}


def _validate(where: str, component: Any, cfg: Mapping[str, Any], name: Any = None) -> None:
    """A component's checks against the rest of the config (``validate_config``, the hook every component
    has); a ValueError becomes a ConfigError naming ``where`` and the component."""
    check = getattr(component, "validate_config", None)
    if not callable(check):
        return
    try:
        check(cfg)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{where} ({getattr(component, 'name', name) if name is None else name}): {exc}") from exc
