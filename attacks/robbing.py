"""Robbing the Fed (Fowl et al., "Robbing the Fed: directly obtaining private data in federated
learning with modified models", ICLR 2022).

THREAT MODEL: MALICIOUS SERVER, not honest-but-curious. The server has modified the model it sent:
an imprint block (:mod:`fedsim.models.imprint`) sits in front of the original model. Every other
attack in this package assumes a server that follows the protocol; this one does not, and its trace
says so (``trace["threat_model"] = "malicious"``).

Attack (no optimisation): the block's first layer has ``k`` units ``relu(m(x) - t_i)`` with one
measurement ``m`` (e.g. mean brightness) and increasing bin boundaries ``t_i``; the gradient of
unit ``i`` sums ``c_b x_b`` over the inputs with ``m(x_b) > t_i``. Differences of consecutive units,
``dL/dW_i - dL/dW_{i+1}`` over ``dL/db_i - dL/db_{i+1}``, return every input that is alone in its bin
exactly, and the ``c_b``-weighted mean of the inputs that share a bin. The pseudo-gradient is the
update over ``-lr K``: exact for one local step; after several steps the block's weights move a little
between steps, so the recovery is approximate, and it covers every input of every local step
(``min(num_examples, K * batch_size)`` images are returned).

Labels come from the base model's last linear layer (:mod:`attacks.labels`) or are known. The
recovered images are returned in bin order, so they are not paired with their labels.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Mapping

import torch

from fedsim.models.imprint import IMPRINT_TRANSFORM, ImprintBlock
from fedsim.params import Range
from fedsim.protocol import BATCH_SIZE

from ._common import Labels, choose_labels, finish, prepare_target
from .base import Attack, AttackInput, AttackResult, register
from .gradients import local_step_count, update_to_gradient


def find_imprint(model: torch.nn.Module) -> tuple[str, ImprintBlock]:
    """Module path and the imprint block of an imprinted model (ValueError if it has none)."""
    for name, mod in model.named_modules():
        if isinstance(mod, ImprintBlock):
            return name, mod
    raise ValueError("attack 'robbing' needs a model with an imprint block (fedsim.models.imprint); the "
                     "global model has none - Robbing the Fed is a malicious-server attack on a modified model")


def bin_differences(grad_weight: torch.Tensor, grad_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-bin gradient differences ``(dW_i - dW_{i+1}, db_i - db_{i+1})`` with ``dW_k = 0``."""
    gw, gb = grad_weight.double(), grad_bias.double()
    dw = gw - torch.cat([gw[1:], torch.zeros_like(gw[:1])])
    db = gb - torch.cat([gb[1:], torch.zeros_like(gb[:1])])
    return dw, db


@register
class RobbingTheFed(Attack):
    """Robbing the Fed (malicious server; see module doc). Parameters:

    * ``labels`` (``"idlg"``): labels inferred from the base model's last layer, or ``"known"``;
    * ``tolerance`` (1e-5): a bin counts as occupied when its bias-gradient difference exceeds this
      fraction of the largest one (differences of empty bins are float rounding of the update).
    """

    name = "robbing"

    def __init__(self, labels: Labels = "idlg", tolerance: Annotated[float, Range(0, 1, open_low=True, open_high=True)] = 1e-5):
        self.labels, self.tolerance = labels, float(tolerance)

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        super().validate_config(cfg)
        if not cfg["model"].get("imprint_bins"):
            raise ValueError("the malicious-server attack needs the imprinted model (model.imprint_bins) and the "
                             "server transform [[transforms]] name = 'robbing-imprint'")
        if not any(isinstance(t, Mapping) and t.get("name") == IMPRINT_TRANSFORM for t in cfg.get("transforms") or []):
            raise ValueError(f"it needs the server transform [[transforms]] name = '{IMPRINT_TRANSFORM}' that "
                             "imprints the model it sends: with model.imprint_bins alone the imprint block keeps its "
                             "random weights and what the attack reads back is not the victims' inputs")

    def run(self, inp: AttackInput) -> AttackResult:
        t0 = time.perf_counter()
        model = inp.global_model()
        path, block = find_imprint(model)
        prefix = f"{path}." if path else ""
        wname, bname = prefix + "linear0.weight", prefix + "linear0.bias"
        steps = local_step_count(inp.recipe, inp.num_examples)
        grads = update_to_gradient(inp.update, inp.recipe, names=[wname, bname], num_examples=inp.num_examples)
        dw, db = bin_differences(grads[wname].to(inp.device), grads[bname].to(inp.device))
        scale = float(db.abs().max())
        occupied = (db.abs() > self.tolerance * scale).nonzero().flatten() if scale > 0 else db.new_zeros(0).long()
        order = occupied[torch.argsort(db[occupied].abs(), descending=True)]
        n = inp.batch_size if steps == 1 else min(int(inp.num_examples), steps * int(inp.recipe[BATCH_SIZE]))
        shape = tuple(inp.input_shape)
        if len(order):
            images = (dw[order] / db[order, None]).float().reshape(len(order), *shape)
        else:
            images = torch.zeros((0, *shape), device=inp.device)
        if len(images) >= n:
            x = images[:n]
        else:  # fewer occupied bins than inputs: some bins hold several; repeat the fullest mixtures
            reps = [images[i % len(images)] for i in range(n - len(images))] if len(images) else []
            fill = torch.stack(reps) if reps else torch.full((n - len(images), *shape), 0.5, device=inp.device)
            x = torch.cat([images, fill])
        y = choose_labels(self.labels, prepare_target(inp), inp, n)
        trace: dict[str, Any] = {
            "threat_model": "malicious",
            "loss": [], "iterations": 0, "converged_at": None,
            "bins": block.num_bins, "occupied_bins": int(len(order)), "images": n, "local_steps": steps,
            "exact": steps == 1,
        }
        return finish(x, y, trace, t0)
