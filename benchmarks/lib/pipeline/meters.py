"""What the pipeline benchmark measures in a run, the same way on both systems.

Wall-clock and CPU time of the timed steps (:func:`timed`), thread CPU of every compute call
(:func:`cpu_timed`), peak activation memory (:class:`ActivationMeter`: live bytes of the storages
autograd saves for backward, each storage counted once and a parameter's not at all, plus the
stage inputs ringpipe keeps for recomputation) and what a rank's stages really hold
(:func:`describe`: parameter count and layers, found by identity in the shared layer list).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["ActivationMeter", "cpu_timed", "describe", "medians", "timed"]


def describe(stage_modules: Sequence[nn.Module], layers: list[nn.Module]) -> dict[str, Any]:
    """Parameter count and the global indices of the layers a rank's stages really hold."""
    index = {id(m): i for i, m in enumerate(layers)}
    held = [index[id(m)] for s in stage_modules for m in s.modules() if id(m) in index]
    params = sum(p.numel() for s in stage_modules for p in s.parameters())
    kinds = sorted(f"{type(layers[i]).__name__}{tuple(p.shape for p in layers[i].parameters())}" for i in held)
    return {"params": params, "layers": held, "kinds": kinds}


class ActivationMeter:
    """Peak live bytes of tensors autograd saves (parameters excluded), plus ringpipe's kept inputs."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.weights = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.kept = self.peak = 0
        self.refs: dict[int, int] = {}  # storage -> saved tensors holding it (a storage counts once)

    def pack(self, t: torch.Tensor, inner: Any = None) -> Any:
        meter = self
        ptr = t.untyped_storage().data_ptr()
        n = 0 if ptr in self.weights else t.untyped_storage().nbytes()

        class Held:
            __slots__ = ("v",)

            def __init__(self, v: Any) -> None:
                self.v = v
                meter.refs[ptr] = meter.refs.get(ptr, 0) + 1
                if meter.refs[ptr] == 1:
                    meter.live += n
                    meter.peak = max(meter.peak, meter.live + meter.kept)

            def __del__(self) -> None:
                meter.refs[ptr] -= 1
                if not meter.refs[ptr]:
                    del meter.refs[ptr]
                    meter.live -= n

        # A saved *output* held as itself would close a cycle through its own grad_fn (node ->
        # saved hook object -> tensor -> node) that Python's collector cannot see: a node that no
        # backward ever executes (zero-bubble weight passes skip the activation nodes) would then
        # never be freed. A detached alias holds the same storage without the cycle.
        return Held(t.detach() if inner is None else inner(t))

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda h: h.v)

    def nested(self, factory: Callable[[nn.Module], Any]) -> Callable[[nn.Module], Any]:
        """Wrap ringpipe's own saved-tensors hooks (asynchronous stages) so they are counted too."""
        def make(module: nn.Module) -> Any:
            inner = factory(module)
            return torch.autograd.graph.saved_tensors_hooks(
                lambda t: self.pack(t, inner.pack_hook), lambda h: inner.unpack_hook(h.v))
        return make


def timed(comm: Any, warmup: Callable[[], None], work: Callable[[], None]) -> tuple[float, float]:
    """Wall-clock seconds of ``work`` between two barriers, and this process's CPU seconds in it."""
    warmup()
    comm.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    work()
    c1 = time.process_time()
    comm.barrier()
    return time.perf_counter() - t0, c1 - c0


def cpu_timed(fn: Callable[..., Any], log: dict[str, list[float]], key: str) -> Callable[..., Any]:
    """``fn``, appending the thread CPU seconds of each call to ``log[key]``."""
    def call(*a: Any, **k: Any) -> Any:
        c0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            log.setdefault(key, []).append(time.thread_time() - c0)
    return call


def medians(log: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in log.items() if v}
