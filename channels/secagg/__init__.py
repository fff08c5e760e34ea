"""Flower's SecAgg+ as a channel: ``[channel] name = "secagg+"``; the server half in :mod:`.server`
(which names the client half), Flower's workflow and the per-stage reply checks in :mod:`.workflow`, the
client half (Flower's ``secaggplus_mod`` around fedsim's training) in :mod:`.client`. docs/secagg.md."""
from channels.secagg.client import SecAggPlusClientChannel
from channels.secagg.server import SecAggPlusChannel

__all__ = ["SecAggPlusChannel", "SecAggPlusClientChannel"]
