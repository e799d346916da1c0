"""Waiting without spinning: the observer's own waits must not take the cores of what it measures.

Open MPI's blocking calls poll a core until the message arrives. On a machine with fewer cores
than ranks (a small machine, several hosts in containers) the waiting ranks then hold the cores
that the ranks being measured need, and a process that spins gets no wake-up preference from
the scheduler: a round trip waits for a time slice. The doctor's probe and the clock
estimation of :func:`ringpipe.observe.collect.clock_offsets` therefore wait here: poll the
request, then sleep between polls. c10d's waits block in the kernel already (and gloo's
receive reports completion only to ``wait``), so there the plain wait is the quiet one.
"""

from __future__ import annotations

import time

import torch

from ringpipe.comm.base import Communicator, Work

__all__ = ["quiet_wait", "quiet_barrier", "QUIET_TAG"]

QUIET_TAG = 7_100_001


def quiet_wait(comm: Communicator, work: Work, longest: float = 0.01, spin: float = 0.0) -> None:
    """Wait for ``work`` without spinning (under MPI): ``spin`` seconds of polling, then sleeps.

    The pause doubles from 20 µs up to ``longest`` (seven waiting ranks polling every half
    millisecond would take a good part of a small machine's cores themselves); ``spin``: seconds
    of plain polling first, so that a transfer about to end is not delayed by a sleep.
    """
    if comm.backend == "mpi":
        pause = 0.00002
        until = time.perf_counter() + spin
        while not work.is_completed():
            if time.perf_counter() >= until:
                time.sleep(pause)
                pause = min(2 * pause, longest)
    work.wait()


def quiet_barrier(comm: Communicator) -> None:
    """A barrier whose waiting ranks sleep between polls instead of spinning on a core."""
    if comm.size == 1:
        return
    t = torch.zeros(1)
    if comm.rank == 0:
        for q in range(1, comm.size):
            quiet_wait(comm, comm.irecv(t, q, QUIET_TAG))
        for q in range(1, comm.size):
            comm.isend(t, q, QUIET_TAG).wait()
    else:
        comm.isend(t, 0, QUIET_TAG).wait()
        quiet_wait(comm, comm.irecv(t, 0, QUIET_TAG))
