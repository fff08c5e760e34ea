"""Robbing the Fed's malicious server (Fowl et al., ICLR 2022): ``[[transforms]] name = "robbing-imprint"``.

THREAT MODEL: a *malicious* server, not an honest-but-curious one. It changes the model it sends: the
architecture gets an imprint block in front of the model (``model.imprint_bins``, so that clients build
the same architecture: in a real deployment the server ships the architecture) and, every round, this
transform overwrites the block's weights so that each of its units measures the inputs' brightness
against one bin boundary (:func:`fedsim.models.imprint.imprint_model`). Boundaries sit at quantiles of the
measurement on the public root split (data the server legitimately has). The clients' updates of the
block then carry their inputs almost verbatim; ``attack.name = "robbing"`` reads them back.

The block's weights the clients return are ignored (they are reset every round), so training of the
rest of the model goes on as usual.
"""
from __future__ import annotations

from typing import Annotated, Any, Mapping, Sequence

import numpy as np
import torch

from fedsim.components import TRANSFORMS
from fedsim.factories import dataset_for, model_for
from fedsim.models.imprint import (
    IMPRINT_TRANSFORM,
    MEASUREMENTS,
    imprint_model,
    measurement_vector,
    quantile_bins,
)
from fedsim.params import OneOf, Range
from fedsim.seams import ServerTransform
from fedsim.seeding import derive_seed

PREFIX = "imprint."


@TRANSFORMS.register
class RobbingImprint(ServerTransform):
    """Sets the imprint block's weights before every send (parameters: the ``measurement``, ``scale`` and
    ``gain`` of :func:`fedsim.models.imprint.imprint_model`)."""

    name = IMPRINT_TRANSFORM
    stateless = True  # the measurement is drawn from the seed in setup

    def __init__(self, measurement: Annotated[str, OneOf(*MEASUREMENTS)] = "brightness",
                 scale: Annotated[float, Range(0, open_low=True)] = 1.0,
                 gain: Annotated[float, Range(0, open_low=True)] = 1e-3):
        self.measurement, self.scale, self.gain = measurement, float(scale), float(gain)

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        k = int(cfg["model"].get("imprint_bins") or 0)
        if k < 2:
            raise ValueError("needs the imprinted architecture: set model.imprint_bins (e.g. 128)")
        self._bins(cfg, k)

    def _bins(self, cfg: Mapping[str, Any], k: int) -> torch.Tensor:
        ds = dataset_for(cfg)
        gen = torch.Generator().manual_seed(derive_seed(cfg["seed"], 0x1B))
        self._w = measurement_vector(ds.in_shape, self.measurement, gen)
        values = ds.x_root.flatten(1).double() @ self._w.double()
        bins = quantile_bins(values, k)
        if len(bins) != k:
            raise ValueError(f"model.imprint_bins = {k} bins need {k} distinct quantiles of the measurement on "
                             f"the public root split (data.root_size = {len(values)}): got {len(bins)}")
        return bins

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        self.names = list(param_names)
        k = int(cfg["model"]["imprint_bins"])
        bins = self._bins(cfg, k)
        with torch.random.fork_rng(devices=[]):  # the run's RNG stream stays as it was
            base = model_for(cfg).base
        imprinted = imprint_model(base, bins, dataset_for(cfg).in_shape, measurement=self._w, scale=self.scale,
                                  gain=self.gain)
        self._imprint = {n: v.detach().cpu().numpy() for n, v in imprinted.state_dict().items()
                         if n.startswith(PREFIX)}

    def before_send(self, server_round: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [self._imprint[n].astype(a.dtype) if n in self._imprint else a for n, a in zip(self.names, arrays)]

    def metrics(self) -> dict[str, float]:
        return {"bins": float(len(next(iter(self._imprint.values()))))}
