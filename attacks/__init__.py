"""Gradient-leakage attacks of a curious server.

Importing this package registers every attack in :data:`fedsim.components.ATTACKS` and the curious
server, seed 002's curious client (``curious-client``) and the curious server's membership inference
(``curious-server-mia``, :mod:`attacks.membership_server`) in :data:`fedsim.components.OBSERVERS`:

* ``dlg``  - Deep Leakage from Gradients (Zhu et al. 2019), labels optimised jointly;
* ``dlg-original`` - DLG with the original's settings (one start from N(0, 1), 300 L-BFGS steps of up to
  20 iterations, no early stop): the DLG seed 003 compares GRNN against;
* ``idlg`` - DLG with labels inferred from the gradient (Zhao et al. 2020);
* ``cpl``  - the CPL attack of seed 001 (geometric initialisation, label regulariser, threshold stop);
* ``ig``   - Inverting Gradients (Geiping et al. 2020), optionally FedAvg-aware;
* ``grnn`` - GRNN, the generative regression attack of seed 003 (chapter 3);
* ``ig-bn`` - Inverting Gradients with a BatchNorm-statistics prior (Yin et al. 2021);
* ``ig-fr`` - seed 004's attack: IG + feature-matching regulariser + untrained-CNN image prior;
* ``robbing`` - Robbing the Fed (Fowl et al. 2022): a *malicious* server's imprint module;
* ``strongest`` - a combination (no paper's attack): GRNN's generator as the start of CPL-regularised
  L-BFGS on the pixels, with inferred label counts and restarts (:mod:`attacks.strongest`).

Each attack's defaults (``dlg-original`` aside) are the strongest measured setting at a stated budget (docs/benchmarks.md,
"Attack strength"). Build one by name with :func:`build_attack`; run it on an :class:`AttackInput`, or
on all victims of a round at once with :meth:`Attack.run_many` (one stacked optimisation per group of
victims that share the global model; :mod:`attacks.batched`).
"""
from __future__ import annotations

from typing import Any

from fedsim.components import declared_params

from . import (  # noqa: F401  (registration)
    cpl,
    curious,
    curious_client_observer,
    dlg,
    fedkl,
    grnn,
    inverting,
    knowledge,
    membership_server,
    regularised,
    robbing,
    strongest,
)
from .base import ATTACKS, Attack, AttackInput, AttackResult, register


def attack_params(cls: type[Attack]) -> list[str]:
    """Keyword parameters an attack class accepts (following ``**kwargs`` up its bases)."""
    return list(declared_params(cls))


def build_attack(name: str, where: str = "attack", **params: Any) -> Attack:
    """Instantiate a registered attack; unknown names and parameters raise errors naming ``where``."""
    return ATTACKS.build_named(name, params, where)


__all__ = ["ATTACKS", "Attack", "AttackInput", "AttackResult", "attack_params", "build_attack", "register"]
