"""Horovod's process sets: subsets of the world's ranks that run collectives among themselves.

A registered set owns a sub-communicator of the world (:meth:`Communicator.split`, collective on
every rank, so every rank must register the same sets in the same order) and that
communicator's engine. Ids are handed out in registration order, so the same set has the same
id on every rank; id 0 is :data:`global_process_set`, every rank. As in Horovod, ranks passed
to a collective on a set (``root_rank``) are world ranks, a rank outside the set that calls a
collective on it gets ``HorovodInternalError("...: Rank R is not a member of the provided
process set.")``, and a removed set can no longer be used.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

from ringpipe.comm.base import Communicator
from ringpipe.core.engine import Engine
from ringpipe.core.errors import HorovodInternalError
from ringpipe.core.world import World, current

__all__ = [
    "NotAMemberError",
    "DuplicateProcessSetError",
    "adopt",
    "HorovodBasics",
    "basics",
    "registered",
    "ProcessSet",
    "add_process_set",
    "global_process_set",
    "register_initial",
    "remove_process_set",
    "resolve",
    "set_root",
]

_NOT_RANKS_OR_COMM = "ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object"


class ProcessSet:
    """A set of world ranks (or an mpi4py communicator) that runs collectives together.

    Create it with a list of ranks, then pass it to ``init(process_sets=[...])`` or
    :func:`add_process_set`; it is usable once ``process_set_id`` is set.
    """

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.comm: Communicator | None = None
        if isinstance(ranks_or_comm, Iterable) and not isinstance(ranks_or_comm, (str, bytes)):
            ranks = sorted(ranks_or_comm)
            if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
                raise ValueError(_NOT_RANKS_OR_COMM)
            self.ranks = ranks
            return
        try:
            from mpi4py import MPI
        except ImportError:
            raise ValueError(_NOT_RANKS_OR_COMM) from None
        if not isinstance(ranks_or_comm, MPI.Comm):
            raise ValueError(_NOT_RANKS_OR_COMM)
        self.mpi_comm = ranks_or_comm

    def size(self) -> int | None:
        """The number of ranks in the set, or None if it is not registered."""
        if self.process_set_id is None or self.ranks is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank inside the set, or None if it is not registered.

        Collectives on a set still take world ranks (``root_rank``), as in Horovod.
        """
        if self.process_set_id is None or self.ranks is None:
            return None
        me = current().comm.rank
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process belongs to the set, or None if its ranks are not known yet."""
        if self.ranks is None:
            return None
        return current().comm.rank in self.ranks

    def _close(self) -> None:
        if self.comm is not None and self.process_set_id:
            Engine.of(self.comm).shutdown()
        self.comm = None

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _world_ranks_of(world: World, mpi_comm: Any) -> list[int]:
    """The world ranks of an mpi4py communicator's members (this rank's view).

    The world is ringpipe's: ``MPI.COMM_WORLD``, or the communicator given to ``init(comm=...)``.
    """
    from mpi4py import MPI

    members = list(range(mpi_comm.Get_size()))
    base = getattr(world.comm, "mpi", None) or MPI.COMM_WORLD
    ranks = MPI.Group.Translate_ranks(mpi_comm.Get_group(), members, base.Get_group())
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError("a process set's MPI communicator has members outside the communicator ringpipe was "
                         "initialised with")
    return sorted(int(r) for r in ranks)


def _register(world: World, ps: ProcessSet) -> ProcessSet:
    assert ps.ranks is not None
    size = world.comm.size
    if not ps.ranks or len(set(ps.ranks)) != len(ps.ranks) or not all(0 <= r < size for r in ps.ranks):
        raise ValueError(f"process set ranks {ps.ranks} must be distinct ranks in [0, {size}) (hvd.size() is {size})")
    if _registered_id(world, ps.ranks) is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    set_id = world.next_set_id
    ps.comm = world.engine.run(lambda: world.comm.split(ps.ranks or [], name=f"process_set{set_id}"),
                               name="add_process_set")
    world.next_set_id += 1
    ps.process_set_id = set_id
    world.sets[set_id] = ps
    return ps


class DuplicateProcessSetError(ValueError):
    """``init(process_sets=...)`` listed a set twice (or all ranks): refused, the world stays initialised, as in Horovod."""


def register_initial(world: World, process_sets: Sequence[ProcessSet] | str | None) -> None:
    """Register the global set and those given to ``init(process_sets=...)`` ("dynamic": none yet).

    As Horovod's ``init``: every distinct rank list is registered (in the same order on every
    rank; an mpi4py communicator stands for each rank's own members, so the distinct member lists
    of all ranks are registered), then each entry is given the id of the set with its ranks
    (:func:`adopt`). An entry whose set came earlier in the list, or that names all ranks (the
    global set), is refused with :class:`DuplicateProcessSetError` after the rest are registered.
    """
    global_process_set.ranks = list(range(world.comm.size))
    global_process_set.comm = world.comm
    world.sets[0] = global_process_set
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', got {process_sets!r}")
        world.dynamic_sets = True
        return
    entries = _entries(process_sets)
    for ps in entries:
        if ps.ranks is None and ps.mpi_comm is not None:
            # every rank names its own communicator's members; register each distinct set once
            mine = _world_ranks_of(world, ps.mpi_comm)
            every = world.engine.run(functools.partial(world.comm.allgather_object, mine), name="process_sets")
            for ranks in dict.fromkeys(tuple(r) for r in every):
                if _registered_id(world, list(ranks)) is None:
                    holder = ps if list(ranks) == mine else ProcessSet(list(ranks))
                    holder.ranks = list(ranks)
                    _register(world, holder)
        elif ps.ranks is not None and _registered_id(world, ps.ranks) is None:
            _register(world, ps)
    adopt(world, entries)


def _entries(process_sets: Sequence[ProcessSet] | None) -> list[ProcessSet]:
    entries = list(process_sets or [])
    for ps in entries:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"process_sets must hold ProcessSet objects, got {type(ps).__name__}")
    return entries


def _registered_id(world: World, ranks: list[int]) -> int | None:
    return next((set_id for set_id, o in world.sets.items() if o.ranks == ranks), None)


def adopt(world: World, process_sets: Sequence[ProcessSet] | None) -> None:
    """Give each listed set the id, ranks and communicator of the registered set with its ranks (Horovod's
    ``_init_process_sets``, run by every ``init``): no collective, so also on a repeated ``init``.

    A set whose id came earlier in the list (the global set's, id 0, counts as listed) is
    invalidated and refused with :class:`DuplicateProcessSetError`, as Horovod refuses it; a set
    that was never registered (only the first ``init`` registers sets) is a ``ValueError``.
    """
    seen, duplicate = {0}, None
    for index, ps in enumerate(_entries(process_sets)):
        ranks = _world_ranks_of(world, ps.mpi_comm) if ps.ranks is None and ps.mpi_comm is not None else ps.ranks
        set_id = _registered_id(world, list(ranks or []))
        if set_id is None:
            raise ValueError(f"process_sets entry number {index} ({ps}) is not a registered process set: the first "
                             "init() registers the sets it is given; add others with add_process_set() after "
                             "init(process_sets='dynamic')")
        holder = world.sets[set_id]
        if holder is not ps:
            ps.process_set_id, ps.ranks, ps.comm = set_id, list(holder.ranks or []), holder.comm
        if set_id in seen:
            ps._invalidate()  # Horovod: a second object with the ranks of a listed set is not valid
            duplicate = duplicate or (index, ps)
        else:
            seen.add(set_id)
    if duplicate is not None:
        index, ps = duplicate
        raise DuplicateProcessSetError(
            f"Horovod could not be initialized because process_sets entry number {index} is a duplicate: {ps} "
            "(every rank list may appear once, and not as all ranks, which is hvd.global_process_set)")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set after ``init`` and return it (collective: every rank calls it alike).

    Needs ``init(process_sets="dynamic")`` or ``HOROVOD_DYNAMIC_PROCESS_SETS=1``, as in Horovod.
    """
    world = current()
    if not world.dynamic_sets:
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after Horovod initialization.")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None and ps.mpi_comm is not None:
        raise NotImplementedError(
            "Dynamically adding process sets defined by an MPI communicator is not implemented. "
            "Please build the process set via a list of ranks."
        )
    return _register(world, ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collective); returns whether it was removed. The global set stays."""
    world = current()
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or world.sets.get(set_id) is not process_set:
        return False
    if not world.dynamic_sets:
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after Horovod initialization.")
    ids = world.engine.run(lambda: world.comm.allgather_object(set_id), name="remove_process_set")
    if len(set(ids)) != 1:
        raise ValueError(
            f"remove_process_set: ranks removed different process sets (ids by rank: {ids}); every rank must "
            "remove the same set in the same order"
        )
    process_set._close()
    del world.sets[set_id]
    process_set._invalidate()
    return True


class NotAMemberError(HorovodInternalError):
    """A collective on a process set this rank is not a member of (Horovod's ``InvalidArgument`` status).

    A ``HorovodInternalError`` on the torch face, as Horovod's torch ops raise it; the TensorFlow
    face raises it as ``tf.errors.InvalidArgumentError``, as Horovod's TensorFlow ops do.
    """


def registered(process_set: ProcessSet | None, what: str) -> ProcessSet:
    """``process_set`` (the global set for None) if it is registered now; else the ``ValueError`` of an unknown set."""
    ps = global_process_set if process_set is None else process_set
    if not isinstance(ps, ProcessSet):
        raise TypeError(f"{what}: process_set must be a ProcessSet, got {type(ps).__name__}")
    holder = None if ps.process_set_id is None else current().sets.get(ps.process_set_id)
    # the registered object, or one given the same set by a later init() (adopt)
    if holder is None or (holder is not ps and (holder.ranks != ps.ranks or holder.comm is not ps.comm)):
        raise ValueError(
            f"{what}: the process set {ps} does not exist or has not been registered (removed, or never passed to "
            "init(process_sets=...) or add_process_set)"
        )
    return ps


def resolve(process_set: ProcessSet | None, what: str) -> tuple[Communicator, list[int]]:
    """The communicator a collective ``what`` on ``process_set`` runs on (this rank must be a member),
    and the set's world ranks."""
    ps = registered(process_set, what)
    world = current()
    if ps.comm is None:
        raise NotAMemberError(f"{what}: Rank {world.comm.rank} is not a member of the provided process set.")
    assert ps.ranks is not None
    return ps.comm, ps.ranks


def set_root(ranks: list[int], root_rank: int, what: str) -> tuple[int, ValueError | None]:
    """The rank inside a set of the world rank ``root_rank``, or (0, the error naming the set) if absent.

    The error is returned, not raised, so that the caller announces its call as invalid and every
    rank raises it (a rank raising alone would leave the others waiting).
    """
    if isinstance(root_rank, int) and not isinstance(root_rank, bool) and root_rank in ranks:
        return ranks.index(root_rank), None
    return 0, ValueError(f"{what}: root_rank {root_rank!r} is not a rank of the process set (world ranks {ranks})")


class HorovodBasics:
    """The part of Horovod's internal ``mpi_ops._basics`` object that Horovod's own process-set tests read."""

    @staticmethod
    def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
        """``{process_set_id: the set's world ranks}`` for every registered set, the global set (0) included."""
        return {set_id: list(ps.ranks or []) for set_id, ps in sorted(current().sets.items())}


#: what ``horovod.torch.mpi_ops._basics`` / ``horovod.tensorflow.mpi_ops._basics`` are to Horovod's tests
basics = HorovodBasics()
