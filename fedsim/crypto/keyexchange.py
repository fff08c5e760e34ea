"""Delivery of a secret (the Paillier private key) from one client to another through an untrusted relay.

Thesis seed 003, Alg. 3 lines 1-5: client 1 generates the Paillier key pair and sends it to the other
clients; the server must never learn it. Here every client has an X25519 key pair and publishes the
32-byte public key (relayed by the server). The key holder derives, for each recipient, a pairwise key

    K = HKDF-SHA256(ikm = X25519(own private, peer public), salt = none, length = 32,
                    info = context)

with ``context`` = length-prefixed (``"fedsim/paillier-key-delivery/v1"``, run, sender, recipient,
sender public key, recipient public key), and seals the secret with AES-256-GCM under ``K``, a random
96-bit nonce, and ``context`` as associated data. Sealed box: ``"FSK1" | nonce (12) | ciphertext+tag``.

Only the recipient (same shared secret, same context) can open it. A flipped bit, a box opened by
another client, or a box presented for another run, sender or recipient fails authentication and
raises :class:`~fedsim.crypto.errors.KeyDeliveryError`.

The server sees public keys and sealed boxes only. It must relay the public keys faithfully: X25519
public keys are not authenticated here, so a server that substitutes its own (an active
man-in-the-middle) would receive the secret. That is outside the honest-but-curious model this
protocol assumes (docs/paillier.md, threat model).
"""
from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from fedsim.crypto.errors import KeyDeliveryError

LABEL = b"fedsim/paillier-key-delivery/v1"
_MAGIC = b"FSK1"
_NONCE = 12


def x25519_keypair() -> tuple[X25519PrivateKey, bytes]:
    """A fresh X25519 private key and its 32-byte raw public key (the part the server relays)."""
    private = X25519PrivateKey.generate()
    return private, public_bytes(private)


def public_bytes(private_key: X25519PrivateKey) -> bytes:
    """The 32-byte raw public key of an X25519 private key."""
    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _field(value: str | bytes) -> bytes:
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return struct.pack(">I", len(data)) + data


def context(run_id: str, sender: str, recipient: str, sender_public: bytes, recipient_public: bytes) -> bytes:
    """The HKDF info and AEAD associated data: an unambiguous encoding of who sends what to whom."""
    for name, value in (("run_id", run_id), ("sender", sender), ("recipient", recipient)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if sender == recipient:
        raise ValueError(f"recipient must differ from sender, both are {sender!r}")
    return b"".join(_field(v) for v in (LABEL, run_id, sender, recipient, sender_public, recipient_public))


def derive_key(own_private: X25519PrivateKey, peer_public: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 of the X25519 shared secret with ``info``: a 32-byte AES-256 key."""
    if len(bytes(peer_public)) != 32:
        raise KeyDeliveryError(f"peer public key must be 32 bytes, got {len(bytes(peer_public))}")
    try:
        shared = own_private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
    except ValueError as exc:  # e.g. a low-order point giving an all-zero secret
        raise KeyDeliveryError(f"X25519 key agreement failed: {exc}") from None
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def seal_secret(secret: bytes, sender_private: X25519PrivateKey, recipient_public: bytes, *, run_id: str,
                sender: str, recipient: str) -> bytes:
    """Encrypt ``secret`` for ``recipient``, bound to (run, sender, recipient, both public keys)."""
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise ValueError("secret must be non-empty bytes")
    info = context(run_id, sender, recipient, public_bytes(sender_private), recipient_public)
    key = derive_key(sender_private, recipient_public, info)
    nonce = os.urandom(_NONCE)
    return _MAGIC + nonce + AESGCM(key).encrypt(nonce, bytes(secret), info)


def open_secret(sealed: bytes, recipient_private: X25519PrivateKey, sender_public: bytes, *, run_id: str,
                sender: str, recipient: str) -> bytes:
    """Open a box from :func:`seal_secret`; :class:`KeyDeliveryError` if it is malformed, tampered
    with, or was not sealed for this recipient by this sender in this run."""
    sealed = bytes(sealed)
    if len(sealed) < len(_MAGIC) + _NONCE + 16 or not sealed.startswith(_MAGIC):
        raise KeyDeliveryError("sealed secret is malformed (bad magic or too short)")
    info = context(run_id, sender, recipient, sender_public, public_bytes(recipient_private))
    key = derive_key(recipient_private, sender_public, info)
    nonce, body = sealed[len(_MAGIC):len(_MAGIC) + _NONCE], sealed[len(_MAGIC) + _NONCE:]
    try:
        return AESGCM(key).decrypt(nonce, body, info)
    except InvalidTag:
        raise KeyDeliveryError(
            f"sealed secret failed authentication for run {run_id!r}, sender {sender!r}, recipient "
            f"{recipient!r}: tampered with, or sealed for another recipient, sender, run or key") from None
