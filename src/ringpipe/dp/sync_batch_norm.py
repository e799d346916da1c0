"""SyncBatchNorm on any communicator: batch statistics over every rank's batch, differentiable.

torch's ``nn.SyncBatchNorm`` works only on c10d process groups with CUDA tensors; this one
reduces its statistics with ringpipe's differentiable allreduce, so it runs on gloo, NCCL and
MPI, on CPU and GPU. The per-channel sum, sum of squares and count are reduced in one
message; autograd through the (sum) allreduce gives the exact gradient of the summed loss,
which is what torch's fused backward computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.core.ops import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch normalisation whose training statistics cover the batches of all ranks."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        comm: Communicator | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.comm = comm

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")

    def _comm(self) -> Communicator:
        if self.comm is None:
            from ringpipe.core.world import current

            return current().comm
        return self.comm

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        comm = self._comm()
        dims = [0, *range(2, input.dim())]
        count = input.numel() // input.shape[1]
        local = torch.cat([input.sum(dims), (input * input).sum(dims),
                           input.new_full((1,), float(count))])
        total = allreduce(comm, local, ReduceOp.SUM) if comm.size > 1 else local
        c = self.num_features
        n = total[2 * c]
        mean = total[:c] / n
        var = (total[c : 2 * c] / n - mean * mean).clamp_min(0.0)
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), float(n.item()))
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (n / max(n - 1.0, 1.0))
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, comm: Communicator | None = None) -> nn.Module:
        """Replace every ``BatchNorm*d`` in ``module`` by a SyncBatchNorm with the same state."""
        out = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, comm=comm)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, comm))
        return out
