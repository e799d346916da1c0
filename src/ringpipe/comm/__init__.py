"""Communicators: one protocol, backends over torch c10d (gloo, NCCL) and MPI (mpi4py)."""

from ringpipe.comm.base import CommError, Communicator, ReduceOp, Work, nbytes_of
from ringpipe.comm.events import Event, EventLog, comm_stats, default_log
from ringpipe.comm.rendezvous import BACKENDS, init_world, pin_device, shutdown_world

__all__ = [
    "BACKENDS",
    "CommError",
    "Communicator",
    "Event",
    "EventLog",
    "ReduceOp",
    "Work",
    "comm_stats",
    "default_log",
    "init_world",
    "nbytes_of",
    "pin_device",
    "shutdown_world",
]
