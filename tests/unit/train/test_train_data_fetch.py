"""Datasets of the bundled configs: checked before any process starts, with where to get them;
torchvision's layouts read as they are; ``ringpipe data fetch`` verifies every file's MD5."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from ringpipe.train.config import load_config
from ringpipe.train.datasets import load_dataset
from ringpipe.train.fetch import SOURCES, DataFile, FetchError, fetch
from ringpipe.train.formats import write_idx


def _cli(*argv, cwd):
    env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    return subprocess.run([sys.executable, "-m", "ringpipe.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("config,name,url", [
    ("mnist", "mnist", "https://ossci-datasets.s3.amazonaws.com/mnist/train-images-idx3-ubyte.gz"),
    ("resnet_cifar10", "cifar10", "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"),
])
def test_bundled_config_without_its_data_says_where_to_get_it(tmp_path, config, name, url):
    out = _cli("train", "--config", config, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    err = out.stderr
    assert f"{name}: data.root='data/{name}' does not exist" in err
    assert f"ringpipe data fetch {name}" in err and url in err and "torchvision" in err
    assert "starting" not in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no run directory, no process started


def _write_idx_set(folder, n=20):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    write_idx(folder / "train-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)).astype(np.uint8))
    write_idx(folder / "train-labels-idx1-ubyte", (np.arange(n) % 10).astype(np.uint8))
    write_idx(folder / "t10k-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)).astype(np.uint8))
    write_idx(folder / "t10k-labels-idx1-ubyte", (np.arange(n) % 10).astype(np.uint8))


@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_torchvision_layout_is_read(tmp_path, name, folder):
    """torchvision.datasets.MNIST(root, download=True) leaves root/MNIST/raw/ (FashionMNIST/raw/ likewise)."""
    _write_idx_set(tmp_path / folder / "raw")
    data = load_dataset(load_config(overrides=[f"data.name={name}", f"data.root={tmp_path}"]).data)
    assert data.train.x.shape == (20, 1, 28, 28)


# ------------------------------------------------------------------------------ ringpipe data fetch


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_fetch_without_network_names_the_url_and_the_manual_steps(tmp_path):
    out = _cli("data", "fetch", "mnist", "--root", str(tmp_path / "mnist"), "--mirror", "http://127.0.0.1:9",
               "--timeout", "5", cwd=tmp_path)
    assert out.returncode == 1
    err = out.stderr
    assert "could not get train-images-idx3-ubyte.gz" in err
    assert "http://127.0.0.1:9/train-images-idx3-ubyte.gz" in err  # the URL tried, and why it failed
    assert "by hand" in err and "md5sum" in err
    for f in SOURCES["mnist"]:
        assert f.md5 in err and f.urls()[0] in err
    assert not any(p.is_file() for p in (tmp_path / "mnist").rglob("*"))


@pytest.mark.e2e
def test_fetch_unknown_dataset_lists_the_known_ones(tmp_path):
    out = _cli("data", "fetch", "imagenet", cwd=tmp_path)
    assert out.returncode == 1 and "mnist, fashion-mnist, cifar10" in out.stderr


def _mirror(tmp_path, name, data):
    mirror = tmp_path / "mirror"
    mirror.mkdir(exist_ok=True)
    (mirror / name).write_bytes(data)
    return mirror.as_uri()


def test_fetch_checks_the_md5_of_each_file(tmp_path):
    data = b"the published bytes"
    good = hashlib.md5(data).hexdigest()
    url = _mirror(tmp_path, "a.gz", data)
    root = tmp_path / "root"
    lines = []
    fetch("mnist", root, [url], sources={"mnist": (DataFile("a.gz", good, ("http://unused",)),)}, log=lines.append)
    assert (root / "a.gz").read_bytes() == data and any("md5 ok" in line for line in lines)
    lines.clear()
    fetch("mnist", root, [url], sources={"mnist": (DataFile("a.gz", good, ("http://unused",)),)}, log=lines.append)
    assert lines == [f"{root / 'a.gz'}: present, md5 ok"]  # not downloaded again
    (root / "a.gz").write_bytes(b"the published bytez")  # damaged on disk: downloaded again
    fetch("mnist", root, [url], sources={"mnist": (DataFile("a.gz", good, ("http://unused",)),)}, log=lines.append)
    assert (root / "a.gz").read_bytes() == data
    wrong = "0" * 32
    with pytest.raises(FetchError) as info:
        fetch("mnist", tmp_path / "other", [url], sources={"mnist": (DataFile("a.gz", wrong, (url,)),)},
              log=lambda _: None)
    assert f"md5 {good}, expected {wrong}" in str(info.value) and "by hand" in str(info.value)
    assert not any((tmp_path / "other").iterdir())  # nothing unverified is left


def test_fetch_unpacks_cifar_into_the_layout_train_reads(tmp_path):
    buf = io.BytesIO()
    rng = np.random.default_rng(0)
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("data_batch_1", "test_batch"):
            blob = pickle.dumps({b"data": rng.integers(0, 256, (4, 3072)).astype(np.uint8), b"labels": [0, 1, 2, 3]})
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    archive = buf.getvalue()
    url = _mirror(tmp_path, "cifar-10-python.tar.gz", archive)
    source = DataFile("cifar-10-python.tar.gz", hashlib.md5(archive).hexdigest(), (url,), extract=True)
    root = tmp_path / "cifar10"
    fetch("cifar10", root, sources={"cifar10": (source,)}, log=lambda _: None)
    data = load_dataset(load_config(overrides=["data.name=cifar10", f"data.root={root}"]).data)
    assert data.train.x.shape == (4, 3, 32, 32) and data.test.y.tolist() == [0, 1, 2, 3]


class _Crafted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_crafted_cifar_batch_runs_no_code(tmp_path):
    from ringpipe.train.formats import FormatError, read_cifar_batch

    marker = tmp_path / "marker"
    (tmp_path / "data_batch_1").write_bytes(pickle.dumps({b"data": _Crafted(marker), b"labels": [0]}))
    with pytest.raises(FormatError, match="refused global builtins.exec"):
        read_cifar_batch(tmp_path / "data_batch_1")
    assert not marker.exists()
