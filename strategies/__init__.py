"""Server-side plugins: aggregation rules and server transforms (channels: the ``channels`` package).

Importing this package registers them in :mod:`fedsim.components` (``STRATEGIES``,
``TRANSFORMS``). They implement the seams of :mod:`fedsim.seams`; strategies never import
``attacks`` (the curious server is just another observer) or ``clients``.
"""
from strategies import (  # noqa: F401
    compensation,
    dp,
    fedavg,
    fedboosting,
    flower,
    lossless,
    robbing,
)
