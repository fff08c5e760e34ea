"""Imports every built-in defense module so that each registers itself in ``clients.base.DEFENSES``."""
import clients.clipping  # noqa: F401
import clients.noise  # noqa: F401
import clients.pruning  # noqa: F401
import clients.slicing  # noqa: F401
