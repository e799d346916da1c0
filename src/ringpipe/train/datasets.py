"""Dataset registry: embedded digits, MNIST / Fashion-MNIST (IDX), CIFAR-10 (python batches), synthetic.

Every dataset is small enough to hold in memory as tensors; a loader returns a
:class:`Dataset` with the train and test splits already normalised. Splits that are not
given by the files (digits, synthetic) are drawn with a fixed generator, independent of the
training seed, so every run and every rank sees the same split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ringpipe.pipeline.model_io import batch_index
from ringpipe.train.formats import FormatError, read_cifar_batch, read_idx
from ringpipe.train.registry import Registry

__all__ = ["Dataset", "Split", "DATASETS", "load_dataset", "DatasetError", "data_problem", "digits_arrays"]

#: Seed of the generator that draws train/test splits and synthetic data (not the training seed).
SPLIT_SEED = 1234


class DatasetError(FileNotFoundError):
    """Dataset files are missing or unusable; the message names the directory and the files expected."""


@dataclass
class Split:
    """Inputs and targets of one split, as tensors."""

    x: Any  # a tensor, a tuple or a mapping of tensors (ringpipe.pipeline.model_io)
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def batch(self, idx: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The inputs and targets of the samples at ``idx``."""
        return batch_index(self.x, idx), self.y[idx]


@dataclass
class Dataset:
    """A loaded dataset: splits, classes (or vocabulary) and the shape of one input.

    A split is anything with ``len()`` and ``batch(idx) -> (inputs, targets)``: a :class:`Split`
    of tensors, or the user's torch Dataset behind :class:`ringpipe.train.userdata.TorchSplit`.
    ``num_classes`` is 0 where it is not known (the user's data; only built-in models read it).
    """

    name: str
    train: Any
    test: Any
    num_classes: int
    input_shape: tuple[int, ...]
    kind: str = "classification"  # or "lm": x and y are token sequences, y shifted by one


DATASETS: Registry[Callable[[Any], Dataset]] = Registry("dataset")


def load_dataset(cfg: Any) -> Dataset:
    """Load the dataset described by a data config section (a registered name, or the user's
    ``package.module:function``, see :mod:`ringpipe.train.factories`).

    A factory with a ``train`` parameter, written as torchvision's datasets are
    (``def dataset(train=True): ...``), is called with ``train=True`` for the train set and, when
    that returns one dataset, with ``train=False`` for the test set.
    """
    if cfg.name not in DATASETS and ":" in cfg.name:
        from ringpipe.train.factories import (
            call_factory,
            import_factory,
            section_kwargs,
            takes_parameter,
        )
        from ringpipe.train.userdata import as_dataset, is_one_split

        factory, kwargs = import_factory(cfg.name, "data"), section_kwargs(cfg)
        if takes_parameter(factory, "train") and "train" not in kwargs:
            result = call_factory(factory, {**kwargs, "train": True}, cfg.name, "data")
            if is_one_split(result):
                test = call_factory(factory, {**kwargs, "train": False}, cfg.name, "data")
                return as_dataset(result, cfg.name, f"data.name={cfg.name!r}", test=test,
                                  test_what=f"data.name={cfg.name!r} with train=False")
        else:
            result = call_factory(factory, kwargs, cfg.name, "data")
        return as_dataset(result, cfg.name, f"data.name={cfg.name!r}")
    if cfg.name == "python":
        raise DatasetError(
            "data.name='python' stands for data handed to ringpipe.train.fit; from a config, name a factory "
            "'package.module:function' or a registered dataset"
        )
    result = DATASETS.get(cfg.name)(cfg)
    if isinstance(result, Dataset):
        return result
    from ringpipe.train.userdata import as_dataset

    return as_dataset(result, cfg.name, f"dataset {cfg.name!r} (registered)")


def _split(n: int, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    perm = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_test = max(1, round(n * test_fraction))
    return perm[n_test:], perm[:n_test]


def _normalise(train: np.ndarray, test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel standardisation with the train split's statistics (axis 1 is the channel)."""
    axes = tuple(i for i in range(train.ndim) if i != 1)
    mean = train.mean(axis=axes, keepdims=True)
    std = train.std(axis=axes, keepdims=True) + 1e-6
    return (
        torch.from_numpy(((train - mean) / std).astype(np.float32)),
        torch.from_numpy(((test - mean) / std).astype(np.float32)),
    )


#: The 8x8 handwritten digits: the test set (1,797 images) of the UCI "Optical Recognition of
#: Handwritten Digits" data (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0,
#: https://archive.ics.uci.edu/dataset/80), as 1,797 rows of 65 bytes: 64 pixel counts (0..16, row
#: by row), then the label.
DIGITS_FILE = Path(__file__).resolve().parent / "data" / "digits.u8.gz"


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits as (images, labels): float32 pixel counts 0..16 of shape (1797, 8, 8), int64 labels 0..9.

    Read from the file shipped with ringpipe (about 0.01 s); the same images and labels, in the same
    order, as scikit-learn's ``load_digits()``.
    """
    import gzip

    rows = np.frombuffer(gzip.decompress(DIGITS_FILE.read_bytes()), dtype=np.uint8).reshape(-1, 65)
    return rows[:, :64].astype(np.float32).reshape(-1, 8, 8), rows[:, 64].astype(np.int64)


@DATASETS.register("digits")
def digits(cfg: Any) -> Dataset:
    images, labels = digits_arrays()
    x = (images / 16.0).reshape(-1, 1, 8, 8)
    tr, te = _split(len(x), cfg.test_fraction)
    xtr, xte = _normalise(x[tr], x[te])
    return Dataset("digits", Split(xtr, torch.from_numpy(labels[tr])), Split(xte, torch.from_numpy(labels[te])), 10,
                   (1, 8, 8))


_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


#: torchvision's folder for each IDX dataset (``torchvision.datasets.MNIST(root)`` writes ``root/MNIST/raw``).
_TORCHVISION_FOLDER = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}


def _find(root: Path, stem: str, dataset: str) -> Path | None:
    tv = _TORCHVISION_FOLDER.get(dataset, dataset)
    for folder in (root, root / "raw", root / dataset / "raw", root / dataset, root / tv / "raw", root / tv):
        for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
            if (folder / name).is_file():
                return folder / name
    return None


def _get_them(name: str, root: Path) -> str:
    """Where to get a dataset's files, for an error about them."""
    from ringpipe.train.fetch import SOURCES

    urls = ", ".join(f.urls()[0] for f in SOURCES[name])
    tv = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": "CIFAR10"}[name]
    return (
        f"get them with `ringpipe data fetch {name.replace('_', '-')} --root {root}` (checks each file's MD5), or "
        f"by hand from {urls}; torchvision's layout is read too (torchvision.datasets.{tv}(root={str(root)!r}, "
        "download=True)); or set data.root to where the files are"
    )


def data_problem(cfg: Any) -> str:
    """Why the files of data section ``cfg`` cannot be read ("" if they can, or need none), with where to get them."""
    if cfg.name not in ("mnist", "fashion_mnist", "cifar10"):
        return ""
    root = Path(cfg.root).expanduser()
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        return f"{cfg.name}: data.root={str(root)!r} {what}: {_get_them(cfg.name, root)}"
    if cfg.name == "cifar10":
        folder = _cifar_folder(root)
        if not sorted(folder.glob("data_batch_*")) or not (folder / "test_batch").is_file():
            packed = " (cifar-10-python.tar.gz is there: unpack it with tar -xzf)" if (
                root / "cifar-10-python.tar.gz").is_file() else ""
            return (f"cifar10: data.root={str(root)!r} must hold data_batch_1..5 and test_batch (directly or in "
                    f"cifar-10-batches-py/){packed}: {_get_them(cfg.name, root)}")
        return ""
    missing = [stem for stem in _IDX_FILES.values() if _find(root, stem, cfg.name) is None]
    if missing:
        tv = _TORCHVISION_FOLDER[cfg.name]
        return (
            f"{cfg.name}: {', '.join(m + '[.gz]' for m in missing)} not found in {root} (nor in raw/, {cfg.name}/raw/ "
            f"or torchvision's {tv}/raw/): {_get_them(cfg.name, root)}"
        )
    return ""


def _cifar_folder(root: Path) -> Path:
    return root / "cifar-10-batches-py" if (root / "cifar-10-batches-py").is_dir() else root


def _found(root: Path, stem: str, dataset: str) -> Path:
    path = _find(root, stem, dataset)
    assert path is not None  # data_problem checked it
    return path


@DATASETS.register("mnist", "fashion_mnist")
def idx_dataset(cfg: Any) -> Dataset:
    problem = data_problem(cfg)
    if problem:
        raise DatasetError(problem)
    root = Path(cfg.root).expanduser()
    arrays = {k: read_idx(_found(root, stem, cfg.name)) for k, stem in _IDX_FILES.items()}
    for split in ("train", "test"):
        imgs, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if imgs.ndim != 3 or labels.ndim != 1 or len(imgs) != len(labels):
            raise FormatError(
                f"{cfg.name} {split}: images must be N x H x W and labels N, got {imgs.shape} and {labels.shape}"
            )
    tr = arrays["train_images"].astype(np.float32)[:, None] / 255.0
    te = arrays["test_images"].astype(np.float32)[:, None] / 255.0
    xtr, xte = _normalise(tr, te)
    ytr = torch.from_numpy(arrays["train_labels"].astype(np.int64))
    yte = torch.from_numpy(arrays["test_labels"].astype(np.int64))
    classes = int(max(int(ytr.max()), int(yte.max())) + 1)
    return Dataset(cfg.name, Split(xtr, ytr), Split(xte, yte), max(classes, 10), tuple(xtr.shape[1:]))


@DATASETS.register("cifar10")
def cifar10(cfg: Any) -> Dataset:
    problem = data_problem(cfg)
    if problem:
        raise DatasetError(problem)
    folder = _cifar_folder(Path(cfg.root).expanduser())
    train_files = sorted(folder.glob("data_batch_*"))
    test_file = folder / "test_batch"
    parts = [read_cifar_batch(f) for f in train_files]
    xtr = np.concatenate([p[0] for p in parts]).astype(np.float32) / 255.0
    ytr = np.concatenate([p[1] for p in parts])
    xte_u8, yte = read_cifar_batch(test_file)
    xtr_t, xte_t = _normalise(xtr, xte_u8.astype(np.float32) / 255.0)
    return Dataset(
        "cifar10", Split(xtr_t, torch.from_numpy(ytr)), Split(xte_t, torch.from_numpy(yte)), 10, (3, 32, 32)
    )


@DATASETS.register("synthetic")
def synthetic(cfg: Any) -> Dataset:
    rng = np.random.default_rng(SPLIT_SEED)
    dim = int(np.prod(cfg.shape))
    centers = rng.normal(size=(cfg.classes, dim)).astype(np.float32) * 2.0
    y = rng.integers(0, cfg.classes, size=cfg.samples)
    x = centers[y] + cfg.noise * rng.normal(size=(cfg.samples, dim)).astype(np.float32)
    x = x.reshape(cfg.samples, *cfg.shape).astype(np.float32)
    tr, te = _split(cfg.samples, cfg.test_fraction)
    return Dataset(
        "synthetic",
        Split(torch.from_numpy(x[tr]), torch.from_numpy(y[tr].astype(np.int64))),
        Split(torch.from_numpy(x[te]), torch.from_numpy(y[te].astype(np.int64))),
        cfg.classes,
        tuple(cfg.shape),
    )


@DATASETS.register("synthetic_lm")
def synthetic_lm(cfg: Any) -> Dataset:
    """Each token is followed by a fixed successor with probability ``1 - noise``, else a random one."""
    rng = np.random.default_rng(SPLIT_SEED)
    successor = rng.permutation(cfg.vocab)
    seq = np.empty((cfg.samples, cfg.seq_len + 1), dtype=np.int64)
    seq[:, 0] = rng.integers(0, cfg.vocab, size=cfg.samples)
    for t in range(1, cfg.seq_len + 1):
        noisy = rng.random(cfg.samples) < cfg.noise
        seq[:, t] = np.where(noisy, rng.integers(0, cfg.vocab, size=cfg.samples), successor[seq[:, t - 1]])
    tr, te = _split(cfg.samples, cfg.test_fraction)
    x, y = torch.from_numpy(seq[:, :-1].copy()), torch.from_numpy(seq[:, 1:].copy())
    return Dataset("synthetic_lm", Split(x[tr], y[tr]), Split(x[te], y[te]), cfg.vocab, (cfg.seq_len,), kind="lm")
