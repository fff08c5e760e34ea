"""Flower's own client-side privacy mods, exposed under fedsim's config.

Where Flower already implements a mechanism, fedsim runs Flower's code rather than a rewrite:
``[[client.flower_mods]]`` entries wrap the ClientApp's train handler with Flower mods, in order
(the first entry is the outermost), exactly as ``@app.train(mods=[...])`` would.

=============  ==========================================  =========================================
name           Flower mod                                  parameters
=============  ==========================================  =========================================
``local-dp``   ``flwr.clientapp.mod.LocalDpMod``           clipping_norm, sensitivity, epsilon, delta
=============  ==========================================  =========================================

``local-dp`` clips the client's update (returned - received weights) to ``clipping_norm`` and adds
Laplace noise of scale ``sensitivity / epsilon`` (Flower's local DP). Flower's server-side DP
wrappers (``DifferentialPrivacy*``) wrap a strategy; fedsim's ``clip-update`` + ``gaussian-noise``
defenses cover fixed clipping with noise inside the defense pipeline.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Sequence

from flwr.clientapp.mod import LocalDpMod

FLOWER_MODS: dict[str, type] = {"local-dp": LocalDpMod}

Handler = Callable[[Any, Any], Any]


def _params(cls: type) -> dict[str, Any]:
    return {n: p.default for n, p in list(inspect.signature(cls.__init__).parameters.items())[1:]}


def build_flower_mods(entries: Sequence[Mapping[str, Any]]) -> list[Callable]:
    """Instantiate ``[[client.flower_mods]]`` entries; errors name ``client.flower_mods[i].key``."""
    mods = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"client.flower_mods[{i}] must be a table with a name")
        name = entry.get("name")
        if name not in FLOWER_MODS:
            raise ValueError(f"client.flower_mods[{i}].name must be one of {sorted(FLOWER_MODS)}, got {name!r}")
        cls = FLOWER_MODS[name]
        allowed = _params(cls)
        params = {k: v for k, v in entry.items() if k != "name"}
        for k in params:
            if k not in allowed:
                raise ValueError(f"client.flower_mods[{i}].{k} is not a parameter of {name!r}; "
                                 f"allowed: {sorted(allowed)}")
        missing = [k for k, v in allowed.items() if v is inspect.Parameter.empty and k not in params]
        if missing:
            raise ValueError(f"client.flower_mods[{i}] ({name}) needs {missing}")
        try:
            mods.append(cls(**params))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"client.flower_mods[{i}] ({name}): {exc}") from exc
    return mods


def wrap(handler: Handler, mods: Sequence[Callable]) -> Handler:
    """``handler`` wrapped by Flower mods (``mod(msg, context, call_next)``), first mod outermost."""
    for mod in reversed(list(mods)):
        handler = (lambda m, nxt: lambda msg, ctx: m(msg, ctx, nxt))(mod, handler)
    return handler
