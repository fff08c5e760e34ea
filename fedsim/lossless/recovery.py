"""The server's side (seed 002 eq. 14-15, Theorem 3): the clients' terms aggregated, the noise removed."""
from __future__ import annotations

import math
from typing import Sequence

from fedsim.lossless.client import ClientTerms
from fedsim.lossless.network import Layer, flat, unflat
from fedsim.lossless.noise import Secrets


# -------------------------------------------------------------------------------------- server side
def aggregate(terms: Sequence[ClientTerms], weights: Sequence[float] | None = None) -> ClientTerms:
    """Eq. 14: the weighted mean of the clients' terms (default weights: their example counts)."""
    if not terms:
        raise ValueError("aggregate needs at least one client's terms")
    loss = terms[0].loss
    if any(t.loss != loss for t in terms) or any(len(t.sigma) != len(terms[0].sigma) for t in terms):
        raise ValueError("clients' terms differ in loss or number of groups")
    w = [float(t.num_examples) for t in terms] if weights is None else [float(v) for v in weights]
    if len(w) != len(terms) or any(not math.isfinite(v) or v < 0 for v in w) or sum(w) <= 0:
        raise ValueError(f"aggregation weights must be {len(terms)} non-negative numbers with a positive sum, "
                         f"got {w}")
    tot = sum(w)

    def mean(blocks: Sequence[Sequence[Layer]]) -> list[Layer]:
        flats = [flat(b) for b in blocks]
        avg = [sum(wi / tot * f[i] for wi, f in zip(w, flats)) for i in range(len(flats[0]))]
        return unflat(avg, blocks[0])

    grads = mean([t.grads for t in terms])
    sigma = [mean([t.sigma[s] for t in terms]) for s in range(len(terms[0].sigma))]
    beta = mean([t.beta for t in terms]) if terms[0].beta else []
    return ClientTerms(grads, sigma, beta, loss, sum(t.num_examples for t in terms))


def recover(agg: ClientTerms, secrets: Secrets) -> list[Layer]:
    """Eq. 14-15 / Theorem 3: the true aggregated gradient from the aggregated terms and the secrets."""
    L = len(agg.grads)
    if len(secrets.r) != L - 1:
        raise ValueError(f"secrets are for {len(secrets.r) + 1} layers, the terms for {L}")
    if agg.loss == "cross_entropy":
        if not secrets.public.shift_invariant:
            raise ValueError("cross-entropy terms can only be recovered with shift-invariant secrets "
                             "(draw_secrets(..., mode='shift'))")
    elif len(agg.sigma) != secrets.num_groups or len(agg.beta) != L:
        raise ValueError(f"MSE terms need {secrets.num_groups} sigma groups and {L} beta layers, got "
                         f"{len(agg.sigma)} and {len(agg.beta)}")
    v = secrets.v
    out: list[Layer] = []
    for k, (gw, gb) in enumerate(agg.grads):
        dev, dt = gw.device, gw.dtype
        Rw, Rb = (t.to(dev, dt) for t in secrets.scale(k, L, tuple(gw.shape)))
        gw = gw.clone()
        gb = gb.clone() if gb is not None else None
        if agg.loss == "mse":
            for s in range(secrets.num_groups):
                g_s = secrets.gamma[s].to(dev, dt)
                sw, sb = agg.sigma[s][k]
                gw = gw - g_s * sw
                if gb is not None:
                    gb = gb - g_s * sb
            bw, bb = agg.beta[k]
            gw = gw + v.to(dev, dt) * bw
            if gb is not None:
                gb = gb + v.to(dev, dt) * bb
        out.append((Rw * gw, Rb * gb if gb is not None else None))
    return out
