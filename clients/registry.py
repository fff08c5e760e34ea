"""Imports every built-in defense module so that each registers itself in ``clients.base.DEFENSES``."""
