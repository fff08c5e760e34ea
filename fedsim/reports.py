"""Run folders, atomic file writes, plots and ``report.md``.

Every file is written to a temporary file in the same folder and then renamed, so a reader never
sees a half-written file and an interrupted run leaves only complete files.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from fedsim.protocol import TRAIN_LOSS


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None if math.isnan(x) else (1e308 if x > 0 else -1e308)
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        return _jsonable(x.item())
    return x


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(_jsonable(obj), indent=2) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(_jsonable(r)) + "\n" for r in rows))


def append_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Append rows to a JSONL file as whole lines (one ``write`` per call, flushed): a reader sees
    complete lines only, and the file is never rewritten."""
    text = "".join(json.dumps(_jsonable(r)) + "\n" for r in rows)
    if not text:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def save_figure(fig, path: str | Path) -> None:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def new_run_dir(parent: str | Path, name: str) -> Path:
    """``parent/<name>-<YYYYmmdd-HHMMSS>`` (suffixed if it exists)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(parent) / f"{name}-{stamp}"
    path, k = base, 1
    while path.exists():
        k += 1
        path = Path(f"{base}-{k}")
    path.mkdir(parents=True)
    return path


def plot_accuracy(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    rounds = [r["round"] for r in rows]
    ax.plot(rounds, [r["accuracy"] for r in rows], marker="o", label="test accuracy")
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax2 = ax.twinx()
    ax2.plot(rounds, [r["loss"] for r in rows], color="tab:red", alpha=0.6, label="test loss")
    ax2.set_ylabel("loss", color="tab:red")
    save_figure(fig, path)
    plt.close(fig)


def md_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], fmt: Mapping[str, str] | None = None) -> str:
    fmt = fmt or {}

    def cell(r: Mapping[str, Any], c: str) -> str:
        v = r.get(c, "")
        if v is None:
            return "-"
        if isinstance(v, float):
            return format(v, fmt.get(c, ".4g"))
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _sgd_extras(train: Mapping[str, Any]) -> str:
    out = ""
    if train.get("lr_schedule", "constant") != "constant":
        out += f" ({train['lr_schedule']} schedule)"
    for k in ("momentum", "weight_decay"):
        if train.get(k):
            out += f", {k.replace('_', ' ')} {train[k]}"
    return out


def _time_split(summary: Mapping[str, Any]) -> str:
    """`` (start-up 9.1 s, rounds 12.0 s, observers 3.2 s)`` when the summary has the split."""
    parts = [(k, summary.get(f"{k}_seconds")) for k in ("startup", "round", "observer")]
    parts = [(k, v) for k, v in parts if isinstance(v, (int, float))]
    names = {"startup": "start-up", "round": "rounds", "observer": "observers"}
    return f" ({', '.join(f'{names[k]} {v:.1f} s' for k, v in parts)})" if parts else ""


def write_report(out: Path, cfg: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any],
                 sections: Sequence[str] = ()) -> None:
    """``report.md``: run settings, the accuracy plot, per-round table, observer sections."""
    fed, data, model, train = cfg["federation"], cfg["data"], cfg["model"], cfg["train"]
    steps = f"{train['local_steps']} steps" if train.get("local_steps") else f"{train['local_epochs']} epochs"
    defenses = ", ".join(d["name"] for d in cfg.get("defenses", [])) or "none"
    text = [f"# fedsim run: {cfg['name']}\n",
            f"- strategy **{cfg['strategy']['name']}**, {fed['rounds']} rounds, {fed['num_clients']} clients "
            f"({fed['clients_per_round'] or fed['num_clients']} per round)",
            f"- data **{data['dataset']}** ({data['partition']} partition), model **{model['name']}**",
            f"- local training: SGD lr {train['lr']}{_sgd_extras(train)}, batch {train['batch_size']}, {steps}; "
            f"defenses: {defenses}",
            f"- seed {cfg['seed']}; final accuracy **{summary.get('final_accuracy', float('nan')):.4f}**, "
            f"total {summary.get('seconds', 0):.1f} s{_time_split(summary)}, client failures "
            f"{summary.get('client_failures', 0)}\n",
            "![accuracy](accuracy.png)\n", "## Rounds\n",
            md_table(rows, ["round", "accuracy", "loss", TRAIN_LOSS, "replies", "failures", "seconds"],
                     {"seconds": ".2f", "accuracy": ".4f", "loss": ".4f", TRAIN_LOSS: ".4f"})]
    text += [s for s in sections if s]
    atomic_write_text(out / "report.md", "\n".join(text))
