"""Datasets and partitioners."""
from __future__ import annotations

import gzip
import os
import pickle

import numpy as np
import pytest
import torch

from fedsim.data import DatasetUnavailable, builtin_datasets, load_dataset, partition
from fedsim.data import registry as reg

# a label vector with a known, balanced class structure (like fmnist-small's training set)
LABELS = np.repeat(np.arange(10), 200)


def _assert_disjoint_cover(parts, n, cover=True):
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "a sample is given to two clients"
    assert allidx.min() >= 0 and allidx.max() < n
    if cover:
        assert len(allidx) == n and set(allidx.tolist()) == set(range(n))


# ------------------------------------------------------------------------------------------- IID
@pytest.mark.parametrize("n,k", [(2000, 10), (2000, 7), (101, 4), (10, 10)])
def test_iid_equal_disjoint_cover(n, k):
    labels = LABELS[:n] if n <= len(LABELS) else np.arange(n) % 10
    parts = partition(labels, k, "iid", seed=3)
    assert len(parts) == k
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    _assert_disjoint_cover(parts, n)


def test_iid_is_shuffled():
    parts = partition(LABELS, 10, "iid", seed=0)
    # a shuffled deal gives every client several classes, not one contiguous block
    assert all(len(np.unique(LABELS[p])) > 5 for p in parts)


# ------------------------------------------------------------------------------------- Dirichlet
def _mean_classes(parts, labels, min_share=0.05):
    """Mean number of classes making up at least ``min_share`` of a client's data."""
    out = []
    for p in parts:
        counts = np.bincount(labels[p], minlength=10)
        out.append(int(np.sum(counts >= min_share * len(p))))
    return float(np.mean(out))


@pytest.mark.parametrize("alpha", [0.1, 0.5, 100.0])
def test_dirichlet_disjoint_cover_min_size(alpha):
    parts = partition(LABELS, 20, "dirichlet", seed=1, alpha=alpha)
    assert len(parts) == 20
    _assert_disjoint_cover(parts, len(LABELS))
    assert min(len(p) for p in parts) >= 1


def test_dirichlet_min_size_is_enforced():
    from fedsim.data.partition import dirichlet

    free = [partition(LABELS, 10, "dirichlet", seed=s, alpha=0.5) for s in range(5)]
    held = [dirichlet(LABELS, 10, np.random.default_rng(s), alpha=0.5, min_size=100) for s in range(5)]
    # without the constraint some client gets fewer than 100 samples: the redraw does something
    assert min(min(len(p) for p in ps) for ps in free) < 100
    for ps in held:
        assert min(len(p) for p in ps) >= 100
        _assert_disjoint_cover(ps, len(LABELS))
    with pytest.raises(ValueError, match="could not give each"):
        dirichlet(LABELS, 20, np.random.default_rng(0), alpha=0.01, min_size=150, max_tries=3)


def test_dirichlet_smaller_alpha_more_skew():
    skew = {a: np.mean([_mean_classes(partition(LABELS, 10, "dirichlet", seed=s, alpha=a), LABELS)
                        for s in range(5)]) for a in (0.05, 0.5, 100.0)}
    assert skew[0.05] < skew[0.5] < skew[100.0]
    iid = _mean_classes(partition(LABELS, 10, "iid", seed=0), LABELS)
    assert skew[100.0] == pytest.approx(iid, abs=0.5)  # large alpha ~ IID


def test_dirichlet_rejects_bad_alpha():
    with pytest.raises(ValueError, match="data.alpha"):
        partition(LABELS, 5, "dirichlet", alpha=0.0)


# ---------------------------------------------------------------------------------- pathological
@pytest.mark.parametrize("k,a,b", [(2, 10, 50), (1, 5, 5), (3, 1, 20)])
def test_pathological_k_classes_a_to_b_each(k, a, b):
    parts = partition(LABELS, 12, "pathological", seed=4, classes_per_client=k, min_per_class=a,
                      max_per_class=b)
    assert len(parts) == 12
    _assert_disjoint_cover(parts, len(LABELS), cover=False)
    for p in parts:
        counts = np.bincount(LABELS[p], minlength=10)
        present = counts[counts > 0]
        assert len(present) == k
        assert present.min() >= a and present.max() <= b
    if a < b:  # sizes actually vary within [a, b]
        all_counts = np.concatenate([np.bincount(LABELS[p])[np.bincount(LABELS[p]) > 0] for p in parts])
        assert len(np.unique(all_counts)) > 1


def test_pathological_errors():
    with pytest.raises(ValueError, match="classes_per_client"):
        partition(LABELS, 3, "pathological", classes_per_client=11)
    with pytest.raises(ValueError, match="min_per_class"):
        partition(LABELS, 3, "pathological", min_per_class=9, max_per_class=5)
    with pytest.raises(ValueError, match="ran out of class"):
        partition(LABELS, 50, "pathological", classes_per_client=10, min_per_class=100, max_per_class=100)


def test_partition_errors_name_keys():
    with pytest.raises(ValueError, match="data.partition"):
        partition(LABELS, 3, "nope")
    with pytest.raises(ValueError, match="federation.num_clients"):
        partition(LABELS, 0, "iid")
    with pytest.raises(ValueError, match="federation.num_clients"):
        partition(LABELS[:5], 6, "iid")


# ----------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("scheme,params", [("iid", {}), ("dirichlet", {"alpha": 0.3}),
                                           ("pathological", {"classes_per_client": 2})])
def test_partition_deterministic_in_seed(scheme, params):
    a = partition(LABELS, 8, scheme, seed=7, **params)
    b = partition(LABELS, 8, scheme, seed=7, **params)
    c = partition(LABELS, 8, scheme, seed=8, **params)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert any(len(x) != len(y) or not np.array_equal(x, y) for x, y in zip(a, c))


def test_partition_does_not_use_global_rng():
    np.random.seed(0)
    a = partition(LABELS, 5, "iid", seed=1)
    np.random.seed(123)
    b = partition(LABELS, 5, "iid", seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


# -------------------------------------------------------------------------------------- datasets
def test_fmnist_small_shapes_ranges_balance():
    ds = load_dataset("fmnist-small")
    assert ds.name == "fmnist-small" and ds.kind == "image" and ds.num_classes == 10
    assert ds.x_train.shape == (2000, 1, 28, 28) and ds.y_train.shape == (2000,)
    assert ds.x_test.shape == (500, 1, 28, 28) and ds.y_test.shape == (500,)
    assert ds.x_root.shape == (100, 1, 28, 28) and ds.y_root.shape == (100,)
    assert ds.in_shape == (1, 28, 28)
    for x in (ds.x_train, ds.x_test, ds.x_root):
        assert x.dtype == torch.float32
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
        assert float(x.max()) > 0.9 and float(x.min()) < 0.1  # the full range is used (not left in 0..255)
    assert ds.y_train.dtype == torch.int64
    assert torch.bincount(ds.y_train, minlength=10).tolist() == [200] * 10
    assert torch.bincount(ds.y_test, minlength=10).tolist() == [50] * 10
    assert len(ds.class_names) == 10


def test_fmnist_small_root_size_and_no_overlap():
    ds = load_dataset("fmnist-small", root_size=30)
    assert ds.x_root.shape[0] == 30
    # the public root split is not part of the clients' training data
    train = {bytes(x.numpy().tobytes()) for x in ds.x_train}
    assert not any(bytes(x.numpy().tobytes()) in train for x in ds.x_root)


def test_fmnist_missing_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(reg, "DEBIAN_FMNIST", tmp_path / "nowhere")
    with pytest.raises(DatasetUnavailable) as exc:
        load_dataset.__wrapped__("fmnist")  # bypass the per-process cache
    msg = str(exc.value)
    assert "apt-get install dataset-fashion-mnist" in msg and "data.data_dir" in msg
    ok, detail = builtin_datasets()["fmnist"].available(None)
    assert not ok and "apt-get install dataset-fashion-mnist" in detail
    with pytest.raises(DatasetUnavailable, match="data.data_dir"):
        load_dataset.__wrapped__("fmnist", str(tmp_path / "empty"))


def _write_idx(path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + arr.astype(np.uint8).tobytes())


def test_fmnist_reads_idx_files_from_data_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(reg, "DEBIAN_FMNIST", tmp_path / "nowhere")
    rng = np.random.default_rng(0)
    xtr, ytr = rng.integers(0, 256, (60, 28, 28)), np.arange(60) % 10
    xte, yte = rng.integers(0, 256, (20, 28, 28)), np.arange(20) % 10
    d = tmp_path / "fm"
    d.mkdir()
    for name, arr in zip(reg.FMNIST_FILES, (xtr, ytr, xte, yte)):
        _write_idx(d / f"{name}.gz", arr)
    assert builtin_datasets()["fmnist"].available(str(d))[0]
    ds = load_dataset.__wrapped__("fmnist", str(d), False, 10)
    assert ds.x_train.shape == (50, 1, 28, 28) and ds.x_root.shape == (10, 1, 28, 28)
    assert ds.x_test.shape == (20, 1, 28, 28)
    assert torch.equal(ds.y_test, torch.as_tensor(yte))
    assert torch.allclose(ds.x_test[:, 0], torch.as_tensor(xte / 255.0, dtype=torch.float32))
    with pytest.raises(ValueError, match="root_size"):
        load_dataset.__wrapped__("fmnist", str(d), False, 60)


@pytest.mark.parametrize("name", ["cifar10", "cifar100", "mnist"])
def test_torchvision_datasets_need_data_dir(name):
    with pytest.raises(DatasetUnavailable, match="data.data_dir"):
        load_dataset(name)
    ok, detail = builtin_datasets()[name].available(None)
    assert not ok and "data.data_dir" in detail


def test_cifar10_empty_data_dir_explains(tmp_path):
    with pytest.raises(DatasetUnavailable, match="data.data_dir"):
        load_dataset("cifar10", str(tmp_path))


def test_breast_cancer_shapes_and_standardised():
    ds = load_dataset("breast-cancer")
    assert ds.kind == "tabular" and ds.num_classes == 2 and ds.in_shape == (30,)
    n = len(ds.y_train) + len(ds.y_test) + len(ds.y_root)
    assert n == 569
    assert len(ds.y_test) == round(0.2 * 569)
    assert ds.x_test.shape == (len(ds.y_test), 30) and ds.x_root.shape == (len(ds.y_root), 30)
    assert torch.allclose(ds.x_train.mean(0), torch.zeros(30), atol=1e-4)
    assert torch.allclose(ds.x_train.std(0, unbiased=False), torch.ones(30), atol=1e-3)
    assert set(ds.y_train.unique().tolist()) == {0, 1}


def test_faces_shapes():
    ds = load_dataset("faces")
    assert ds.kind == "image" and ds.num_classes == 2 and ds.in_shape == (1, 25, 25)
    assert len(ds.y_train) + len(ds.y_test) + len(ds.y_root) == 200
    assert ds.x_test.shape[1:] == (1, 25, 25)
    assert float(ds.x_train.min()) >= 0 and float(ds.x_train.max()) <= 1
    assert set(ds.y_train.unique().tolist()) == {0, 1}


def test_digits_are_scikit_learns_digits_at_mnists_size():
    from skimage.transform import resize
    from sklearn.datasets import load_digits

    ds = load_dataset("digits")
    assert ds.kind == "image" and ds.num_classes == 10 and ds.in_shape == (1, 28, 28)
    assert len(ds.y_train) + len(ds.y_test) + len(ds.y_root) == 1797
    assert float(ds.x_train.min()) >= 0 and float(ds.x_train.max()) <= 1
    assert set(ds.y_train.unique().tolist()) == set(range(10))
    # MNIST's layout: a blank 4-pixel frame around a 20x20 box, and the box is the 8x8 source digit upscaled:
    # shrunk back, every test image is nearest to a source digit with its own label
    frame = torch.ones(28, 28, dtype=torch.bool)
    frame[4:24, 4:24] = False
    assert float(ds.x_train[:, 0][:, frame].abs().max()) == 0.0
    assert float(ds.x_train[:, 0, 4:24, 4:24].amax(dim=(1, 2)).min()) > 0.5  # every box holds a digit
    src = load_digits()
    back = np.stack([resize(im[0, 4:24, 4:24].numpy(), (8, 8), order=1, anti_aliasing=True) for im in ds.x_test])
    orig = src.images / 16.0
    dist = ((back[:, None] - orig[None]) ** 2).reshape(len(back), len(orig), -1).mean(-1)  # (test, all sources)
    assert (src.target[dist.argmin(1)] == ds.y_test.numpy()).mean() > 0.99
    # the public root set is held out from the training images
    assert not any(torch.equal(r, t) for r in ds.x_root[:20] for t in ds.x_train)


def test_unknown_dataset_names_key():
    with pytest.raises(ValueError, match="data.dataset"):
        load_dataset("nope")


# ---- feature (style) shift: data.styles
def test_styles_deal_the_training_images_and_draw_the_test_set_in_every_style():
    from fedsim.data.styles import STYLES

    base = load_dataset("fmnist-small")
    ds = load_dataset("fmnist-small", styles=("plain", "inverted"))
    assert ds.source_names == ("plain", "inverted") and ds.sources.bincount().tolist() == [1000, 1000]
    # each training image is drawn in its source's style: plain as it is, inverted as 1 - x
    plain, inv = ds.sources == 0, ds.sources == 1
    torch.testing.assert_close(ds.x_train[plain], base.x_train[plain])
    torch.testing.assert_close(ds.x_train[inv], 1.0 - base.x_train[inv])
    assert torch.equal(ds.y_train, base.y_train)  # the labels (and so the task) do not change
    # the test set holds every test image in every style
    n = len(base.y_test)
    assert len(ds.y_test) == 2 * n and ds.test_sources.bincount().tolist() == [n, n]
    torch.testing.assert_close(ds.x_test[n:], 1.0 - base.x_test) and torch.testing.assert_close(ds.x_test[:n], base.x_test)
    assert torch.equal(ds.y_test, base.y_test.repeat(2))
    # every style keeps the images in [0, 1] and changes them (but plain)
    x = base.x_test[:8]
    for name, (f, _) in STYLES.items():
        y = f(x)
        assert y.shape == x.shape and float(y.min()) >= 0 and float(y.max()) <= 1, name
        assert (name == "plain") == torch.equal(y, x), name
    # dealt the same way in every process (a fixed permutation): the client's data is reproducible
    load_dataset.cache_clear()
    assert torch.equal(load_dataset("fmnist-small", styles=("plain", "inverted")).sources, ds.sources)
    with pytest.raises(ValueError, match="unknown style"):
        load_dataset("fmnist-small", styles=("plain", "sepia"))
    with pytest.raises(ValueError, match="needs an image dataset"):
        load_dataset("breast-cancer", styles=("plain", "inverted"))


def test_styles_give_one_style_per_client_and_the_global_model_is_scored_per_style(small_cfg):
    """``partition = "natural"`` with styles: each client holds one style; the server reports the accuracy on
    each style's test images (``test.<style>_accuracy``), whose mean is the accuracy (equal halves)."""
    from fedsim.app.client import client_app
    from fedsim.app.server import Server
    from fedsim.config import ConfigError
    from fedsim.factories import client_data, dataset_for, partitions_for
    from fedsim.inprocess import InProcessGrid
    from fedsim.protocol import num_nodes

    cfg = small_cfg('data.styles=["plain", "inverted"]', 'data.partition="natural"', "federation.num_clients=2",
                    "federation.rounds=1", "train.local_steps=20")
    ds = dataset_for(cfg)
    for pid, style in enumerate(ds.source_names):
        assert set(ds.sources[partitions_for(cfg)[pid]].tolist()) == {pid}, style
    assert float(client_data(cfg, 1)[0].mean()) > 0.5 > float(client_data(cfg, 0)[0].mean())  # inverted vs plain
    server = Server(cfg, None, [], progress=False)
    server.run(InProcessGrid(client_app, num_nodes(2, cfg["simulation"]["clients_per_node"])))
    row = server.rows[-1]
    assert row["evaluated_by"] == "server"
    assert row["accuracy"] == pytest.approx((row["test.plain_accuracy"] + row["test.inverted_accuracy"]) / 2)
    assert row["test.plain_accuracy"] != row["test.inverted_accuracy"]
    with pytest.raises(ConfigError, match="unknown style"):
        small_cfg('data.styles=["plain", "sepia"]')
    with pytest.raises(ConfigError, match="natural"):
        small_cfg('data.partition="natural"')


@pytest.mark.filterwarnings("ignore:.*key.*:UserWarning")
def test_a_client_that_evaluates_for_the_server_reports_the_accuracy_per_source(small_cfg):
    """Under Paillier the server cannot read the model: the evaluating client reports the accuracy on each
    test source too (synthetic-2d's two sources), and the server logs them by name."""
    import warnings

    from fedsim.app.client import client_app
    from fedsim.app.server import Server
    from fedsim.inprocess import InProcessGrid
    from fedsim.protocol import num_nodes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = small_cfg('data.dataset="synthetic-2d"', 'data.partition="natural"', 'model.name="mlp"',
                        "model.hidden=[8]", 'model.activation="sigmoid"', "federation.num_clients=2",
                        "federation.rounds=1", "train.local_steps=30", "train.lr=0.1",
                        'channel.name="paillier"', "channel.key_bits=512")
    server = Server(cfg, None, [], progress=False)
    server.run(InProcessGrid(client_app, num_nodes(2, cfg["simulation"]["clients_per_node"])))
    row = server.rows[-1]
    assert row["evaluated_by"].startswith("client ")
    assert row["accuracy"] == pytest.approx((row["test.wide_accuracy"] + row["test.tight_accuracy"]) / 2)


def test_a_malformed_per_source_accuracy_is_an_invalid_reply(small_cfg):
    """The evaluating client's per-source accuracies are untrusted input: checked with the rest of its reply."""
    from flwr.app import MetricRecord

    from fedsim.app.server import Server
    from fedsim.protocol import EVAL_ACCURACY, EVAL_EXAMPLES, EVAL_LOSS, EVAL_SOURCE_ACCURACY, METRICS
    from fedsim.replies import InvalidReply

    class Evaluation:  # a reply with a metrics record whose values are ``metrics`` (as Reply reads them)
        def __init__(self, metrics):
            self.metrics = metrics

        def has(self, name):
            return name == METRICS

        def record(self, name):
            return MetricRecord({})

    checks = Server(small_cfg(), None, [], progress=False).engine.checks
    ok = {EVAL_LOSS: 1.0, EVAL_ACCURACY: 0.5, EVAL_EXAMPLES: 10}
    checks.check_evaluation(Evaluation(ok))
    checks.check_evaluation(Evaluation({**ok, EVAL_SOURCE_ACCURACY: [0.25, 1.0]}))
    for bad in ([0.5, 1.5], [float("nan")], "0.5", [True], [0.5] * 65):
        with pytest.raises(InvalidReply, match=EVAL_SOURCE_ACCURACY):
            checks.check_evaluation(Evaluation({**ok, EVAL_SOURCE_ACCURACY: bad}))


# --------------------------------------------- MNIST / CIFAR in torchvision's layout, read without torchvision
def _idx(path, arr):
    arr = np.asarray(arr, dtype=np.uint8)
    head = bytes([0, 0, 8, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as fh:
        fh.write(head + arr.tobytes())


def test_mnist_is_read_from_torchvisions_layout_gzipped_or_not(tmp_path):
    rng = np.random.default_rng(0)
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    xtr, ytr = rng.integers(0, 256, (40, 28, 28)), rng.integers(0, 10, 40)
    xte, yte = rng.integers(0, 256, (12, 28, 28)), rng.integers(0, 10, 12)
    _idx(raw / "train-images-idx3-ubyte.gz", xtr)
    _idx(raw / "train-labels-idx1-ubyte", ytr)
    _idx(raw / "t10k-images-idx3-ubyte", xte)
    _idx(raw / "t10k-labels-idx1-ubyte.gz", yte)
    ds = load_dataset.__wrapped__("mnist", str(tmp_path), False, 10)
    assert ds.num_classes == 10 and ds.x_train.shape == (30, 1, 28, 28) and ds.x_root.shape == (10, 1, 28, 28)
    assert torch.equal(ds.y_test, torch.as_tensor(yte))
    assert torch.allclose(ds.x_test[:, 0], torch.as_tensor(xte / 255.0, dtype=torch.float32))
    (raw / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetUnavailable, match="missing .*t10k-labels-idx1-ubyte"):
        load_dataset.__wrapped__("mnist", str(tmp_path), False, 10)


def _cifar_dir(tmp_path, rng, n=6):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    batches = {}
    for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batches[f] = {"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
                      "labels": [int(v) for v in rng.integers(0, 10, n)], "batch_label": f}
        (d / f).write_bytes(pickle.dumps(batches[f], protocol=2))
    (d / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}, protocol=2))
    return d, batches


def test_cifar10_is_read_from_torchvisions_pickles_as_hwc_images(tmp_path):
    d, batches = _cifar_dir(tmp_path, np.random.default_rng(1))
    ds = load_dataset.__wrapped__("cifar10", str(tmp_path), False, 5)
    assert ds.x_train.shape == (25, 3, 32, 32) and ds.x_test.shape == (6, 3, 32, 32) and ds.class_names[3] == "c3"
    test = batches["test_batch"]
    assert ds.y_test.tolist() == test["labels"]
    # channel c of pixel (h, w) is data[c * 1024 + h * 32 + w], as in CIFAR's files
    assert float(ds.x_test[2, 1, 4, 7]) == pytest.approx(test["data"][2, 1024 + 4 * 32 + 7] / 255.0)


def test_a_cifar_file_that_asks_to_run_code_is_refused_not_run(tmp_path):
    d, _ = _cifar_dir(tmp_path, np.random.default_rng(2))
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (d / "data_batch_3").write_bytes(pickle.dumps({"data": Evil(), "labels": []}, protocol=2))
    with pytest.raises(DatasetUnavailable, match=r"data_batch_3 cannot be read as a CIFAR batch .*(posix|os)\.system"):
        load_dataset.__wrapped__("cifar10", str(tmp_path), False, 5)
    assert not marker.exists()
