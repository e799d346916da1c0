"""Trainer data: IDX and CIFAR-10 parsing on generated files, datasets, models, batch stream."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from ringpipe.train.config import load_config
from ringpipe.train.datasets import DatasetError, digits_arrays, load_dataset
from ringpipe.train.formats import (
    FormatError,
    read_cifar_batch,
    read_idx,
    write_cifar_batch,
    write_idx,
)
from ringpipe.train.models import build_model
from ringpipe.train.sampling import ShardStream, eval_indices


def test_idx_header_and_data_by_hand(tmp_path):
    # magic 0x00000801 (uint8, 1 dim), 3 items, big-endian dims.
    (tmp_path / "labels").write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 2, 9]))
    assert read_idx(tmp_path / "labels").tolist() == [7, 2, 9]
    # int16, 2 x 2, big-endian values.
    raw = bytes([0, 0, 0x0B, 2, 0, 0, 0, 2, 0, 0, 0, 2]) + np.array([1, -2, 300, 4], ">i2").tobytes()
    (tmp_path / "m.gz").write_bytes(gzip.compress(raw))
    assert read_idx(tmp_path / "m.gz").tolist() == [[1, -2], [300, 4]]


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "float32", "float64"])
def test_idx_round_trip(tmp_path, dtype):
    arr = (np.arange(60).reshape(3, 4, 5) - 7).astype(dtype)
    for name in ("a.idx", "a.idx.gz"):
        write_idx(tmp_path / name, arr)
        out = read_idx(tmp_path / name)
        assert out.dtype == np.dtype(dtype) and out.shape == arr.shape and np.array_equal(out, arr)


def test_idx_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x08\x01")
    with pytest.raises(FormatError, match="bad: not an IDX file"):
        read_idx(bad)
    bad.write_bytes(bytes([0, 0, 0x07, 1, 0, 0, 0, 1, 0]))
    with pytest.raises(FormatError, match="unknown IDX type code 0x07"):
        read_idx(bad)
    bad.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))
    with pytest.raises(FormatError, match=r"needs 5 data bytes, found 2"):
        read_idx(bad)


def _write_mnist(root, n_train=40, n_test=10, gz=True):
    rng = np.random.default_rng(0)
    sfx = ".gz" if gz else ""
    write_idx(root / f"train-images-idx3-ubyte{sfx}", rng.integers(0, 256, (n_train, 28, 28)).astype(np.uint8))
    write_idx(root / f"train-labels-idx1-ubyte{sfx}", (np.arange(n_train) % 10).astype(np.uint8))
    write_idx(root / f"t10k-images-idx3-ubyte{sfx}", rng.integers(0, 256, (n_test, 28, 28)).astype(np.uint8))
    write_idx(root / f"t10k-labels-idx1-ubyte{sfx}", (np.arange(n_test) % 10).astype(np.uint8))


@pytest.mark.parametrize("name,gz", [("mnist", True), ("fashion_mnist", False)])
def test_idx_datasets(tmp_path, name, gz):
    _write_mnist(tmp_path, gz=gz)
    data = load_dataset(load_config(overrides=[f"data.name={name}", f"data.root={tmp_path}"]).data)
    assert data.train.x.shape == (40, 1, 28, 28) and data.test.x.shape == (10, 1, 28, 28)
    assert data.train.y.tolist() == [i % 10 for i in range(40)] and data.num_classes == 10
    assert abs(float(data.train.x.mean())) < 1e-4  # standardised with train statistics


def test_idx_dataset_missing_files(tmp_path):
    with pytest.raises(DatasetError, match="train-images-idx3-ubyte"):
        load_dataset(load_config(overrides=["data.name=mnist", f"data.root={tmp_path}"]).data)


def test_cifar_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(1)
    imgs = [rng.integers(0, 256, (6, 3, 32, 32)).astype(np.uint8) for _ in range(3)]
    for i, im in enumerate(imgs[:2], start=1):
        write_cifar_batch(folder / f"data_batch_{i}", im, np.arange(6) + i)
    write_cifar_batch(folder / "test_batch", imgs[2], np.arange(6))
    x, y = read_cifar_batch(folder / "data_batch_1")
    assert np.array_equal(x, imgs[0]) and y.tolist() == [1, 2, 3, 4, 5, 6]
    # channel planes: the first 1024 bytes of a row are the red plane
    assert np.array_equal(x[0, 0].reshape(-1), imgs[0][0, 0].reshape(-1))
    data = load_dataset(load_config(overrides=["data.name=cifar10", f"data.root={tmp_path}"]).data)
    assert data.train.x.shape == (12, 3, 32, 32) and data.test.x.shape == (6, 3, 32, 32)
    assert data.train.y.tolist() == list(range(1, 7)) + list(range(2, 8))
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a pickle")
    with pytest.raises(FormatError, match="bad"):
        read_cifar_batch(bad)


def test_digits_split_is_fixed():
    a = load_dataset(load_config().data)
    b = load_dataset(load_config(overrides=["seed=7"]).data)
    assert len(a.train) + len(a.test) == 1797 and torch.equal(a.test.y, b.test.y)


def test_digits_are_the_uci_test_set():
    """The shipped file holds the UCI optdigits test set: its class counts and first row as the UCI files give them."""
    images, labels = digits_arrays()
    assert images.shape == (1797, 8, 8) and images.dtype == np.float32 and labels.dtype == np.int64
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert images.min() == 0 and images.max() == 16 and np.array_equal(images, images.round())
    first = [0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0, 0, 3, 15, 2, 0, 11, 8, 0, 0, 4, 12, 0, 0, 8, 8, 0,
             0, 5, 8, 0, 0, 9, 8, 0, 0, 4, 11, 0, 1, 12, 7, 0, 0, 2, 14, 5, 10, 12, 0, 0, 0, 0, 6, 13, 10, 0, 0, 0]
    assert images[0].ravel().tolist() == first and labels[0] == 0


def test_digits_equal_scikit_learns_copy_where_it_is_installed():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    theirs = sklearn_datasets.load_digits()
    images, labels = digits_arrays()
    assert np.array_equal(images, theirs.images) and np.array_equal(labels, theirs.target)


@pytest.mark.parametrize("model,data", [
    ("mlp", []), ("cnn", []), ("resnet", []),
    ("transformer", ["data.name=synthetic_lm", "data.samples=64"]),
])
def test_models_are_sequential_and_run(model, data):
    cfg = load_config(overrides=[f"model.name={model}", *data])
    ds = load_dataset(cfg.data)
    net = build_model(cfg.model, ds)
    assert isinstance(net, torch.nn.Sequential) and len(net) >= 3
    out = net(ds.train.x[:4])
    assert out.shape[-1] == ds.num_classes and out.shape[0] == 4


def test_shard_stream_covers_every_sample_and_resumes():
    records, replicas, batch = 50, 2, 7
    streams = [ShardStream(records, replicas, r, batch, seed=3) for r in range(replicas)]
    seen = torch.cat([torch.cat([s.next_batch() for _ in range(3)]) for s in streams])  # 42 samples, pass 0
    assert len(set(seen.tolist())) == 42
    resumed = ShardStream(records, replicas, 0, batch, seed=3)
    resumed.load_state_dict(streams[0].state_dict())
    for _ in range(5):  # crosses into pass 1
        assert torch.equal(resumed.next_batch(), streams[0].next_batch())
    ev = torch.cat([torch.cat(eval_indices(11, 2, r, 4)) for r in range(2)])
    assert sorted(ev.tolist()) == list(range(11))
