"""TEST DOUBLE for the Keras MNIST download: random arrays of MNIST's shapes, written as mnist.npz files.

keras.datasets.mnist.load_data checks the file's hash against the real MNIST's, so a stand-in
.npz cannot sit in ~/.keras/datasets; the harness points the examples' load_data call here instead
(one sed, listed in run.py). Arrays: x_train (N, 28, 28) uint8, y_train (N,) uint8 in 0..9,
x_test / y_test with N // 4 rows; N = FAKE_DATA_N (default 256).
"""
import os

import numpy as np


def write_npz(path, seed=0):
    n = int(os.environ.get("FAKE_DATA_N", "256"))
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, rows in (("train", n), ("test", max(1, n // 4))):
        arrays[f"x_{split}"] = rng.integers(0, 256, (rows, 28, 28), dtype=np.uint8)
        arrays[f"y_{split}"] = rng.integers(0, 10, (rows,), dtype=np.uint8)
    np.savez(path, **arrays)


def mnist_load_data(path="mnist.npz"):
    """keras.datasets.mnist.load_data's return value, read from $FAKE_DATA_DIR/<basename of path>."""
    full = os.path.join(os.environ["FAKE_DATA_DIR"], os.path.basename(path))
    with np.load(full) as f:
        return (f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])


def write_image_folder(root, classes=1000, filled=2, per_class=4, seed=0):
    """An ImageNet-like folder for flow_from_directory: `classes` class folders (so one-hot labels
    have ImageNet's 1000 columns), the first `filled` of them holding `per_class` random 256x256 JPEGs."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        d = os.path.join(root, f"n{c:08d}")
        os.makedirs(d, exist_ok=True)
        for i in range(per_class if c < filled else 0):
            Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(os.path.join(d, f"{i}.jpg"))
