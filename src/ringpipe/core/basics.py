"""Horovod's basics, shared by every face: init and shutdown, who am I, what is built, handles, process sets.

The torch face (``import ringpipe as hvd``), the TensorFlow face and the Keras face re-export
these names: one process state (:mod:`ringpipe.core.world`) whichever face a program uses.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.core import world as _w
from ringpipe.core.engine import Handle
from ringpipe.core.errors import HorovodInternalError, NotInitializedError
from ringpipe.core.process_sets import (
    DuplicateProcessSetError,
    ProcessSet,
    add_process_set,
    adopt,
    global_process_set,
    register_initial,
    remove_process_set,
)
from ringpipe.core.timeline import save_events
from ringpipe.core.world import World

__all__ = [
    "Adasum",
    "Average",
    "HorovodInternalError",
    "Max",
    "Min",
    "NotInitializedError",
    "ProcessSet",
    "Product",
    "Sum",
    "World",
    "add_process_set",
    "ccl_built",
    "communicator",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "gpu_available",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "synchronize",
]

log = logging.getLogger("ringpipe.api")

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM


def _world() -> World:
    return _w.current()


def init(
    comm: Any = None,
    backend: str | None = None,
    process_sets: Sequence[ProcessSet] | str | None = None,
) -> None:
    """Initialise ringpipe (Horovod step 1): from the launch environment, or around an existing ``comm``.

    ``comm``: a ringpipe ``Communicator``, or an mpi4py communicator (Horovod's ``init(comm=...)``:
    ringpipe's world is then its members, on the mpi backend; e.g. a part of ``MPI.COMM_WORLD``
    from ``Split``). The backend is ``backend``, else ``$RINGPIPE_BACKEND``, else NCCL with GPUs and gloo without.
    ``process_sets``: process sets to register now (every rank passes the same), or
    ``"dynamic"`` to add them later with :func:`add_process_set`. A list that names a set twice (or
    all ranks) raises ``ValueError`` and leaves ringpipe initialised, as Horovod does. Calling
    ``init`` again while initialised only gives a listed set the id of the registered set with its
    ranks (Horovod's repeated ``init``); after :func:`shutdown` it initialises anew.
    """
    state = _w._state
    if state is not None:
        if isinstance(comm, Communicator) and comm is not state.comm:
            raise RuntimeError("ringpipe is already initialised with another communicator; call shutdown() first")
        if process_sets is not None and not isinstance(process_sets, str):
            adopt(state, process_sets)  # Horovod: a repeated init maps the listed sets onto the registered ones
        return
    mpi_comm = comm if _is_mpi4py(comm) else None
    if comm is not None and mpi_comm is None and not isinstance(comm, Communicator):
        raise ValueError(
            "init(comm=...) takes a ringpipe Communicator or an mpi4py communicator; Horovod's list of ranks for "
            "a subset of the job is not supported: split MPI.COMM_WORLD and pass the part, or use process sets"
        )
    if mpi_comm is not None and (backend or "mpi") != "mpi":
        raise ValueError(f"init(comm=<mpi4py communicator>) runs on the mpi backend, not backend={backend!r}")
    from ringpipe.launch import horovod_env

    settings = horovod_env.apply()
    owns = not isinstance(comm, Communicator)
    created = False
    if mpi_comm is not None:
        from ringpipe.comm.rendezvous import init_world_on

        comm = init_world_on(mpi_comm)  # Horovod duplicates the communicator it is given, as this does
        global_process_set.mpi_comm = mpi_comm
    if comm is None:
        from ringpipe.comm.rendezvous import init_world
        from ringpipe.env import detect

        if settings.timeline and detect().rank == 0:
            # Rank 0 creates the file before the rendezvous, so no rank appends to an old one.
            from ringpipe.observe.live import create_file

            create_file(settings.timeline)
            created = True
        comm = init_world(backend or os.environ.get("RINGPIPE_BACKEND") or None)
    assert isinstance(comm, Communicator)
    world = World(comm, owns_comm=owns)
    _w.install(world)
    try:
        register_initial(world, process_sets)
    except DuplicateProcessSetError:
        # Horovod is initialised by then and stays so: init() again with a valid list goes on
        _apply_settings(comm, settings, created)
        raise
    except BaseException:
        _w.release()
        world.close()
        raise
    _apply_settings(comm, settings, created)
    log.debug("ringpipe initialised: %r", comm)


def _is_mpi4py(obj: Any) -> bool:
    """Whether ``obj`` is an mpi4py communicator (without importing mpi4py for anything else)."""
    return type(obj).__module__.startswith("mpi4py")


def _apply_settings(comm: Communicator, settings: Any, created: bool) -> None:
    """The ``HOROVOD_*`` settings that need the communicator: the timeline and the stall shutdown."""
    from ringpipe.observe import live

    if settings.timeline:
        live.start(settings.timeline, comm.rank, settings.mark_cycles, create=(comm.rank == 0 and not created))
    if settings.stall_shutdown_s > 0:
        from ringpipe.comm.rendezvous import stall_inspector

        inspector = stall_inspector()
        if inspector is None:
            log.warning("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS has no effect: the stall inspector is off")
        else:
            inspector.shutdown_seconds = settings.stall_shutdown_s
            inspector.on_shutdown.append(live.stop)


def shutdown() -> None:
    """Stop the engines and release the communicator created by :func:`init` (or by ``init_world``).

    The timeline being written (``HOROVOD_TIMELINE`` / ``RINGPIPE_TIMELINE``, ``start_timeline``)
    is completed and closed; with one from the environment, rank 0 also saves every rank's events
    beside it (``FILE`` with ``.events.json``, for ``ringpipe doctor`` and ``ringpipe trace``).
    """
    from ringpipe.launch.horovod_env import timeline_path
    from ringpipe.observe import live

    live.stop()
    state = _w.release()
    if state is None:  # a world from init_world() (the lower-level entry point) is released too
        from ringpipe.comm.rendezvous import shutdown_world

        shutdown_world()
        return
    path = timeline_path(os.environ)
    try:
        if path and path != "DYNAMIC":
            state.engine.run(lambda: save_events(state.comm, path), name="timeline")
    finally:
        state.close()
        global_process_set.ranks = []
        global_process_set.comm = None


def is_initialized() -> bool:
    return _w.is_initialized()


def communicator() -> Communicator:
    """The world communicator (for ringpipe's lower layers)."""
    return _world().comm


def rank() -> int:
    return _world().comm.rank


def size() -> int:
    return _world().comm.size


def local_rank() -> int:
    return _world().comm.topology.local_rank


def local_size() -> int:
    return _world().comm.topology.local_size


def cross_rank() -> int:
    """The index of this rank's node."""
    return _world().comm.topology.node_rank


def cross_size() -> int:
    """The number of nodes."""
    return _world().comm.topology.num_nodes


def is_homogeneous() -> bool:
    """True if every node runs the same number of ranks (Horovod's ``is_homogeneous``)."""
    topology = _world().comm.topology
    return is_homogeneous_placement(topology.hostnames or ("",) * topology.size)


def is_homogeneous_placement(hostnames: Sequence[str]) -> bool:
    """Whether ranks placed on ``hostnames`` (one per rank) give every host the same number of ranks."""
    counts: dict[str, int] = {}
    for host in hostnames:
        counts[host] = counts.get(host, 0) + 1
    return len(set(counts.values())) <= 1


def mpi_enabled() -> bool:
    return _world().comm.backend == "mpi"


def gloo_enabled() -> bool:
    return _world().comm.backend == "gloo"


def mpi_built() -> bool:
    from ringpipe.comm.mpi_backend import mpi_available

    return mpi_available()


def gloo_built() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def nccl_built() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_nccl_available()


def ccl_built() -> bool:
    """Intel oneCCL: not a ringpipe backend."""
    return False


def ddl_built() -> bool:
    """IBM DDL: not a ringpipe backend."""
    return False


def cuda_built() -> bool:
    return torch.cuda.is_available()


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether framework ``ext_base_name`` ('torch', 'tensorflow') runs here with a GPU, as Horovod's
    ``gpu_available``; False for a framework that is not installed or that ringpipe does not serve."""
    import importlib.util

    if ext_base_name in ("torch", "horovod.torch"):
        return torch.cuda.is_available()
    if ext_base_name in ("tensorflow", "horovod.tensorflow") and importlib.util.find_spec("tensorflow"):
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    if verbose:
        print(f"Extension {ext_base_name} is not running with GPU: ringpipe serves torch and tensorflow")
    return False


def rocm_built() -> bool:
    return torch.version.hip is not None


def mpi_threads_supported() -> bool:
    """Only the engine thread calls MPI, so ringpipe needs no MPI thread support."""
    return False


def poll(handle: Handle) -> bool:
    """Whether the asynchronous operation behind ``handle`` has finished (never blocks)."""
    if callable(handle) and not isinstance(handle, Handle):
        return True
    return handle.done()


def synchronize(handle: Handle | Any) -> Any:
    """Wait for an asynchronous operation and return its result.

    A failed collective (a mismatch across ranks, a lost peer) raises a
    :class:`HorovodInternalError`, as in Horovod.
    """
    if callable(handle) and not isinstance(handle, Handle):  # sparse_allreduce_async's handle
        return handle()
    return handle.wait()
