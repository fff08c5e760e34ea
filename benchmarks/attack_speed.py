"""Attack iterations per second against the cost floor of gradient matching, and victims per second
when all victims of a round are attacked at once.

**Per-iteration cost.** For each model (the DLG LeNet and seed 000's ConvNet) and batch size (1 and 8)
this times

* ``floor``: one forward, the parameter gradient with ``create_graph=True``, the squared L2 distance
  to a fixed target and the double backward to the dummy input - the least any gradient-matching
  iteration must do on that model;
* every optimisation-based attack (``dlg`` joint labels, ``idlg``, ``cpl``, ``ig``, ``grnn``, ``ig-bn``,
  ``ig-fr``; not ``robbing``, which is closed-form) with its per-iteration work only (one attempt, no
  threshold stop, no patience stop). ``ig-bn`` needs BatchNorm: on the LeNet (none) its cell is ``-``;

side by side in the same process (interleaved repeats; the floor is timed again just before each
attack), and prints iterations per second (the best of the repeats) and the attack-to-floor time ratio
(1.00 = no overhead beyond the floor): the median over the repeats of each attack's ratio to the floor
timed just before it, with the range of the repeats below the table. (Until 2026-11-26 the ratio was the
best floor rate over the best attack rate, kept separately, which a change of load between the two
could swing by up to 0.6.)
Attack rates are measured as the difference between a long and a short run, so one-off set-up
(target extraction, label inference) is excluded. DLG with joint labels can saturate the sigmoids
from some starts, after which L-BFGS iterations are no-ops (a zero gradient), which inflates its rate.

**Victims per second** (``--victims V``, 0 to skip): ``V`` victims of one round (one global LeNet -
the BatchNorm LeNet for ``ig-bn`` - disjoint fmnist-small images, batch 1 and 8) attacked one by one
with ``run`` and together with ``run_many``, the same iterations per victim; prints victims per second
of both, the speed-up and the mean SSIM of both runs (equal quality: the stacked run solves the same
problems). ``ig-bn`` and ``ig-fr`` have no stacked implementation (``run_many`` runs them one by one:
speed-up ~1), nor has GRNN above batch 4 (docs/attacks.md).

``--clock process`` times the per-iteration table with the process's CPU time instead of the wall clock (CPU only): with one
torch thread that is the attack's own work, which other processes on a shared, loaded machine do not
lengthen the way they do the wall time (they still slow it a little through shared caches).

``--device`` (``cpu``, ``cuda``, ``cuda:N``, ``auto``) is where the attacks and the floor run: the global
model, the dummy data and every attack tensor (``AttackInput.device``); GPU timings synchronise before
reading the clock. The victims' updates are computed on the CPU (the same updates on every device).

    .venv/bin/python benchmarks/attack_speed.py [--threads 1] [--device cpu|cuda] [--clock wall|process]
        [--seconds 1.0] [--repeats 3]
        [--attacks dlg,idlg,cpl,ig,grnn,ig-bn,ig-fr] [--victims 8]
"""
from __future__ import annotations

import argparse
import ast
import time
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from attacks import AttackInput, build_attack
from fedsim.data.registry import load_dataset
from fedsim.device import resolve_device
from fedsim.metrics import score_reconstruction
from fedsim.models import build_model
from fedsim.training.local import local_train
from fedsim.training.recipe import Recipe

MODELS = {  # build_model keyword arguments; "init" is the global model's initialisation
    "lenet": dict(name="lenet", init="uniform"),  # sigmoid, U(-0.5, 0.5): the DLG setting
    "convnet": dict(name="convnet", init="default"),  # width 16, ReLU, BatchNorm (fedsim defaults)
    "lenet-bn": dict(name="lenet", init="default", norm="batch", activation="relu"),  # attack_priors' model
}
PER_ITERATION_MODELS = ("lenet", "convnet")
ATTACKS = ("dlg", "idlg", "cpl", "ig", "grnn", "ig-bn", "ig-fr")
NEEDS_BN = {"ig-bn"}  # a model without BatchNorm is an error for these
# per-iteration work only: one attempt, no early stops
PER_ITERATION = {"dlg": {"threshold": None, "restarts": 1, "patience": None},
                 "idlg": {"threshold": None, "restarts": 1, "patience": None},
                 "cpl": {"threshold": None, "restarts": 1, "patience": None},
                 "ig": {"threshold": None, "restarts": 1},
                 "grnn": {"threshold": None, "restarts": 1},
                 "ig-bn": {"threshold": None, "restarts": 1},
                 "ig-fr": {"threshold": None, "restarts": 1}}
# iterations per victim in the victims-per-second comparison
VICTIM_ITERATIONS = {"dlg": 300, "idlg": 300, "cpl": 300, "ig": 300, "grnn": 100, "ig-bn": 300, "ig-fr": 100}


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
clock = CLOCKS["wall"]  # what every timing here reads (main's --clock)


def has_bn(model_key: str) -> bool:
    spec = dict(MODELS[model_key])
    model = build_model(spec.pop("name"), (1, 28, 28), 10, **{k: v for k, v in spec.items() if k != "init"})
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def supports(name: str, model_key: str) -> bool:
    return name not in NEEDS_BN or has_bn(model_key)


def parse_sets(items: list[str]) -> dict[str, dict[str, Any]]:
    """``--set ATTACK.KEY=VALUE`` items as ``{attack: {key: value}}`` (values read as Python literals where they parse)."""
    params: dict[str, dict[str, Any]] = {}
    for item in items:
        key, _, value = item.partition("=")
        name, _, param = key.partition(".")
        if not param or not _:
            raise SystemExit(f"--set needs attack.key=value, got {item!r}")
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = value
        params.setdefault(name, {})[param] = parsed
    return params


def victim(model_key: str, batch: int, device: torch.device, start: int = 0, seed: int = 0) -> tuple[
        AttackInput, torch.Tensor, torch.Tensor]:
    """One client's FedSGD update on images ``start .. start + batch`` (the global model from ``seed``)."""
    ds = load_dataset("fmnist-small")
    spec = dict(MODELS[model_key])
    name, init = spec.pop("name"), spec.pop("init")
    shape = ds.in_shape

    def model_fn():
        return build_model(name, shape, 10, **spec)

    torch.manual_seed(0)
    net = build_model(name, shape, 10, init=init, **spec)
    g = {k: v.detach().clone() for k, v in net.state_dict().items()}
    recipe = Recipe(lr=0.1, batch_size=batch, local_steps=1)
    x, y = ds.x_train[start:start + batch], ds.y_train[start:start + batch]
    res = local_train(net, x, y, recipe, seed=0, round=0, client=0)
    update = {k: torch.as_tensor(w) - g[k] for k, w in zip(g, res.weights)}
    inp = AttackInput(model_fn, g, update, recipe.to_mapping(), shape, 10, batch, device=device, seed=seed)
    return inp, x, y


def floor_rate(inp: AttackInput, seconds: float) -> float:
    model = inp.global_model().train()
    params = [p for p in model.parameters() if p.requires_grad]
    target = [torch.randn_like(p) for p in params]
    x = torch.rand((inp.batch_size, *inp.input_shape), device=inp.device, requires_grad=True)
    y = torch.arange(inp.batch_size, device=inp.device) % inp.num_classes

    def step():
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)
        dist = sum((g - t).pow(2).sum() for g, t in zip(grads, target))
        (gx,) = torch.autograd.grad(dist, x)
        return gx

    return _rate(step, seconds, inp.device)


def floor_seconds(inp: AttackInput, seconds: float) -> float:
    """Seconds per evaluation of the floor (:func:`floor_rate`)."""
    return 1.0 / floor_rate(inp, seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(step, seconds: float, device: torch.device) -> float:
    for _ in range(3):
        step()
    _sync(device)
    n, t0 = 0, clock()
    while clock() - t0 < seconds:
        step()
        n += 1
    _sync(device)
    return n / (clock() - t0)


def attack_rate(name: str, inp: AttackInput, seconds: float, guess: float, extra: dict | None = None) -> float:
    """Iterations per second from a long and a short run (set-up cost cancels). ``name`` may be a
    variant ``NAME@LABEL`` whose parameters ``extra`` adds to the per-iteration settings."""
    base = name.split("@")[0]
    params = {**PER_ITERATION[base], **(extra or {})}
    short = max(5, int(guess * seconds * 0.2))
    long = max(short + 10, int(guess * seconds))
    times, its = [], []
    build_attack(base, **{**params, "iterations": 3}).run(inp)  # warm-up (lazy kernel initialisation)
    for n in (short, long):
        attack = build_attack(base, **{**params, "iterations": n})
        _sync(inp.device)
        t0 = clock()
        res = attack.run(inp)
        _sync(inp.device)
        times.append(clock() - t0)
        its.append(res.trace["iterations"])
    if its[1] <= its[0] or times[1] <= times[0]:
        return its[1] / times[1]
    return (its[1] - its[0]) / (times[1] - times[0])


def victims_rate(name: str, batch: int, victims: int, device: torch.device, extra: dict | None = None) -> dict[str, Any]:
    """Victims per second one by one and stacked, with the mean SSIM of each (on the LeNet, or the
    BatchNorm LeNet for attacks that need BatchNorm)."""
    name = name.split("@")[0]
    model_key = "lenet" if supports(name, "lenet") else "lenet-bn"
    vs = [victim(model_key, batch, device, start=37 * k, seed=k) for k in range(victims)]
    inputs = [v[0] for v in vs]
    params = {**PER_ITERATION[name], **(extra or {}), "iterations": VICTIM_ITERATIONS[name]}
    attack = build_attack(name, **params)
    build_attack(name, **dict(params, iterations=3)).run_many(inputs[:2])  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    one = [attack.run(i) for i in inputs]
    _sync(device)
    t1 = time.perf_counter()
    many = attack.run_many(inputs)
    _sync(device)
    t2 = time.perf_counter()

    def mean_ssim(results):
        return float(np.mean([score_reconstruction(r.inputs, r.labels, x, y)["ssim"]
                              for r, (_, x, y) in zip(results, vs)]))

    return {"one": victims / (t1 - t0), "many": victims / (t2 - t1), "speedup": (t1 - t0) / (t2 - t1),
            "ssim_one": mean_ssim(one), "ssim_many": mean_ssim(many), "iterations": VICTIM_ITERATIONS[name],
            "model": model_key, "stacked": bool(many and many[0].trace.get("group_size"))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (CUDA when present)")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall: elapsed time; process: this process's CPU time (CPU only; robust to other load)")
    ap.add_argument("--seconds", type=float, default=1.0, help="target time per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (best rate, median ratio)")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--victims", type=int, default=8, help="victims per round for run_many (0: skip)")
    ap.add_argument("--models", default=",".join(PER_ITERATION_MODELS), help="models of the per-iteration table")
    ap.add_argument("--set", action="append", default=[], metavar="ATTACK.KEY=VALUE",
                    help="parameters of an attack or of a variant NAME@LABEL listed in --attacks")
    args = ap.parse_args(argv)
    sets = parse_sets(args.set)
    torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
    except (RuntimeError, ValueError) as exc:
        ap.error(f"--device: {exc}")
    if args.clock == "process" and device.type != "cpu":
        ap.error("--clock process: CPU time does not measure work on a GPU (use --clock wall)")
    global clock
    clock = CLOCKS[args.clock]
    names = args.attacks.split(",")
    unknown = [n for n in names if n.split("@")[0] not in PER_ITERATION]
    if unknown:
        ap.error(f"--attacks: {unknown} not among {list(PER_ITERATION)}")
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, clock {args.clock}")
    # warm-up: the first backward of a process is slow
    floor_rate(victim("lenet", 1, device)[0], 0.2)
    configs = [(m, b) for m in args.models.split(",") for b in (1, 8)]
    inputs = {c: victim(*c, device)[0] for c in configs}
    best: dict[tuple, dict[str, float]] = {c: {} for c in configs}
    ratios: dict[tuple, dict[str, list[float]]] = {c: {} for c in configs}
    for _ in range(args.repeats):  # interleaved repeats: robust to other load on the machine
        for c in configs:
            for n in [n for n in names if supports(n.split("@")[0], c[0])]:
                fl = floor_rate(inputs[c], args.seconds)  # the floor just before the attack: the same load
                rate = attack_rate(n, inputs[c], args.seconds, fl, sets.get(n))
                ratios[c].setdefault(n, []).append(fl / rate)
                best[c]["floor"] = max(best[c].get("floor", 0.0), fl)
                best[c][n] = max(best[c].get(n, 0.0), rate)
    print("\nIterations per second (best of the repeats), and time per iteration over the floor's (median of "
          "the repeats' ratios, each attack against the floor timed just before it)")
    print(f"{'model':8} {'batch':>5} {'floor it/s':>11} " + " ".join(f"{n + ' it/s':>10} {'/floor':>6}" for n in names))
    for (model_key, batch), r in best.items():
        med = {n: float(np.median(v)) for n, v in ratios[(model_key, batch)].items()}
        print(f"{model_key:8} {batch:5d} {r.get('floor', 0.0):11.1f} "
              + " ".join(f"{r[n]:10.1f} {med[n]:6.2f}" if n in r else f"{'-':>10} {'-':>6}" for n in names))
    print("floor: one forward + parameter gradient (create_graph) + L2 distance + double backward. "
          "-: the attack needs BatchNorm.")
    print("\n/floor per repeat (min - max):")
    for (model_key, batch), per in ratios.items():
        print(f"{model_key:8} {batch:5d} " + "  ".join(f"{n} {min(v):.2f}-{max(v):.2f}" for n, v in per.items()))
    if args.victims:
        print(f"\nVictims per second: {args.victims} victims of one round (LeNet; ig-bn: BatchNorm LeNet), one by one (run) vs stacked "
              "(run_many), same iterations per victim")
        print(f"{'attack':6} {'model':8} {'batch':>5} {'iters':>5} {'one v/s':>8} {'stacked v/s':>11} "
              f"{'speed-up':>8} {'SSIM one':>8} {'SSIM stacked':>12}")
        for batch in (1, 8):
            for n in names:
                r = victims_rate(n, batch, args.victims, device, sets.get(n))
                note = "" if r["stacked"] else "  (not stacked: one by one)"
                print(f"{n:6} {r['model']:8} {batch:5d} {r['iterations']:5d} {r['one']:8.2f} {r['many']:11.2f} "
                      f"{r['speedup']:8.2f} {r['ssim_one']:8.3f} {r['ssim_many']:12.3f}{note}", flush=True)


if __name__ == "__main__":
    main()
