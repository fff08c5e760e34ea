"""Dataset registry: each entry knows how to load itself and how to explain what is missing."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from fedsim.data.files import IDX_FILES, DatasetUnavailable, read_cifar, read_idx_dataset, read_mnist

EMBEDDED = Path(__file__).with_name("fmnist_small.npz")
DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
FMNIST_FILES = IDX_FILES  # Fashion-MNIST's files are named like MNIST's


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_root: torch.Tensor  # public "root" split held out from client data (seed 000)
    y_root: torch.Tensor
    num_classes: int
    kind: str = "image"  # "image" (values in [0, 1]) or "tabular"
    class_names: tuple[str, ...] = field(default=())
    # the source each training sample was drawn from (datasets with natural client splits, e.g.
    # synthetic-2d); ``data.partition = "natural"`` gives each client its own source
    sources: torch.Tensor | None = None
    # the source of each test sample and the sources' names (per-source test accuracy,
    # ``test.<name>_accuracy``): synthetic-2d's two sources, or ``data.styles`` (fedsim.data.styles)
    test_sources: torch.Tensor | None = None
    source_names: tuple[str, ...] = ()

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _images(x: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W) or (N, H, W, C) -> float (N, C, H, W) in [0, 1]."""
    t = torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0)
    return t.unsqueeze(1) if t.ndim == 3 else t.permute(0, 3, 1, 2).contiguous()


def _labels(y: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(y, dtype=np.int64))


def _hold_out_root(x: np.ndarray, y: np.ndarray, root_size: int):
    """Split a fixed (seed-0) random ``root_size`` subset off the training data."""
    if root_size >= len(y):
        raise ValueError(f"data.root_size={root_size} must be smaller than the training set ({len(y)})")
    perm = np.random.default_rng(0).permutation(len(y))
    r, t = perm[:root_size], perm[root_size:]
    return x[t], y[t], x[r], y[r]


FMNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                  "Sneaker", "Bag", "Ankle boot")


def _load_fmnist_small(data_dir: str | None, download: bool, root_size: int) -> Dataset:
    with np.load(EMBEDDED) as z:
        if root_size > len(z["y_root"]):
            raise ValueError(f"data.root_size={root_size} is larger than fmnist-small's public root split "
                             f"({len(z['y_root'])} images)")
        return Dataset("fmnist-small", _images(z["x_train"]), _labels(z["y_train"]),
                       _images(z["x_test"]), _labels(z["y_test"]),
                       _images(z["x_root"][:root_size]), _labels(z["y_root"][:root_size]), 10,
                       class_names=FMNIST_CLASSES)


def _find_fmnist(data_dir: str | None) -> Path | None:
    candidates = []
    if data_dir:
        d = Path(data_dir)
        candidates += [d, d / "fashion-mnist", d / "FashionMNIST" / "raw"]
    candidates.append(DEBIAN_FMNIST)
    for c in candidates:
        if all((c / f).exists() or (c / (f + ".gz")).exists() for f in FMNIST_FILES):
            return c
    return None


def _fmnist_hint(data_dir: str | None) -> str:
    where = f" or in data.data_dir={data_dir!r}" if data_dir else ""
    return (f"Fashion-MNIST IDX files ({', '.join(FMNIST_FILES)}, optionally .gz) were not found in "
            f"{DEBIAN_FMNIST}{where}. Install them with `apt-get install dataset-fashion-mnist` or put "
            f"the four files in a folder and set data.data_dir to it.")


def _load_fmnist(data_dir: str | None, download: bool, root_size: int) -> Dataset:
    d = _find_fmnist(data_dir)
    if d is None:
        raise DatasetUnavailable(_fmnist_hint(data_dir))
    xtr, ytr, xte, yte = read_idx_dataset(d)
    xtr, ytr, xr, yr = _hold_out_root(xtr, ytr, root_size)
    return Dataset("fmnist", _images(xtr), _labels(ytr), _images(xte), _labels(yte), _images(xr),
                   _labels(yr), 10, class_names=FMNIST_CLASSES)


_TV = {"mnist": ("MNIST", 10), "cifar10": ("CIFAR10", 10), "cifar100": ("CIFAR100", 100)}


def _load_torchvision_layout(name: str):
    """MNIST and CIFAR-10/100 from a data directory in torchvision's layout, read by fedsim itself (torchvision
    is needed only to download them: ``pip install 'fedsim[vision]'``)."""
    def load(data_dir: str | None, download: bool, root_size: int) -> Dataset:
        cls_name, n_cls = _TV[name]
        if not data_dir:
            raise DatasetUnavailable(
                f"dataset {name!r} is read from a data directory: set data.data_dir "
                f"to a folder holding torchvision's {cls_name} files, or to an empty folder together "
                f"with data.download=true on a machine with internet access.")
        if download:
            try:
                import torchvision.datasets as tvd
            except ImportError:
                raise DatasetUnavailable(f"dataset {name!r}: data.download=true needs torchvision "
                                         "(pip install 'fedsim[vision]'); or put the files in data.data_dir "
                                         "and set data.download=false") from None
            for train in (True, False):
                getattr(tvd, cls_name)(data_dir, train=train, download=True)
        try:
            xtr, ytr, xte, yte, classes = (read_mnist if name == "mnist" else
                                           lambda r: read_cifar(name, r))(Path(data_dir))
        except FileNotFoundError as exc:
            raise DatasetUnavailable(
                f"dataset {name!r}: {cls_name} is not in data.data_dir={data_dir!r} (missing {exc.filename}). "
                f"Put torchvision's files there or set data.download=true where internet is available."
            ) from None
        xtr, ytr, xr, yr = _hold_out_root(xtr, ytr, root_size)
        return Dataset(name, _images(xtr), _labels(ytr), _images(xte), _labels(yte), _images(xr),
                       _labels(yr), n_cls, class_names=classes)

    return load


def _split_tabular(x: np.ndarray, y: np.ndarray, test_frac: float, root_size: int):
    perm = np.random.default_rng(0).permutation(len(y))
    n_test = int(round(len(y) * test_frac))
    te, r, tr = perm[:n_test], perm[n_test:n_test + root_size], perm[n_test + root_size:]
    return x[tr], y[tr], x[te], y[te], x[r], y[r]


def _load_breast_cancer(data_dir: str | None, download: bool, root_size: int) -> Dataset:
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    x = bunch.data.astype(np.float32)
    xtr, ytr, xte, yte, xr, yr = _split_tabular(x, bunch.target, 0.2, min(root_size, 50))
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-8
    f = lambda a: torch.from_numpy(((a - mu) / sd).astype(np.float32))  # noqa: E731
    return Dataset("breast-cancer", f(xtr), _labels(ytr), f(xte), _labels(yte), f(xr), _labels(yr), 2,
                   kind="tabular", class_names=tuple(bunch.target_names))


def _load_faces(data_dir: str | None, download: bool, root_size: int) -> Dataset:
    from skimage.data import lfw_subset

    x = lfw_subset()  # (200, 25, 25) float in [0, 1]; first 100 faces, last 100 non-faces
    y = np.array([1] * 100 + [0] * 100)
    x = np.clip(np.round(x * 255), 0, 255).astype(np.uint8)
    xtr, ytr, xte, yte, xr, yr = _split_tabular(x, y, 0.2, min(root_size, 20))
    return Dataset("faces", _images(xtr), _labels(ytr), _images(xte), _labels(yte), _images(xr),
                   _labels(yr), 2, class_names=("non-face", "face"))


DIGITS_BOX, DIGITS_SIZE = 20, 28  # MNIST's layout: a digit size-normalised into 20x20, centred in 28x28


def _load_digits(data_dir: str | None, download: bool, root_size: int) -> Dataset:
    """scikit-learn's handwritten digits (1,797 images of 8x8 pixels, 17 grey levels) laid out as MNIST's:
    upscaled bilinearly to 20x20 and centred in a blank 28x28 frame, offline; at MNIST's size the LeNets take
    them as they are. Blurrier than MNIST (the 8x8 source)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    small = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)
    box = torch.nn.functional.interpolate(small, size=(DIGITS_BOX, DIGITS_BOX), mode="bilinear", align_corners=False)
    margin = (DIGITS_SIZE - DIGITS_BOX) // 2
    box = box.squeeze(1).mul(255).round().clamp(0, 255).to(torch.uint8).numpy()
    x = np.pad(box, ((0, 0), (margin, margin), (margin, margin)))
    xtr, ytr, xte, yte, xr, yr = _split_tabular(x, bunch.target, 0.2, min(root_size, 100))
    return Dataset("digits", _images(xtr), _labels(ytr), _images(xte), _labels(yte), _images(xr), _labels(yr), 10,
                   class_names=tuple(str(c) for c in range(10)))


# ---- seed 003 §4.3.1: the synthetic two-source 2-D task (FedBoosting's decision-boundary study)
# Binary labels; each source draws each class from a Gaussian of its own (mean, standard deviation):
# source 0 (wide) lies on the left with the classes above and below each other, source 1 (tight) on the
# right with the classes side by side. Each client alone learns a straight boundary that is wrong for
# the other's part of the plane; the pooled data needs a bent one (what the centralised model learns).
SYNTHETIC_2D = {  # source -> class -> (mean x, mean y, standard deviation)
    0: {0: (-2.0, -1.0, 1.0), 1: (-2.0, 1.5, 1.0)},
    1: {0: (1.0, 0.0, 0.5), 1: (2.5, 0.0, 0.5)},
}
SYNTHETIC_2D_PER_SOURCE = 40_000  # samples per source (half per class), split 9:1 into train and test


def _load_synthetic_2d(data_dir: str | None, download: bool, root_size: int) -> Dataset:
    rng = np.random.default_rng(0)
    xs, ys, ss = [], [], []
    per_class = SYNTHETIC_2D_PER_SOURCE // 2
    for source, classes in SYNTHETIC_2D.items():
        for label, (mx, my, sd) in classes.items():
            xs.append(rng.normal((mx, my), sd, size=(per_class, 2)))
            ys.append(np.full(per_class, label))
            ss.append(np.full(per_class, source))
    x, y, s = np.concatenate(xs).astype(np.float32), np.concatenate(ys), np.concatenate(ss)
    test, train = [], []
    for source in SYNTHETIC_2D:  # 9:1 within each source; the test set holds both sources
        idx = rng.permutation(np.flatnonzero(s == source))
        n_test = len(idx) // 10
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    te, tr = np.concatenate(test), rng.permutation(np.concatenate(train))
    root, tr = tr[:min(root_size, 100)], tr[min(root_size, 100):]
    t = lambda i: torch.from_numpy(x[i])  # noqa: E731
    return Dataset("synthetic-2d", t(tr), _labels(y[tr]), t(te), _labels(y[te]), t(root), _labels(y[root]), 2,
                   kind="tabular", class_names=("class 0", "class 1"), sources=torch.from_numpy(s[tr]),
                   test_sources=torch.from_numpy(s[te]), source_names=("wide", "tight"))


@dataclass(frozen=True)
class DatasetEntry:
    load: Callable[[str | None, bool, int], Dataset]
    description: str
    available: Callable[[str | None], tuple[bool, str]]
    sources: int = 0  # natural sources (> 0: the dataset supports data.partition = "natural")


def _always(_: str | None) -> tuple[bool, str]:
    return True, "ships with fedsim or its dependencies"


def _fmnist_available(data_dir: str | None) -> tuple[bool, str]:
    d = _find_fmnist(data_dir)
    return (True, f"found in {d}") if d else (False, _fmnist_hint(data_dir))


def _tv_available(name: str):
    def check(data_dir: str | None) -> tuple[bool, str]:
        if not data_dir:
            return False, "needs data.data_dir (torchvision's files) or data.download=true with internet"
        return True, f"will be read from {data_dir}"

    return check


def _register_builtins() -> None:
    """The built-in datasets join the users' in :data:`fedsim.components.DATASETS` (one registry)."""
    from fedsim.components import DATASETS

    for name, entry in {
        "fmnist-small": DatasetEntry(_load_fmnist_small, "Fashion-MNIST subset embedded in fedsim "
                                     "(2,000 train / 500 test / 200 public root, 28x28 grey, 10 classes)", _always),
        "fmnist": DatasetEntry(_load_fmnist, "full Fashion-MNIST (60k/10k) from Debian's dataset-fashion-mnist "
                               "or data.data_dir", _fmnist_available),
        "mnist": DatasetEntry(_load_torchvision_layout("mnist"), "MNIST in torchvision's layout (data.data_dir)",
                              _tv_available("mnist")),
        "cifar10": DatasetEntry(_load_torchvision_layout("cifar10"),
                                "CIFAR-10 in torchvision's layout (data.data_dir)",
                                _tv_available("cifar10")),
        "cifar100": DatasetEntry(_load_torchvision_layout("cifar100"),
                                 "CIFAR-100 in torchvision's layout (data.data_dir)",
                                 _tv_available("cifar100")),
        "breast-cancer": DatasetEntry(_load_breast_cancer, "Wisconsin breast cancer, 569 x 30 tabular, 2 classes "
                                      "(scikit-learn)", _always),
        "digits": DatasetEntry(_load_digits, "scikit-learn's handwritten digits: 1,797 8x8 images upscaled to "
                               "20x20 in a blank 28x28 frame (MNIST's layout), grey, 10 classes", _always),
        "faces": DatasetEntry(_load_faces, "scikit-image LFW subset: 200 25x25 grey crops, face / non-face",
                              _always),
        "synthetic-2d": DatasetEntry(_load_synthetic_2d, "seed 003 §4.3.1: 2-D points from Gaussians, 2 classes, "
                                     "2 sources (one per client with data.partition = natural), 36,000 train / "
                                     "4,000 test per source", _always, sources=len(SYNTHETIC_2D)),
    }.items():
        DATASETS.add(name, entry)


_register_builtins()


def builtin_datasets() -> dict[str, DatasetEntry]:
    """The built-in datasets by name, in registration order."""
    from fedsim.components import DATASETS

    return {n: e for n, e in DATASETS.items() if isinstance(e, DatasetEntry)}


def dataset_status(data_dir: str | None = None) -> list[tuple[str, bool, str, str]]:
    """(name, available, description, detail) for every registered dataset."""
    return [(n, *e.available(data_dir)[:1], e.description, e.available(data_dir)[1])
            for n, e in builtin_datasets().items()]


def _tensor(a: Any, what: str, dtype: torch.dtype) -> torch.Tensor:
    """A user dataset's array as a tensor: inputs (N, ...) as float32, labels (N,) as int64; anything else
    (strings, objects, ragged lists, wrong ranks) is a ValueError naming ``what``."""
    try:
        t = a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{what} must be a numeric array or tensor, got {type(a).__name__} "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if t.dtype.is_complex:
        raise ValueError(f"{what} must be a real numeric array, got dtype {t.dtype}")
    if dtype is torch.int64:
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{what} must hold integer class labels, got dtype {t.dtype}")
        if t.ndim != 1:
            raise ValueError(f"{what} must be one label per example (N,), got shape {tuple(t.shape)}")
        return t.to(torch.int64)
    if t.ndim < 2:
        raise ValueError(f"{what} must be (N, features) or (N, C, H, W) inputs, got shape {tuple(t.shape)}")
    return t.to(torch.float32)


def dataset_from(obj: Any, name: str, root_size: int) -> Dataset:
    """A user dataset's return value as a :class:`Dataset`.

    Either a ``Dataset``, or a mapping with ``x_train``, ``y_train``, ``x_test``, ``y_test`` (arrays or
    tensors; images as float (N, C, H, W) in [0, 1], tabular as float (N, F); labels integers
    0..C-1) and optionally ``x_root``/``y_root`` (the public root split; default: ``data.root_size``
    examples held out from the training data with a fixed seed), ``num_classes`` (default: largest
    label + 1), ``kind`` (``"image"`` when x has 3 dimensions per example, else ``"tabular"``) and
    ``class_names``.
    """
    if isinstance(obj, Dataset):
        return obj
    if not isinstance(obj, Mapping):
        raise ValueError(f"data.dataset {name!r} returned {type(obj).__name__}; return a fedsim.data.Dataset or "
                         "a mapping with x_train, y_train, x_test, y_test")
    missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in obj]
    if missing:
        raise ValueError(f"data.dataset {name!r} returned a mapping without {missing}")

    def tensor(key: str, dtype: torch.dtype) -> torch.Tensor:
        return _tensor(obj[key], f"data.dataset {name!r}: {key}", dtype)

    x_tr, y_tr = tensor("x_train", torch.float32), tensor("y_train", torch.int64)
    x_te, y_te = tensor("x_test", torch.float32), tensor("y_test", torch.int64)
    if len(x_tr) != len(y_tr) or len(x_te) != len(y_te):
        raise ValueError(f"data.dataset {name!r}: x and y differ in length (train {len(x_tr)} vs {len(y_tr)}, "
                         f"test {len(x_te)} vs {len(y_te)})")
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise ValueError(f"data.dataset {name!r}: train and test inputs differ in shape "
                         f"({tuple(x_tr.shape[1:])} vs {tuple(x_te.shape[1:])})")
    if "x_root" in obj and "y_root" in obj:
        x_r, y_r = tensor("x_root", torch.float32), tensor("y_root", torch.int64)
    else:
        if root_size >= len(y_tr):
            raise ValueError(f"data.root_size={root_size} must be smaller than {name!r}'s training set ({len(y_tr)})")
        perm = torch.as_tensor(np.random.default_rng(0).permutation(len(y_tr)))
        x_r, y_r = x_tr[perm[:root_size]], y_tr[perm[:root_size]]
        x_tr, y_tr = x_tr[perm[root_size:]], y_tr[perm[root_size:]]
    labels = torch.cat([y_tr, y_te])
    if len(labels) and int(labels.min()) < 0:
        raise ValueError(f"data.dataset {name!r}: labels must be >= 0")
    if x_r.shape[1:] != x_tr.shape[1:] or len(x_r) != len(y_r):
        raise ValueError(f"data.dataset {name!r}: x_root/y_root must be {len(x_r)} inputs of shape "
                         f"{tuple(x_tr.shape[1:])} with one label each, got {tuple(x_r.shape)} and {len(y_r)} labels")
    given = obj.get("num_classes")
    if given is not None and (isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given < 1):
        raise ValueError(f"data.dataset {name!r}: num_classes must be a positive integer, got {given!r}")
    num_classes = int(given or (int(labels.max()) + 1 if len(labels) else 0))
    if len(labels) and int(labels.max()) >= num_classes:
        raise ValueError(f"data.dataset {name!r}: a label is >= num_classes ({num_classes})")
    kind = str(obj.get("kind") or ("image" if x_tr.ndim == 4 else "tabular"))
    return Dataset(name, x_tr, y_tr, x_te, y_te, x_r, y_r, num_classes, kind=kind,
                   class_names=tuple(obj.get("class_names") or ()))


def check_finite(ds: Dataset) -> Dataset:
    """Refuse a dataset whose inputs hold NaN or infinity (a model trained on them becomes NaN)."""
    for split in ("x_train", "x_test", "x_root"):
        x = getattr(ds, split)
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise ValueError(f"data.dataset {ds.name!r}: {split} holds {bad} non-finite values (NaN or infinity); "
                             "a model trained or evaluated on them becomes NaN")
    return ds


@lru_cache(maxsize=8)
def load_dataset(name: str, data_dir: str | None = None, download: bool = False,
                 root_size: int = 100, params: str = "{}", styles: tuple[str, ...] = ()) -> Dataset:
    """Load a dataset (cached per process: every client actor loads it once); ``styles``
    (``data.styles``): the dataset drawn in one style per source (:mod:`fedsim.data.styles`).

    A built-in name (:func:`builtin_datasets`), or a user's dataset: registered in
    :data:`fedsim.components.DATASETS` or an import reference (``"mypkg.data:load"``,
    ``"path/to/file.py:load"``) to a function (or class) that takes ``data_dir``, ``download``,
    ``root_size`` when it declares them and ``[data] params`` (``params``: their JSON text), and returns
    what :func:`dataset_from` accepts."""
    if styles:
        from fedsim.data.styles import with_styles

        return with_styles(load_dataset(name, data_dir, download, root_size, params), styles)
    if data_dir is not None:
        data_dir = os.path.expanduser(str(data_dir))
    builtin = builtin_datasets()
    if name not in builtin:
        import json

        from fedsim.components import DATASETS as PLUGINS
        from fedsim.references import is_reference

        if name not in PLUGINS and not is_reference(name):
            raise ValueError(f"data.dataset must be one of {PLUGINS.names()} or an "
                             f"import reference ('module:attribute' or 'path/file.py:attribute'), got {name!r}")
        obj = PLUGINS.build_named(name, json.loads(params), "data.params", name_where="data.dataset",
                                  data_dir=data_dir, download=download, root_size=root_size)
        return check_finite(dataset_from(obj, name, root_size))
    if json_params_given(params):
        raise ValueError(f"data.params is for a user's own dataset; the built-in {name!r} takes none")
    return builtin[name].load(data_dir, download, root_size)


def json_params_given(params: str) -> bool:
    return params.strip() not in ("", "{}", "null")
