"""Who am I: rank, size, local rank and node from torchrun, Open MPI, MPICH/Intel MPI, Slurm or nothing.

Detection order (first complete set wins): explicit arguments > torchrun > Open MPI > MPICH / Intel
MPI / Cray PMI > Slurm > a single process. The result is an explicit :class:`Topology` object that is
passed around; nothing here is a module global.

A launcher sets all of its variables on every rank it starts, so a partial set (``RANK`` and
``WORLD_SIZE`` without ``LOCAL_RANK``, ``PMI_RANK`` alone) is an error naming the missing
variables, never a silent single process. Slurm needs care: a batch script (``sbatch`` without
``srun``) or an allocation shell also carries ``SLURM_PROCID=0`` and often ``SLURM_NTASKS``, yet
runs one copy; only the tasks of an ``srun`` job step (``SLURM_STEP_ID`` a number >= 0; the batch,
interactive and extern steps have none or a negative one) form a Slurm world.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ringpipe.slurm_lists import expand_nodelist, expand_tasks_per_node, slurm_port

__all__ = [
    "EnvironmentError_",
    "Topology",
    "detect",
    "expand_nodelist",
    "expand_tasks_per_node",
    "slurm_port",
]


class EnvironmentError_(RuntimeError):
    """The launch environment is inconsistent or incomplete."""


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    launcher: str = "single"
    master_addr: str | None = None
    master_port: int | None = None
    hostnames: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (self.size >= 1, f"size={self.size} must be >= 1"),
            (0 <= self.rank < self.size, f"rank={self.rank} must be in [0, size={self.size})"),
            (self.local_size >= 1, f"local_size={self.local_size} must be >= 1"),
            (
                0 <= self.local_rank < self.local_size,
                f"local_rank={self.local_rank} must be in [0, local_size={self.local_size})",
            ),
            (
                0 <= self.node_rank < self.num_nodes,
                f"node_rank={self.node_rank} must be in [0, num_nodes={self.num_nodes})",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise EnvironmentError_(f"inconsistent launch environment ({self.launcher}): {msg}")

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def with_hostnames(self, hostnames: Sequence[str]) -> Topology:
        """Fill in the hostnames of all ranks and derive node rank / count / local size from them.

        Nodes are numbered in order of their first rank, the convention of torchrun, mpirun and srun.
        """
        if len(hostnames) != self.size:
            raise ValueError(f"got {len(hostnames)} hostnames for {self.size} ranks")
        order: dict[str, int] = {}
        for host in hostnames:
            order.setdefault(host, len(order))
        me = hostnames[self.rank]
        same = [r for r, h in enumerate(hostnames) if h == me]
        return dataclasses.replace(
            self,
            hostnames=tuple(hostnames),
            node_rank=order[me],
            num_nodes=len(order),
            local_rank=same.index(self.rank),
            local_size=len(same),
        )

    def ranks_on_node(self, node_rank: int | None = None) -> list[int]:
        """Global ranks on a node (needs hostnames, i.e. an initialised job)."""
        if not self.hostnames:
            if self.size == 1:
                return [0]
            raise EnvironmentError_("node membership is known only after init (hostnames missing)")
        order: dict[str, int] = {}
        for host in self.hostnames:
            order.setdefault(host, len(order))
        node = self.node_rank if node_rank is None else node_rank
        return [r for r, h in enumerate(self.hostnames) if order[h] == node]

    def node_leaders(self) -> list[int]:
        """The lowest global rank of every node, in node order."""
        if not self.hostnames:
            return [0]
        first: dict[str, int] = {}
        for r, host in enumerate(self.hostnames):
            first.setdefault(host, r)
        return list(first.values())


#: Set to "1" by ``ringpipe launch --mode mp`` on its ranks, which otherwise read as torchrun's.
MP_MARKER = "RINGPIPE_LAUNCH_MP"


# ---------------------------------------------------------------------------------------------
# Detection


def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise EnvironmentError_(f"{launcher} launch detected but {name} is not set") from None
    except ValueError:
        raise EnvironmentError_(f"{name}={env[name]!r} is not an integer ({launcher} launch)") from None


def _first_int(env: Mapping[str, str], names: Sequence[str], default: int | None = None) -> int | None:
    for n in names:
        if n in env and env[n].strip().lstrip("-").isdigit():
            return int(env[n])
    return default


def _port(env: Mapping[str, str]) -> int | None:
    if "MASTER_PORT" not in env:
        return None
    try:
        return int(env["MASTER_PORT"])
    except ValueError:
        raise EnvironmentError_(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number") from None


def detect(
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    size: int | None = None,
    local_rank: int | None = None,
    local_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> Topology:
    """Read the launch environment into a :class:`Topology` (before any communication).

    Raises :class:`EnvironmentError_` naming the missing variables when a launcher's variables are
    only partly set and no other launcher's are complete.
    """
    env = dict(os.environ if environ is None else environ)

    if rank is not None or size is not None:
        if rank is None or size is None:
            raise EnvironmentError_("give both rank and size explicitly, or neither")
        return Topology(
            rank=rank,
            size=size,
            local_rank=rank if local_rank is None else local_rank,
            local_size=size if local_size is None else local_size,
            num_nodes=1,
            launcher="explicit",
            master_addr=master_addr or env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=master_port or _port(env),
        )

    addr = master_addr or env.get("MASTER_ADDR")
    port = master_port or _port(env)
    partial = {name: _missing(env, name) for name in _LAUNCHERS}

    if partial["torchrun"] == [] and not _copied_from_mpi(env, partial):
        n = "torchrun"
        size_ = _int(env, "WORLD_SIZE", n)
        lsize = _first_int(env, ["LOCAL_WORLD_SIZE"], None)
        grp = _first_int(env, ["GROUP_RANK"], 0) or 0
        lsize = lsize or size_
        nnodes = max(grp + 1, -(-size_ // lsize))
        return Topology(
            rank=_int(env, "RANK", n),
            size=size_,
            local_rank=_int(env, "LOCAL_RANK", n),
            local_size=lsize,
            node_rank=grp,
            num_nodes=nnodes,
            # ``ringpipe launch --mode mp`` sets torchrun's variables for its own processes
            launcher="ringpipe-mp" if env.get(MP_MARKER) == "1" else n,
            master_addr=addr,
            master_port=port,
        )

    if partial["openmpi"] == []:
        n = "openmpi"
        size_ = _int(env, "OMPI_COMM_WORLD_SIZE", n)
        lsize = _first_int(env, ["OMPI_COMM_WORLD_LOCAL_SIZE"], size_) or size_
        rank_ = _int(env, "OMPI_COMM_WORLD_RANK", n)
        return Topology(
            rank=rank_,
            size=size_,
            local_rank=_first_int(env, ["OMPI_COMM_WORLD_LOCAL_RANK"], 0) or 0,
            local_size=lsize,
            node_rank=_guess_node(rank_, size_, lsize),
            num_nodes=-(-size_ // lsize),
            launcher=n,
            master_addr=addr,
            master_port=port,
        )

    if partial["mpich"] == []:
        n = "mpich"
        size_ = _int(env, "PMI_SIZE", n)
        rank_ = _int(env, "PMI_RANK", n)
        lsize = _first_int(env, ["MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"], None)
        lrank = _first_int(env, ["MPI_LOCALRANKID", "PMI_LOCAL_RANK"], None)
        if lsize is None or lrank is None:
            # Hydra without Intel/Cray extensions: the real values come from hostnames at init.
            lsize, lrank = size_, rank_
        return Topology(
            rank=rank_,
            size=size_,
            local_rank=lrank,
            local_size=lsize,
            node_rank=_guess_node(rank_, size_, lsize),
            num_nodes=-(-size_ // lsize),
            launcher=n,
            master_addr=addr,
            master_port=port,
        )

    if partial["slurm"] == []:
        n = "slurm"
        size_ = _int(env, "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS", n)
        rank_ = _int(env, "SLURM_PROCID", n)
        nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
        node_id = _first_int(env, ["SLURM_NODEID"], 0) or 0
        tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        per_node = expand_tasks_per_node(tasks) if tasks else [size_]
        lsize = per_node[node_id] if node_id < len(per_node) else per_node[-1]
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not addr:
            if not nodes:
                raise EnvironmentError_(
                    "Slurm launch detected but SLURM_JOB_NODELIST is empty: set MASTER_ADDR"
                )
            addr = nodes[0]
        if port is None:
            if job is None:
                raise EnvironmentError_("Slurm launch detected but SLURM_JOB_ID is not set: set MASTER_PORT")
            port = slurm_port(job)
        return Topology(
            rank=rank_,
            size=size_,
            local_rank=_first_int(env, ["SLURM_LOCALID"], 0) or 0,
            local_size=lsize,
            node_rank=node_id,
            num_nodes=max(len(nodes), len(per_node), node_id + 1),
            launcher=n,
            master_addr=addr,
            master_port=port,
        )

    problems = [_partial_message(env, name, missing) for name, missing in partial.items() if missing]
    if problems:
        raise EnvironmentError_("incomplete launch environment:\n  " + "\n  ".join(problems))
    return Topology(launcher="single", master_addr=addr or "127.0.0.1", master_port=port)


def _copied_from_mpi(env: Mapping[str, str], partial: Mapping[str, list[str] | None]) -> bool:
    """Whether the torch variables are a copy of mpirun's (``ringpipe launch --backend mpi`` exports both).

    The launcher is then mpirun: ranks that agree with Open MPI's (or Hydra's) own variables were
    started by it, and its view (local ranks, rendezvous through MPI) is the one to keep.
    """
    pairs = (("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("mpich", "PMI_RANK", "PMI_SIZE"))
    for name, rank, size in pairs:
        if partial[name] == [] and env.get(rank, "").strip() == env.get("RANK", "").strip() \
                and env.get(size, "").strip() == env.get("WORLD_SIZE", "").strip():
            return True
    return False


#: Per launcher: the variables that show it started this process, the required ones (each entry a
#: tuple of alternatives, one of which must be set) and what sets them.
_LAUNCHERS: dict[str, tuple[tuple[str, ...], tuple[tuple[str, ...], ...], str]] = {
    "torchrun": (
        ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        (("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",)),
        "torchrun and ringpipe launch set RANK, WORLD_SIZE and LOCAL_RANK on every rank; set the missing "
        "ones (LOCAL_RANK=0 with one process per node) or unset the others to run a single process",
    ),
    "openmpi": (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"),
        (("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",)),
        "Open MPI's mpirun sets both on every rank; start under mpirun or unset the others",
    ),
    "mpich": (
        ("PMI_RANK", "PMI_SIZE"),
        (("PMI_RANK",), ("PMI_SIZE",)),
        "mpiexec of MPICH / Intel MPI (Hydra), Cray PMI and srun --mpi=pmi2 set both on every rank; "
        "start under one of them or unset the other",
    ),
    "slurm": (
        ("SLURM_STEP_ID", "SLURM_STEPID"),  # only in an srun job step: see _srun_step
        (("SLURM_PROCID",), ("SLURM_NTASKS", "SLURM_NPROCS")),
        "srun sets SLURM_PROCID and SLURM_NTASKS in every task of a job step; start under srun",
    ),
}


def _srun_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of an ``srun`` job step (not a batch script or allocation shell)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
    return step.isdigit()


def _missing(env: Mapping[str, str], launcher: str) -> list[str] | None:
    """None if none of ``launcher``'s variables is set, else its required variables that are missing."""
    markers, required, _ = _LAUNCHERS[launcher]
    if launcher == "slurm" and not _srun_step(env):
        return None
    if not any(m in env for m in markers):
        return None
    return [" or ".join(alts) for alts in required if not any(a in env for a in alts)]


def _partial_message(env: Mapping[str, str], launcher: str, missing: Sequence[str]) -> str:
    markers, required, setter = _LAUNCHERS[launcher]
    names = dict.fromkeys([*markers, *(a for alts in required for a in alts)])
    given = [f"{n}={env[n]}" for n in names if n in env]
    return (
        f"{launcher}: {', '.join(given)} {_verb(given)} set but {', '.join(missing)} {_verb(missing)} not "
        f"({setter})"
    )


def _verb(items: Sequence[str]) -> str:
    return "is" if len(items) == 1 else "are"


def _guess_node(rank: int, size: int, local_size: int) -> int:
    """Node index under block placement; replaced by the hostname-derived value at init."""
    return min(rank // max(local_size, 1), -(-size // max(local_size, 1)) - 1)


def hostname() -> str:
    return socket.gethostname()
