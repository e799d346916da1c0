"""Create the world communicator from the launch environment (and tear it down)."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from ringpipe.comm import departures, elastic_rendezvous
from ringpipe.comm.base import CommError, Communicator
from ringpipe.comm.events import internal
from ringpipe.comm.stall import StallInspector
from ringpipe.env import EnvironmentError_, Topology, detect
from ringpipe.ports import free_port

__all__ = ["BACKENDS", "init_world", "shutdown_world", "pin_device", "default_backend",
           "resolve_backend", "abort_mpi_job_on_exception", "stall_inspector", "init_world_on"]

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl", "mpi")
_WORLDS_MADE = [0]  # worlds this process joined on a job's store (each under keys of its own)
_JOB_STORES: dict[tuple[str, int, bool], Any] = {}  # the job's store, kept for the process's life


def _job_store(addr: str, port: int, size: int, serve: bool, timeout: datetime.timedelta) -> Any:
    """The job's key-value store at ``addr:port`` (served here when ``serve``), opened once per process.

    Kept open across worlds: were rank 0's server closed with one world, a rank joining the next
    could still reach the closing server and fail (``Connection was likely closed``).
    """
    key = (addr, port, serve)
    if key not in _JOB_STORES:
        _JOB_STORES[key] = dist.TCPStore(addr, port, world_size=size, is_master=serve, timeout=timeout,
                                         multi_tenant=serve)
    return _JOB_STORES[key]


def default_backend(local_size: int = 1) -> str:
    """NCCL where each of this node's ``local_size`` ranks has a GPU of its own, else gloo.

    The GPUs are counted through NVML (``torch.cuda.device_count`` before CUDA is initialised),
    which neither initialises CUDA nor creates a context, so a CPU job on a GPU host stays off
    its GPUs. With more ranks on a node than GPUs, NCCL could not give each rank a device (it
    refuses two ranks on one GPU), so those jobs run on gloo.
    """
    gpus = torch.cuda.device_count()
    return "nccl" if gpus > 0 and local_size <= gpus else "gloo"


def resolve_backend(backend: str | None = None, local_size: int = 1) -> str:
    """The backend to use: the argument, else ``$RINGPIPE_BACKEND``, else :func:`default_backend`."""
    source = "backend"
    if not backend:
        backend, source = os.environ.get("RINGPIPE_BACKEND", "").strip(), "RINGPIPE_BACKEND"
    if not backend:
        return default_backend(local_size)
    backend = backend.lower()
    if backend not in BACKENDS:
        raise CommError(f"unknown backend {backend!r} (from {source}); valid backends: {', '.join(BACKENDS)}")
    return backend


def abort_mpi_job_on_exception(world: Any) -> None:
    """Make an uncaught exception print its traceback, then abort every rank of the MPI job.

    Without it, the failed rank's interpreter finalises MPI at exit, which waits for ranks that
    are blocked in a collective with it: the job hangs. ``python -m mpi4py`` does the same.
    Installed once; the previous hook still prints the traceback.
    """
    import sys

    previous = sys.excepthook
    if getattr(previous, "_ringpipe_mpi_abort", False) or world.Get_size() <= 1:
        return

    def hook(kind: Any, value: Any, tb: Any) -> None:
        try:
            if previous is sys.__excepthook__:
                # one write: mpirun's --tag-output tags each fragment of a piecewise traceback
                import traceback

                sys.stderr.write("".join(traceback.format_exception(kind, value, tb)))
            else:
                previous(kind, value, tb)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            world.Abort(1)

    hook._ringpipe_mpi_abort = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def pin_device(topology: Topology) -> torch.device:
    """Pin this process to the GPU of its local rank (Horovod step 2); the CPU without GPUs."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if topology.local_rank >= count:
            raise EnvironmentError_(
                f"local rank {topology.local_rank} has no GPU: this node has {count}; start at most "
                f"{count} processes per node"
            )
        torch.cuda.set_device(topology.local_rank)
        return torch.device("cuda", topology.local_rank)
    return torch.device("cpu")


def _mpi_rendezvous(topology: Topology) -> tuple[str, int]:
    """Share rank 0's address and a free port through MPI (mpirun without MASTER_ADDR)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise EnvironmentError_(
            f"started by {topology.launcher} without MASTER_ADDR/MASTER_PORT: install mpi4py "
            "(pip install 'ringpipe[mpi]') so rank 0 can share its address, or export MASTER_ADDR "
            "and MASTER_PORT to every rank (mpirun -x MASTER_ADDR=host0 -x MASTER_PORT=29500)"
        ) from None
    payload = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        addr = topology.master_addr or _my_address()
        payload = (addr, topology.master_port or free_port())
    addr, port = MPI.COMM_WORLD.bcast(payload, root=0)
    return str(addr), int(port)


def _my_address() -> str:
    host = socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


def init_world(
    backend: str | None = None,
    topology: Topology | None = None,
    timeout_s: float = 300.0,
) -> Communicator:
    """Initialise the job's world communicator from the launch environment.

    ``backend`` is ``gloo`` (CPU), ``nccl`` (CUDA) or ``mpi`` (mpi4py); without it
    ``$RINGPIPE_BACKEND`` (which ``ringpipe launch --backend`` exports), else NCCL where every
    local rank has a GPU of its own and gloo otherwise — the rule of :func:`ringpipe.init`,
    ``bench`` and ``doctor`` too.
    For gloo/NCCL the torch default process group is initialised too, so plain
    ``torch.distributed`` and DDP code works alongside. Under MPI an uncaught exception prints its
    traceback and aborts the whole MPI job (see :func:`abort_mpi_job_on_exception`).
    """
    elastic_version = 0
    if topology is None and elastic_rendezvous.active():  # a worker of an elastic job: the driver places it
        elastic_version = elastic_rendezvous.join()
        timeout_s = float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "30") or 30)
    topo = topology or detect()
    backend = resolve_backend(backend, topo.local_size)

    if backend == "mpi":
        from ringpipe.comm.mpi_backend import MPICommunicator, mpi_available

        if not mpi_available():
            raise CommError("the mpi backend needs mpi4py: pip install 'ringpipe[mpi]' (or pip install mpi4py)")
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        abort_mpi_job_on_exception(world)
        if world.Get_size() != topo.size:
            raise EnvironmentError_(
                f"MPI world has {world.Get_size()} ranks but the environment says size={topo.size}: "
                "start the script with mpirun/mpiexec/srun --mpi (not torchrun) for the mpi backend"
            )
        comm: Communicator = MPICommunicator(world, topo)
    else:
        if backend == "nccl" and not torch.cuda.is_available():
            raise CommError(
                "the nccl backend needs CUDA GPUs and a CUDA build of torch; use backend='gloo' on CPU"
            )
        from ringpipe.comm.torch_backend import TorchCommunicator

        device = pin_device(topo) if backend == "nccl" else torch.device("cpu")
        # Under NCCL, CPU tensors travel over gloo (Horovod's CPU operations in a GPU job).
        c10d_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_s)
            if topo.size == 1:
                dist.init_process_group(c10d_backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                addr, port = topo.master_addr, topo.master_port
                if (addr is None or port is None) and topo.launcher in ("openmpi", "mpich"):
                    addr, port = _mpi_rendezvous(topo)
                if addr is None or port is None:
                    raise EnvironmentError_(
                        f"{topo.launcher} launch with {topo.size} ranks but MASTER_ADDR/MASTER_PORT are not "
                        "set: export both (the address and a free port of rank 0's host)"
                    )
                # Under torchrun the agent already serves the store at MASTER_ADDR:MASTER_PORT
                # (TORCHELASTIC_USE_AGENT_STORE): join it instead of binding the port again, under a
                # prefix of this restart's number: the agent keeps its store across restarts
                # (--max-restarts), and the keys of the ranks that failed would otherwise be read
                # as this attempt's (a rank connecting to a dead peer's address). Otherwise rank 0
                # serves the store, as ``init_method="tcp://..."`` would. Either way a world made
                # again in one process (``shutdown()`` then ``init()``, as an elastic reset does)
                # meets the same store (the agent's, or rank 0's, which c10d keeps per port): its
                # keys go under this process's count of worlds, or the new group would read the
                # old one's addresses and departures and wait for ever.
                _WORLDS_MADE[0] += 1
                if elastic_version:  # the elastic driver's store, under this world version's keys
                    client = elastic_rendezvous.driver_store()
                    prefix = elastic_rendezvous.prefix(elastic_version)
                elif topo.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                    client = _job_store(addr, port, topo.size, False, timeout)
                    prefix = f"/ringpipe/attempt_{attempt}/world_{_WORLDS_MADE[0]}"
                else:
                    client = _job_store(addr, port, topo.size, topo.rank == 0, timeout)
                    prefix = f"/ringpipe/world_{_WORLDS_MADE[0]}"
                dist.init_process_group(c10d_backend, store=dist.PrefixStore(prefix, client), rank=topo.rank,
                                        world_size=topo.size, timeout=timeout)
        comm = TorchCommunicator(backend, topo, device=device)

    # an elastic job's hosts are the names its discovery printed (several may be this machine)
    me = os.environ.get("HOROVOD_HOSTNAME", "") if elastic_version else ""
    me = me or socket.gethostname()
    if topo.size > 1:
        with internal():  # ringpipe's own bookkeeping, shown apart from the program's calls
            hosts = comm.allgather_object(me)
        topo = topo.with_hostnames(hosts)
    else:
        topo = topo.with_hostnames([me])
    if elastic_version:
        elastic_rendezvous.mark_ready(elastic_version)
    comm.topology = topo
    _start_stall_inspector(comm)
    if backend != "mpi":
        _shutdown_at_exit()
    return comm


def init_world_on(mpi_comm: Any) -> Communicator:
    """A world communicator over an mpi4py communicator the program made (Horovod's ``init(comm=...)``).

    Collective over ``mpi_comm``, which is duplicated (the program keeps its own). Ranks, size and
    the node layout (local rank and size, node rank and count) are those of its members, as
    Horovod computes them for the communicator it is given.
    """
    from ringpipe.comm.mpi_backend import MPICommunicator, mpi_available

    if not mpi_available():
        raise CommError("init(comm=<mpi4py communicator>) needs mpi4py: pip install 'ringpipe[mpi]'")
    from mpi4py import MPI

    if not isinstance(mpi_comm, MPI.Intracomm) or mpi_comm == MPI.COMM_NULL:
        raise CommError(f"init(comm=...) takes an mpi4py intracommunicator this rank belongs to, got {mpi_comm!r}")
    abort_mpi_job_on_exception(MPI.COMM_WORLD)
    own = mpi_comm.Dup()
    base = detect()
    layout = dataclasses.replace(base, rank=own.Get_rank(), size=own.Get_size(), local_rank=0, local_size=1,
                                 node_rank=0, num_nodes=1, hostnames=())
    comm = MPICommunicator(own, layout.with_hostnames(own.allgather(socket.gethostname())))
    _start_stall_inspector(comm)
    return comm


def _shutdown_at_exit() -> None:
    """Destroy the process group when the interpreter exits, if the program did not.

    A gloo group left alive at exit is torn down during interpreter finalization, where one of
    its worker threads can still be releasing a finished operation that holds Python state: the
    thread then dies and the process aborts ("terminate called without an active exception"),
    now and then, after the program's last line ran correctly. ``atexit`` runs while the
    interpreter is intact; :func:`shutdown_world` is idempotent, so an explicit call stays free.
    Registered once however often a world is created.
    """
    atexit.unregister(_shutdown_at_end)
    atexit.register(_shutdown_at_end)
    _leave_at_exit()


def _shutdown_at_end() -> None:
    """At exit: the world, then the job's store kept across worlds (its threads end with it)."""
    shutdown_world()
    _JOB_STORES.clear()


def _leave_at_exit() -> None:
    """Write this rank's departure at exit, before the world is torn down (atexit runs last-in first)."""
    atexit.unregister(_exited)
    atexit.register(_exited)


def _exited() -> None:
    departures.leave("exited")


_INSPECTOR: StallInspector | None = None


def _mpi_stall_store(topology: Topology, mpi_comm: Any = None) -> Any:
    """A key-value store for the stall inspector under MPI, which has no c10d store.

    Rank 0 serves a ``TCPStore`` on a free port and shares its address through MPI; the other
    ranks connect only when the inspector first needs the store (a stall), so a job that never
    stalls pays one small broadcast at start-up and an unreachable address costs nothing then.
    Returns the store on rank 0, a function that opens it on the other ranks, or None where no
    store can be served.
    """
    from mpi4py import MPI

    world = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    served: Any = None
    where: tuple[list[str], int] | None = None
    if world.Get_rank() == 0:
        if topology.num_nodes == 1:
            hosts = ["127.0.0.1"]
        else:  # the store listens on every interface; the others try rank 0's addresses in turn
            hosts = list(dict.fromkeys([a for a in (topology.master_addr, _my_address()) if a]
                                       + _ipv4_addresses()))
            hosts = [h for h in hosts if not h.startswith("127.")] or hosts
        try:
            served = dist.TCPStore(hosts[0], 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=10))
            where = (hosts, int(served.port))
        except Exception:  # noqa: BLE001 - without a store the warnings name each rank's own wait only
            log.debug("cannot serve a store for the stall inspector", exc_info=True)
    where = world.bcast(where, root=0)
    if where is None:
        return None
    if served is not None:
        return served
    hosts, port = where

    def connect() -> Any:
        errors = []
        for host in hosts:
            try:
                return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                     timeout=datetime.timedelta(seconds=5))
            except Exception as exc:  # noqa: BLE001 - try rank 0's next address
                errors.append(f"{host}:{port}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        raise CommError("rank 0's store is not reachable at " + "; ".join(errors))

    return connect


def _ipv4_addresses() -> list[str]:
    """This host's IPv4 addresses, one per interface that has one (Linux; empty elsewhere)."""
    try:
        import fcntl
        import struct

        out = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    req = struct.pack("256s", name.encode()[:15])
                    out.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]))  # SIOCGIFADDR
                except OSError:  # an interface without an IPv4 address
                    continue
        return out
    except (ImportError, OSError):
        return []


def _start_stall_inspector(comm: Communicator) -> None:
    """Watch for stalled communication (``RINGPIPE_STALL_CHECK_SECONDS``, 60 by default; 0: off)."""
    global _INSPECTOR
    raw = os.environ.get("RINGPIPE_STALL_CHECK_SECONDS", "60")
    try:
        seconds = float(raw)
    except ValueError:
        raise EnvironmentError_(f"RINGPIPE_STALL_CHECK_SECONDS={raw!r} is not a number of seconds (0 turns it off)") from None
    store: Any = None
    if comm.size == 1:
        return
    if comm.backend == "mpi":
        store = _mpi_stall_store(comm.topology, getattr(comm, "mpi", None))
    else:
        try:  # the process group's key-value store: every rank reaches it without communicating
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - without a store the warning names this rank's wait only
            log.debug("no c10d store for the stall inspector", exc_info=True)
    abort = None
    if comm.backend == "mpi":
        from mpi4py import MPI

        abort = lambda: MPI.COMM_WORLD.Abort(1)  # noqa: E731 - a rank blocked in MPI cannot be interrupted
        _leave_at_exit()
    departures.start(comm.rank, comm.size, comm.log, store, comm.backend, abort)
    if _INSPECTOR is not None:
        _INSPECTOR.stop()
        _INSPECTOR = None
    if seconds <= 0:
        return
    _INSPECTOR = StallInspector(comm.rank, comm.size, comm.log, seconds, store).start()


def stall_inspector() -> StallInspector | None:
    """The running stall inspector of this process (None when off or single-process)."""
    return _INSPECTOR


def shutdown_world() -> None:
    """Destroy the torch default process group if one exists (MPI finalises at exit)."""
    global _INSPECTOR
    departures.leave("shutdown")
    if _INSPECTOR is not None:
        _INSPECTOR.stop()
        _INSPECTOR = None
    if dist.is_initialized():
        dist.destroy_process_group()
