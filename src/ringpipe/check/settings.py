"""DistributedOptimizer settings: validated, and compared with every other rank's at construction.

Why: buckets are laid out from the parameters and the settings (bucket sizes, compression,
algorithm, ...) on each rank alone. If two ranks differ, their buckets differ in length or
wire dtype and the first reduction hangs or mixes unrelated gradients. One gather at
construction compares everything and lets every rank raise the same error, naming the setting
or parameter and each rank's value. A setting that is invalid on one rank only is reported as a
difference too, so that no rank raises alone while the others wait in the gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringpipe.check.announcement import announce
from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.core.compression import Compressor
from ringpipe.core.engine import Engine

__all__ = ["agree", "comparable", "layout_of", "validate"]

Layout = list[tuple[str, tuple[int, ...], str]]


def comparable(name: str, value: Any) -> Any:
    """A picklable value of a setting that compares equal when two ranks mean the same setting."""
    if name == "compression":
        if value is None:
            return "none"
        return value.name if isinstance(value, Compressor) else str(value).lower()
    if name == "op":
        return value.value if isinstance(value, ReduceOp) else str(value).lower()
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return repr(value)


def _differences(every: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    for name in every[0]:
        values = [s.get(name) for s in every]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            out.append(f"{name} differs across ranks ({per_rank})")
    return out


def agree(
    comm: Communicator,
    settings: dict[str, Any],
    layout: Callable[[], Layout],
    problem: Exception | None,
) -> None:
    """Compare ``settings`` and the parameter ``layout`` over ranks; raise on every rank if they differ.

    ``problem`` is this rank's error in validating its own settings: it is raised (on every rank,
    since the settings are then equal everywhere) only once the settings were found equal.
    """
    try:
        mine: Layout | str = layout()
    except ValueError as exc:
        mine = str(exc)

    def gather() -> list[Any]:
        announce(comm, "allgather_object")
        return comm.allgather_object((settings, mine))

    every = Engine.of(comm).run(gather, name="check-parameters")
    differences = _differences([s for s, _ in every])
    if differences:
        raise ValueError(
            "DistributedOptimizer settings must be equal on every rank: " + "; ".join(differences)
            + "; pass the same arguments on every rank"
        )
    if problem is not None:
        raise problem
    failed = [(r, m) for r, (_, m) in enumerate(every) if isinstance(m, str)]
    if failed:
        rank, message = failed[0]
        raise ValueError(message if rank == comm.rank else f"rank {rank}: {message}")
    _compare_layouts([m for _, m in every])


def _compare_layouts(every: Sequence[Layout]) -> None:
    ref = every[0]
    for rank, theirs in enumerate(every):
        if theirs == ref:
            continue
        if len(theirs) != len(ref):
            raise ValueError(
                f"rank {rank} has {len(theirs)} parameters to reduce but rank 0 has {len(ref)}: every rank "
                "must build the same model and optimizer before DistributedOptimizer"
            )
        for a, b in zip(ref, theirs, strict=True):
            if a != b:
                raise ValueError(
                    f"parameter mismatch across ranks: rank 0 has {a[0]!r} {a[1]} {a[2]} where rank {rank} "
                    f"has {b[0]!r} {b[1]} {b[2]}; every rank must build the same model in the same order"
                )


def layout_of(named: Sequence[tuple[str, torch.Tensor]]) -> Layout:
    """Name, shape and dtype of every parameter to reduce, in order."""
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in named]


def validate(
    op: ReduceOp | str,
    gradient_predivide_factor: float,
    backward_passes_per_step: int,
    bucket_bytes: int,
    first_bucket_bytes: int,
) -> ReduceOp:
    """Check the settings that need no communicator; return the reduce op."""
    rop = ReduceOp.parse(op)
    if rop not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
        raise ValueError(f"DistributedOptimizer supports op Average or Sum for gradients (or Adasum), got {rop.value}")
    if gradient_predivide_factor != 1.0 and rop is not ReduceOp.AVERAGE:
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor} only applies with op=Average "
            f"(got op={rop.value}); use op=Average or leave gradient_predivide_factor at 1.0"
        )
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
    if bucket_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError(f"bucket sizes must be > 0, got bucket_bytes={bucket_bytes}, "
                         f"first_bucket_bytes={first_bucket_bytes}")
    return rop
