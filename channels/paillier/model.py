"""The global model as the Paillier channel's server holds it (:class:`EncryptedModel`), and the server
half's checkpoints (:class:`EncryptedModelCheckpoints`): the encrypted global state as one byte array,
the key delivery's outcome and who holds which global model. No secret is in either."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

_STATE_MAGIC = b"FSPS1"


class EncryptedModel:
    """The global model as the server holds it after round 1 (a mixture of FedBoosting's too).

    ``kind = "model"``: ``head`` encrypts the model itself. ``kind = "update"``: the model is the initial
    model plus the aggregate updates ``chain`` (``(round, payload)`` of rounds ``1..round-1``) plus ``head``,
    the combination made in ``round``."""

    def __init__(self, kind: str, head: bytes, round: int, chain: tuple[tuple[int, bytes], ...] = ()):
        self.kind, self.head, self.round, self.chain = kind, head, int(round), tuple(chain)

    @property
    def payload(self) -> bytes:  # the payload made this round (tests, observers)
        return self.head


class EncryptedModelCheckpoints:
    """The checkpoint side of :class:`channels.paillier.server.PaillierChannel` (``ServerChannel.state``,
    ``load_state``, ``checkpoint_arrays``, ``from_checkpoint_arrays``)."""

    x0: list[np.ndarray] | None
    holder: dict[int, int]

    def state(self) -> dict[str, Any]:
        """The key delivery's outcome (run tag, public key) and who holds which global model; the global
        state itself goes through :meth:`checkpoint_arrays`. No secret: the clients' keys are in their own
        state (the client-state mirror)."""
        return {"run_tag": getattr(self, "run_tag", ""),
                "public_key": np.frombuffer(getattr(self, "public_bytes", None) or b"", dtype=np.uint8),
                "x0": list(self.x0 or []), "holder": {str(k): int(v) for k, v in self.holder.items()}}

    def load_state(self, state: Mapping[str, Any]) -> None:
        if len(state.get("public_key", ())) == 0:
            raise ValueError("the checkpoint holds no Paillier public key (the key delivery never finished)")
        self.run_tag = str(state["run_tag"])
        public = state["public_key"]
        self.public_bytes = bytes(public) if isinstance(public, (bytes, bytearray)) else np.asarray(public, np.uint8).tobytes()
        self.accept_public_key(self.public_bytes)
        self.x0 = [np.asarray(a) for a in state["x0"]]
        self.holder = {int(k): int(v) for k, v in state["holder"].items()}

    def checkpoint_arrays(self, state: Any) -> list[np.ndarray]:
        if not isinstance(state, EncryptedModel):
            return list(state)
        parts = [state.kind.encode(), str(state.round).encode(), state.head,
                 *[b for r, p in state.chain for b in (str(r).encode(), p)]]
        blob = _STATE_MAGIC + b"".join(len(x).to_bytes(8, "big") + x for x in parts)
        return [np.frombuffer(blob, dtype=np.uint8).copy()]

    def from_checkpoint_arrays(self, arrays: list[np.ndarray]) -> Any:
        if len(arrays) == 1 and arrays[0].dtype == np.uint8 and arrays[0][:len(_STATE_MAGIC)].tobytes() == _STATE_MAGIC:
            blob, parts, i = arrays[0].tobytes(), [], len(_STATE_MAGIC)
            while i < len(blob):
                n = int.from_bytes(blob[i:i + 8], "big")
                parts.append(blob[i + 8:i + 8 + n])
                i += 8 + n
            chain = tuple((int(parts[k]), parts[k + 1]) for k in range(3, len(parts), 2))
            return EncryptedModel(parts[0].decode(), parts[2], int(parts[1]), chain)
        return self.initial(arrays)
