"""Client-side plugins: defenses (composed as a pipeline from ``[[defenses]]``) and Flower client mods.

Importing this package registers every built-in defense in :data:`fedsim.components.DEFENSES` and
every Flower mod in :data:`fedsim.components.FLOWER_MODS`. The defense interface itself
(:class:`fedsim.defense.Defense`) belongs to the core.
"""
from clients import clipping, fedkl, flower_mods, lossless, noise, pruning, slicing  # noqa: F401
