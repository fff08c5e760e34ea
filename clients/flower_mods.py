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
Gaussian noise of standard deviation ``sensitivity * sqrt(2 ln(1.25 / delta)) / epsilon`` to the
returned model (Flower 1.41's LocalDpMod). Flower's server-side DP
wrappers (``DifferentialPrivacy*``) wrap a strategy; fedsim's ``clip-update`` + ``gaussian-noise``
defenses cover fixed clipping with noise inside the defense pipeline.
"""
from __future__ import annotations

from flwr.clientapp.mod import LocalDpMod

from fedsim.components import FLOWER_MODS

FLOWER_MODS.add("local-dp", LocalDpMod)
