"""Split a sequence of layers into pipeline stages: by explicit balance, parameters or measured time."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "BalanceError",
    "as_layers",
    "check_balance",
    "split_layers",
    "balance_by_size",
    "balance_by_params",
    "balance_by_time",
    "layer_times",
    "partition",
]

log = logging.getLogger(__name__)


class BalanceError(ValueError):
    """A balance does not describe a valid split of the layers."""


def as_layers(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The layers of an ``nn.Sequential`` or a list of modules, refusing anything else (another module too)."""
    if isinstance(model, nn.Sequential):
        return list(model.children())
    if isinstance(model, nn.Module):
        raise TypeError(
            f"cannot split a {type(model).__name__}: pass an nn.Sequential or a list of modules "
            "(write the model as a sequence of layers)"
        )
    layers = list(model)
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer {i} is a {type(layer).__name__}, not an nn.Module")
    return layers


def check_balance(balance: Sequence[int], num_layers: int) -> list[int]:
    """Validate ``balance`` (layers per stage) against ``num_layers``; return it as a list."""
    bal = [int(b) for b in balance]
    if not bal:
        raise BalanceError(f"balance {bal} is empty; give one layer count per stage")
    if any(b < 1 for b in bal):
        raise BalanceError(f"balance {bal} has a stage with no layer; every entry must be >= 1")
    if len(bal) > num_layers:
        raise BalanceError(
            f"balance {bal} asks for {len(bal)} stages but the model has only {num_layers} layers; "
            f"use at most {num_layers} stages"
        )
    if sum(bal) != num_layers:
        raise BalanceError(
            f"balance {bal} sums to {sum(bal)} but the model has {num_layers} layers; "
            "the entries must add up to the number of layers"
        )
    return bal


def split_layers(layers: Sequence[nn.Module], balance: Sequence[int]) -> list[nn.Sequential]:
    """One ``nn.Sequential`` per stage, stage ``s`` holding the next ``balance[s]`` layers."""
    bal = check_balance(balance, len(layers))
    out, start = [], 0
    for b in bal:
        out.append(nn.Sequential(*layers[start : start + b]))
        start += b
    return out


def balance_by_size(costs: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous split of per-layer ``costs`` into ``num_stages`` parts minimising the largest part.

    Exact (dynamic programming over split points, O(stages * layers^2)); every stage gets at
    least one layer.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise BalanceError(f"cannot split {n} layers into {num_stages} stages; need 1 <= stages <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][j]: minimal largest part splitting the first j layers into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                val = max(best[k - 1][i], prefix[j] - prefix[i])
                if val < best[k][j]:
                    best[k][j], cut[k][j] = val, i
    bal, j = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        bal.append(j - i)
        j = i
    return bal[::-1]


def balance_by_params(layers: Sequence[nn.Module], num_stages: int) -> list[int]:
    """Balance by parameter count (layers without parameters count as 1 so they still spread)."""
    costs = [max(1, sum(p.numel() for p in layer.parameters())) for layer in layers]
    return balance_by_size(costs, num_stages)


def layer_times(
    layers: Sequence[nn.Module],
    sample: Any,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Seconds of forward+backward of each layer on ``sample`` (a batch), as a pipeline runs it.

    Each layer is timed on the output of the previous one: the median of ``repeats`` passes over
    all the layers (so that drift of a shared machine falls on every layer alike), read from
    ``clock`` (``time.thread_time`` measures CPU, which load disturbs least, when torch runs one
    thread). Later layers get an input that requires grad, as a stage's input
    does, so their backward includes the input gradient; the first layer gets ``sample`` as it is,
    so a plain data batch is timed without the input gradient that the first stage never computes.
    Parameter gradients are cleared afterwards. Layers run in training mode, so running statistics
    of normalisation layers move; call it before loading weights if that matters.
    """
    runs: list[list[float]] = [[] for _ in layers]
    for _ in range(max(1, repeats)):
        x = sample
        for i, layer in enumerate(layers):
            inp = _detach(x, requires_grad=None if i == 0 else True)
            t0 = clock()
            out = layer(*inp) if isinstance(inp, tuple) else layer(inp)
            outs = out if isinstance(out, tuple) else (out,)
            grads = [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
            if grads:
                torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
            runs[i].append(clock() - t0)
            x = _detach(out, requires_grad=False)
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    return [sorted(r)[len(r) // 2] for r in runs]


def balance_by_time(
    layers: Sequence[nn.Module],
    sample: Any,
    num_stages: int,
    repeats: int = 3,
) -> list[int]:
    """Balance by measured forward+backward time of each layer on ``sample`` (:func:`layer_times`)."""
    times = layer_times(layers, sample, repeats)
    bal = balance_by_size(times, num_stages)
    log.info("balance by time %s from per-layer seconds %s", bal, [f"{t:.2e}" for t in times])
    return bal


def _detach(x: Any, requires_grad: bool | None) -> Any:
    """``x`` cut from its graph; ``requires_grad`` None keeps each tensor's own flag."""
    if isinstance(x, tuple):
        return tuple(_detach(t, requires_grad) for t in x)
    if isinstance(x, torch.Tensor):
        keep = x.requires_grad if requires_grad is None else requires_grad
        y = x.detach()
        if keep and y.is_floating_point():
            y.requires_grad_(True)
        return y
    return x


def partition(
    model: nn.Sequential | Sequence[nn.Module],
    num_stages: int | None = None,
    balance: Sequence[int] | str | None = None,
    sample: Any = None,
) -> tuple[list[nn.Sequential], list[int]]:
    """Split ``model`` into stages; returns ``(stages, balance)``.

    ``balance`` is a list of layer counts, ``"params"`` (by parameter count, the default when
    only ``num_stages`` is given) or ``"time"`` (measured on ``sample``).
    """
    layers = as_layers(model)
    if isinstance(balance, str):
        if num_stages is None:
            raise BalanceError(f"balance {balance!r} needs num_stages")
        if balance == "params":
            bal = balance_by_params(layers, num_stages)
        elif balance == "time":
            if sample is None:
                raise BalanceError("balance 'time' needs a sample batch to time the layers on")
            bal = balance_by_time(layers, sample, num_stages)
        else:
            raise BalanceError(f"unknown balance method {balance!r}; use a list of counts, 'params' or 'time'")
    elif balance is None:
        if num_stages is None:
            raise BalanceError("give a balance (layers per stage) or a number of stages")
        bal = balance_by_params(layers, num_stages)
    else:
        bal = check_balance(balance, len(layers))
        if num_stages is not None and len(bal) != num_stages:
            raise BalanceError(f"balance {bal} has {len(bal)} stages but {num_stages} stages were asked for")
    return split_layers(layers, bal), bal
