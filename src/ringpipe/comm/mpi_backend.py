"""Communicator over MPI through mpi4py: CPU tensors are passed as buffers without copies.

Every dtype of :data:`DTYPES` works with every operation. float16 and bfloat16 have no MPI
datatype: they travel as raw 16-bit words (bool as bytes) wherever data only moves, and are
reduced in a float32 copy cast back afterwards; bool is reduced in an int32 copy (sum and max
are a logical or, min and product a logical and, average is true where every rank is true),
so that no count of ranks can wrap it. With a CUDA-aware
MPI (Open MPI built with CUDA, ``MPIX_Query_cuda_support``), CUDA tensors are passed directly
after a stream synchronisation; otherwise CUDA tensors are refused with an explanation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringpipe.comm.base import CommError, Communicator, ReduceOp, Work
from ringpipe.comm.events import EventLog
from ringpipe.env import Topology

__all__ = ["MPICommunicator", "mpi_available", "cuda_aware_mpi", "DTYPES"]

#: Every dtype the MPI communicator serves in every operation.
DTYPES = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
)  # fmt: skip

try:  # mpi4py is an optional extra (pip install ringpipe[mpi])
    from mpi4py import MPI
except ImportError:  # pragma: no cover - exercised only where mpi4py is absent
    MPI = None  # type: ignore[assignment]


def mpi_available() -> bool:
    return MPI is not None


def cuda_aware_mpi() -> bool:
    if MPI is None:
        return False
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query else False
    except Exception:  # noqa: BLE001 - some MPIs raise for unknown extensions
        return False


#: The widening copy a reduction of a dtype MPI cannot reduce runs in.
_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.int32}


def _mpi_op(op: ReduceOp) -> Any:
    ops = {
        ReduceOp.SUM: MPI.SUM,
        ReduceOp.AVERAGE: MPI.SUM,
        ReduceOp.MIN: MPI.MIN,
        ReduceOp.MAX: MPI.MAX,
        ReduceOp.PRODUCT: MPI.PROD,
    }
    if op not in ops:
        raise CommError(f"the mpi backend has no native {op.value} reduction; use "
                        f"ringpipe.collectives.allreduce(comm, tensor, op={op.value!r}) for it")
    return ops[op]


class MPICommunicator(Communicator):
    """An ``MPI.Comm`` seen through the ringpipe protocol."""

    backend = "mpi"

    def __init__(
        self,
        mpi_comm: Any,
        topology: Topology,
        global_ranks: Sequence[int] | None = None,
        name: str = "world",
        log: EventLog | None = None,
    ) -> None:
        if MPI is None:
            raise CommError("the mpi backend needs mpi4py: pip install 'ringpipe[mpi]' (or pip install mpi4py)")
        ranks = list(global_ranks) if global_ranks is not None else list(range(mpi_comm.Get_size()))
        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size(), topology, ranks, name, log)
        self.mpi = mpi_comm
        self._cuda_aware = cuda_aware_mpi()

    # ------------------------------------------------------------------ buffers

    def _check_device(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.device.type == "cpu":
            return
        if tensor.device.type == "cuda" and self._cuda_aware:
            return
        raise CommError(
            f"{what}: the mpi backend needs CPU tensors here (this MPI is not CUDA-aware), got one on "
            f"{tensor.device}; move it with .cpu() or use the nccl backend"
        )

    def _buf(self, tensor: torch.Tensor) -> Any:
        """A writable buffer over the tensor's memory (no copy)."""
        if tensor.device.type == "cuda":
            torch.cuda.current_stream(tensor.device).synchronize()
            return tensor  # CUDA-aware MPI reads __cuda_array_interface__
        t = tensor
        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.view(torch.int16)
        elif t.dtype == torch.bool:
            t = t.view(torch.uint8)
        if t.numel() == 0:
            return t.numpy()
        return t.numpy()

    # ------------------------------------------------------------------ p2p

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.mpi.Send(self._buf(tensor), dest=dst, tag=tag)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        self.mpi.Recv(self._buf(tensor), source=src, tag=tag)

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        req = self.mpi.Isend(self._buf(tensor), dest=dst, tag=tag)
        return Work(req.Wait, req.Test, result=tensor)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        req = self.mpi.Irecv(self._buf(tensor), source=src, tag=tag)
        return Work(req.Wait, req.Test, result=tensor)

    # ------------------------------------------------------------------ collectives

    def _average(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        if op is ReduceOp.AVERAGE:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(self.size)
            else:
                tensor.copy_(torch.div(tensor, self.size, rounding_mode="floor"))

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        wide = _WIDE.get(tensor.dtype)
        if wide is not None:
            tmp = tensor.to(wide)
            self.mpi.Allreduce(MPI.IN_PLACE, self._buf(tmp), op=_mpi_op(op))
            self._average(tmp, op)
            tensor.copy_(tmp.to(tensor.dtype))
            return
        self.mpi.Allreduce(MPI.IN_PLACE, self._buf(tensor), op=_mpi_op(op))
        self._average(tensor, op)

    def _iallreduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        wide = _WIDE.get(tensor.dtype)
        if wide is not None:
            tmp = tensor.to(wide)
            req = self.mpi.Iallreduce(MPI.IN_PLACE, self._buf(tmp), op=_mpi_op(op))

            def post() -> None:
                self._average(tmp, op)
                tensor.copy_(tmp.to(tensor.dtype))

            return Work(req.Wait, req.Test, result=tensor, post=post)
        req = self.mpi.Iallreduce(MPI.IN_PLACE, self._buf(tensor), op=_mpi_op(op))
        return Work(req.Wait, req.Test, result=tensor, post=lambda: self._average(tensor, op))

    def _allgather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = torch.empty((self.size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        self.mpi.Allgather(self._buf(tensor.contiguous()), self._buf(out))
        return list(out.unbind(0))

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self.mpi.Bcast(self._buf(tensor), root=root)

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
        wide = _WIDE.get(tensor.dtype)
        target = tensor.to(wide) if wide is not None else tensor
        if self.rank == root:
            self.mpi.Reduce(MPI.IN_PLACE, self._buf(target), op=_mpi_op(op), root=root)
            self._average(target, op)
            if target is not tensor:
                tensor.copy_(target.to(tensor.dtype))
        else:
            self.mpi.Reduce(self._buf(target), None, op=_mpi_op(op), root=root)

    def _reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        wide = _WIDE.get(tensor.dtype)
        src = tensor.to(wide) if wide is not None else tensor
        out = torch.empty_like(src.chunk(self.size, dim=0)[0])
        self.mpi.Reduce_scatter_block(self._buf(src), self._buf(out), op=_mpi_op(op))
        self._average(out, op)
        return out.to(tensor.dtype) if wide is not None else out

    def _alltoall(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        send = torch.stack([t.contiguous() for t in tensors])
        recv = torch.empty_like(send)
        self.mpi.Alltoall(self._buf(send), self._buf(recv))
        return list(recv.unbind(0))

    def _barrier(self) -> None:
        self.mpi.Barrier()

    def _broadcast_object(self, obj: Any, root: int) -> Any:
        return self.mpi.bcast(obj, root=root)

    def _allgather_object(self, obj: Any) -> list[Any]:
        return list(self.mpi.allgather(obj))

    # ------------------------------------------------------------------ groups

    def _split(self, ranks: list[int], name: str) -> Communicator | None:
        color = 0 if self.rank in ranks else MPI.UNDEFINED
        key = ranks.index(self.rank) if self.rank in ranks else 0
        sub = self.mpi.Split(color, key)
        if sub == MPI.COMM_NULL:
            return None
        return MPICommunicator(sub, self.topology, [self.global_ranks[r] for r in ranks], name, self.log)
