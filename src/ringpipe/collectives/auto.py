"""The ``auto`` algorithm: pick one from measurements, message size, world size and topology.

Measured first: when :func:`ringpipe.collectives.autotune.probe` (``ringpipe bench`` runs it)
or :func:`~ringpipe.collectives.autotune.load` has a table for this backend, world size and set
of hosts, ``auto`` takes the choice of the nearest measured size: the backend's own allreduce
(``native``) unless one of ringpipe's algorithms beat it there in every round of the probe
(:func:`~ringpipe.collectives.autotune.decide`). A call that resolves to ``native`` runs exactly
as ``algorithm="native"`` does, so ``auto`` costs no more than native where native won.

Without a table, rules drawn from the ``ringpipe bench`` / ``benchmarks/collectives.py`` runs
recorded in ``benchmarks/RESULTS.md`` (gloo and Open MPI over loopback on a 2-core host, 2 and 4
ranks, 4 KiB to 64 MiB by factors of 4):

- more than one node and more than one rank on some node: hierarchical;
- MPI: the native ``MPI_Allreduce`` below :data:`RING_BYTES` (Open MPI's shared-memory
  collective was 2-10x faster than any algorithm over point-to-point messages there), the
  ring from it;
- other backends (gloo): recursive doubling up to :data:`RD_BYTES` (fewest latencies, the
  consistency header rides in the data message, so the check costs no extra message: at or
  above gloo's allreduce at 4-64 KiB), the ring from :data:`RING_BYTES` (1.05-1.07x gloo's at
  64 MiB), and gloo's own allreduce in between, where it was faster.

Rabenseifner is never picked by the rules (never faster than both recursive doubling and the
ring over gloo); a probe picks it where it measures fastest. Reduce-scatter and allgather use
the ring; broadcast and reduce the binomial tree.
"""

from __future__ import annotations

from ringpipe.collectives import autotune
from ringpipe.comm.base import Communicator

__all__ = ["RD_BYTES", "RING_BYTES", "SMALL_BYTES", "choose", "num_nodes"]

#: Up to this size hierarchical's leaders use recursive doubling (the ring above).
SMALL_BYTES = 256 * 1024
RD_BYTES = 64 * 1024
RING_BYTES = 64 * 1024 * 1024

_DEFAULTS = {
    "reduce_scatter": "ring",
    "allgather": "ring",
    "broadcast": "tree",
    "reduce": "tree",
}


def num_nodes(comm: Communicator) -> int:
    """How many distinct hosts the members of ``comm`` run on (1 when unknown)."""
    hosts = comm.topology.hostnames
    if not hosts:
        return 1
    return len({hosts[g] for g in comm.global_ranks})


def choose(collective: str, nbytes: int, comm: Communicator) -> str:
    """The algorithm ``auto`` runs for ``collective`` on ``nbytes`` (the same on every rank)."""
    if collective != "allreduce":
        return _DEFAULTS[collective]
    table = autotune.lookup(comm)
    if table is not None and table.rows:
        return table.choose(nbytes)
    nodes = num_nodes(comm)
    if 1 < nodes < comm.size:
        return "hierarchical"
    if getattr(comm, "backend", "") == "mpi":
        return "native" if nbytes < RING_BYTES else "ring"
    if nbytes <= RD_BYTES:
        return "recursive_doubling"
    return "ring" if nbytes >= RING_BYTES else "native"
