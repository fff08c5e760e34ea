"""Client partitioners: IID, Dirichlet(alpha) label skew, the papers' pathological non-IID, and the
natural split of a dataset drawn from several sources (one source per client).

Each returns one index array per client into the training set; all are deterministic in ``rng``.
"""
from __future__ import annotations

import numpy as np


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and deal the samples into ``num_clients`` equal (±1) shards."""
    return [np.sort(s) for s in np.array_split(rng.permutation(len(labels)), num_clients)]


def dirichlet(labels: np.ndarray, num_clients: int, rng: np.random.Generator, alpha: float = 0.5,
              min_size: int = 1, max_tries: int = 100) -> list[np.ndarray]:
    """Label-skewed split: for every class, client shares ~ Dirichlet(alpha) (Hsu et al. 2019).

    Redraws until every client holds at least ``min_size`` samples.
    """
    if alpha <= 0:
        raise ValueError(f"data.alpha must be > 0, got {alpha}")
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise ValueError(f"dirichlet partition: could not give each of {num_clients} clients {min_size} samples "
                     f"with alpha={alpha} in {max_tries} draws; raise data.alpha or lower federation.num_clients")


def pathological(labels: np.ndarray, num_clients: int, rng: np.random.Generator, classes_per_client: int = 2,
                 min_per_class: int = 10, max_per_class: int = 50) -> list[np.ndarray]:
    """Seed 000 §VI-A: each client holds ``k`` random classes with ``a``..``b`` samples of each.

    Samples are drawn without replacement across clients, so no two clients share a sample.
    """
    classes = np.unique(labels)
    if not 1 <= classes_per_client <= len(classes):
        raise ValueError(f"data.classes_per_client must be in 1..{len(classes)}, got {classes_per_client}")
    if not 1 <= min_per_class <= max_per_class:
        raise ValueError(f"data.min_per_class/max_per_class must satisfy 1 <= min <= max, "
                         f"got {min_per_class}..{max_per_class}")
    pools = {int(c): list(rng.permutation(np.flatnonzero(labels == c))) for c in classes}
    parts = []
    for k in range(num_clients):
        chosen = rng.choice(classes, size=classes_per_client, replace=False)
        idx: list[int] = []
        for c in chosen:
            n = int(rng.integers(min_per_class, max_per_class + 1))
            pool = pools[int(c)]
            if len(pool) < n:
                raise ValueError(f"pathological partition ran out of class {int(c)} samples at client {k}: "
                                 f"lower data.max_per_class ({max_per_class}) or federation.num_clients")
            idx.extend(pool[:n])
            del pool[:n]
        parts.append(np.sort(np.array(idx, dtype=np.int64)))
    return parts


def natural(labels: np.ndarray, num_clients: int, rng: np.random.Generator,
            sources: np.ndarray | None = None) -> list[np.ndarray]:
    """Each client gets the samples of its own source (seed 003 §4.3.1: one Gaussian source per client).

    With ``S`` sources: client ``k`` holds sources ``k, k + K, ...`` when ``K <= S`` clients (``K = 1`` is
    centralised training on the pooled data); with more clients than sources, the clients ``k = s
    (mod S)`` share source ``s``, dealt IID."""
    if sources is None:
        raise ValueError("data.partition = 'natural' needs a dataset with natural sources (e.g. synthetic-2d)")
    sources = np.asarray(sources)
    ids = np.unique(sources)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for s_i, s in enumerate(ids):
        idx = np.flatnonzero(sources == s)
        if num_clients <= len(ids):
            parts[s_i % num_clients].append(idx)
        else:
            sharing = list(range(s_i, num_clients, len(ids)))
            for k, chunk in zip(sharing, np.array_split(rng.permutation(idx), len(sharing))):
                parts[k].append(chunk)
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


PARTITIONERS = {"iid": iid, "dirichlet": dirichlet, "pathological": pathological, "natural": natural}


def partition(labels, num_clients: int, scheme: str = "iid", seed: int = 0, **params) -> list[np.ndarray]:
    """Split sample indices among ``num_clients`` clients with the named scheme."""
    if scheme not in PARTITIONERS:
        raise ValueError(f"data.partition must be one of {sorted(PARTITIONERS)}, got {scheme!r}")
    labels = np.asarray(labels)
    if num_clients < 1 or num_clients > len(labels):
        raise ValueError(f"federation.num_clients must be in 1..{len(labels)}, got {num_clients}")
    rng = np.random.default_rng([seed, 0xDA7A])
    return PARTITIONERS[scheme](labels, num_clients, rng, **params)
