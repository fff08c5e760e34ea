"""Exceptions of :mod:`fedsim.crypto` that are not parameter errors (those are ``ValueError``)."""
from __future__ import annotations


class IntegrityError(Exception):
    """A payload or decrypted aggregate failed a check; ``field`` names what is wrong.

    Raised by the server-side :func:`fedsim.crypto.paillier.verify` (``"header"``, ``"version"``,
    ``"fingerprint"``, ``"count"``, ``"digest"``, ``"ciphertext[i]"``, ...) and by the decrypting client
    (``"canary"``, ``"padding"``, ``"plaintext"``, ``"range"``): the aggregate is refused instead of being
    decoded into garbage.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class KeyDeliveryError(Exception):
    """A sealed secret (the Paillier private key in transit) could not be opened or was malformed."""
