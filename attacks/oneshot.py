"""``fedsim attack``: attack one client update without running a federation.

One exchange, as the curious server would see it in round 1: the server sends the initial global
model, one client (client 0 of a 1-client IID split, i.e. the training set) trains with the given
recipe, and the :class:`attacks.curious.CuriousServer` attacks the returned update and scores it.
Writes the same files as a federated run with ``[attack]`` on: ``config.toml``, ``leakage.jsonl``,
``reconstruction_<attack>.png``, ``summary.json`` and ``report.md``.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

from fedsim.config import ConfigError, apply_overrides, defaults, dump_toml, validate


def oneshot_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = defaults()
    cfg.update(name=f"attack-{'-'.join(args.attack)}", seed=args.seed, device=args.device)
    cfg["federation"].update(rounds=1, num_clients=args.clients, clients_per_round=1)
    cfg["data"]["dataset"] = args.dataset
    cfg["model"].update(name=args.model, activation=args.activation, init=args.init)
    cfg["train"].update(lr=args.lr, batch_size=args.batch_size, local_steps=args.local_steps, local_epochs=None)
    cfg["output"]["observers"] = []
    cfg["attack"] = {"name": list(args.attack), "rounds": [1], "victims": [0], "seed": args.seed,
                     "device": args.device}
    apply_overrides(cfg, args.set or [])
    validate(cfg)
    return cfg


def run_oneshot(cfg: dict[str, Any], out: Path, progress: bool = True) -> dict[str, Any]:
    """Train client 0 once from the seeded initial model and attack its update."""
    import time

    from attacks.curious import CuriousServer
    from clients.base import build_pipeline
    from fedsim.client_app import client_data, dataset_for, model_for
    from fedsim.observers import ClientUpdate
    from fedsim.reports import atomic_write_text, write_json, write_report
    from fedsim.server import train_config
    from fedsim.training import Recipe, evaluate, get_weights, local_train, seed_everything, set_weights

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.toml", dump_toml(cfg))
    seed_everything(cfg["seed"])
    ds = dataset_for(cfg)
    model = model_for(cfg)
    glob = get_weights(model)
    text = str(train_config(cfg)["fedsim-config"])
    x, y = client_data(text, 0)
    res = local_train(model, x, y, Recipe.from_mapping(cfg["train"]), seed=cfg["seed"], round=1, client=0,
                      pipeline=build_pipeline(cfg["defenses"]), device="cpu", public_data=(ds.x_root, ds.y_root))
    set_weights(model, res.weights)
    loss, acc = evaluate(model, ds.x_test, ds.y_test)
    recipe = Recipe.from_mapping(cfg["train"]).to_mapping()
    upd = ClientUpdate.create(round=1, client_id=0, node_id=0, global_weights=glob, weights=res.weights,
                              num_examples=res.num_examples, recipe=recipe, metrics=res.metrics,
                              param_names=list(model.state_dict().keys()))
    curious = CuriousServer(cfg)
    curious.on_start(out)
    curious.observe(upd)
    row = {"round": 1, "accuracy": acc, "loss": loss, "seconds": time.perf_counter() - t0, "replies": 1,
           "failures": 0, "train_loss": res.metrics.get("train_loss")}
    curious.on_round_end(1, row)
    summary = {"name": cfg["name"], "rounds": 1, "final_accuracy": acc, "final_loss": loss,
               "seconds": time.perf_counter() - t0, "client_failures": 0, **curious.on_finish()}
    write_json(out / "summary.json", summary)
    write_report(out, cfg, [row], summary, [curious.report_markdown()])
    if progress:
        for r in curious.rows:
            print(f"[fedsim] {r['attack']}: PSNR {r['psnr']:.2f} dB  SSIM {r['ssim']:.3f}  label acc "
                  f"{r['label_acc']:.2f}  {r['iterations']} it  {r['seconds']:.1f}s")
    return summary


def _cmd_attack(args: argparse.Namespace) -> int:
    from fedsim.client_app import dataset_for
    from fedsim.reports import new_run_dir

    cfg = oneshot_config(args)
    dataset_for(cfg)  # availability errors before any folder exists
    out = Path(args.out) if args.out else new_run_dir(cfg["output"]["dir"], cfg["name"])
    run_oneshot(cfg, out)
    print(f"[fedsim] results in {out}  (report: {out / 'report.md'})")
    return 0


def add_attack_command(sub: Any) -> None:
    a = sub.add_parser("attack", help="attack a single client update (no federation)",
                       description="Train one client once from the seeded initial model, attack its update "
                                   "like a curious server, score the reconstruction and write a report.")
    a.add_argument("--model", default="lenet", help="model.name (default lenet)")
    a.add_argument("--activation", default="sigmoid", help="model.activation (default sigmoid, as in DLG)")
    a.add_argument("--init", default="uniform", choices=("default", "uniform"),
                   help="model.init (default uniform: U(-0.5, 0.5), as DLG initialises its LeNet)")
    a.add_argument("--dataset", default="fmnist-small", help="data.dataset (default fmnist-small)")
    a.add_argument("--batch-size", type=int, default=1, help="the victim's batch size (default 1)")
    a.add_argument("--local-steps", type=int, default=1, help="the victim's local SGD steps (default 1: FedSGD)")
    a.add_argument("--lr", type=float, default=0.1, help="the victim's learning rate")
    a.add_argument("--clients", type=int, default=10, help="clients the data is split among (victim = client 0)")
    a.add_argument("--attack", action="append", required=True, metavar="NAME",
                   help="attack to run (repeatable): dlg, idlg, ig, cpl, ...")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--device", default="auto")
    a.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="further config overrides, e.g. --set attack.params.dlg.iterations=100")
    a.add_argument("--out", help="output folder (default: runs/attack-<name>-<timestamp>)")
    a.set_defaults(func=_cmd_attack)


__all__: Sequence[str] = ("add_attack_command", "oneshot_config", "run_oneshot", "ConfigError")
