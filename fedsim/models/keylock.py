"""FedKL's key-lock module (seed 003, thesis ch. 5, §5.2.3 and Fig. 5.2): a model transform.

A convolution-normalisation block normally ends with a batch normalisation whose scale ``gamma`` and
shift ``beta`` are trainable parameters. The key-lock module replaces them by the outputs of two small
fully connected *lock* layers fed a private *key* sequence ``k`` (length 1024 by default)::

    s = gamma * BN(u) + beta        BN with affine off (running statistics kept)
    gamma = W_gamma . k + b_gamma   lock layer "keylock_gamma" (nn.Linear(key_length, C))
    beta  = W_beta  . k + b_beta    lock layer "keylock_beta"  (nn.Linear(key_length, C))

The thesis's equations are linear (no activation after the lock layers) and so is this module by
default; the public FedKL code applies a ReLU to gamma and beta (``activation="relu"``; any activation
of :data:`fedsim.models.ACTIVATIONS`).

:func:`lock_model` puts :class:`KeyLockNorm` modules, in place, into chosen normalisation slots of a
built model (default: the first, i.e. the first convolution-normalisation block, as in all of the
thesis's experiments). A slot is a ``BatchNorm`` layer, or the ``nn.Identity`` placeholder the model zoo
puts after a convolution when ``norm = "none"``:

* a BatchNorm (LeNet with ``norm = "batch"``, ConvNet, the ResNets) is *replaced*: its running
  statistics keep their names (``features.1.running_mean``, ...), so they still travel and are averaged
  like any other buffer, and its affine ``weight``/``bias`` disappear from the locked model;
* an empty slot (LeNet with ``norm = "none"``) gets a new normalisation: the thesis's LeNet experiment,
  whose plain LeNet has no normalisation and whose locked LeNet normalises its first block only.
  :func:`add_statistics_slots` instead puts a statistics-only BatchNorm (affine off) into such a slot
  of the *shared* architecture, so that its running statistics travel and are averaged like the
  replaced BatchNorm's (FedKL's ``average_norm_stats``; the public FedKL code averages them).

Every key-lock entry of a locked model's state dict has a name part starting with :data:`MARK`
(``keylock_``): ``<block>.keylock_key`` (the key buffer), ``<block>.keylock_gamma.weight|bias`` and
``<block>.keylock_beta.weight|bias`` (the lock). :func:`is_private` tells them apart.

Why this module is in the core: FedKL is one plugin package, :mod:`clients.fedkl` (the defense and its
server-side random-key evaluation), but the curious server's threat-model ablation (``[[attack.knowledge]]
name = "fedkl"``, ``attacks/fedkl.py``) rebuilds the same locked architecture on the attacker side, and
attacks may not import clients. So what both sides build on is this small vocabulary: the key-lock layer
and how it is put into a model, the key-lock entry names, the names of the lock-leak ablation's reply
arrays, and the secrets that are pure functions of the run seed:

* :func:`client_key` - a client's key as a pure function of (run seed, partition id), so that runs are
  reproducible; only the key ablation of the curious server ever re-creates it on the server side;
* :func:`random_key` - a key nobody holds (the thesis's "Random" evaluation, Table 5.3);
* :func:`init_lock` - the initial lock weights, a pure function of the run seed (in the thesis the
  server initialises the model with the key-lock module and distributes it once, so the initial lock
  is public; every later lock is private).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

MARK = "keylock_"
KEY = "keylock_key"
GAMMA = "keylock_gamma"
BETA = "keylock_beta"
DEFAULT_KEY_LENGTH = 1024
# upper bound of key_length: 64 x the thesis's 1024. Each locked block holds 2 x key_length x C lock
# weights (C its channels); a key of 1e11 values would be a 745 GiB allocation on every client
MAX_KEY_LENGTH = 65536
DEFAULT_BLOCKS = "first"
# reply arrays of the lock-leak ablation (clients.fedkl ``leak_lock = true``): never sent otherwise
LEAK_START = "ablation.fedkl.lock-start."
LEAK_END = "ablation.fedkl.lock-end."

_KEY_SALT = 0xFED1
_RANDOM_KEY_SALT = 0xFED2
_LOCK_SALT = 0xFED3


def _derive(*parts: int) -> int:
    from fedsim.seeding import derive_seed

    return derive_seed(*parts)


def check_key_length(key_length: Any) -> int:
    """``key_length`` as an int in [1, :data:`MAX_KEY_LENGTH`]; ValueError naming it otherwise."""
    if isinstance(key_length, bool) or not isinstance(key_length, (int, np.integer)) or \
            not 1 <= key_length <= MAX_KEY_LENGTH:
        raise ValueError(f"key_length must be an integer in [1, {MAX_KEY_LENGTH}] (the thesis uses 1024; the lock "
                         f"layers hold 2 x key_length x channels weights per locked block), got {key_length!r}")
    return int(key_length)


def is_private(name: str) -> bool:
    """Whether a state-dict entry belongs to a key-lock module (key buffer or lock layer)."""
    return any(part.startswith(MARK) for part in name.split("."))


class StatisticsNorm(_BatchNorm):
    """Batch normalisation without scale and shift, on (N, C), (N, C, L) or (N, C, H, W) inputs: a lock
    block's normalisation in the architecture every party shares (:func:`add_statistics_slots`)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 track_running_stats: bool = True):
        super().__init__(num_features, eps, momentum, affine=False, track_running_stats=track_running_stats)

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"{type(self).__name__} expects (N, C, ...) input, got shape {tuple(x.shape)}")


class KeyLockNorm(StatisticsNorm):
    """Batch normalisation (affine off) followed by ``gamma * x + beta`` from the key and two lock layers.

    Works on (N, C), (N, C, L) and (N, C, H, W) inputs like the BatchNorm it replaces. The key is a
    buffer (``keylock_key``), the lock layers are ``keylock_gamma`` and ``keylock_beta``.
    """

    def __init__(self, num_features: int, key_length: int = DEFAULT_KEY_LENGTH, eps: float = 1e-5,
                 momentum: float | None = 0.1, track_running_stats: bool = True, activation: str = "none"):
        super().__init__(num_features, eps, momentum, track_running_stats)
        self.key_length = key_length = check_key_length(key_length)
        self.register_buffer(KEY, torch.zeros(key_length))
        self.keylock_gamma = nn.Linear(key_length, num_features)
        self.keylock_beta = nn.Linear(key_length, num_features)
        self.activation = check_activation(activation)
        if activation != "none":  # (no module otherwise: an nn.Identity here would look like a norm slot)
            self.lock_act = _activations()[activation]()

    def scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gamma, beta), each of shape (C,), for the current key and lock."""
        key = getattr(self, KEY)
        gamma, beta = self.keylock_gamma(key), self.keylock_beta(key)
        if self.activation != "none":
            gamma, beta = self.lock_act(gamma), self.lock_act(beta)
        return gamma, beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        gamma, beta = self.scale_shift()
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return y * gamma.view(shape) + beta.view(shape)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, key_length={self.key_length}, eps={self.eps}, momentum={self.momentum}, "
                f"activation={self.activation}")


def _activations() -> dict:
    from fedsim.models import ACTIVATIONS

    return ACTIVATIONS


def check_activation(activation: Any) -> str:
    """Validate a lock activation: ``"none"`` (the thesis's linear lock) or a model activation name."""
    names = ["none", *sorted(_activations())]
    if activation not in names:
        raise ValueError(f"lock_activation must be one of {names}, got {activation!r}")
    return activation


def _is_slot_owner(m: nn.Module) -> bool:
    return isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))


def norm_layers(model: nn.Module) -> list[str]:
    """Module names of the model's normalisation slots, in module order: every batch-norm layer (not yet
    locked) and every ``nn.Identity`` placeholder that directly follows a convolution or linear layer
    (where the model zoo puts a batch norm when ``norm = "batch"``, e.g. LeNet's ``features.1``)."""
    out, prev = [], None
    for n, m in model.named_modules():
        if isinstance(m, _BatchNorm) and not isinstance(m, KeyLockNorm):
            out.append(n)
        elif isinstance(m, nn.Identity) and prev is not None and _is_slot_owner(prev):
            out.append(n)
        if n:
            prev = m
    return out


def locked_blocks(model: nn.Module) -> list[str]:
    """Module names of the model's key-lock modules, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, KeyLockNorm)]


def check_blocks(blocks: Any) -> str | list[Any]:
    """Validate a ``blocks`` spec: ``"first"``, ``"all"``, or a non-empty list of normalisation-slot
    indices (0 = the first, see :func:`norm_layers`) or module names."""
    if isinstance(blocks, str) and blocks in ("first", "all"):
        return blocks
    if isinstance(blocks, (list, tuple)) and blocks and all(
            (isinstance(b, int) and not isinstance(b, bool) and b >= 0) or (isinstance(b, str) and b)
            for b in blocks):
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks lists a layer twice: {list(blocks)}")
        return list(blocks)
    raise ValueError(f"blocks must be \"first\", \"all\" or a non-empty list of normalisation-layer indices "
                     f"(0 = the first) or module names, got {blocks!r}")


def select_blocks(model: nn.Module, blocks: Any = "first") -> list[str]:
    """The module names of the normalisation slots ``blocks`` picks (see :func:`check_blocks`)."""
    blocks = check_blocks(blocks)
    norms = norm_layers(model)
    if not norms:
        raise ValueError(f"the model ({type(model).__name__}) has no convolution-normalisation block to lock")
    if blocks == "first":
        return norms[:1]
    if blocks == "all":
        return norms
    out = []
    for b in blocks:
        if isinstance(b, int):
            if b >= len(norms):
                raise ValueError(f"blocks: index {b} is out of range; the model has {len(norms)} normalisation "
                                 f"layers ({norms})")
            out.append(norms[b])
        elif b not in norms:
            raise ValueError(f"blocks: {b!r} is not a normalisation layer of the model; its normalisation layers "
                             f"are {norms}")
        else:
            out.append(b)
    return sorted(set(out), key=norms.index)


def _features_before(model: nn.Module, name: str) -> int:
    prev = None
    for n, m in model.named_modules():
        if n == name:
            break
        if n:
            prev = m
    if isinstance(prev, nn.Linear):
        return prev.out_features
    if prev is not None and _is_slot_owner(prev):
        return prev.out_channels
    raise ValueError(f"{name} does not follow a convolution or linear layer")


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def add_statistics_slots(model: nn.Module, blocks: Any = "first") -> list[str]:
    """Put a statistics-only BatchNorm (affine off) into each empty slot (``nn.Identity``) that
    ``blocks`` picks, in place; returns their module names. :func:`lock_model` then replaces them like any
    BatchNorm, keeping their running statistics under the base model's names."""
    names = [n for n in select_blocks(model, blocks) if isinstance(model.get_submodule(n), nn.Identity)]
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    for name in names:
        _set_module(model, name, StatisticsNorm(_features_before(model, name)).to(dev).train(model.training))
    return names


def lock_model(model: nn.Module, key: np.ndarray | torch.Tensor, blocks: Any = "first", *,
               lock_state: Mapping[str, Any] | None = None, init_seed: int | None = None,
               activation: str = "none") -> list[str]:
    """Embed key-lock modules into ``model`` in place; returns the locked blocks' module names.

    A chosen BatchNorm becomes a :class:`KeyLockNorm` with the same running statistics and settings (its
    affine weight and bias are dropped). A chosen ``nn.Identity`` slot after a convolution (a model built
    with ``norm = "none"``) gets a fresh :class:`KeyLockNorm`: the thesis's LeNet experiment, whose
    plain LeNet has no normalisation and whose locked LeNet normalises the first block only. The key
    (a 1-D array) is loaded into every locked block. The lock weights come from ``lock_state``
    (state-dict names, as :func:`lock_entries` returns them) when given, else from :func:`init_lock`
    with ``init_seed`` (PyTorch's initialisation from the global RNG when that is None too).
    ``activation`` goes after the lock layers (:class:`KeyLockNorm`; default none, as in the thesis).
    """
    names = select_blocks(model, blocks)
    key_t = torch.as_tensor(np.asarray(key), dtype=torch.float32).flatten()
    for name in names:
        old = model.get_submodule(name)
        if isinstance(old, _BatchNorm):
            dev = old.running_mean.device if old.running_mean is not None else torch.device("cpu")
            kl = KeyLockNorm(old.num_features, len(key_t), old.eps, old.momentum, old.track_running_stats,
                             activation).to(dev)
            with torch.no_grad():
                if old.track_running_stats:
                    kl.running_mean.copy_(old.running_mean)
                    kl.running_var.copy_(old.running_var)
                    kl.num_batches_tracked.copy_(old.num_batches_tracked)
        else:
            dev = next((p.device for p in model.parameters()), torch.device("cpu"))
            kl = KeyLockNorm(_features_before(model, name), len(key_t), activation=activation).to(dev)
        with torch.no_grad():
            getattr(kl, KEY).copy_(key_t.to(dev))
        kl.train(model.training)
        _set_module(model, name, kl)
    if lock_state is not None:
        load_lock(model, lock_state)
    elif init_seed is not None:
        init_lock(model, init_seed)
    return names


def lock_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """The lock layers' state-dict entries (``<block>.keylock_gamma.weight``, ...), key excluded."""
    return {k: v for k, v in model.state_dict().items() if is_private(k) and not k.endswith("." + KEY)}


def load_lock(model: nn.Module, lock_state: Mapping[str, Any]) -> None:
    """Load lock weights (names as in :func:`lock_entries`); every lock entry must be given."""
    current = lock_entries(model)
    missing = sorted(set(current) - set(lock_state))
    extra = sorted(set(lock_state) - set(current))
    if missing or extra:
        raise ValueError(f"lock state does not fit the locked model: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for k, v in current.items():
            v.copy_(torch.as_tensor(np.asarray(lock_state[k])).reshape(v.shape).to(v.dtype))


def init_lock(model: nn.Module, seed: int) -> None:
    """The initial lock: every lock layer's weight and bias from U(-1/sqrt(L), 1/sqrt(L)) (the
    distribution of PyTorch's default ``nn.Linear`` initialisation), drawn from ``seed`` only."""
    for i, name in enumerate(locked_blocks(model)):
        kl = model.get_submodule(name)
        gen = torch.Generator(device="cpu").manual_seed(_derive(seed, _LOCK_SALT, i))
        bound = 1.0 / float(np.sqrt(kl.key_length))
        with torch.no_grad():
            for lin in (kl.keylock_gamma, kl.keylock_beta):
                for p in (lin.weight, lin.bias):
                    p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1).mul_(bound).to(p.device))


def client_key(seed: int, client: int, length: int = DEFAULT_KEY_LENGTH) -> np.ndarray:
    """Client ``client``'s key: ``length`` values from U[0, 1), a pure function of (seed, client)."""
    return np.random.default_rng(_derive(seed, _KEY_SALT, client)).random(length).astype(np.float32)


def random_key(seed: int, length: int = DEFAULT_KEY_LENGTH, salt: int = 0) -> np.ndarray:
    """A key no client holds (U[0, 1), like the clients' keys), from (seed, salt)."""
    return np.random.default_rng(_derive(seed, _RANDOM_KEY_SALT, salt)).random(length).astype(np.float32)
