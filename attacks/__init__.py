"""Gradient-leakage attacks of a curious server.

Importing this package registers every attack in :data:`ATTACKS`:

* ``dlg``  - Deep Leakage from Gradients (Zhu et al. 2019), labels optimised jointly;
* ``idlg`` - DLG with labels inferred from the gradient (Zhao et al. 2020);
* ``cpl``  - the CPL attack of seed 001 (geometric initialisation, label regulariser, threshold stop);
* ``ig``   - Inverting Gradients (Geiping et al. 2020), optionally FedAvg-aware.

Build one by name with :func:`build_attack`; run it on an :class:`AttackInput`.
"""
from __future__ import annotations

import inspect
from typing import Any

from . import cpl, dlg, inverting, regularised, robbing  # noqa: F401  (registration)
from .base import ATTACKS, Attack, AttackInput, AttackResult, register


def attack_params(cls: type[Attack]) -> list[str]:
    """Keyword parameters an attack class accepts (following ``**kwargs`` up its bases)."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        sig = inspect.signature(init)
        more = False
        for p in list(sig.parameters.values())[1:]:
            if p.kind is p.VAR_KEYWORD:
                more = True
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names:
                names.append(p.name)
        if not more:
            break
    return names


def build_attack(name: str, **params: Any) -> Attack:
    """Instantiate a registered attack, rejecting unknown names and parameters with clear errors."""
    if name not in ATTACKS:
        raise ValueError(f"attack.name must be one of {sorted(ATTACKS)}, got {name!r}")
    cls = ATTACKS[name]
    allowed = attack_params(cls)
    for key in params:
        if key not in allowed:
            raise ValueError(f"attack.{key} is not a parameter of attack {name!r}; "
                             f"allowed: {', '.join(sorted(allowed))}")
    return cls(**params)


__all__ = ["ATTACKS", "Attack", "AttackInput", "AttackResult", "attack_params", "build_attack", "register"]
