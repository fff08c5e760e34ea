"""FedKL (seed 003, thesis ch. 5, §5.2.4 and Fig. 5.3): a private key and lock layers that never leave
the client.

``[[defenses]] name = "fedkl"``. Every round the client

1. takes the global model it received (the base architecture: no key, no lock) and merges its own
   key-lock module into it (:meth:`FedKL.adapt_model`, :func:`fedsim.models.keylock.lock_model`): the
   chosen convolution-normalisation blocks (default: the first) get ``gamma = W_gamma.k + b_gamma`` and
   ``beta = W_beta.k + b_beta`` from its private key ``k`` instead of trainable affine parameters;
2. trains the locked model (lock layers included) with the configured recipe;
3. keeps the key and the trained lock in Flower's ``Context.state`` (through ``ctx.state``) for the next
   round (:meth:`FedKL.end_round`) and returns the update of the base model's entries only: the lock
   layers and the key buffer are entries the global model does not have, so
   :func:`fedsim.training.local.local_train` never sends them. The locked blocks' own affine ``weight`` and
   ``bias`` do not exist in the locked model; their update is zero, so in the global model they keep
   their initial values (1 and 0) for ever. Running statistics of a replaced BatchNorm keep their names
   and are averaged as usual; those of a normalisation the lock inserted into a block that had none
   (``model.norm = "none"``, the thesis's LeNet) are client-private too.

The key: ``key_length`` (1024) values from U[0, 1), drawn once per client and kept. ``key_source =
"seeded"`` (default) draws it from (run seed, partition id) with
:func:`fedsim.models.keylock.client_key`, so that runs are reproducible and the attacker-side key
ablation (``attacks/fedkl.py``) can re-create it the way the scorer re-creates ground truth;
``"os"`` draws it from the operating system's CSPRNG (not reproducible, and no ablation can re-create
it). The initial lock is a function of the run seed (:func:`fedsim.models.keylock.init_lock`): in the
thesis the server initialises the locked model once and distributes it, so only trained locks are
secret.

Evaluation (Table 5.1's "FedKL" and Table 5.3's client rows), on the common test split with the
client's own key: ``"before"`` local training - the received global model merged with the client's
lock, as the thesis measures it (its code tests each client's model before the round's local epoch) -
reported as ``own_key_accuracy`` / ``own_key_loss``; ``"after"`` local training - the client's own
trained model - as ``own_key_after_training_accuracy`` / ``own_key_after_training_loss``. ``evaluate =
"both"`` (default) reports both, ``"none"`` neither. The defense asks the server for the
``fedkl-random-key`` observer (:mod:`clients.fedkl.evaluation`): the global model with a random key and the
initial lock (Table 5.3's "Random" row), the clients' mean, min and max and the thesis's Table 5.1
number (the best per-round mean over the clients) in every ``metrics.jsonl`` row.

Two options follow the public FedKL code where it differs from the thesis's equations:
``lock_activation = "relu"`` puts a ReLU after the lock layers (gamma, beta >= 0; default ``"none"``,
the linear lock of the equations), and ``average_norm_stats = true`` averages the running statistics of
a normalisation the lock *inserts* (a block that had none, e.g. the thesis's LeNet) with FedAvg: the
architecture every party shares (:meth:`FedKL.global_model`) then has a statistics-only BatchNorm
there, which each client's lock replaces (default false: those statistics stay on the client). A
BatchNorm the lock *replaces* has its statistics averaged either way, as a base-model entry.

``leak_lock = true`` is a threat-model *ablation* (Table 5.7's "Lock"): the reply then also carries
the lock's weights at the start and at the end of the round as extra arrays named
``ablation.fedkl.lock-start.<entry>`` / ``ablation.fedkl.lock-end.<entry>``. Never set it to defend.
"""
from __future__ import annotations

import secrets
from typing import Annotated, Any, Mapping

import numpy as np
import torch
from torch import nn

from fedsim.defense import Defense, DefenseContext, register
from fedsim.models import keylock
from fedsim.params import OneOf, Range

from .evaluation import RandomKeyEvaluation, check_model

KEY_SOURCES = ("seeded", "os")
EVALUATE = ("both", "before", "after", "none")
_SUFFIX = {"before": "", "after": "_after_training"}  # own_key<suffix>_accuracy / _loss
_KEY = "key"
_ENTRY = "entry."


KEY_LENGTH = Range(1, keylock.MAX_KEY_LENGTH, why="the thesis uses 1024; the lock layers hold 2 x key_length x channels "
                  "weights per locked block")


@register
class FedKL(Defense):
    """Key-lock module kept on the client. Parameters: ``blocks`` (``"first"``, ``"all"`` or a list of
    normalisation-layer indices/names), ``key_length`` (1024), ``key_source`` (``"seeded"`` | ``"os"``),
    ``evaluate`` (``"both"`` | ``"before"`` | ``"after"`` | ``"none"``), ``lock_activation``
    (``"none"`` | ``"relu"`` | another model activation), ``average_norm_stats`` (false),
    ``leak_lock`` (ablation only)."""

    name = "fedkl"

    def __init__(self, blocks: str | list[Any] = keylock.DEFAULT_BLOCKS,
                 key_length: Annotated[int, KEY_LENGTH] = keylock.DEFAULT_KEY_LENGTH,
                 key_source: Annotated[str, OneOf(*KEY_SOURCES)] = "seeded",
                 evaluate: Annotated[str, OneOf(*EVALUATE)] = "both", lock_activation: str = "none", average_norm_stats: bool = False,
                 leak_lock: bool = False, cfg: Mapping[str, Any] | None = None):
        self.blocks = keylock.check_blocks(blocks)
        self.key_length, self.key_source, self.evaluate = int(key_length), key_source, evaluate
        self.lock_activation = keylock.check_activation(lock_activation)
        self.average_norm_stats = bool(average_norm_stats)
        self.leak_lock = bool(leak_lock)
        self.cfg = cfg
        if cfg is not None:
            check_model(cfg, self.blocks)
        self._metrics: dict[str, float] = {}
        self._start: dict[str, np.ndarray] = {}
        self._end: dict[str, np.ndarray] = {}
        self._base: set[str] = set()

    # ---- helpers ------------------------------------------------------------------------------------
    def _need_cfg(self) -> Mapping[str, Any]:
        if self.cfg is None:
            raise ValueError("fedkl needs the run config (build the pipeline with fedsim.build.client_pipeline)")
        return self.cfg

    def draw_key(self, client: int) -> np.ndarray:
        """This client's key (first round it trains in; kept in its state afterwards)."""
        if self.key_source == "os":
            return np.random.default_rng(secrets.randbits(128)).random(self.key_length).astype(np.float32)
        return keylock.client_key(int(self._need_cfg()["seed"]), client, self.key_length)

    @classmethod
    def global_model(cls, model: nn.Module, params: Mapping[str, Any]) -> nn.Module:
        """With ``average_norm_stats``: a statistics-only BatchNorm in every locked slot that has no
        normalisation, so that its running statistics are base-model entries (sent and averaged)."""
        if params.get("average_norm_stats"):
            keylock.add_statistics_slots(model, params.get("blocks", keylock.DEFAULT_BLOCKS))
        return model

    def _evaluate(self, model: nn.Module, ctx: DefenseContext, when: str) -> None:
        """The locked model with the client's own key on the common test split (``when``: before or
        after local training)."""
        from fedsim.factories import dataset_for
        from fedsim.training.evaluation import evaluate

        if self.evaluate not in ("both", when):
            return
        ds = dataset_for(self._need_cfg())
        was_training = model.training
        loss, acc = evaluate(model, ds.x_test, ds.y_test, ctx.device)
        model.train(was_training)
        self._metrics.update({f"own_key{_SUFFIX[when]}_accuracy": acc, f"own_key{_SUFFIX[when]}_loss": loss})

    # ---- stages -------------------------------------------------------------------------------------
    def adapt_model(self, model: nn.Module, ctx: DefenseContext) -> nn.Module:
        self._base = set(model.state_dict())
        key = ctx.state.get(_KEY)
        if key is None:
            key = self.draw_key(ctx.client_id)
            ctx.state[_KEY] = key
        key = np.asarray(key, dtype=np.float32)
        if key.shape != (self.key_length,):
            raise ValueError(f"fedkl: the stored key has shape {key.shape}, key_length is {self.key_length}")
        keylock.lock_model(model, key, self.blocks, init_seed=int(self._need_cfg()["seed"]),
                           activation=self.lock_activation)
        saved = {k[len(_ENTRY):]: v for k, v in ctx.state.items() if k.startswith(_ENTRY)}
        private = self._private(model)
        if saved:  # the client's own lock (and inserted running statistics) from its last round
            if set(saved) != set(private):
                raise ValueError(f"fedkl: stored lock entries {sorted(saved)} do not fit the locked model "
                                 f"{sorted(private)} (did the model or `blocks` change?)")
            sd = model.state_dict()
            with torch.no_grad():
                for k, v in saved.items():
                    # (Context.state stores 0-d arrays, e.g. num_batches_tracked, with shape (1,))
                    sd[k].copy_(torch.as_tensor(np.asarray(v)).reshape(sd[k].shape).to(sd[k].dtype))
        self._start = {k: v.detach().cpu().numpy().copy() for k, v in keylock.lock_entries(model).items()}
        # Table 5.3's numerator: the lock layers' parameters
        n_lock = sum(p.numel() for n, p in model.named_parameters() if keylock.is_private(n))
        self._metrics = {"lock_parameters": float(n_lock),
                         "lock_fraction": n_lock / max(sum(p.numel() for p in model.parameters()), 1)}
        self._evaluate(model, ctx, "before")
        return model

    def _private(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Entries the global model does not have, except the key buffers (the key is stored once)."""
        return {k: v for k, v in model.state_dict().items()
                if k not in self._base and not k.endswith("." + keylock.KEY)}

    def end_round(self, model: nn.Module, ctx: DefenseContext) -> None:
        for k, v in self._private(model).items():
            ctx.state[_ENTRY + k] = v.detach().cpu().numpy().copy()
        self._end = {k: v.detach().cpu().numpy().copy() for k, v in keylock.lock_entries(model).items()}
        self._evaluate(model, ctx, "after")

    def reply_extras(self, ctx: DefenseContext) -> dict[str, np.ndarray]:
        if not self.leak_lock:
            return {}
        out = {keylock.LEAK_START + k: v for k, v in self._start.items()}
        out.update({keylock.LEAK_END + k: v for k, v in self._end.items()})
        return out

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def server_observers(self) -> list[dict[str, Any]]:
        return [{"name": RandomKeyEvaluation.name, "blocks": self.blocks, "key_length": self.key_length,
                 "lock_activation": self.lock_activation}]
