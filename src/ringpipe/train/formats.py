"""Readers (and, for tests and tools, writers) of the IDX and CIFAR-10 python-batch file formats.

IDX (LeCun et al., the MNIST distribution format): two zero bytes, a type code (0x08 uint8,
0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64), the number of dimensions,
then each dimension as a big-endian uint32 and the data in big-endian order. Files may be
gzipped. CIFAR-10's python batches are pickled dicts with ``data`` (N x 3072 uint8, channel
planes R, G, B of 32 x 32 pixels) and ``labels``; they are unpickled with only numpy's array
and dtype constructors allowed, so a crafted batch file cannot run code.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FormatError", "read_idx", "write_idx", "read_cifar_batch", "write_cifar_batch"]

_IDX_TYPES: dict[int, str] = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_IDX_CODES = {np.dtype(v).newbyteorder(">").str.lstrip("<>|="): k for k, v in _IDX_TYPES.items()}


class FormatError(ValueError):
    """A data file does not follow its format; the message names the file and what is wrong."""


#: The globals a CIFAR-10 batch names (numpy arrays and scalars, under numpy 1 and 2 module names).
_ARRAY_GLOBALS = {(mod, name) for mod in ("numpy.core.multiarray", "numpy._core.multiarray")
                  for name in ("_reconstruct", "scalar")} | {("numpy", "ndarray"), ("numpy", "dtype"),
                                                             ("_codecs", "encode")}  # bytes in protocol 2


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that rebuilds containers, numbers, strings and numpy arrays, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ARRAY_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} (a CIFAR-10 batch holds only arrays)")


def _open(path: Path) -> bytes:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise FormatError(f"{path}: truncated or corrupt gzip file ({exc})") from None
    return raw


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into a numpy array of its stored type and shape."""
    p = Path(path)
    data = _open(p)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise FormatError(f"{p}: not an IDX file (the magic number must start with two zero bytes)")
    code, ndim = data[2], data[3]
    if code not in _IDX_TYPES:
        valid = ", ".join(f"0x{c:02X}" for c in _IDX_TYPES)
        raise FormatError(f"{p}: unknown IDX type code 0x{code:02X}; valid codes: {valid}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise FormatError(f"{p}: header announces {ndim} dimensions but the file ends after {len(data)} bytes")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = np.dtype(_IDX_TYPES[code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise FormatError(
            f"{p}: shape {tuple(shape)} of {dtype.name} needs {expected} data bytes, found {len(data) - header}"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray, compress: bool | None = None) -> None:
    """Write ``array`` as an IDX file (gzipped when ``compress`` or the name ends in ``.gz``)."""
    p = Path(path)
    arr = np.asarray(array)
    key = arr.dtype.newbyteorder(">").str.lstrip("<>|=")
    if key not in _IDX_CODES:
        raise FormatError(f"IDX cannot store dtype {arr.dtype}; use uint8, int8, int16, int32, float32 or float64")
    big = arr.astype(arr.dtype.newbyteorder(">") if arr.dtype.itemsize > 1 else arr.dtype)
    payload = bytes([0, 0, _IDX_CODES[key], arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + big.tobytes()
    if compress or (compress is None and p.suffix == ".gz"):
        payload = gzip.compress(payload)
    p.write_bytes(payload)


def read_cifar_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 python batch: images (N, 3, 32, 32) uint8 and labels (N,) int64."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            obj: Any = _ArraysOnly(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise FormatError(f"{p}: not a CIFAR-10 python batch ({exc})") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{p}: a CIFAR-10 batch is a pickled dict, got {type(obj).__name__}")
    d = {(k.decode() if isinstance(k, bytes) else k): v for k, v in obj.items()}
    if "data" not in d or "labels" not in d:
        raise FormatError(f"{p}: a CIFAR-10 batch needs keys 'data' and 'labels', found {sorted(d)}")
    data = np.asarray(d["data"], dtype=np.uint8)
    labels = np.asarray(d["labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise FormatError(f"{p}: 'data' must be N x 3072 (3 planes of 32x32), got shape {data.shape}")
    if labels.shape != (data.shape[0],):
        raise FormatError(f"{p}: {data.shape[0]} images but {labels.shape[0]} labels")
    return data.reshape(-1, 3, 32, 32), labels


def write_cifar_batch(path: str | Path, images: np.ndarray, labels: np.ndarray) -> None:
    """Write a CIFAR-10 python batch (images (N, 3, 32, 32) uint8) the way the distribution does."""
    imgs = np.asarray(images, dtype=np.uint8).reshape(len(images), -1)
    with Path(path).open("wb") as f:
        pickle.dump({b"data": imgs, b"labels": [int(x) for x in labels]}, f, protocol=2)
