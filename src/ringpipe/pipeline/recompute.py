"""Activation recomputation: forward without a graph, replay it with the same randomness before backward.

``torch.utils.checkpoint`` is not used because a pipeline stage needs three things it does
not give together: the forward and the replay happen in different executor actions (with a
weight-policy hook in between that may swap the parameters), the replay must not move the
running statistics of normalisation layers a second time, and the kept input must be one the
stage owns (an in-place first layer would otherwise overwrite it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "RngState",
    "microbatch_seed",
    "seeded",
    "frozen_buffers",
    "disable_border_inplace",
]

log = logging.getLogger(__name__)


@dataclass
class RngState:
    """The CPU (and one CUDA device's) random generator state at a point in time."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None
    device: int | None = None

    @classmethod
    def capture(cls, device: torch.device | None = None) -> RngState:
        if device is not None and device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            return cls(torch.get_rng_state(), torch.cuda.get_rng_state(idx), idx)
        return cls(torch.get_rng_state())

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body with this state, leaving the outer generator sequence untouched."""
        devices = [self.device] if self.device is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None and self.device is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def microbatch_seed(base: int, stage: int, microbatch: int) -> int:
    """The seed a stage uses for one micro-batch when per-micro-batch seeding is on.

    A single-process reference reproduces a pipeline's dropout masks by running stage
    ``s``'s layers for micro-batch ``m`` under ``seeded(microbatch_seed(base, s, m))``.
    """
    return (int(base) * 1_000_003 + stage * 10_007 + microbatch) % (2**63 - 1)


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device | None = None) -> Iterator[None]:
    """Run the body with the generators seeded by ``seed`` (outer state restored); no-op for None."""
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        # exactly the generators fork_rng restores: torch.manual_seed would also seed every other
        # device's generator (left changed on the way out) and, before CUDA, XPU and MTIA are
        # initialised, queue their seeding with a stack trace each: 0.2-0.5 ms per micro-batch
        torch.default_generator.manual_seed(seed)
        for index in devices:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


@contextlib.contextmanager
def frozen_buffers(module: nn.Module) -> Iterator[None]:
    """Run the body on copies of every buffer of ``module``, then put the originals back.

    Running statistics (BatchNorm) therefore move only once per micro-batch: the replay of a
    recomputed forward updates throw-away copies. The copies, not the originals, are what the
    replay's graph saved, so restoring the originals cannot invalidate that graph.
    """
    saved = [(sub, name, buf) for sub in module.modules() for name, buf in sub._buffers.items() if buf is not None]
    for sub, name, buf in saved:
        sub._buffers[name] = buf.clone()
    try:
        yield
    finally:
        for sub, name, buf in saved:
            sub._buffers[name] = buf


def disable_border_inplace(module: nn.Module, stage: int) -> list[str]:
    """Turn off ``inplace`` on the leading layers of a stage; returns the names changed.

    An in-place first layer (``ReLU(inplace=True)``) would overwrite the stage input that
    the runtime keeps for the backward pass or for recomputation. The leading chain of
    parameter-free layers is scanned, down to the first layer that allocates a new tensor.
    """
    changed: list[str] = []
    for name, sub in module.named_modules():
        if sub is module or list(sub.children()):
            continue
        if getattr(sub, "inplace", False):
            sub.inplace = False
            changed.append(name)
            continue
        if any(True for _ in sub.parameters()) or not _is_elementwise(sub):
            break
    if changed:
        log.info("stage %d: in-place disabled on border layers %s (the stage input is kept)", stage, changed)
    return changed


def _is_elementwise(layer: nn.Module) -> bool:
    """Parameter-free layers that may be followed by an in-place layer still acting on the input."""
    return isinstance(layer, nn.Identity | nn.Dropout | nn.Flatten | nn.Unflatten)
