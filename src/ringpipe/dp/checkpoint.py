"""Checkpoints written by rank 0 only, atomically, and loadable on any world size."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ringpipe.comm.base import Communicator
from ringpipe.dp.announce import run_announced

__all__ = ["save_checkpoint", "load_checkpoint"]


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
        from ringpipe.api import _world

        comm = _world().comm
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


def load_checkpoint(path: str | os.PathLike[str], comm: Communicator | None = None, root_rank: int | None = 0,
                    map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint: on ``root_rank`` and broadcast it (or, with ``root_rank=None``, on every rank)."""
    if root_rank is None or comm is None or comm.size == 1:
        return torch.load(path, map_location=map_location, weights_only=False)
    state = torch.load(path, map_location=map_location, weights_only=False) if comm.rank == root_rank else None
    return run_announced(comm, "broadcast_object", lambda: comm.broadcast_object(state, root_rank), "load-checkpoint")
