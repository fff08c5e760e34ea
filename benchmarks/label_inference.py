"""Label inference at batch 2 to 16: share of labels and of whole batches recovered, per method.

Victims as in ``benchmarks/attack_strength.py`` (:func:`round_victims`): DLG's sigmoid LeNet
(U(-0.5, 0.5) init) on fmnist-small **test** images, one FedSGD step (SGD lr 0.1) per victim, the
victims of a round sharing the global model; ``--trained`` lists global-model states as numbers of SGD
steps (lr 0.1, batches of 32 training images) taken before the round (0 = fresh). Per state, batch size
and method it prints the label accuracy (multiset overlap with the true labels, as
:func:`fedsim.metrics.score_reconstruction` counts it), the share of batches whose labels are all
right, and the global model's test accuracy.

Methods (:mod:`attacks.labels`): ``ilrg`` (fedsim's default, :func:`infer_label_counts`), ``llg`` (the
sign heuristic, :func:`infer_labels_batch`, used when the last layer has no bias) and ``probe`` (Geng
et al.'s estimate with the mean softmax of 64 random inputs, the default before iLRG).

    PYTHONPATH=. .venv/bin/python benchmarks/label_inference.py [--batches 2,4,8,16] [--rounds 3]
        [--victims 10] [--trained 0,100,300,1000]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_strength import round_victims  # noqa: E402

from attacks._common import prepare_target  # noqa: E402
from attacks.labels import (  # noqa: E402
    infer_label_counts,
    infer_labels_batch,
    infer_labels_counts,
    last_linear,
    probe_probs,
)
from fedsim.data.registry import load_dataset  # noqa: E402

METHODS = ("ilrg", "llg", "probe")


def infer(method: str, target, batch: int, shape, seed: int) -> torch.Tensor:
    w, b = last_linear(target.model)
    params = dict(target.model.named_parameters())
    if method == "ilrg":
        return infer_label_counts(params[w], params[b], target.grads[w], target.grads[b], batch)
    if method == "llg":
        return infer_labels_batch(target.grads, batch, w, b)
    probs = probe_probs(target.model, shape, torch.Generator().manual_seed(seed))
    return infer_labels_counts(target.grads[b], batch, probs)


def overlap(pred: torch.Tensor, truth: torch.Tensor, classes: int) -> int:
    return int(torch.minimum(torch.bincount(pred, minlength=classes), torch.bincount(truth, minlength=classes)).sum())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="2,4,8,16")
    ap.add_argument("--rounds", type=int, default=3, help="global models (seeds 0..rounds-1)")
    ap.add_argument("--victims", type=int, default=10, help="victims (batches) per round")
    ap.add_argument("--trained", default="0,100,300,1000", help="SGD steps of the global model before the round")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ds = load_dataset("fmnist-small")
    methods = args.methods.split(",")
    print(f"torch {torch.__version__}; {args.rounds} rounds x {args.victims} batches per batch size")
    print(f"{'trained':>7} {'test acc':>8} {'B':>3} {'batches':>7} " + " ".join(f"{m + ' acc':>9} {'exact':>6}" for m in methods)
          + f" {'s/batch':>8}")
    t_all = time.perf_counter()
    for steps in [int(s) for s in args.trained.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            hits = {m: 0 for m in methods}
            exact = {m: 0 for m in methods}
            n, total, accs, secs = 0, 0, [], 0.0
            for r in range(args.rounds):
                vs = round_victims(batch, r, args.victims, train_steps=steps)
                model = vs[0][0].global_model().eval()
                with torch.no_grad():
                    accs.append(float((model(ds.x_test).argmax(-1) == ds.y_test).float().mean()))
                for v, (inp, _, y) in enumerate(vs):
                    target = prepare_target(inp)
                    for m in methods:
                        t0 = time.perf_counter()
                        pred = infer(m, target, batch, inp.input_shape, v)
                        if m == "ilrg":
                            secs += time.perf_counter() - t0
                        k = overlap(pred, y, inp.num_classes)
                        hits[m] += k
                        exact[m] += int(k == batch)
                    n += 1
                    total += batch
            print(f"{steps:7d} {np.mean(accs):8.3f} {batch:3d} {n:7d} "
                  + " ".join(f"{hits[m] / total:9.3f} {exact[m] / n:6.2f}" for m in methods)
                  + f" {secs / n:8.3f}", flush=True)
    print(f"acc: label accuracy (multiset); exact: share of batches with every label right; s/batch: iLRG's time. "
          f"{time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
