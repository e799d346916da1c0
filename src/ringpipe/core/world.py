"""The process state: one world per process (communicator, engine, process sets).

Every face (torch, TensorFlow, Keras) and ``ringpipe.dp``'s own modules (optimizer, sampler, broadcasts,
checkpoints, SyncBatchNorm) read the world here, below all of them, so that the global process
set and the added ones are one concept whichever face a program uses.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ringpipe.comm.base import Communicator
from ringpipe.core.engine import Engine
from ringpipe.core.errors import NotInitializedError

if TYPE_CHECKING:
    from ringpipe.core.process_sets import ProcessSet

__all__ = [
    "World",
    "current",
    "install",
    "is_initialized",
    "release",
    "world_comm",
]

log = logging.getLogger(__name__)


class World:
    """The world communicator, its background engine, and the process sets registered on it."""

    def __init__(self, comm: Communicator, owns_comm: bool, dynamic_sets: bool = False) -> None:
        self.comm = comm
        self.engine = Engine.of(comm)
        self.owns_comm = owns_comm
        #: Process sets by id; 0 is the global set.
        self.sets: dict[int, ProcessSet] = {}
        self.next_set_id = 1
        #: Named asynchronous operations not yet synchronized (a second one of a name is an error).
        self.names: dict[str, Any] = {}
        #: ``add_process_set`` after init is allowed (Horovod's HOROVOD_DYNAMIC_PROCESS_SETS=1).
        self.dynamic_sets = dynamic_sets or os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") not in ("", "0")

    def close(self) -> None:
        for ps in list(self.sets.values()):
            if ps.process_set_id:
                ps._close()
        self.sets.clear()
        self.engine.shutdown()
        if self.owns_comm and self.comm.backend != "mpi":
            from ringpipe.comm.rendezvous import shutdown_world

            shutdown_world()


_state: World | None = None


def current() -> World:
    """The initialised world; :class:`NotInitializedError` before ``init()``."""
    if _state is None:
        raise NotInitializedError("ringpipe has not been initialised: call ringpipe.init() first")
    return _state


def is_initialized() -> bool:
    return _state is not None


def install(world: World) -> None:
    global _state
    _state = world


def release() -> World | None:
    """Forget the world (the caller closes it); returns it."""
    global _state
    world, _state = _state, None
    return world


def world_comm(comm: Communicator | None = None) -> Communicator:
    """``comm`` if given, else the world communicator."""
    return comm if comm is not None else current().comm
