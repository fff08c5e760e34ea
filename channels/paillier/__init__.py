"""The Paillier channel (seed 003 §4.2.2): ``[channel] name = "paillier"``; the server half in
:mod:`.server` (which names the client half), the client half in :mod:`.client`, the encrypted global
model and its checkpoints in :mod:`.model`. Protocol, threat model and costs: docs/paillier.md."""
from channels.paillier.client import PaillierClientChannel
from channels.paillier.model import EncryptedModel
from channels.paillier.server import BITS, ENCRYPT, PaillierChannel

__all__ = ["BITS", "ENCRYPT", "EncryptedModel", "PaillierChannel", "PaillierClientChannel"]
