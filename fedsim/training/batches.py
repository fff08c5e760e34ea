"""The deterministic batch order: which local examples each mini-batch holds, from (seed, round, client).

The client trains in this order; the curious server's scorer re-creates it to know which samples a victim
trained on (it needs the config alone, never anything the client sent).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from fedsim.seeding import derive_seed
from fedsim.training.recipe import Recipe


def iter_batches(seed: int, round: int, client: int, n: int, recipe: Recipe) -> Iterator[np.ndarray]:
    """Positions (into the client's local data) of each local mini-batch, in training order, drawn lazily:
    memory stays bounded by one permutation of the local data for any ``local_steps``/``local_epochs``.

    ``local_steps`` mode draws full batches of ``min(batch_size, n)`` from successive shuffles
    (drop-last), so every step sees the same batch size; ``local_epochs`` mode keeps the last
    partial batch of each epoch, as a DataLoader would.
    """
    rng = np.random.default_rng(derive_seed(seed, round, client, 0xBA7C))
    bs = min(recipe.batch_size, n)
    if recipe.local_steps is not None:
        done = 0
        while done < recipe.local_steps:
            perm = rng.permutation(n)
            for k in range(n // bs):
                yield perm[k * bs:(k + 1) * bs]
                done += 1
                if done == recipe.local_steps:
                    return
    else:
        for _ in range(recipe.local_epochs or 0):
            perm = rng.permutation(n)
            for k in range(0, n, bs):
                yield perm[k:k + bs]


def batch_schedule(seed: int, round: int, client: int, n: int, recipe: Recipe) -> list[np.ndarray]:
    """:func:`iter_batches` as a list (for callers that index it; the client trains from the iterator)."""
    return list(iter_batches(seed, round, client, n, recipe))
