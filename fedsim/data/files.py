"""Reading dataset files that users bring: IDX files (MNIST, Fashion-MNIST) and CIFAR's pickles, in the folder
layout torchvision writes, without torchvision. Damage is reported by file name; a CIFAR pickle is loaded by an
unpickler that builds only arrays, so a file that asks to run code is refused, not run."""
from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Any

import numpy as np

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte")


class DatasetUnavailable(RuntimeError):
    """The dataset's files are not on this machine; the message says how to get them."""


def read_idx(path: Path) -> np.ndarray:
    """An IDX file of unsigned bytes (optionally gzipped); a damaged file is reported by name."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError; a cut .gz raises EOFError
        raise DatasetUnavailable(f"dataset file {path} cannot be read ({type(exc).__name__}: {exc}); "
                                 "reinstall it") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08 or not 1 <= data[3] <= 4:
        raise DatasetUnavailable(f"dataset file {path} is not an IDX file of unsigned bytes (bad header "
                                 f"{data[:4].hex() or 'empty'}); reinstall it")
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise DatasetUnavailable(f"dataset file {path} is truncated (header cut short); reinstall it")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    need = 4 + 4 * ndim + int(np.prod(dims, dtype=np.int64))
    if len(data) != need:
        raise DatasetUnavailable(f"dataset file {path} holds {len(data)} bytes, its header {dims} needs {need} "
                                 "(truncated or damaged); reinstall it")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims).copy()


def read_idx_in(folder: Path, name: str) -> np.ndarray:
    """The IDX file ``name`` in ``folder``, plain or as ``name.gz``; FileNotFoundError if neither is there."""
    for p in (folder / name, folder / (name + ".gz")):
        if p.exists():
            return read_idx(p)
    raise FileNotFoundError(2, "no such file", str(folder / name))


#: torchvision's folder layout: (folder, training files, test files, label key, meta file, class-name key)
CIFAR_LAYOUT = {
    "cifar10": ("cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "labels",
                "batches.meta", "label_names"),
    "cifar100": ("cifar-100-python", ("train",), ("test",), "fine_labels", "meta", "fine_label_names"),
}


class _ArraysOnly(pickle.Unpickler):
    """CIFAR's files are pickles: this unpickler builds only numpy arrays, dicts, lists and strings, so a
    file that asks for anything else (code to run) is refused instead of executed."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in (("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")):
            return _np_reconstruct
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if (module, name) == ("_codecs", "encode"):  # how Python 3 writes bytes at protocol 2: text -> bytes only
            import _codecs

            return _codecs.encode
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which a CIFAR file never holds")


def _np_reconstruct(*args: Any) -> Any:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct(*args)


def _read_cifar_file(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            obj = _ArraysOnly(fh, encoding="latin1").load()
    except FileNotFoundError:
        raise
    except Exception as exc:  # any damage or a refused global: the file is named, nothing is run
        raise DatasetUnavailable(f"dataset file {path} cannot be read as a CIFAR batch ({type(exc).__name__}: "
                                 f"{exc}); reinstall it") from None
    if not isinstance(obj, dict):
        raise DatasetUnavailable(f"dataset file {path} is not a CIFAR batch (a {type(obj).__name__}, not a dict)")
    return obj


def read_cifar(name: str, root: Path) -> tuple[np.ndarray, ...]:
    folder, train, test, label_key, meta, names_key = CIFAR_LAYOUT[name]
    d = root / folder

    def part(files: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for f in files:
            batch = _read_cifar_file(d / f)
            x, y = np.asarray(batch.get("data")), np.asarray(batch.get(label_key), dtype=np.int64)
            if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or y.shape != (len(x),):
                raise DatasetUnavailable(f"dataset file {d / f} does not match CIFAR's layout: data {x.shape} "
                                         f"{x.dtype}, {label_key} {y.shape}; reinstall it")
            xs.append(x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            ys.append(y)
        return np.concatenate(xs), np.concatenate(ys)

    xtr, ytr = part(train)
    xte, yte = part(test)
    classes = ()
    if (d / meta).exists():
        classes = tuple(str(c) for c in _read_cifar_file(d / meta).get(names_key, ()))
    return xtr, ytr, xte, yte, classes


def read_idx_dataset(folder: Path) -> tuple[np.ndarray, ...]:
    """The four IDX files of an MNIST-like dataset in ``folder`` (plain or .gz): training images and labels,
    test images and labels, checked to fit together (images of 2-D, one label 0-9 per image)."""
    xtr, ytr, xte, yte = (read_idx_in(folder, f) for f in IDX_FILES)
    for x, y, f in ((xtr, ytr, IDX_FILES[1]), (xte, yte, IDX_FILES[3])):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y) or (len(y) and int(y.max()) > 9):
            raise DatasetUnavailable(f"dataset files in {folder} do not match: {f} has {y.shape} labels "
                                     f"(max {int(y.max()) if len(y) else '-'}) for images {x.shape}; reinstall them")
    return xtr, ytr, xte, yte


def read_mnist(root: Path) -> tuple[np.ndarray, ...]:
    return (*read_idx_dataset(root / "MNIST" / "raw"), tuple(f"{i}" for i in range(10)))
