"""Mixed precision and the gradients' last stop before a step: autocast, a loss scale every rank agrees on, global clipping.

``precision: bf16 | fp16`` runs the forward passes (training and evaluation) under
``torch.autocast``; the parameters, their gradients and the optimizer state stay fp32, so the
asynchronous pipeline's weight predictions and gaps are computed in fp32 as before.

``fp16`` also scales the loss (:class:`LossScale`, torch's ``GradScaler`` rule: start at 2^16,
halve on an overflow, double after 2000 clean steps). A scaler of its own rather than
``GradScaler``: in the pipeline modes the loss lives on the last stage while every stage holds
some of the gradients, so unscaling, the overflow test and the skip must be decided for the
whole model, in one allreduce with the clipping norm (:class:`GradStep`).

``optimizer.clip_grad_norm`` clips the gradient of the whole model, as
``torch.nn.utils.clip_grad_norm_`` on one process: the data-parallel modes clip the replicas'
average (identical on every replica, so no message is needed), the pipeline modes sum the
squared norms of every stage (a world allreduce divided by the replicas, which hold equal
averaged gradients).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ringpipe.comm import Communicator

__all__ = ["DTYPES", "autocast", "on_comm_device", "autocast_layers", "LossScale", "GradStep"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``precision`` on ``device``'s type (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def on_comm_device(comm: Communicator, t: torch.Tensor) -> torch.Tensor:
    """``t`` where ``comm`` takes tensors (its pinned GPU under NCCL, else the CPU)."""
    device = getattr(comm, "device", None)
    return t.to(device) if isinstance(device, torch.device) and device != t.device else t


class _Enter:
    """Forward pre-hook entering autocast; :class:`_Exit` (the same pair) leaves it after the forward."""

    def __init__(self, precision: str, device_type: str) -> None:
        self.precision, self.device_type = precision, device_type
        self.open: list[Any] = []

    def __call__(self, module: nn.Module, args: Any) -> None:
        ctx = torch.autocast(self.device_type, dtype=DTYPES[self.precision])
        ctx.__enter__()
        self.open.append(ctx)


class _Exit:
    def __init__(self, enter: _Enter) -> None:
        self.enter = enter

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.enter.open.pop().__exit__(None, None, None)


def autocast_layers(layers: Sequence[nn.Module], precision: str, device_type: str) -> list[Any]:
    """Run each layer's forward under autocast (hooks: the layers and their state_dict keys stay as they are).

    Returns the hooks' handles (``handle.remove()`` takes them off). The pipeline modes cut the model between layers and run each stage's layers themselves; a
    hook per layer puts every forward (and every recomputed one) under autocast wherever it runs.
    """
    handles: list[Any] = []
    if precision == "fp32":
        return handles
    for layer in layers:
        enter = _Enter(precision, device_type)
        handles.append(layer.register_forward_pre_hook(enter))
        handles.append(layer.register_forward_hook(_Exit(enter)))
    return handles


class LossScale:
    """Dynamic loss scale, torch's ``GradScaler`` rule; the overflow verdict comes from the caller."""

    def __init__(self, init: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5, interval: int = 2000) -> None:
        self.scale, self.growth, self.backoff, self.interval = init, growth, backoff, interval
        self.clean = 0  # steps without overflow since the last change
        self.skipped = 0  # steps skipped for an overflow

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff
            self.clean = 0
            self.skipped += 1
            return
        self.clean += 1
        if self.clean == self.interval:
            self.scale *= self.growth
            self.clean = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean": self.clean, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.clean, self.skipped = float(state["scale"]), int(state["clean"]), int(state["skipped"])


class GradStep:
    """An optimizer step pre-hook: unscale (fp16), skip an overflowing step everywhere, clip to the global norm.

    ``comm``: the ranks whose gradients make up the model (``None``: this rank holds all of it);
    ``copies``: how many of them hold each gradient (the replicas of a pipeline stage).
    """

    def __init__(self, params: Sequence[nn.Parameter], clip: float | None, scaler: LossScale | None,
                 comm: Communicator | None = None, copies: int = 1) -> None:
        self.params, self.clip, self.scaler = list(params), clip, scaler
        self.comm, self.copies = comm, copies
        self.last_norm = math.nan

    def install(self, optimizer: torch.optim.Optimizer) -> GradStep:
        optimizer.register_step_pre_hook(self)
        return self

    @torch.no_grad()
    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            for g in grads:
                g.mul_(inv)
        local = torch.zeros(2, dtype=torch.float64)
        for g in grads:
            local[0] += g.detach().double().pow(2).sum().cpu()
        if self.scaler is not None:
            local[1] = float(not all(bool(torch.isfinite(g).all()) for g in grads))
        if self.comm is not None and self.comm.size > 1:
            local = on_comm_device(self.comm, local)
            self.comm.allreduce(local)
            local = local.cpu()
        sumsq, overflow = float(local[0]) / self.copies, bool(local[1] > 0)
        if self.scaler is not None:
            overflow = overflow or not math.isfinite(sumsq)
            self.scaler.update(overflow)
            if overflow:  # skip the step on every rank: a parameter without a gradient is not updated
                for p in self.params:
                    p.grad = None
                return
        norm = math.sqrt(sumsq)
        self.last_norm = norm
        if self.clip is not None:
            coef = self.clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s coefficient
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
