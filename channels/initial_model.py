"""What the encrypted channels' server halves (Paillier, CKKS) keep of the initial model.

Round 1 sends the public initial model in plaintext; every later global model exists only encrypted (or
as the holder decrypts it). The server half keeps that first model (``x0``: the base every encrypted
update is added to, and what a checkpoint restores from), and counts the values a client encrypts: the
model's floating entries (integer buffers travel in no form).
"""
from __future__ import annotations

import numpy as np


class InitialModel:
    """A mixin of a server channel: ``initial`` keeps the first model it is given (``x0``)."""

    x0: list[np.ndarray] | None = None

    def initial(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        if self.x0 is None:
            self.x0 = [np.asarray(a) for a in arrays]
        return arrays

    @property
    def num_values(self) -> int:
        """Values a client encrypts: the model's floating entries (integer buffers travel in no form)."""
        return sum(int(a.size) for a in self.x0 if np.issubdtype(a.dtype, np.floating))
