"""The ``auto`` algorithm: pick one from message size, world size and topology.

Thresholds come from ``ringpipe bench`` / ``benchmarks/collectives.py`` runs recorded in
``benchmarks/RESULTS.md`` (gloo and Open MPI over loopback on a 2-core host, 2 and 4 ranks,
4 KiB to 64 MiB by factors of 4):

- allreduce up to :data:`SMALL_BYTES`: recursive doubling (fewest latencies; the consistency
  header rides in the data message). It was the fastest ringpipe algorithm, or tied, at every
  recorded size from 4 to 256 KiB;
- more than one node and more than one rank on some node: hierarchical;
- otherwise the ring (bandwidth-optimal, pipelined).

Rabenseifner is never picked: it was slower than recursive doubling at every recorded size up
to 256 KiB and never faster than the ring above it over gloo; it beat both only in some MPI
runs (4 ranks at 1, 4 and 64 MiB; 2 ranks at 64 MiB), within the runs' 2x spread. Its
``lg p`` latencies may pay off on worlds larger than those measured: ask for it by name.

Reduce-scatter and allgather use the ring; broadcast and reduce the binomial tree.
"""

from __future__ import annotations

from ringpipe.comm.base import Communicator

__all__ = ["SMALL_BYTES", "choose", "num_nodes"]

SMALL_BYTES = 256 * 1024

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
    if nbytes <= SMALL_BYTES:
        return "recursive_doubling"
    nodes = num_nodes(comm)
    if 1 < nodes < comm.size:
        return "hierarchical"
    return "ring"
