"""The ``auto`` algorithm: pick one from measurements, message size, world size and topology.

Measured first: when :func:`ringpipe.collectives.autotune.probe` (``ringpipe bench`` runs it)
or :func:`~ringpipe.collectives.autotune.load` has a table for this backend, world size and set
of hosts, ``auto`` takes the choice of the nearest measured size: the backend's own allreduce
(``native``) unless one of ringpipe's algorithms took at most 0.9x native's time in the median
of the probe's paired rounds and was faster in at least two thirds of them
(:func:`~ringpipe.collectives.autotune.decide`). A call that resolves to ``native`` runs exactly
as ``algorithm="native"`` does, so ``auto`` costs no more than native where native won.

Without a table, rules drawn from the ``ringpipe bench`` / ``benchmarks/collectives.py`` runs
recorded in ``benchmarks/RESULTS.md`` (gloo and Open MPI over loopback on a 2-core host, 2 and 4
ranks, 4 KiB to 64 MiB by factors of 4):

- more than one node and more than one rank on some node: hierarchical;
- MPI: the native ``MPI_Allreduce`` below :data:`RING_BYTES` (Open MPI's shared-memory
  collective was 2-10x faster than any algorithm over point-to-point messages there), the
  ring from it;
- other backends (gloo): recursive doubling up to :data:`RD_BYTES` = 256 KiB (fewest latencies,
  the consistency header rides in the data message). The interleaved quiet runs on 2 ranks (the
  table opening the collectives section of RESULTS.md and the one before the probe's paired
  rule) put it at 1.3-2.9x gloo's allreduce at 4-256 KiB: 2.41x, 1.78x, 1.34x, 1.46x at 4, 16,
  64, 256 KiB (9 rounds, load 1.5-2.4), 1.28x, 2.87x, 2.49x, 2.06x (7 rounds, load 0.2-1.9;
  paired per-round medians 1.32x, 2.18x, 2.26x, 2.12x; 693 against 1722 us at 64 KiB, 883
  against 1820 us at 256 KiB); on 4 ranks it was level with or above gloo's at 4-256 KiB in every record
  (busbw 1.33x, 1.20x, 0.98x, 1.23x in the quiet sequential re-run, 1.03-2.5x in the first
  table, 2.3-4.3x interleaved under load). At 1 MiB gloo's own was ahead or level (best own
  0.83x; recursive doubling 1.14x on medians but 0.83x paired) and 2.3-2.6x ahead of recursive
  doubling on 4 ranks (sequential tables). The ring
  from :data:`RING_BYTES` (1.05-1.07x gloo's at 64 MiB after the chunking change, 1.03x paired
  in the 7-round run), and gloo's own allreduce in between, where it was faster (the ring 0.79x
  at 4 MiB, 0.86x at 16 MiB).

Rabenseifner is never picked by the rules (never faster than both recursive doubling and the
ring over gloo); a probe picks it where it measures fastest. Reduce-scatter and allgather use
the ring; broadcast and reduce the binomial tree.
"""

from __future__ import annotations

import contextlib

from ringpipe.collectives import autotune
from ringpipe.comm.base import Communicator

__all__ = ["RD_BYTES", "RING_BYTES", "SMALL_BYTES", "choose", "num_nodes"]

#: Up to this size hierarchical's leaders use recursive doubling (the ring above).
SMALL_BYTES = 256 * 1024
#: Up to this size gloo (and any backend but MPI) runs recursive doubling without a table.
RD_BYTES = 256 * 1024
#: From this size the ring, without a table.
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
    # auto resolves on every call: its answers are kept on the communicator until the tables change
    gen = autotune.generation()
    memo: tuple[int, dict[int, str]] | None = getattr(comm, "_auto_choices", None)
    if memo is None or memo[0] != gen:
        memo = (gen, {})
        with contextlib.suppress(AttributeError):
            comm._auto_choices = memo  # type: ignore[attr-defined]
    chosen = memo[1].get(nbytes)
    if chosen is None:
        table = autotune.lookup(comm)
        chosen = table.choose(nbytes) if table is not None and table.rows else _rules(nbytes, comm)
        if len(memo[1]) < 4096:
            memo[1][nbytes] = chosen
    return chosen


def _rules(nbytes: int, comm: Communicator) -> str:
    """``auto``'s recorded rules, for a communicator without a probe table."""
    nodes = num_nodes(comm)
    if 1 < nodes < comm.size:
        return "hierarchical"
    if getattr(comm, "backend", "") == "mpi":
        return "native" if nbytes < RING_BYTES else "ring"
    if nbytes <= RD_BYTES:
        return "recursive_doubling"
    return "ring" if nbytes >= RING_BYTES else "native"
