"""One pipeline stage's computation: forward and backward of micro-batches, with optional recomputation.

The stage knows nothing about communication: the executor hands it the received inputs and
gradients and sends what it returns. Weight-policy hooks (:class:`WeightPolicy`) are called
around every forward and backward, and the replay of a recomputed forward happens after
``before_backward`` so that it uses the weights the policy chose for the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ringpipe.pipeline.policy import WeightPolicy
from ringpipe.pipeline.recompute import RngState, disable_border_inplace, frozen_buffers, seeded

__all__ = ["StageError", "StageRuntime", "as_tensors", "live_weights", "renew_buffers"]

LossFn = Callable[[Any, Any], torch.Tensor]
MetricsFn = Callable[[Any, Any], dict[str, float]]


class StageError(RuntimeError):
    """A stage produced something the pipeline cannot carry, or was driven out of order."""


def as_tensors(value: Any, stage: int, what: str = "output") -> tuple[torch.Tensor, ...]:
    """``value`` as a tuple of tensors, or a :class:`StageError` naming the stage and the type."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, tuple | list) and value and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value)
    kinds = [type(v).__name__ for v in value] if isinstance(value, tuple | list) else type(value).__name__
    raise StageError(
        f"stage {stage} {what} is {kinds}; a stage must return a tensor or a tuple of tensors "
        "(wrap other values in tensors or move them into the next stage)"
    )


def _modified(tensor: torch.Tensor, version: int) -> RuntimeError:
    """Autograd's in-place error for a saved tensor found at another version than when it was saved."""
    kind = f"{tensor.type()} {list(tensor.shape)}"
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{kind}] is at version {tensor._version}; expected version {version} "
        "instead. The stage keeps its graph until an asynchronous backward: make that operation "
        "out of place (or use recomputation)"
    )


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr() if t.numel() else 0
    except (RuntimeError, NotImplementedError):  # tensors without plain storage (sparse, nested, ...)
        return 0


def live_weights(params: nn.Module | Iterable[torch.Tensor]) -> Any:
    """Context in which autograd keeps the parameters by reference, without version checks.

    ``params``: a module (its parameters) or the parameters themselves (a stage lists them once
    instead of walking its modules on every forward). A graph kept from a forward then reads,
    at backward time, whatever the parameter storage holds *then* (the current weights, or the
    stash a policy loaded), while its saved activations stay the forward-time ones; in-place
    weight updates between the forward and the backward no longer invalidate it. Every other
    saved tensor (activations, inputs, a parameter's copy) keeps autograd's check: an in-place
    operation that overwrites an activation the backward needs still raises, as it does
    without this context. A saved tensor counts as a parameter when it lives in a parameter's
    storage (``W.t()`` saved by a linear layer is a view of ``W``); the storages are read when
    the context is made, so a parameter re-bound to new storage (``p.data = ...``) counts as
    what it holds then. Same semantics as :func:`ringpipe.pipeline.staleness.live_forward`,
    without re-binding every parameter on each call (a quarter of a small stage's compute
    time). A checked tensor is saved as a plain ``(tensor, version)`` pair: no Python object
    is built per saved tensor.
    """
    if isinstance(params, nn.Module):
        params = params.parameters()
    weights = frozenset(_storage(p) for p in params) - {0}

    def pack(t: torch.Tensor) -> Any:
        return t if _storage(t) in weights else (t, t._version)

    def unpack(saved: Any) -> torch.Tensor:
        if type(saved) is tuple:
            tensor, version = saved
            if tensor._version != version:
                raise _modified(tensor, version)
            return tensor
        return saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _call(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Any:
    return module(inputs[0]) if len(inputs) == 1 else module(inputs)


def renew_buffers(module: nn.Module | Sequence[nn.Module]) -> None:
    """Give every buffer a fresh copy before a forward whose graph is kept.

    ``module``: a module (it and its submodules), or the list of them (a stage lists them once).

    Autograd saves BatchNorm's running statistics with the graph of each forward; the next
    micro-batch's forward would update them in place and invalidate the kept graph ("modified
    by an inplace operation"). Rebinding the buffers to copies first leaves each kept graph
    its own version while the statistics move exactly as in one process.
    """
    for sub in module.modules() if isinstance(module, nn.Module) else module:
        if not sub._buffers:
            continue
        for name, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[name] = buf.clone()


@dataclass
class _Record:
    inputs: tuple[torch.Tensor, ...]  # leaves (with grad) or kept inputs (recompute)
    outputs: tuple[torch.Tensor, ...] | None = None  # graph outputs (no recompute)
    loss: torch.Tensor | None = None  # last stage, no recompute
    target: Any = None  # last stage, recompute
    weight: float = 1.0
    rng: RngState | None = None
    seed: int | None = None
    versions: tuple[int, ...] = ()


class StageRuntime:
    """Forward/backward of one stage's module over numbered micro-batches.

    ``recompute``: the forward runs under ``no_grad`` keeping the input and the random state;
    ``backward`` replays it (same random state, buffers such as BatchNorm running statistics
    restored afterwards so they move once per micro-batch) and back-propagates. On the last
    stage, ``forward`` also computes ``loss_fn(output, target) * weight`` and ``backward``
    starts from that loss.

    ``live_weights``: without recomputation, keep the forward's graph under :func:`live_weights`
    so it survives in-place weight updates between a forward and its backward (asynchronous
    schedules) and the backward uses whatever weights the parameters hold then.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        num_stages: int,
        loss_fn: LossFn | None = None,
        metrics_fn: MetricsFn | None = None,
        recompute: bool = False,
        policy: WeightPolicy | None = None,
        device: torch.device | None = None,
        live_weights: bool = False,
    ) -> None:
        self.module = module
        self.live = live_weights and not recompute
        self.stage = stage
        self.num_stages = num_stages
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        if self.is_last and loss_fn is None:
            raise StageError(f"stage {stage} is the last stage and needs a loss_fn")
        self.loss_fn = loss_fn
        self.metrics_fn = metrics_fn
        self.recompute = recompute
        self.policy = policy or WeightPolicy()
        self.device = device
        self._records: dict[int, _Record] = {}
        # listed once, not walked on every forward: a stage's modules and parameters are fixed
        # once its optimizer holds them (their storages are still read on every forward)
        self._submodules = list(module.modules())
        self._params = list(module.parameters())
        disable_border_inplace(module, stage)

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded and not yet backwarded (their activations are held)."""
        return len(self._records)

    # ------------------------------------------------------------------ forward

    def _leaves(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        out = []
        for t in inputs:
            leaf = t.detach()
            if not self.is_first and leaf.is_floating_point():
                leaf.requires_grad_(True)
            out.append(leaf)
        return tuple(out)

    def forward(
        self,
        mb: int,
        inputs: tuple[torch.Tensor, ...],
        staleness: int = 0,
        target: Any = None,
        weight: float = 1.0,
        seed: int | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], float | None, dict[str, float]]:
        """Run micro-batch ``mb``; returns (outputs to send, loss value on the last stage, metrics)."""
        if mb in self._records:
            raise StageError(f"stage {self.stage}: micro-batch {mb} forwarded twice without backward")
        self.policy.before_forward(mb, staleness)
        try:
            rec = _Record(inputs=(), weight=weight, seed=seed)
            if self.recompute:
                kept = tuple(t.detach() for t in inputs)
                rec.inputs, rec.versions = kept, tuple(t._version for t in kept)
                rec.rng = RngState.capture(self.device) if seed is None else None
                with torch.no_grad(), seeded(seed, self.device):
                    out = as_tensors(_call(self.module, kept), self.stage)
                if tuple(t._version for t in kept) != rec.versions:
                    raise StageError(
                        f"stage {self.stage}: an in-place operation modified the stage input kept for "
                        "recomputation; make the first operation of the stage out of place"
                    )
            else:
                rec.inputs = self._leaves(inputs)
                renew_buffers(self._submodules)
                live = live_weights(self._params) if self.live else contextlib.nullcontext()
                with seeded(seed, self.device), live:
                    out = as_tensors(_call(self.module, rec.inputs), self.stage)
                rec.outputs = out
            loss_val, metrics = None, {}
            if self.is_last:
                assert self.loss_fn is not None
                value = out[0] if len(out) == 1 else out
                loss = self.loss_fn(value, target)
                loss_val = float(loss.detach())
                if self.metrics_fn is not None:
                    with torch.no_grad():
                        metrics = dict(self.metrics_fn(value, target))
                if self.recompute:
                    rec.target = target
                else:
                    rec.loss = loss * weight
                    rec.outputs = None
            self._records[mb] = rec
        finally:
            self.policy.after_forward(mb)
        return tuple(t.detach() for t in out), loss_val, metrics

    @torch.no_grad()
    def evaluate(self, inputs: tuple[torch.Tensor, ...], target: Any = None) -> tuple[tuple[torch.Tensor, ...], float | None, dict[str, float]]:
        """Forward without any bookkeeping (evaluation); loss and metrics on the last stage."""
        out = as_tensors(_call(self.module, tuple(t.detach() for t in inputs)), self.stage)
        if not self.is_last:
            return out, None, {}
        assert self.loss_fn is not None
        value = out[0] if len(out) == 1 else out
        metrics = dict(self.metrics_fn(value, target)) if self.metrics_fn is not None else {}
        return out, float(self.loss_fn(value, target)), metrics

    # ------------------------------------------------------------------ backward

    def backward(self, mb: int, grad_outputs: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """Back-propagate micro-batch ``mb``; returns the gradients of its floating-point inputs.

        ``grad_outputs`` (one per floating-point output, in order) is required except on the
        last stage. Gradients of inputs that did not receive one are zeros.
        """
        rec = self._records.pop(mb, None)
        if rec is None:
            raise StageError(f"stage {self.stage}: backward of micro-batch {mb} without its forward")
        self.policy.before_backward(mb)
        try:
            leaves, outputs, loss = self._graph(rec)
            if self.is_last:
                assert loss is not None
                loss.backward()
            else:
                if grad_outputs is None:
                    raise StageError(f"stage {self.stage}: backward of micro-batch {mb} needs output gradients")
                pairs = [
                    (o, g) for o, g in zip([o for o in outputs if o.is_floating_point()], grad_outputs, strict=True)
                    if o.requires_grad
                ]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            self.policy.after_backward(mb)
        if self.is_first:
            return ()
        return tuple(
            (t.grad if t.grad is not None else torch.zeros_like(t)) for t in leaves if t.is_floating_point()
        )

    def _graph(self, rec: _Record) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor | None]:
        """``(input leaves, outputs, loss)`` of a micro-batch's graph: the kept one, or its replay (recompute)."""
        if not self.recompute:
            return rec.inputs, rec.outputs or (), rec.loss
        leaves = self._leaves(rec.inputs)
        rng_ctx = rec.rng.replay() if rec.rng is not None else seeded(rec.seed, self.device)
        with torch.enable_grad(), frozen_buffers(self.module), rng_ctx:
            outputs = as_tensors(_call(self.module, leaves), self.stage)
            loss: torch.Tensor | None = None
            if self.is_last:
                assert self.loss_fn is not None
                value = outputs[0] if len(outputs) == 1 else outputs
                loss = self.loss_fn(value, rec.target) * rec.weight
        return leaves, outputs, loss

    def clear(self) -> None:
        """Drop every micro-batch in flight (after an error), and the weight policy's state for them."""
        self._records.clear()
        self.policy.clear()
