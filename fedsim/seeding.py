"""Seeding: the process's random generators from the run's seed, and seeds derived from integers.

Every random choice of a run is a function of the config's ``seed``: :func:`seed_everything` before the
global model is built (its initial weights), :func:`derive_seed` for everything drawn per (round,
client, purpose) - client sampling, batch order, a defense's noise, a channel's dropouts.
"""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers (stable across processes and platforms)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint32)
               .astype(np.uint64).dot(np.array([1, 2**32], dtype=np.uint64)) & np.uint64(2**63 - 1))
