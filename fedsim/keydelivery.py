"""Key delivery for encrypted channels whose secret key every client holds and the server never sees.

The Paillier channel (seed 003, Alg. 3 line 2: "generate key pair and sent to other clients") and the
CKKS channel share one setup exchange before round 1 (``CHANNEL_SETUP`` messages, stages ``hello``,
``keygen``, ``deliver``):

1. ``hello``: every client makes an X25519 key pair and sends its public key;
2. ``keygen``: the key holder (the lowest partition that answered: the thesis' "client 1") makes the
   channel's key pair and seals the serialised secret key for every other client under their pairwise
   X25519 secret (HKDF-SHA256 + AES-256-GCM, bound to the run, sender and recipient:
   :mod:`fedsim.crypto.keyexchange`); it returns the public key and the sealed boxes;
3. ``deliver``: the server relays each client its box; the client opens it, checks the secret key
   against the public key and confirms the public key's fingerprint.

The server only ever holds public keys, X25519 public keys and sealed boxes. A channel plugs in its own
key material through :class:`SealedKeyServer` (server half: ``accept_public_key``) and
:class:`SealedKeyClient` (client half: ``make_keys``, ``check_keys``, ``fingerprint``).
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Mapping

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedsim.crypto.keyexchange import open_secret, seal_secret, x25519_keypair
from fedsim.protocol import (
    CHANNEL,
    CHANNEL_SETUP,
    CODEC,
    CONFIG,
    FINGERPRINT,
    HOLDER,
    HOLDER_KEY,
    NODE_PARTITION_ID,
    PEER_KEYS,
    PEERS,
    PUBLIC_KEY,
    RUN_TAG,
    SEALED,
    STAGE,
    STATE_CHANNEL,
    X25519_PUBLIC,
    train_config,
)
from fedsim.seams import RoundContext

_X25519 = "x25519-private"


def _who(partition: int) -> str:
    return f"client-{int(partition)}"


class SealedKeyServer:
    """Server half of the key delivery (a mixin of a :class:`fedsim.seams.ServerChannel`).

    The channel sets ``self.cfg``, ``self.codec`` (its settings as JSON, sent to the clients) and
    ``self.run_tag`` in ``setup`` (:meth:`setup_delivery`) and implements :meth:`accept_public_key`, which
    parses the holder's public key bytes and returns their fingerprint (what every client must confirm)."""

    key_name = "the key"  # in error messages

    def setup_delivery(self, cfg: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.codec = json.dumps(dict(settings), sort_keys=True)
        self.run_tag = secrets.token_hex(16)
        self.public_bytes: bytes | None = None

    def accept_public_key(self, public: bytes) -> bytes:
        raise NotImplementedError

    def channel_record(self, **items: Any) -> ConfigRecord:
        return ConfigRecord({RUN_TAG: self.run_tag, CODEC: self.codec, **items})

    def stage_config(self, stage: str, server_round: int = 0) -> ConfigRecord:
        rec = train_config(self.cfg, server_round)
        rec[STAGE] = stage
        return rec

    def handshake(self, ctx: RoundContext) -> dict[str, float]:
        """The three stages; returns metrics (``clients_with_key``). Failures of single clients are recorded;
        no answer to ``hello`` or a failed key holder stops the run (nobody could decrypt anything)."""
        parts = sorted(ctx.engine.partition_node)
        hello = ctx.send(parts, CHANNEL_SETUP, RecordDict({CONFIG: self.stage_config("hello"),
                                                           CHANNEL: self.channel_record()}), stage="channel hello")
        keys = {r.partition: bytes(r.record(CHANNEL)[X25519_PUBLIC]) for r in hello}
        if not keys:
            raise RuntimeError(f"channel {self.name!r}: no client answered the key-agreement hello")
        holder, peers = min(keys), [p for p in sorted(keys) if p != min(keys)]
        own = {holder: {CHANNEL: self.channel_record(**{PEERS: peers, PEER_KEYS: [keys[p] for p in peers]})}}
        made = ctx.send([holder], CHANNEL_SETUP, RecordDict({CONFIG: self.stage_config("keygen")}), own,
                        stage="channel keygen")
        if not made:
            raise RuntimeError(f"channel {self.name!r}: the key holder (client {holder}) failed to make {self.key_name}")
        rec = made[0].record(CHANNEL)
        public = bytes(rec[PUBLIC_KEY])
        fingerprint = self.accept_public_key(public)
        self.public_bytes = public
        sealed = dict(zip(peers, [bytes(b) for b in rec[SEALED]]))
        boxes = {p: {CHANNEL: self.channel_record(**{HOLDER: holder, HOLDER_KEY: keys[holder], SEALED: sealed[p],
                                                     PUBLIC_KEY: public})} for p in peers}
        for r in ctx.send(peers, CHANNEL_SETUP, RecordDict({CONFIG: self.stage_config("deliver")}), boxes,
                          stage="channel deliver"):
            if bytes(r.record(CHANNEL)[FINGERPRINT]) != fingerprint:
                ctx.engine.record_failure(ctx.record, 0, r.node_id, "channel deliver",
                                          "the client confirmed another public key", partition=r.partition)
        return {"clients_with_key": float(1 + len(peers))}


class SealedKeyClient:
    """Client half of the key delivery (a mixin of a :class:`fedsim.seams.ClientChannel`). The secret key
    and the X25519 private key stay in ``Context.state`` (record ``STATE_CHANNEL``), never in a reply.

    A channel sets ``secret_field`` / ``public_field`` (its names in that record) and implements
    :meth:`make_keys`, :meth:`check_keys` and :meth:`fingerprint`."""

    secret_field = "secret"
    public_field = "public"

    def make_keys(self, settings: Mapping[str, Any]) -> tuple[bytes, bytes]:
        """A fresh (public, secret) key pair as bytes."""
        raise NotImplementedError

    def check_keys(self, public: bytes, secret: bytes) -> None:
        """Raise ValueError unless ``secret`` belongs to ``public``."""
        raise NotImplementedError

    def fingerprint(self, public: bytes) -> bytes:
        raise NotImplementedError

    def keys_made(self, public: bytes, secret: bytes, settings: Mapping[str, Any]) -> None:
        """Called once the client holds the key pair (e.g. to start precomputing). Default: nothing."""

    # ---- Context.state --------------------------------------------------------------------------------
    @staticmethod
    def channel_state(context: Context) -> dict[str, bytes]:
        return {k: bytes(v) for k, v in context.state[STATE_CHANNEL].items()} if STATE_CHANNEL in context.state else {}

    @staticmethod
    def save_channel_state(context: Context, **items: bytes) -> None:
        rec = context.state[STATE_CHANNEL] if STATE_CHANNEL in context.state else ConfigRecord()
        for k, v in items.items():
            rec[k] = v
        context.state[STATE_CHANNEL] = rec

    # ---- the exchange -----------------------------------------------------------------------------------
    def handshake(self, msg: Message, context: Context) -> RecordDict:
        stage = str(msg.content[CONFIG][STAGE])
        ch = msg.content[CHANNEL]
        me = int(context.node_config[NODE_PARTITION_ID])
        run = str(ch[RUN_TAG])
        settings = json.loads(str(ch[CODEC]))
        if stage == "hello":
            private, public = x25519_keypair()
            raw = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
            self.save_channel_state(context, **{_X25519: raw})
            return RecordDict({CHANNEL: ConfigRecord({X25519_PUBLIC: public})})
        own = X25519PrivateKey.from_private_bytes(self.channel_state(context)[_X25519])
        if stage == "keygen":
            public, secret = self.make_keys(settings)
            sealed = [seal_secret(secret, own, bytes(k), run_id=run, sender=_who(me), recipient=_who(p))
                      for p, k in zip(ch[PEERS], ch[PEER_KEYS])]
            self.save_channel_state(context, **{self.secret_field: secret, self.public_field: public})
            self.keys_made(public, secret, settings)
            return RecordDict({CHANNEL: ConfigRecord({PUBLIC_KEY: public, SEALED: sealed})})
        if stage == "deliver":
            holder = int(ch[HOLDER])
            secret = open_secret(bytes(ch[SEALED]), own, bytes(ch[HOLDER_KEY]), run_id=run, sender=_who(holder),
                                 recipient=_who(me))
            public = bytes(ch[PUBLIC_KEY])
            self.check_keys(public, secret)
            self.save_channel_state(context, **{self.secret_field: secret, self.public_field: public})
            self.keys_made(public, secret, settings)
            return RecordDict({CHANNEL: ConfigRecord({FINGERPRINT: self.fingerprint(public)})})
        return self.other_stage(stage, msg, context)

    def other_stage(self, stage: str, msg: Message, context: Context) -> RecordDict:
        """A channel's own setup stages beyond the key delivery (default: none)."""
        raise ValueError(f"channel {self.name!r}: unknown setup stage {stage!r}")
