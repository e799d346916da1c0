"""The ``auto`` algorithm: pick one from message size, world size and topology.

Thresholds come from ``ringpipe bench`` / ``benchmarks/collectives.py`` runs recorded in
``benchmarks/RESULTS.md`` (gloo and Open MPI over loopback on a 2-core host, 2 and 4 ranks):

- allreduce up to :data:`SMALL_BYTES`: recursive doubling (fewest latencies; the consistency
  header rides in the data message);
- more than one node and more than one rank on some node: hierarchical;
- up to :data:`MEDIUM_BYTES` on a power-of-two world: Rabenseifner (``lg p`` latencies);
- otherwise the ring (bandwidth-optimal, pipelined).

Reduce-scatter and allgather use the ring; broadcast and reduce the binomial tree.
"""

from __future__ import annotations

from ringpipe.comm.base import Communicator

__all__ = ["SMALL_BYTES", "MEDIUM_BYTES", "choose", "num_nodes"]

SMALL_BYTES = 64 * 1024
MEDIUM_BYTES = 512 * 1024

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
    if nbytes <= MEDIUM_BYTES and comm.size & (comm.size - 1) == 0:
        return "rabenseifner"
    return "ring"
