"""One pipeline stage's computation: forward and backward of micro-batches, with optional recomputation.

The stage knows nothing about communication: the executor hands it the received inputs and
gradients and sends what it returns. Weight-policy hooks (:class:`WeightPolicy`) are called
around every forward and backward, and the replay of a recomputed forward happens after
``before_backward`` so that it uses the weights the policy chose for the backward.

The backward is one pass (``backward``: schedules with ``B`` only) or, with ``split_backward``,
two (zero-bubble schedules, :mod:`ringpipe.pipeline.zero_bubble`): ``backward_input`` (``B``)
computes only the gradient of the stage input with ``torch.autograd.grad(outputs, inputs,
grad_outputs, retain_graph=True)`` (what the previous stage waits for) and keeps the graph;
``backward_weight`` (``W``) later accumulates the weight gradient into ``p.grad`` with
``torch.autograd.backward(outputs, grad_outputs, inputs=params)`` and frees the graph. The sum
of the two is the gradient one backward would give.

**Per-layer weight pass.** When the stage is an ``nn.Sequential`` whose layers own disjoint
parameters, ``B`` also asks autograd for the gradient at the output of every layer with
parameters (the input-gradient pass computes those anyway, on its way to the stage input),
and ``W`` back-propagates each of them into its own layer's parameters only: the weight pass
then runs the weight-gradient operations and nothing else, as the paper intends. A
micro-batch falls back to one weight pass over the whole kept graph (which walks the
activation gradients between layers a second time, so ``B + W`` then costs more than one
backward) when a layer's output was changed in place afterwards (``ReLU(inplace=True)`` after
a linear layer: autograd's view of that tensor is then the later one), a layer ran twice or
returned several tensors, or two layers share a parameter.

**Recomputation with a split backward.** The forward keeps only its input; ``B`` replays it
(same random state, normalisation statistics untouched) and keeps the replayed graph until
``W``, so a micro-batch's activations live from its ``B`` to its ``W`` only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ringpipe.pipeline.model_io import logits_of
from ringpipe.pipeline.policy import WeightPolicy
from ringpipe.pipeline.recompute import RngState, disable_border_inplace, frozen_buffers, seeded
from ringpipe.pipeline.values import BoundaryError, Packed, pack, unpack

__all__ = ["SplitStageRuntime", "StageError", "StageRuntime", "as_tensors", "stage_input", "loss_input", "live_weights", "renew_buffers"]

LossFn = Callable[[Any, Any], torch.Tensor]
MetricsFn = Callable[[Any, Any], dict[str, float]]


class StageError(RuntimeError):
    """A stage produced something the pipeline cannot carry, or was driven out of order."""


def as_tensors(value: Any, stage: int, what: str = "output") -> Packed:
    """``value`` packed for the wire (:func:`ringpipe.pipeline.values.pack`), or a :class:`StageError`."""
    try:
        return pack(value, f"stage {stage} {what}")
    except BoundaryError as exc:
        raise StageError(str(exc)) from None


def stage_input(value: Any, requires_grad: bool) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """A received value rebuilt on fresh leaves: ``(value, leaves)``.

    Each tensor is detached from the buffer it arrived in (an in-place operation of the stage
    then cannot reach a tensor kept for recomputation or relayed on); with ``requires_grad`` the
    tensors marked differentiable become leaves that collect the input gradient. A value that is
    not :class:`Packed` is the first stage's data (used as it is, with no leaves), or a value given
    to a later stage directly, whose floating-point tensors all count as differentiable.
    """
    if not isinstance(value, Packed):
        if not requires_grad:
            return value, ()
        packed = pack(value, "a stage input")  # given directly (not received): floating tensors take gradients
        value = Packed(packed.tensors, packed.structure, tuple(t.is_floating_point() for t in packed.tensors))
    leaves = []
    for t, g in zip(value.tensors, value.grads, strict=True):
        leaf = t.detach()
        if requires_grad and g:
            leaf.requires_grad_(True)
        leaves.append(leaf)
    return unpack(value.structure, leaves), tuple(leaves)


def loss_input(value: Any) -> Any:
    """What the loss function gets from the last stage's output: its logits when it has them (a ModelOutput)."""
    if isinstance(value, Mapping) or hasattr(value, "logits"):
        return logits_of(value)
    if isinstance(value, tuple | list) and len(value) == 1:
        return value[0]
    return value


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


def _call(module: nn.Module, value: Any) -> Any:
    """A stage called with its input value: a traced stage takes it whole; a mapping are keyword
    arguments; a one-element tuple its element; anything else one argument (a tuple of several
    tensors is passed as that tuple, as stages of an ``nn.Sequential`` take it)."""
    first = module[0] if isinstance(module, nn.Sequential) and len(module) else module
    if getattr(first, "takes_boundary", False):  # a traced stage, alone or first in a partition's Sequential
        return module(value)
    if isinstance(value, Mapping):
        return module(**value)
    if isinstance(value, tuple | list) and len(value) == 1:
        return module(value[0])
    return module(value)


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
    value: Any = None  # the input value (on ``inputs``); recompute: the received Packed or data
    outputs: tuple[torch.Tensor, ...] | None = None  # differentiable graph outputs (no recompute)
    loss: torch.Tensor | None = None  # last stage, no recompute
    target: Any = None  # last stage, recompute
    weight: float = 1.0
    rng: RngState | None = None
    seed: int | None = None
    versions: tuple[int, ...] = ()
    grads: tuple[bool, ...] = ()  # recompute: which outputs were sent as differentiable


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

    ``split_backward``: the stage also runs the two-pass backward of the module docstring
    (``backward_input`` then ``backward_weight``; synchronous schedules only). ``backward``
    stays available for micro-batches whose schedule has no ``W``.
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
        split_backward: bool = False,
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
        self.split_backward = split_backward
        # the split backward: what each micro-batch's W needs, and the per-layer weight pass's layers
        self._pending: dict[int, _Pending] = {}
        self._trainable = [p for p in self._params if p.requires_grad]
        self._layers: list[tuple[nn.Module, list[nn.Parameter]]] = []
        self._captured: list[tuple[int, Any, int]] | None = None
        self._outputs: dict[int, list[tuple[int, Any, int]]] = {}
        if split_backward:
            self._hook_layers()

    def _hook_layers(self) -> None:
        """Capture each parameter-owning layer's output (the per-layer weight pass), when they own disjoint parameters."""
        owned: list[int] = []
        if isinstance(self.module, nn.Sequential):
            for layer in self.module.children():
                params = [p for p in layer.parameters() if p.requires_grad]
                if params:
                    self._layers.append((layer, params))
                    owned += [id(p) for p in params]
        if len(owned) == len(set(owned)) == len(self._trainable):
            for index, (layer, _) in enumerate(self._layers):
                layer.register_forward_hook(self._hook(index))
        else:
            self._layers = []  # shared or stray parameters: the whole-graph weight pass

    def _hook(self, index: int) -> Any:
        def capture(module: nn.Module, inputs: Any, output: Any) -> None:
            if self._captured is not None and torch.is_grad_enabled():
                version = output._version if isinstance(output, torch.Tensor) else -1
                self._captured.append((index, output, version))

        return capture

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded and not yet backwarded, or whose weight pass is still to run (their graph is held)."""
        return len(self._records) + len(self._pending)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        mb: int,
        inputs: Any,
        staleness: int = 0,
        target: Any = None,
        weight: float = 1.0,
        seed: int | None = None,
    ) -> tuple[Packed, float | None, dict[str, float]]:
        """Run micro-batch ``mb`` on ``inputs`` (a received :class:`Packed`, or the first stage's data).

        Returns (the output packed to send, loss value on the last stage, metrics).
        """
        if mb in self._records:
            raise StageError(f"stage {self.stage}: micro-batch {mb} forwarded twice without backward")
        self.policy.before_forward(mb, staleness)
        self._captured = [] if self._layers and not self.recompute else None
        try:
            rec = _Record(inputs=(), weight=weight, seed=seed)
            if self.recompute:
                value, kept = stage_input(inputs, False)
                rec.value = inputs if isinstance(inputs, Packed) else value
                rec.inputs, rec.versions = kept, tuple(t._version for t in kept)
                rec.rng = RngState.capture(self.device) if seed is None else None
                with torch.no_grad(), seeded(seed, self.device):
                    raw = _call(self.module, value)
                if tuple(t._version for t in kept) != rec.versions:
                    raise StageError(
                        f"stage {self.stage}: an in-place operation modified the stage input kept for "
                        "recomputation; make the first operation of the stage out of place"
                    )
            else:
                value, rec.inputs = stage_input(inputs, not self.is_first)
                renew_buffers(self._submodules)
                live = live_weights(self._params) if self.live else contextlib.nullcontext()
                with seeded(seed, self.device), live:
                    raw = _call(self.module, value)
            loss_val, metrics = None, {}
            if self.is_last:
                assert self.loss_fn is not None
                out = Packed((), None, ())
                value = loss_input(raw)
                loss = self.loss_fn(value, target)
                loss_val = float(loss.detach())
                if self.metrics_fn is not None:
                    with torch.no_grad():
                        metrics = dict(self.metrics_fn(value, target))
                if self.recompute:
                    rec.target = target
                else:
                    rec.loss = loss * weight
            else:
                out = as_tensors(raw, self.stage)
                if self.recompute:  # computed without a graph: every floating-point output takes a gradient back
                    out = Packed(out.tensors, out.structure, tuple(t.is_floating_point() for t in out.tensors))
                    rec.grads = out.grads
                else:
                    rec.outputs = tuple(t for t, g in zip(out.tensors, out.grads, strict=True) if g)
            self._records[mb] = rec
            if self._captured is not None:
                self._outputs[mb] = self._captured
        finally:
            self._captured = None
            self.policy.after_forward(mb)
        return out.detached(), loss_val, metrics

    @torch.no_grad()
    def evaluate(self, inputs: Any, target: Any = None) -> tuple[Packed, float | None, dict[str, float]]:
        """Forward without any bookkeeping (evaluation); loss and metrics on the last stage."""
        value, _ = stage_input(inputs, False)
        raw = _call(self.module, value)
        if not self.is_last:
            return as_tensors(raw, self.stage), None, {}
        assert self.loss_fn is not None
        value = loss_input(raw)
        metrics = dict(self.metrics_fn(value, target)) if self.metrics_fn is not None else {}
        return Packed((), None, ()), float(self.loss_fn(value, target)), metrics

    # ------------------------------------------------------------------ backward

    def backward(self, mb: int, grad_outputs: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """Back-propagate micro-batch ``mb``; returns the gradients of its differentiable inputs.

        ``grad_outputs`` (one per differentiable output, in order) is required except on the
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
                pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            self.policy.after_backward(mb)
        if self.is_first:
            return ()
        return tuple((t.grad if t.grad is not None else torch.zeros_like(t)) for t in leaves if t.requires_grad)

    def _graph(self, rec: _Record) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor | None]:
        """``(input leaves, outputs, loss)`` of a micro-batch's graph: the kept one, or its replay (recompute)."""
        if not self.recompute:
            return rec.inputs, rec.outputs or (), rec.loss
        value, leaves = stage_input(rec.value, not self.is_first)
        rng_ctx = rec.rng.replay() if rec.rng is not None else seeded(rec.seed, self.device)
        with torch.enable_grad(), frozen_buffers(self.module), rng_ctx:
            raw = _call(self.module, value)
            loss: torch.Tensor | None = None
            outputs: tuple[torch.Tensor, ...] = ()
            if self.is_last:
                assert self.loss_fn is not None
                loss = self.loss_fn(loss_input(raw), rec.target) * rec.weight
            else:
                out = as_tensors(raw, self.stage)
                outputs = tuple(t for t, g in zip(out.tensors, rec.grads, strict=True) if g)
        return leaves, outputs, loss

    # ------------------------------------------------------------------ split backward

    def _layer_outputs(self, captured: list[tuple[int, Any, int]] | None) -> list[torch.Tensor] | None:
        """Each layer's output, in layer order, when every one can carry its layer's weight pass."""
        if not self._layers or captured is None or sorted(i for i, _, _ in captured) != list(range(len(self._layers))):
            return None
        outs: list[torch.Tensor] = [torch.empty(0)] * len(self._layers)
        for index, out, version in captured:
            if not isinstance(out, torch.Tensor) or not out.requires_grad or out._version != version:
                return None
            outs[index] = out
        return outs

    def backward_input(self, mb: int, grad_outputs: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """``B``: the gradients of micro-batch ``mb``'s differentiable inputs; what ``W`` needs is kept."""
        if not self.split_backward:
            raise StageError(f"stage {self.stage}: backward_input needs a runtime made with split_backward=True")
        rec = self._records.pop(mb, None)
        captured = self._outputs.pop(mb, None)
        if rec is None:
            raise StageError(f"stage {self.stage}: backward of micro-batch {mb} without its forward")
        if mb in self._pending:
            raise StageError(f"stage {self.stage}: backward of micro-batch {mb} twice before its weight pass")
        self.policy.before_backward(mb)
        if self.recompute and self._layers:
            self._captured = []
        try:
            leaves, outputs, loss = self._graph(rec)
        finally:
            if self.recompute and self._layers:
                captured, self._captured = self._captured, None
        if self.is_last:
            assert loss is not None
            roots, grads = [loss], None
        else:
            if grad_outputs is None:
                raise StageError(f"stage {self.stage}: backward of micro-batch {mb} needs output gradients")
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        wanted = [t for t in leaves if t.requires_grad]
        layer_outs = self._layer_outputs(captured)
        live = bool(roots) and any(r.requires_grad for r in roots)
        got: tuple[torch.Tensor | None, ...] = ()
        if live and (wanted or layer_outs):
            got = torch.autograd.grad(roots, [*wanted, *(layer_outs or [])], grads, retain_graph=True,
                                      allow_unused=True)
        if layer_outs is not None:
            per_layer = [(o, g, params) for o, g, (_, params) in
                         zip(layer_outs, got[len(wanted):], self._layers, strict=True) if g is not None]
            self._pending[mb] = _Pending(layers=per_layer)
        else:
            self._pending[mb] = _Pending(roots=roots if live else [], grads=grads)
        if self.is_first:
            return ()
        by_leaf = {id(t): g for t, g in zip(wanted, got, strict=False)}
        return tuple(
            (by_leaf.get(id(t)) if by_leaf.get(id(t)) is not None else torch.zeros_like(t))  # type: ignore[misc]
            for t in leaves if t.requires_grad
        )

    def backward_weight(self, mb: int) -> None:
        """``W``: accumulate micro-batch ``mb``'s weight gradient into ``p.grad`` and free what was kept."""
        pending = self._pending.pop(mb, None)
        if pending is None:
            raise StageError(f"stage {self.stage}: weight pass of micro-batch {mb} before its backward")
        try:
            if pending.layers is not None:
                for out, grad, params in pending.layers:
                    torch.autograd.backward([out], [grad], inputs=params)
            elif self._trainable and pending.roots:
                torch.autograd.backward(pending.roots, pending.grads, inputs=self._trainable)
        finally:
            self.policy.after_backward(mb)

    def clear(self) -> None:
        """Drop every micro-batch in flight (after an error), and the weight policy's state for them."""
        self._pending.clear()
        self._outputs.clear()
        self._records.clear()
        self.policy.clear()


@dataclass
class _Pending:
    """What a micro-batch's weight pass needs: per layer (output, its gradient, parameters), or the whole graph."""

    layers: list[tuple[torch.Tensor, torch.Tensor, list[nn.Parameter]]] | None = None
    roots: list[torch.Tensor] | None = None
    grads: list[torch.Tensor] | None = None


def SplitStageRuntime(*args: Any, **kwargs: Any) -> StageRuntime:  # noqa: N802 (the former class's name)
    """A :class:`StageRuntime` with ``split_backward=True`` (arguments as :class:`StageRuntime`).

    Kept under the name of the former subclass: the split backward is now an option of the one
    stage runtime.
    """
    kwargs["split_backward"] = True
    return StageRuntime(*args, **kwargs)
