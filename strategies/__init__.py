"""Server-side plugins: aggregation rules, server channel halves and server transforms.

Importing this package registers them in :mod:`fedsim.components` (``STRATEGIES``, ``CHANNELS``,
``TRANSFORMS``). They implement the seams of :mod:`fedsim.seams`; strategies never import
``attacks`` (the curious server is just another observer) or ``clients``.
"""
from strategies import (  # noqa: F401
    ckks,
    compensation,
    dp,
    fedavg,
    fedboosting,
    flower,
    lossless,
    paillier,
    robbing,
    secagg,
)
