"""The round-end evaluation of the global model: central (or by a client when the server cannot read the
model) and client-side (``evaluate.client_fraction``)."""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from flwr.app import RecordDict
from flwr.serverapp import Grid

from fedsim.factories import dataset_for, model_for
from fedsim.models.weights import set_weights
from fedsim.protocol import CONFIG, EVAL_ACCURACY, EVAL_DATA, EVAL_EXAMPLES, EVAL_LOSS, EVALUATE, train_config
from fedsim.rounds import RoundEngine, sample_partitions
from fedsim.seams import RoundRecord
from fedsim.seeding import derive_seed
from fedsim.training.evaluation import evaluate, source_accuracies


class Evaluator:
    """Evaluates the global model at the end of every round (``Server.round_end``)."""

    def __init__(self, cfg: Mapping[str, Any], engine: RoundEngine, device: torch.device):
        self.cfg, self.engine, self.device = cfg, engine, device
        self.ds = dataset_for(cfg)
        self.model = model_for(cfg)  # draws from torch's RNG: built where the server built it before

    def evaluate(self, grid: Grid, state: Any, record: RoundRecord) -> dict[str, Any]:
        """The global model's accuracy and loss on the common test split: on the server when it can read the
        model, else by the first client that can (the round's contributors first)."""
        arrays = self.engine.channel.plaintext(state)
        if arrays is not None:
            set_weights(self.model, arrays)
            loss, acc = evaluate(self.model, self.ds.x_test, self.ds.y_test, self.device)
            return {"accuracy": acc, "loss": loss, "evaluated_by": "server",
                    **self._by_source(source_accuracies(self.model, self.ds, self.device))}
        order = record.contributors or record.sampled or sorted(self.engine.partition_node)
        res = self.engine.evaluate_remote(grid, record.round, state, record, order)
        if res is None:
            return {"accuracy": None, "loss": None, "evaluated_by": "nobody (every evaluator failed)"}
        loss, acc, p, per_source = res
        return {"accuracy": acc, "loss": loss, "evaluated_by": f"client {p}", **self._by_source(per_source)}

    def _by_source(self, accuracies: Sequence[float]) -> dict[str, float]:
        """``test.<source>_accuracy`` for a test set of several sources (synthetic-2d, ``data.styles``)."""
        names = self.ds.source_names
        return {f"test.{n}_accuracy": a for n, a in zip(names, accuracies)} if len(accuracies) == len(names) else {}

    def client_evaluate(self, grid: Grid, state: Any, record: RoundRecord) -> dict[str, Any]:
        """Client-side evaluation (``evaluate.client_fraction``): clients drawn from (seed, round)
        evaluate the global model on their own data; example-weighted mean, worst and best."""
        frac = float(self.cfg.get("evaluate", {}).get("client_fraction", 0.0) or 0.0)
        if frac <= 0 or record.round < 1:
            return {}
        parts = sorted(self.engine.partition_node)
        k = max(1, math.ceil(frac * len(parts)))
        chosen = sample_partitions(derive_seed(self.cfg["seed"], 0xE7A1), record.round, parts, k)
        config = train_config(self.cfg, record.round)
        config[EVAL_DATA] = "local"
        content = RecordDict({CONFIG: config, **self.engine.channel.outgoing(state)})
        replies = self.engine.send(grid, chosen, EVALUATE, content, None, "client-evaluate", record.round, record,
                                   self.engine.checks.check_evaluation)
        if not replies:
            return {"client_evaluators": 0}
        accs = [float(r.metrics[EVAL_ACCURACY]) for r in replies]
        n = [float(r.metrics[EVAL_EXAMPLES]) for r in replies]
        share = [w / sum(n) for w in n]  # weights summing to 1: a huge (finite) loss cannot overflow the mean
        return {"client_accuracy": sum(a * w for a, w in zip(accs, share)),
                "client_loss": sum(float(r.metrics[EVAL_LOSS]) * w for r, w in zip(replies, share)),
                "client_accuracy_min": min(accs), "client_accuracy_max": max(accs),
                "client_evaluators": len(replies)}
