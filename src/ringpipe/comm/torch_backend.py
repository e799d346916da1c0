"""Communicator over torch c10d process groups: gloo for CPU tensors, NCCL for CUDA tensors.

Under the ``nccl`` backend the world is c10d's two-backend group (``cpu:gloo,cuda:nccl``): CUDA
tensors travel over NCCL and CPU tensors over gloo, as Horovod moves a CPU tensor through its
CPU operations (MPI or gloo) in a job whose GPU operations are NCCL's.

Every dtype of :data:`DTYPES` works with every operation, whatever the process group takes
itself. gloo has no int16 and NCCL neither int16 nor bool, so a dtype outside
:data:`_C10D_MOVES` travels as its bytes (a ``uint8`` view of the same memory: the bits arrive
unchanged) through sends, receives, broadcasts, gathers and all-to-all, and a dtype outside
:data:`_C10D_REDUCES` is reduced in a widening copy (:data:`_WIDEN`) cast back afterwards:
int16 through int32 (sums and products wrap modulo 2^16 exactly as int16 arithmetic does),
bool through int32 (sum and max are a logical or, min and product a logical and, average is
true where every rank is true).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringpipe.comm.base import CommError, Communicator, ReduceOp, Work
from ringpipe.comm.events import EventLog
from ringpipe.env import Topology

__all__ = ["TorchCommunicator", "DTYPES"]

#: Every dtype the torch communicator serves in every operation.
DTYPES = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
)  # fmt: skip
#: What gloo and NCCL reduce themselves.
_C10D_REDUCES = frozenset((torch.uint8, torch.int8, torch.int32, torch.int64,
                           torch.float16, torch.bfloat16, torch.float32, torch.float64))
#: What they move themselves (anything else travels as bytes).
_C10D_MOVES = _C10D_REDUCES
#: The widening copy a reduction of another dtype runs in.
_WIDEN = {torch.int16: torch.int32, torch.bool: torch.int32}

_NATIVE_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


class TorchCommunicator(Communicator):
    """A c10d process group seen through the ringpipe protocol.

    Sub-communicators are new c10d groups. c10d requires every rank of the default group to
    take part in creating a group, so :meth:`split` on a torch communicator must be called by
    all world ranks (the usual torch rule); ranks outside the parent simply pass through.
    """

    def __init__(
        self,
        backend: str,
        topology: Topology,
        group: Any = None,
        global_ranks: Sequence[int] | None = None,
        name: str = "world",
        log: EventLog | None = None,
        device: torch.device | None = None,
    ) -> None:
        ranks = list(global_ranks) if global_ranks is not None else list(range(dist.get_world_size()))
        super().__init__(
            rank=dist.get_rank(group) if group is not None else dist.get_rank(),
            size=len(ranks),
            topology=topology,
            global_ranks=ranks,
            name=name,
            log=log,
        )
        self.backend = backend
        self.group = group
        self.device = device or torch.device("cpu")

    # ------------------------------------------------------------------ checks

    def _check_device(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.device.type not in ("cpu", "cuda"):
            raise CommError(
                f"{what}: the {self.backend} backend cannot send tensors on {tensor.device}; "
                "move it to the CPU or a CUDA device"
            )

    def _on_gloo(self, tensor: torch.Tensor) -> bool:
        """Whether gloo carries ``tensor``: always under gloo; CPU tensors under NCCL (as Horovod)."""
        return self.backend == "gloo" or tensor.device.type != "cuda"

    def _object_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _g(self, rank: int) -> int:
        return self.global_ranks[rank]

    # ------------------------------------------------------------------ dtypes

    @staticmethod
    def _wire(tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the process group can move it: itself, or a uint8 view of its bytes."""
        if tensor.dtype in _C10D_MOVES:
            return tensor
        return tensor.reshape(-1).view(torch.uint8)

    def _widened(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """``tensor`` itself when the process group reduces its dtype, else a widening copy."""
        if tensor.dtype in _C10D_REDUCES:
            return tensor
        wide = _WIDEN.get(tensor.dtype)
        if wide is None:
            valid = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
            raise CommError(
                f"{what}: the {self.backend} backend cannot reduce {tensor.dtype} tensors (it reduces {valid}); "
                "convert the tensor to one of these dtypes"
            )
        return tensor.to(wide)

    # ------------------------------------------------------------------ p2p

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        dist.send(self._wire(tensor), self._g(dst), group=self.group, tag=tag)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        dist.recv(self._wire(tensor), self._g(src), group=self.group, tag=tag)

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        w = dist.isend(self._wire(tensor), self._g(dst), group=self.group, tag=tag)
        assert w is not None
        return Work(w.wait, w.is_completed, result=tensor)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        w = dist.irecv(self._wire(tensor), self._g(src), group=self.group, tag=tag)
        assert w is not None
        return Work(w.wait, w.is_completed, result=tensor)

    # ------------------------------------------------------------------ collectives

    def _native(self, tensor: torch.Tensor, op: ReduceOp) -> tuple[Any, bool]:
        """The c10d op and whether the result must be divided by size afterwards.

        NCCL averages floating-point tensors itself; integers are summed and floored here on
        every backend, so that an integer average means the same everywhere.
        """
        if op is ReduceOp.AVERAGE:
            if not self._on_gloo(tensor) and tensor.is_floating_point():
                return dist.ReduceOp.AVG, False
            return dist.ReduceOp.SUM, True
        native = _NATIVE_OPS.get(op)
        if native is None:
            raise CommError(
                f"the {self.backend} backend has no native {op.value} reduction; use "
                f"ringpipe.collectives.allreduce(comm, tensor, op={op.value!r}) for it"
            )
        return native, False

    def _finish_average(self, tensor: torch.Tensor, divide: bool) -> None:
        if divide:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(self.size)
            else:
                tensor.copy_(torch.div(tensor, self.size, rounding_mode="floor"))

    @staticmethod
    def _narrow(tensor: torch.Tensor, work: torch.Tensor) -> None:
        """Cast a widening copy's result back into ``tensor`` (nothing to do without one)."""
        if work is not tensor:
            tensor.copy_(work)

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        work = self._widened(tensor, "allreduce")
        native, divide = self._native(work, op)
        dist.all_reduce(work, op=native, group=self.group)
        self._finish_average(work, divide)
        self._narrow(tensor, work)

    def _iallreduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        work = self._widened(tensor, "allreduce")
        native, divide = self._native(work, op)
        w = dist.all_reduce(work, op=native, group=self.group, async_op=True)
        assert w is not None

        def post() -> None:
            self._finish_average(work, divide)
            self._narrow(tensor, work)

        return Work(w.wait, w.is_completed, result=tensor, post=post)

    def _allgather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        wire = self._wire(tensor)
        out = [torch.empty_like(wire) for _ in range(self.size)]
        dist.all_gather(out, wire, group=self.group)
        if wire is tensor:
            return out
        return [o.view(tensor.dtype).reshape(tensor.shape) for o in out]

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        dist.broadcast(self._wire(tensor), self._g(root), group=self.group)

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
        work = self._widened(tensor, "reduce")
        native, divide = self._native(work, op)
        dist.reduce(work, self._g(root), op=native, group=self.group)
        if self.rank == root:
            self._finish_average(work, divide)
            self._narrow(tensor, work)

    def _reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        work = self._widened(tensor, "reduce_scatter")
        native, divide = self._native(work, op)
        if self._on_gloo(work):
            # gloo has no reduce_scatter: allreduce a copy and keep this rank's block.
            if work is tensor:
                work = tensor.clone()
            dist.all_reduce(work, op=native, group=self.group)
            out = work.chunk(self.size, dim=0)[self.rank].clone()
        else:
            chunks = [c.contiguous() for c in work.chunk(self.size, dim=0)]
            out = torch.empty_like(chunks[0])
            dist.reduce_scatter(out, chunks, op=native, group=self.group)
        self._finish_average(out, divide)
        return out.to(tensor.dtype) if out.dtype != tensor.dtype else out

    def _alltoall(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for t in tensors]
        if any(self._on_gloo(t) for t in tensors):
            # gloo's all_to_all is not implemented for lists: post every pair as p2p messages.
            works = []
            for peer in range(self.size):
                if peer == self.rank:
                    out[peer].copy_(tensors[peer])
                    continue
                works.append(dist.isend(self._wire(tensors[peer]), self._g(peer), group=self.group, tag=7))
                works.append(dist.irecv(self._wire(out[peer]), self._g(peer), group=self.group, tag=7))
            for w in works:
                assert w is not None
                w.wait()
        else:
            dist.all_to_all([self._wire(o) for o in out], [self._wire(t) for t in tensors], group=self.group)
        return out

    def _barrier(self) -> None:
        if self.backend == "nccl":
            dist.barrier(group=self.group, device_ids=[self.device.index or 0])
        else:
            dist.barrier(group=self.group)

    # ------------------------------------------------------------------ groups

    def _split(self, ranks: list[int], name: str) -> Communicator | None:
        global_members = [self._g(r) for r in ranks]
        group = dist.new_group(global_members)
        if self.rank not in ranks:
            return None
        comm = TorchCommunicator(
            self.backend,
            self.topology,
            group=group,
            global_ranks=global_members,
            name=name,
            log=self.log,
            device=self.device,
        )
        return comm
