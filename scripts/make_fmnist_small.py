"""Build the embedded ``fmnist-small`` dataset from Debian's ``dataset-fashion-mnist`` files.

Provenance of ``fedsim/data/fmnist_small.npz``::

    apt-get install dataset-fashion-mnist
    python scripts/make_fmnist_small.py --src /usr/share/datasets/fashion-mnist \
        --out fedsim/data/fmnist_small.npz

Takes a class-balanced random subset (seed 0): 200 training and 50 test images per class
(2,000 + 500), plus a disjoint 20-per-class "public root" split (200 images) from the training
set that the defenses of seed 000 use as public data. Stored as uint8 with np.savez_compressed.
Fashion-MNIST is (c) Zalando SE, MIT licence.
"""
from __future__ import annotations

import argparse
import gzip
import os
import tempfile
from pathlib import Path

import numpy as np


def read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    magic = int.from_bytes(data[0:4], "big")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims)


def balanced_pick(labels: np.ndarray, per_class: int, rng: np.random.Generator,
                  exclude: np.ndarray | None = None) -> np.ndarray:
    picked = []
    mask = np.ones(len(labels), dtype=bool)
    if exclude is not None:
        mask[exclude] = False
    for c in range(10):
        idx = np.flatnonzero((labels == c) & mask)
        picked.append(rng.choice(idx, size=per_class, replace=False))
    out = np.concatenate(picked)
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--out", default="fedsim/data/fmnist_small.npz")
    ap.add_argument("--train-per-class", type=int, default=200)
    ap.add_argument("--test-per-class", type=int, default=50)
    ap.add_argument("--root-per-class", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    src = Path(args.src)
    xtr = read_idx(src / "train-images-idx3-ubyte.gz")
    ytr = read_idx(src / "train-labels-idx1-ubyte.gz")
    xte = read_idx(src / "t10k-images-idx3-ubyte.gz")
    yte = read_idx(src / "t10k-labels-idx1-ubyte.gz")
    rng = np.random.default_rng(args.seed)
    tr = balanced_pick(ytr, args.train_per_class, rng)
    root = balanced_pick(ytr, args.root_per_class, rng, exclude=tr)
    te = balanced_pick(yte, args.test_per_class, rng)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".npz")
    os.close(fd)
    np.savez_compressed(tmp, x_train=xtr[tr], y_train=ytr[tr], x_test=xte[te], y_test=yte[te],
                        x_root=xtr[root], y_root=ytr[root])
    os.replace(tmp, out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB): train {len(tr)}, test {len(te)}, root {len(root)}")


if __name__ == "__main__":
    main()
