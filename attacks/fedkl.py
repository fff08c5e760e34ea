"""FedKL threat-model ablation (seed 003, thesis §5.3.4 and Table 5.7): hand the curious server the
victim's key, its lock update, or both, to show which secret matters.

Without this knowledge the curious server attacks with what it has: the base model it sent (no key, no
lock, the locked blocks' affine parameters at their initial values) and the update of the base entries.
``[[attack.knowledge]] name = "fedkl"`` instead attacks the *locked* architecture:

* ``key = true`` - the victim's key, re-created on the attacker side from (run seed, partition id)
  with :func:`fedsim.models.keylock.client_key`, the way the scorer re-creates ground truth: no message
  carries it (the FedKL defense needs ``key_source = "seeded"``). Without it the attacker guesses a
  random key of its own.
* ``lock = true`` - the victim's lock weights at the start of the round and their update, read from the
  extra reply arrays that the FedKL defense sends only with ``leak_lock = true`` (the ablation; the
  normal path never sends them). The lock layers are then matched like every other parameter. Without
  it the attacker uses the initial lock (public: a function of the run seed, as if the server had
  distributed it) and leaves the lock layers out of the matching.

``key = false, lock = false`` is an attacker that knows the defense but none of its secrets.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np
import torch

from fedsim.models import keylock
from fedsim.observers import ClientUpdate

from .base import AttackInput
from .knowledge import Knowledge, register

_GUESS_SALT = 0xA77


def fedkl_entry(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``[[defenses]]`` entry of the FedKL defense (the server configured it, so it is public)."""
    entries = [d for d in cfg.get("defenses") or [] if isinstance(d, Mapping) and d.get("name") == "fedkl"]
    if not entries:
        raise ValueError("no fedkl defense is configured ([[defenses]] name = \"fedkl\")")
    return entries[0]


@register
class FedKLKnowledge(Knowledge):
    """Grants the victim's FedKL key (``key``) and/or its leaked lock update (``lock``); ``guess_salt``
    picks the attacker's own random key when the key is not granted."""

    name = "fedkl"

    def __init__(self, *, cfg: Mapping[str, Any], key: bool = False, lock: bool = False, guess_salt: int = 0):
        entry = fedkl_entry(cfg)
        self.blocks = keylock.check_blocks(entry.get("blocks", keylock.DEFAULT_BLOCKS))
        self.key_length = int(entry.get("key_length", keylock.DEFAULT_KEY_LENGTH))
        self.activation = keylock.check_activation(entry.get("lock_activation", "none"))  # public, like the rest
        if key and entry.get("key_source", "seeded") != "seeded":
            raise ValueError("key = true needs the fedkl defense's key_source = \"seeded\" (an \"os\" key cannot "
                             "be re-created)")
        if lock and not entry.get("leak_lock", False):
            raise ValueError("lock = true needs the fedkl defense's leak_lock = true (the ablation in which "
                             "clients send their lock)")
        self.key, self.lock, self.guess_salt = bool(key), bool(lock), int(guess_salt)
        self.seed = int(cfg["seed"])

    def label(self) -> str:
        parts = [p for p, on in (("key", self.key), ("lock", self.lock)) if on]
        return f"fedkl:{'+'.join(parts) if parts else 'guess'}"

    def victim_key(self, client: int) -> np.ndarray:
        if self.key:
            return keylock.client_key(self.seed, client, self.key_length)
        return keylock.random_key(self.seed, self.key_length, salt=_GUESS_SALT + self.guess_salt)

    def leaked_lock(self, update: ClientUpdate) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        ex = update.extras
        start = {k[len(keylock.LEAK_START):]: np.array(v) for k, v in ex.items() if k.startswith(keylock.LEAK_START)}
        end = {k[len(keylock.LEAK_END):]: np.array(v) for k, v in ex.items() if k.startswith(keylock.LEAK_END)}
        if not start or set(start) != set(end):
            raise ValueError(f"client {update.client_id}'s reply carries no lock arrays: the fedkl defense sends "
                             "them only with leak_lock = true")
        return start, end

    def grant(self, inp: AttackInput, update: ClientUpdate) -> AttackInput:
        key = self.victim_key(update.client_id)
        start, end = self.leaked_lock(update) if self.lock else ({}, {})
        base_fn, blocks, lock, seed, act = inp.model_fn, self.blocks, self.lock, self.seed, self.activation

        def model_fn() -> torch.nn.Module:
            m = base_fn()
            keylock.lock_model(m, key, blocks, lock_state=start if lock else None, init_seed=None if lock else seed,
                               activation=act)
            if not lock:  # nothing to match them against: the lock layers stay out of the attack
                for n, p in m.named_parameters():
                    if keylock.is_private(n):
                        p.requires_grad_(False)
            return m

        sd = model_fn().state_dict()
        glob = {n: inp.global_state[n] if n in inp.global_state else v.detach().clone() for n, v in sd.items()}
        upd = {n: inp.update[n] if n in inp.update else torch.zeros_like(v, dtype=torch.float32)
               for n, v in sd.items()}
        for n in end:
            upd[n] = torch.as_tensor(end[n] - start[n]).float()
        return dataclasses.replace(inp, model_fn=model_fn, global_state=glob, update=upd)
