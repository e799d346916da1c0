"""A stage runtime whose backward is two passes: the input gradient ``B`` now, the weight gradient ``W`` later.

``backward_input`` computes only the gradient of the stage input with
``torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=True)`` (what the previous
stage waits for) and keeps the graph; ``backward_weight`` later accumulates the weight
gradient into ``p.grad`` with ``torch.autograd.backward(outputs, grad_outputs, inputs=params)``
and frees the graph. The sum of the two is the gradient one backward would give.

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

**Recomputation.** With ``recompute`` the forward keeps only its input; ``B`` replays it
(same random state, normalisation statistics untouched) and keeps the replayed graph until
``W``, so a micro-batch's activations live from its ``B`` to its ``W`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ringpipe.pipeline.stage import StageError, StageRuntime

__all__ = ["SplitStageRuntime"]


class SplitStageRuntime(StageRuntime):
    """:class:`StageRuntime` with ``backward_input`` / ``backward_weight`` (synchronous schedules only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[int, _Pending] = {}
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self._layers: list[tuple[nn.Module, list[nn.Parameter]]] = []
        self._captured: list[tuple[int, Any, int]] | None = None
        self._outputs: dict[int, list[tuple[int, Any, int]]] = {}
        owned: list[int] = []
        if isinstance(self.module, nn.Sequential):
            for layer in self.module.children():
                params = [p for p in layer.parameters() if p.requires_grad]
                if params:
                    self._layers.append((layer, params))
                    owned += [id(p) for p in params]
        if len(owned) == len(set(owned)) == len(self._params):
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
        """Micro-batches forwarded whose weight gradient has not been computed (their graph is held)."""
        return len(self._records) + len(self._pending)

    def forward(self, mb: int, *args: Any, **kwargs: Any) -> Any:
        self._captured = [] if self._layers and not self.recompute else None
        try:
            return super().forward(mb, *args, **kwargs)
        finally:
            if self._captured is not None and mb in self._records:
                self._outputs[mb] = self._captured
            self._captured = None

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
            elif self._params and pending.roots:
                torch.autograd.backward(pending.roots, pending.grads, inputs=self._params)
        finally:
            self.policy.after_backward(mb)

    def clear(self) -> None:
        self._pending.clear()
        self._outputs.clear()
        super().clear()


@dataclass
class _Pending:
    """What a micro-batch's weight pass needs: per layer (output, its gradient, parameters), or the whole graph."""

    layers: list[tuple[torch.Tensor, torch.Tensor, list[nn.Parameter]]] | None = None
    roots: list[torch.Tensor] | None = None
    grads: list[torch.Tensor] | None = None
