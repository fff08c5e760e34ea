"""Exports for other tools: CSV files next to the JSONL ones, and TensorBoard event files.

* :func:`write_csv` - rows (dicts) as CSV, columns in first-seen order, written atomically. Sweeps
  write ``sweep.csv``; the curious server ``leakage.csv``; ``fedsim compare`` ``comparison.csv``.
* :class:`CsvLog` - ``metrics.csv`` next to ``metrics.jsonl``: grows by whole lines, rewritten
  (atomically) only when a row brings a new column.
* :class:`EventWriter` - TensorBoard's event-file format (TFRecord framing of ``Event`` protocol
  buffers with scalar summaries), written directly, so TensorBoard can read a run without fedsim
  depending on TensorFlow, tensorboard or tensorboardX. The ``tensorboard`` observer
  (``output.observers = ["tensorboard"]``) writes every numeric column of every round to
  ``<run>/tensorboard/``; point ``tensorboard --logdir`` at a run, a sweep or ``runs/``.
"""
from __future__ import annotations

import csv
import io
import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from fedsim.components import OBSERVERS
from fedsim.observers import Observer


# ============================================================================== CSV
def csv_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    cols: dict[str, None] = {}
    for r in rows:
        for k in r:
            cols.setdefault(k, None)
    return list(cols)


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (list, tuple, dict)):
        import json

        return json.dumps(v)
    return v


def csv_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    cols = list(columns) if columns is not None else csv_columns(rows)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in rows:
        w.writerow([_cell(r.get(c)) for c in cols])
    return buf.getvalue()


def write_csv(path: str | Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> None:
    """``rows`` as CSV (lists and tables as JSON text, unset values empty), written atomically."""
    from fedsim.reports import atomic_write_text

    atomic_write_text(path, csv_text(rows, columns))


class CsvLog:
    """A CSV file that mirrors a growing list of rows (``metrics.csv``): each new row is appended as one
    whole line (one ``write``, flushed, as :func:`fedsim.reports.append_jsonl` does), so a round costs
    one line, not the whole file. Only when a row brings a column the header lacks is the file
    rewritten, atomically, with the columns in first-seen order. At every step the file holds exactly
    what :func:`write_csv` of all the rows would write."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.columns: list[str] | None = None  # the header of the file as this object last wrote it
        self.rewrites = 0  # whole-file writes (the first one, and one per new column set)

    def write(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Rewrite the file with ``rows`` (the start of a run, a resumed run's rows, new columns)."""
        self.columns = csv_columns(rows)
        write_csv(self.path, rows, self.columns)
        self.rewrites += 1

    def append(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """``rows`` is every row so far; its last row is the new one."""
        row = rows[-1]
        known = set(self.columns or ())
        if self.columns is None or any(k not in known for k in row) or not self.path.exists():
            self.write(rows)
            return
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow([_cell(row.get(c)) for c in self.columns])
        with open(self.path, "a", encoding="utf-8", newline="") as fh:
            fh.write(buf.getvalue())
            fh.flush()


# ============================================================================== TensorBoard
def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of TFRecord framing."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One TFRecord: length, masked CRC of the length, data, masked CRC of the data."""
    n = struct.pack("<Q", len(data))
    return n + struct.pack("<I", masked_crc(n)) + data + struct.pack("<I", masked_crc(data))


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, wire: int) -> bytes:
    return _varint((number << 3) | wire)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2) + _varint(len(data)) + data


def event_bytes(wall_time: float, step: int = 0, *, file_version: str | None = None,
                scalars: Mapping[str, float] | None = None) -> bytes:
    """A serialised ``tensorflow.Event``: ``wall_time`` (1, double), ``step`` (2, int64), and either
    ``file_version`` (3, string) or ``summary`` (5: ``Summary.value`` (1) entries of ``tag`` (1,
    string) and ``simple_value`` (2, float))."""
    out = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(int(step))
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        summary = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5) + struct.pack("<f", float(v)))
                           for tag, v in scalars.items())
        out += _bytes_field(5, summary)
    return out


class EventWriter:
    """Appends scalar events to one ``events.out.tfevents.<time>.<host>`` file in ``logdir``."""

    def __init__(self, logdir: str | Path):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.path = self.logdir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self._write(event_bytes(time.time(), 0, file_version="brain.Event:2"))

    def _write(self, event: bytes) -> None:
        with open(self.path, "ab") as fh:
            fh.write(tfrecord(event))
            fh.flush()

    def scalars(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        """One event holding every finite value of ``values`` at ``step``."""
        finite = {k: float(v) for k, v in values.items() if math.isfinite(float(v))}
        if finite:
            self._write(event_bytes(time.time() if wall_time is None else wall_time, step, scalars=finite))


def read_events(path: str | Path) -> Iterable[bytes]:
    """The records of an event file, checking both CRCs (for tests and tools)."""
    data = Path(path).read_bytes()
    i = 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        (crc_n,) = struct.unpack_from("<I", data, i + 8)
        if crc_n != masked_crc(data[i:i + 8]):
            raise ValueError(f"{path}: corrupt record length at byte {i}")
        payload = data[i + 12:i + 12 + n]
        (crc_d,) = struct.unpack_from("<I", data, i + 12 + n)
        if crc_d != masked_crc(payload):
            raise ValueError(f"{path}: corrupt record at byte {i}")
        yield payload
        i += 16 + n


def numeric_items(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric (not boolean) values of a row."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "round"}


@OBSERVERS.register
class TensorBoardObserver(Observer):
    """Writes every numeric column of every round's ``metrics.jsonl`` row as TensorBoard scalars
    (``<run>/tensorboard/``; tags as the column names, step = round)."""

    name = "tensorboard"

    def __init__(self) -> None:
        self.writer: EventWriter | None = None
        self.steps = 0

    def on_start(self, out_dir: Path | None) -> None:
        self.writer = EventWriter(out_dir / "tensorboard") if out_dir is not None else None

    def on_round_end(self, round: int, metrics: Mapping[str, Any]) -> None:
        if self.writer is not None:
            self.writer.scalars(int(round), numeric_items(metrics))
            self.steps += 1

    def on_finish(self) -> dict[str, Any]:
        return {"tensorboard_events": str(self.writer.path) if self.writer else None}
