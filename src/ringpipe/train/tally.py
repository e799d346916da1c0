"""Running ``[loss_sum, correct, count]`` sums of the loop, reduced across ranks when read."""

from __future__ import annotations

import math

import torch

from ringpipe.comm import Communicator
from ringpipe.train.precision import on_comm_device

__all__ = ["Tally"]


class Tally:
    """Running ``[loss_sum, correct, count]`` sums, reduced across ranks when read."""

    def __init__(self) -> None:
        self.value = torch.zeros(3, dtype=torch.float64)

    def add(self, t: torch.Tensor) -> None:
        self.value += t

    def reduce(self, comm: Communicator) -> tuple[float, float, int]:
        loss, acc, count, _ = self.reduce_flag(comm, False)
        return loss, acc, count

    def reduce_flag(self, comm: Communicator, flag: bool) -> tuple[float, float, int, bool]:
        """``reduce`` that also tells, in the same allreduce, whether any rank raised ``flag``."""
        total = torch.cat((self.value, torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)))
        if comm.size > 1:
            total = on_comm_device(comm, total)  # NCCL reduces CUDA tensors only
            comm.allreduce(total)
            total = total.cpu()
        loss_sum, correct, count, flags = (float(v) for v in total)
        self.value.zero_()
        if count == 0:
            return math.nan, math.nan, 0, flags > 0
        return loss_sum / count, correct / count, int(count), flags > 0
