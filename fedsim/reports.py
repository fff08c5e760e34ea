"""Run folders, atomic file writes, plots and ``report.md``.

Every file is written to a temporary file in the same folder and then renamed, so a reader never
sees a half-written file and an interrupted run leaves only complete files.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence


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


def atomic_write_bytes(path: str | Path, data: bytes, durable: bool = False) -> None:
    """Write ``data`` to a temporary file in the same folder, then rename it to ``path``: a reader sees
    the old file or the new one, never a part. The file gets the user's normal permissions (mode 0666
    less the umask, like any file the user creates). ``durable`` also fsyncs the file and the folder
    (checkpoints: the rename survives a power cut)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:  # a failed write names no file: name it
            raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
        raise
    if durable:
        try:
            dfd = os.open(path.parent, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dfd)
        except OSError:
            pass
        finally:
            os.close(dfd)


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
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
    except OSError as exc:
        if exc.filename is None:  # a failed write names no file: name it
            raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
        raise


def read_jsonl(path: str | Path, skip_bad: bool = False) -> list[dict[str, Any]]:
    """The rows of a JSONL file; ``skip_bad`` drops lines that do not parse (a line cut by a crash)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            if not skip_bad:
                raise ValueError(f"{path}: line {n} is not valid JSON ({exc})") from None
    return rows


def save_figure(fig, path: str | Path) -> None:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def new_run_dir(parent: str | Path, name: str, create: bool = True) -> Path:
    """``parent/<name>-<YYYYmmdd-HHMMSS>`` (suffixed ``-2``, ``-3``, ... if taken). With ``create`` the
    folder is made here, atomically (two runs started in the same second get different folders)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(parent) / f"{name}-{stamp}"
    path, k = base, 1
    while True:
        if not path.exists():
            if not create:
                return path
            try:
                path.mkdir(parents=True)
                return path
            except FileExistsError:
                pass
        k += 1
        path = Path(f"{base}-{k}")


def plot_accuracy(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    rounds = [r["round"] for r in rows]
    ax.plot(rounds, [r["accuracy"] for r in rows], marker="o", label="test accuracy")
    ax.set_xlabel("round")
    ax.xaxis.get_major_locator().set_params(integer=True)  # rounds, not 2.5
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


def _count(n: Any, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def write_report(out: Path, cfg: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any],
                 sections: Sequence[str] = ()) -> None:
    """``report.md``: run settings, the accuracy plot, per-round table, observer sections."""
    from fedsim.protocol import TRAIN_LOSS  # here: fedsim.protocol imports Flower; reading reports needs none

    fed, data, model, train = cfg["federation"], cfg["data"], cfg["model"], cfg["train"]
    steps = _count(train["local_steps"], "step") if train.get("local_steps") else _count(train["local_epochs"], "epoch")
    defenses = ", ".join(d["name"] for d in cfg.get("defenses", [])) or "none"
    final = summary.get("final_accuracy")
    final_text = "-" if final is None else f"{final:.4f}"
    status = summary.get("status", "completed")
    status_line = [] if status == "completed" else [
        f"- **status: {status}** "
        + (f"after round {summary['completed_round']}" if summary.get("completed_round") is not None
           else "before any round completed")
        + (f" ({summary['error']})" if summary.get("error") else "")
        + (f"; resume with `fedsim run --resume {out}`" if summary.get("resumable") else
           f"; start it again with `fedsim run --resume {out}`" if summary.get("completed_round") is None else "")]
    text = [f"# fedsim run: {cfg['name']}\n",
            f"- strategy **{cfg['strategy']['name']}**, {fed['rounds']} rounds, {fed['num_clients']} clients "
            f"({fed['clients_per_round'] or fed['num_clients']} per round)",
            f"- data **{data['dataset']}** ({data['partition']} partition), model **{model['name']}**",
            f"- local training: SGD lr {train['lr']}{_sgd_extras(train)}, batch {train['batch_size']}, {steps}; "
            f"defenses: {defenses}",
            f"- seed {cfg['seed']}; final accuracy **{final_text}**, "
            f"total {summary.get('seconds', 0):.1f} s{_time_split(summary)}, client failures "
            f"{summary.get('client_failures', 0)}",
            *status_line, "",
            "![accuracy](accuracy.png)\n", "## Rounds\n",
            md_table(rows, ["round", "accuracy", "loss", TRAIN_LOSS, "replies", "failures", "seconds"],
                     {"seconds": ".2f", "accuracy": ".4f", "loss": ".4f", TRAIN_LOSS: ".4f"})]
    text += [s for s in sections if s]
    atomic_write_text(out / "report.md", "\n".join(text))
