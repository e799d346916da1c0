"""Checkpoints written by rank 0 only, atomically, loadable on any world size, and loaded without running code.

Loading is safe by default: ``torch.load(weights_only=True)`` rebuilds tensors, containers,
numbers and strings (what module, optimizer and LR-scheduler state dicts hold), plus numpy
scalars and arrays, and refuses anything else, so a crafted file cannot run code. A file that
needs other types is refused with an error naming the type; ``weights_only=False`` loads it
with full pickle, which runs whatever code the file names: pass it only for files you trust.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ringpipe.check.announcement import run_announced
from ringpipe.comm.base import Communicator

__all__ = ["save_checkpoint", "load_checkpoint", "UnsafeCheckpointError", "SAFE_GLOBALS"]


def _unwrap(obj: Any) -> Any:
    """State dicts of modules/optimizers (DistributedOptimizer gives its wrapped optimizer's)."""
    if isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
        return obj.state_dict()
    return obj


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any], comm: Communicator | None = None,
                    root_rank: int = 0) -> None:
    """Write ``state`` (modules and optimizers become their state dicts) on ``root_rank`` only.

    The file is written to a temporary name in the same directory and renamed, so a crash never
    leaves a half-written checkpoint under ``path``. Every rank returns after the file exists.
    The state holds no rank or world-size information, so it loads on any number of ranks.
    """
    if comm is None:
        from ringpipe.core.world import current

        comm = current().comm
    if comm.rank == root_rank:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        payload = {k: _unwrap(v) for k, v in state.items()}
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    if comm.size > 1:
        run_announced(comm, "barrier", comm.barrier, "checkpoint-barrier")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint needs types that a safe load does not rebuild (it could run code)."""


def _numpy_globals() -> list[Any]:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    kinds = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128")
    return [core.multiarray.scalar, core.multiarray._reconstruct, np.ndarray, np.dtype,
            *(type(np.dtype(k)) for k in kinds)]


#: Types a safe load rebuilds beyond torch's own (numpy values often saved beside a model's state).
SAFE_GLOBALS: list[Any] = _numpy_globals()


@contextlib.contextmanager
def _safe_globals() -> Iterator[None]:
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        yield


def _load(path: str | os.PathLike[str], map_location: Any, weights_only: bool) -> Any:
    if not weights_only:  # the caller vouches for the file: full pickle
        return torch.load(path, map_location=map_location, weights_only=False)
    try:
        with _safe_globals():
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = next((line.strip() for line in text.splitlines() if "Unsupported global" in line
                      or "Unsupported operand" in line), text.strip().splitlines()[-1] if text.strip() else "")
        raise UnsafeCheckpointError(
            f"checkpoint {os.fspath(path)!r} was not loaded: it needs more than tensors, containers, numbers "
            f"and strings ({found.split('. Please use')[0]}), and loading it could run code from the file. "
            "If you trust the file, load it with load_checkpoint(path, weights_only=False), or allow the type "
            "with torch.serialization.add_safe_globals([...])"
        ) from None


def load_checkpoint(path: str | os.PathLike[str], comm: Communicator | None = None, root_rank: int | None = 0,
                    map_location: Any = "cpu", *, weights_only: bool = True) -> dict[str, Any]:
    """Read a checkpoint: on ``root_rank`` and broadcast it (or, with ``root_rank=None``, on every rank).

    Safe by default: only tensors, containers, numbers, strings and :data:`SAFE_GLOBALS` are
    rebuilt; a file that needs anything else raises :class:`UnsafeCheckpointError` and runs
    nothing. ``weights_only=False`` is the explicit opt-in to full pickle, for files you trust
    only: a crafted file runs arbitrary code when loaded that way.
    """
    if root_rank is None or comm is None or comm.size == 1:
        return _load(path, map_location, weights_only)
    state: Any = None
    error: BaseException | None = None
    if comm.rank == root_rank:
        try:
            state = _load(path, map_location, weights_only)
        except (UnsafeCheckpointError, OSError, RuntimeError) as exc:
            error = exc  # raised on every rank below, not only on the root
    failure = (type(error).__name__, str(error)) if error is not None else None
    state, failure = run_announced(comm, "broadcast_object", lambda: comm.broadcast_object((state, failure), root_rank),
                                   "load-checkpoint")
    if error is not None:
        raise error
    if failure is not None:
        kind = UnsafeCheckpointError if failure[0] == UnsafeCheckpointError.__name__ else RuntimeError
        raise kind(f"rank {root_rank} could not load the checkpoint: {failure[1]}")
    return state
