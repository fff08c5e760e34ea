"""Attack iterations per second against the cost floor of gradient matching.

For each model (the DLG LeNet and seed 000's ConvNet) and batch size (1 and 8) this times

* ``floor``: one forward, the parameter gradient with ``create_graph=True``, the squared L2 distance
  to a fixed target and the double backward to the dummy input - the least any gradient-matching
  iteration must do on that model;
* ``dlg``: the registered DLG attack (L-BFGS) with iDLG labels. Joint labels cost the same per
  iteration, but from some starts joint DLG saturates the sigmoids, the gradient becomes exactly zero
  and L-BFGS iterations turn into no-ops, which would inflate the rate;
* ``ig``: the registered Inverting Gradients attack (cosine distance, TV, signed Adam, box clamp);

side by side in the same process (interleaved repeats, best rate of each kept), and prints
iterations per second and the attack-to-floor time ratio (1.00 = no overhead beyond the floor). Attack rates are measured as the difference between a
long and a short run, so one-off set-up (target extraction, label inference) is excluded.

    .venv/bin/python benchmarks/attack_speed.py [--threads 1] [--device cpu] [--seconds 1.0] [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F

from attacks import AttackInput, build_attack
from fedsim.data.registry import load_dataset
from fedsim.models import build_model
from fedsim.training import Recipe, local_train

MODELS = {
    "lenet": dict(name="lenet", init="uniform"),  # sigmoid, U(-0.5, 0.5): the DLG setting
    "convnet": dict(name="convnet", init="default"),  # width 16, ReLU, BatchNorm (fedsim defaults)
}


def victim(model_key: str, batch: int, device: torch.device) -> AttackInput:
    ds = load_dataset("fmnist-small")
    spec = MODELS[model_key]
    shape = ds.in_shape

    def model_fn():
        return build_model(spec["name"], shape, 10)

    torch.manual_seed(0)
    net = build_model(spec["name"], shape, 10, init=spec["init"])
    g = {k: v.detach().clone() for k, v in net.state_dict().items()}
    recipe = Recipe(lr=0.1, batch_size=batch, local_steps=1)
    res = local_train(net, ds.x_train[:batch], ds.y_train[:batch], recipe, seed=0, round=0, client=0)
    update = {k: torch.as_tensor(w) - g[k] for k, w in zip(g, res.weights)}
    return AttackInput(model_fn, g, update, recipe.to_mapping(), shape, 10, batch, device=device, seed=0)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(step, seconds: float, device: torch.device) -> float:
    for _ in range(3):
        step()
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
    _sync(device)
    return n / (time.perf_counter() - t0)


def attack_rate(name: str, inp: AttackInput, seconds: float, guess: float) -> float:
    """Iterations per second from a long and a short run (set-up cost cancels)."""
    short = max(5, int(guess * seconds * 0.2))
    long = max(short + 10, int(guess * seconds))
    times, its = [], []
    build_attack(name, iterations=3).run(inp)  # warm-up (lazy kernel initialisation)
    for n in (short, long):
        attack = build_attack(name, iterations=n, **({"threshold": None} if name in ("dlg", "idlg") else {}))
        _sync(inp.device)
        t0 = time.perf_counter()
        res = attack.run(inp)
        _sync(inp.device)
        times.append(time.perf_counter() - t0)
        its.append(res.trace["iterations"])
    if its[1] <= its[0] or times[1] <= times[0]:
        return its[1] / times[1]
    return (its[1] - its[0]) / (times[1] - times[0])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=1.0, help="target time per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the best rate is kept")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}")
    print(f"{'model':8} {'batch':>5} {'floor it/s':>11} {'dlg it/s':>9} {'dlg/floor':>10} "
          f"{'ig it/s':>8} {'ig/floor':>9}")
    # warm-up: the first backward of a process is slow
    floor_rate(victim("lenet", 1, device), 0.2)
    configs = [(m, b) for m in MODELS for b in (1, 8)]
    inputs = {c: victim(*c, device) for c in configs}
    best: dict[tuple, list[float]] = {c: [0.0, 0.0, 0.0] for c in configs}
    for _ in range(args.repeats):  # interleaved repeats, best of each: robust to other load on the machine
        for c in configs:
            fl = floor_rate(inputs[c], args.seconds)
            rates = (fl, attack_rate("idlg", inputs[c], args.seconds, fl), attack_rate("ig", inputs[c], args.seconds, fl))
            best[c] = [max(a, b) for a, b in zip(best[c], rates)]
    for (model_key, batch), (fl, dlg, ig) in best.items():
        print(f"{model_key:8} {batch:5d} {fl:11.1f} {dlg:9.1f} {fl / dlg:10.2f} {ig:8.1f} {fl / ig:9.2f}")
    print("dlg = DLG with iDLG labels (L-BFGS); ig = Inverting Gradients (signed Adam).")
    print("dlg/floor, ig/floor: time per attack iteration over time per floor iteration.")


if __name__ == "__main__":
    main()
