"""Communicator over torch c10d process groups: gloo for CPU tensors, NCCL for CUDA tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringpipe.comm.base import CommError, Communicator, ReduceOp, Work
from ringpipe.comm.events import EventLog
from ringpipe.env import Topology

__all__ = ["TorchCommunicator"]

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
        if self.backend == "nccl" and tensor.device.type != "cuda":
            raise CommError(
                f"{what}: the nccl backend needs CUDA tensors, got one on {tensor.device}; "
                f"move it with .to('{self.device}') or use the gloo backend for CPU tensors"
            )
        if self.backend == "gloo" and tensor.device.type not in ("cpu", "cuda"):
            raise CommError(f"{what}: the gloo backend cannot send tensors on {tensor.device}")

    def _object_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _g(self, rank: int) -> int:
        return self.global_ranks[rank]

    # ------------------------------------------------------------------ p2p

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        dist.send(tensor, self._g(dst), group=self.group, tag=tag)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        dist.recv(tensor, self._g(src), group=self.group, tag=tag)

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        w = dist.isend(tensor, self._g(dst), group=self.group, tag=tag)
        assert w is not None
        return Work(w.wait, w.is_completed, result=tensor)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        w = dist.irecv(tensor, self._g(src), group=self.group, tag=tag)
        assert w is not None
        return Work(w.wait, w.is_completed, result=tensor)

    # ------------------------------------------------------------------ collectives

    def _native(self, tensor: torch.Tensor, op: ReduceOp) -> tuple[Any, bool]:
        """The c10d op and whether the result must be divided by size afterwards."""
        if op is ReduceOp.AVERAGE:
            if self.backend == "nccl":
                return dist.ReduceOp.AVG, False
            return dist.ReduceOp.SUM, True
        return _NATIVE_OPS[op], False

    def _finish_average(self, tensor: torch.Tensor, divide: bool) -> None:
        if divide:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(self.size)
            else:
                tensor.copy_(torch.div(tensor, self.size, rounding_mode="floor"))

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        native, divide = self._native(tensor, op)
        if tensor.dtype == torch.bool:
            raise CommError("allreduce: bool tensors are not supported; convert to uint8 or int32")
        dist.all_reduce(tensor, op=native, group=self.group)
        self._finish_average(tensor, divide)

    def _iallreduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        native, divide = self._native(tensor, op)
        w = dist.all_reduce(tensor, op=native, group=self.group, async_op=True)
        assert w is not None
        return Work(w.wait, w.is_completed, result=tensor, post=lambda: self._finish_average(tensor, divide))

    def _allgather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor, group=self.group)
        return out

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        dist.broadcast(tensor, self._g(root), group=self.group)

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
        native, divide = self._native(tensor, op)
        dist.reduce(tensor, self._g(root), op=native, group=self.group)
        if self.rank == root:
            self._finish_average(tensor, divide)

    def _reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        native, divide = self._native(tensor, op)
        chunks = list(tensor.chunk(self.size, dim=0))
        out = torch.empty_like(chunks[0])
        if self.backend == "gloo":
            # gloo has no reduce_scatter: allreduce a copy and keep this rank's block.
            work = tensor.clone()
            dist.all_reduce(work, op=native, group=self.group)
            out.copy_(work.chunk(self.size, dim=0)[self.rank])
        else:
            dist.reduce_scatter(out, [c.contiguous() for c in chunks], op=native, group=self.group)
        self._finish_average(out, divide)
        return out

    def _alltoall(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for t in tensors]
        if self.backend == "gloo":
            # gloo's all_to_all is not implemented for lists: post every pair as p2p messages.
            works = []
            for peer in range(self.size):
                if peer == self.rank:
                    out[peer].copy_(tensors[peer])
                    continue
                works.append(dist.isend(tensors[peer], self._g(peer), group=self.group, tag=7))
                works.append(dist.irecv(out[peer], self._g(peer), group=self.group, tag=7))
            for w in works:
                assert w is not None
                w.wait()
        else:
            dist.all_to_all(out, tensors, group=self.group)
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
