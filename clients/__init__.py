"""Client-side defenses, composed as a pipeline from the ``[[defenses]]`` entries of a config."""
from clients.base import DEFENSES, Defense, DefenseContext, DefensePipeline, build_pipeline, register

__all__ = ["DEFENSES", "Defense", "DefenseContext", "DefensePipeline", "build_pipeline", "register"]
