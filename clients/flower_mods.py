"""Flower's own client mods, exposed under fedsim's config.

Where Flower already implements a mechanism, fedsim runs Flower's code rather than a rewrite:
``[[client.flower_mods]]`` entries wrap the ClientApp's train handler with Flower mods, in order
(the first entry is the outermost), exactly as ``@app.train(mods=[...])`` would. They wrap training
only: evaluation and the channels' setup exchanges never pass through them.

=====================  ==========================================  =========================================
name                   Flower mod                                  parameters
=====================  ==========================================  =========================================
``local-dp``           ``flwr.clientapp.mod.LocalDpMod``           clipping_norm, sensitivity, epsilon, delta
``fixed-clipping``     ``flwr.clientapp.mod.fixedclipping_mod``    none (the norm comes from the strategy)
``adaptive-clipping``  ``flwr.clientapp.mod.adaptiveclipping_mod`` none (the norm comes from the strategy)
=====================  ==========================================  =========================================

``local-dp`` clips the client's update (returned - received weights) to ``clipping_norm`` and adds
Gaussian noise of standard deviation ``sensitivity * sqrt(2 ln(1.25 / delta)) / epsilon`` to the
returned model (Flower's LocalDpMod). Its nominal (epsilon, delta) holds per release only when
``sensitivity`` bounds how far one client's data moves the update, i.e. ``sensitivity >=
clipping_norm``, and only for one round: fedsim's ledger (:mod:`fedsim.privacy`) reports the
guarantee actually given, from the noise multiplier ``std / clipping_norm``, composed over the rounds
each client takes part in (client level, against the server).

``fixed-clipping`` / ``adaptive-clipping`` are the client halves of Flower's central-DP wrappers with
client-side clipping (``strategy.name = "flwr-dp-client-fixed"`` / ``"flwr-dp-client-adaptive"``,
``strategies/dp.py``): they clip the update to the norm the strategy sends, and the adaptive one reports
whether it clipped (``norm_bit``). Each is refused at config time without its strategy.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, fixedclipping_mod

from fedsim.components import FLOWER_MODS
from fedsim.privacy import AGAINST_SERVER, Mechanism, classic_gaussian_std
from fedsim.protocol import CONFIG, FEDSIM_CONFIG, NODE_PARTITION_ID, SERVER_ROUND
from fedsim.seeding import derive_seed


class LocalDp(LocalDpMod):
    """Flower's ``LocalDpMod``, unchanged, with fedsim's privacy declaration."""

    def __init__(self, clipping_norm: float, sensitivity: float, epsilon: float, delta: float) -> None:
        if not epsilon > 0:  # Flower accepts 0 and then divides by it in the first round
            raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        super().__init__(clipping_norm, sensitivity, epsilon, delta)

    def __call__(self, msg: Message, context: Context, call_next: Any) -> Message:
        """Flower's mod, its noise drawn from NumPy's global generator seeded by (seed, round, client) right
        before Flower draws it: in a Ray actor nothing else seeds that generator, so without this the noise
        differed from run to run (and in-process it depended on what ran before)."""
        def train_then_seed(m: Message, ctx: Context) -> Message:
            reply = call_next(m, ctx)
            conf = msg.content[CONFIG]
            seed = json.loads(str(conf[FEDSIM_CONFIG]))["seed"]
            np.random.seed(derive_seed(seed, int(conf[SERVER_ROUND]), int(context.node_config[NODE_PARTITION_ID]),
                                       0x1D9) % 2 ** 32)
            return reply
        return super().__call__(msg, context, train_then_seed)

    def privacy(self, cfg: Mapping[str, Any], key: str) -> list[Mechanism]:
        std = classic_gaussian_std(self.sensitivity, self.epsilon, self.delta)
        z = std / self.clipping_norm
        desc = (f"Flower's LocalDpMod: update clipped to {self.clipping_norm:g}, Gaussian noise std {std:.3g} "
                f"(nominal epsilon {self.epsilon:g}, delta {self.delta:g}, sensitivity {self.sensitivity:g})")
        notes = [f"accounted with noise multiplier std / clipping_norm = {z:.4g} per round a client takes part in"]
        if self.sensitivity < self.clipping_norm:
            notes.append(f"sensitivity {self.sensitivity:g} < clipping_norm {self.clipping_norm:g}: Flower's nominal "
                         "per-round epsilon does not hold; the reported one does")
        return [Mechanism(f"{key}.local-dp", desc, "client", AGAINST_SERVER, self.delta,
                          per_participation=lambda r, c, conf: [(z, 1.0, 1)], notes=notes)]


class _CentralClipping:
    """A Flower central-DP clipping mod as a configurable fedsim mod (it takes no parameters: the norm comes
    with every train message from the strategy)."""

    mod: Any = None
    strategy = ""

    def __call__(self, msg: Message, context: Context, call_next: Any) -> Message:
        return type(self).mod(msg, context, call_next)

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        name = (cfg.get("strategy") or {}).get("name")
        if name != self.strategy:
            raise ValueError(f"this mod is the client half of strategy.name = {self.strategy!r} (it clips to the "
                             f"norm that strategy sends), got strategy.name = {name!r}")


class FixedClipping(_CentralClipping):
    """Flower's ``fixedclipping_mod``."""

    mod = staticmethod(fixedclipping_mod)
    strategy = "flwr-dp-client-fixed"


class AdaptiveClipping(_CentralClipping):
    """Flower's ``adaptiveclipping_mod``."""

    mod = staticmethod(adaptiveclipping_mod)
    strategy = "flwr-dp-client-adaptive"


FLOWER_MODS.add("local-dp", LocalDp)
FLOWER_MODS.add("fixed-clipping", FixedClipping)
FLOWER_MODS.add("adaptive-clipping", AdaptiveClipping)
