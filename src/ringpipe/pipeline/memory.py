"""A pipeline stage's memory: predicted from the schedule before a run, measured during it.

What a stage holds at the boundary between two of its actions is

- its **parameters** and their **gradients** (present from the first backward that
  accumulates into ``p.grad`` until the step clears them: ``B``, or ``W`` where the backward is
  split);
- its **optimizer state** (present once the optimizer has stepped);
- the **activations** of every micro-batch in flight: autograd's saved tensors of its forward,
  its input and its outputs (only the input with recomputation). Where the backward is split
  (``zb_h1``, ``zb_h2``) ringpipe's ``B`` keeps the whole graph for ``W`` and adds the gradient
  of each layer's output (the per-layer weight pass of the split backward, :mod:`ringpipe.pipeline.stage`),
  so a micro-batch holds more between its ``B`` and its ``W`` than before its ``B``;
- the **weight stashes** of an asynchronous stage with weight stashing (one copy of the
  stage's parameters per weight version that a micro-batch in flight still has to backward
  on, :mod:`ringpipe.pipeline.staleness.stash`).

**Prediction** (:func:`predict_stage`): one micro-batch's forward is run once through the
stage under :func:`torch.autograd.graph.saved_tensors_hooks`, counting the unique storages of
the tensors autograd saves (parameters excluded), plus the stage input and outputs
(:func:`microbatch_footprint`); the optimizer state is measured with one step of the same
optimizer on copies of the parameters (:func:`optimizer_state_bytes`); then the action list
is walked, keeping count of what is held after each action, and the largest total is the
stage's peak.

**Measurement** (:class:`MemoryMeter`): attached to a running stage, it samples after each
forward, backward, weight pass and step the bytes the stage holds: the unique storages
reachable from the graphs of its micro-batches in flight (walked through autograd's
``_saved_*`` attributes, a different route from the prediction's hooks), the kept inputs and
outputs, the split backward's pending gradients, ``p.grad``, the optimizer's state and the
policy's stashes. On a GPU it also reports ``torch.cuda.max_memory_allocated``, which counts
the working memory *inside* a pass too (not part of the prediction).

Not counted: working memory inside a pass (intermediate gradients of a backward, the
temporary weight copy a stash's ``load`` makes), message buffers, and the Python objects
around the tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ringpipe.pipeline.actions import Action
from ringpipe.pipeline.model_io import logits_of, tensors_of
from ringpipe.pipeline.schedule_checks import staleness_at_forward

__all__ = [
    "MemoryBudgetError",
    "MemoryMeter",
    "MicrobatchFootprint",
    "StageMemory",
    "format_bytes",
    "held_activation_bytes",
    "microbatch_footprint",
    "optimizer_state_bytes",
    "parse_bytes",
    "predict_stage",
    "stash_kind",
]


class MemoryBudgetError(ValueError):
    """A memory budget cannot be read, or a planned schedule does not fit it."""


# ----------------------------------------------------------------------------- sizes


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if s.nbytes() == 0:
        return None
    return s.data_ptr(), s.nbytes()


def _bytes_of(tensors: Iterable[torch.Tensor], exclude: set[int] | frozenset[int] = frozenset()) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        key = _storage_key(t)
        if key is not None and key[0] not in exclude:
            seen[key[0]] = key[1]
    return sum(seen.values())


def _param_storages(params: Iterable[torch.Tensor]) -> set[int]:
    return {k[0] for k in (_storage_key(p) for p in params) if k is not None}


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``3.2 KiB``, ``1.50 MiB``, ``2.00 GiB``."""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_bytes(text: str | int | float) -> int:
    """A size such as ``2G``, ``512MiB``, ``1.5 GB`` or ``1000000`` in bytes (binary units)."""
    if isinstance(text, int | float):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise MemoryBudgetError(f"cannot read the memory size {text!r}; write it like 2G, 512M, 1.5GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# ----------------------------------------------------------------------------- one micro-batch


@dataclass(frozen=True)
class MicrobatchFootprint:
    """What one micro-batch's forward leaves on a stage (bytes).

    ``activations``: saved tensors, input and outputs (what it holds from ``F`` to its
    backward); ``kept_input``: the input alone (what recomputation holds); ``split_extra``:
    what ringpipe's split backward adds from ``B`` to ``W`` (the gradients of the layer
    outputs); ``split_captured``: layer outputs the split backward keeps from ``F`` that
    autograd did not save; ``split_freed``: what the split backward's ``B`` frees (the last
    stage's loss graph, which the per-layer weight pass does not need).
    """

    activations: int
    kept_input: int
    split_extra: int = 0
    split_captured: int = 0
    split_freed: int = 0


def _call(module: nn.Module, inputs: Any) -> Any:
    """A stage's call on its input: a mapping (a model's keyword batch) as is, a tuple's one element alone."""
    if isinstance(inputs, Mapping):
        return module(inputs)
    return module(inputs[0]) if len(inputs) == 1 else module(inputs)


def _copied(value: Any, grad: Callable[[torch.Tensor], bool]) -> Any:
    """``value`` with each tensor detached and copied, requiring grad where ``grad(tensor)``, as a stage receives it."""
    if isinstance(value, torch.Tensor):
        leaf = value.detach().clone()
        return leaf.requires_grad_(True) if grad(value) and leaf.is_floating_point() else leaf
    if isinstance(value, Mapping):
        return {k: _copied(v, grad) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return tuple(_copied(v, grad) for v in value)
    return value


def _weight_layers(module: nn.Module) -> list[nn.Module] | None:
    """The layers the split backward's per-layer weight pass uses (``None``: the whole-graph pass)."""
    if not isinstance(module, nn.Sequential):
        return None
    layers, owned = [], []
    for layer in module.children():
        params = [p for p in layer.parameters() if p.requires_grad]
        if params:
            layers.append(layer)
            owned += [id(p) for p in params]
    all_params = [p for p in module.parameters() if p.requires_grad]
    return layers if len(owned) == len(set(owned)) == len(all_params) else None


def microbatch_footprint(
    module: nn.Module,
    inputs: Any,
    first: bool,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
) -> tuple[MicrobatchFootprint, Any]:
    """Run one micro-batch's forward through ``module`` and count what it leaves; returns the footprint and the outputs.

    ``inputs``: a tensor, a sequence of values, or a mapping (a traced model's keyword batch);
    ``first``: the stage is the first (its input needs no gradient). Past the first stage, a
    floating input takes a gradient when it required one where it was made (the previous stage's
    outputs returned here keep that mark), as a run sends gradients back only for those (a traced
    Llama's rotary ``cos``/``sin`` take none); inputs none of which is marked all take one.
    ``loss_fn`` and ``target``:
    the last stage's loss, whose saved tensors count too; a model output with ``logits`` (a
    Hugging Face ``ModelOutput``) gives the loss its logits, as the runs do. The module's
    buffers and the random state are left as they were.
    """
    given = inputs if isinstance(inputs, Mapping) else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    marked = any(t.requires_grad for t in tensors_of(given))
    x = _copied(given, lambda t: not first and (t.requires_grad or not marked))
    leaves = tensors_of(x)
    params = _param_storages(module.parameters())
    saved: list[torch.Tensor] = []
    layer_outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: layer_outs.extend(tensors_of(out)))
             for layer in (_weight_layers(module) or [])]
    buffers = {k: v.clone() for k, v in module.state_dict().items() if not isinstance(v, nn.Parameter)}
    rng = torch.random.get_rng_state()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            raw = _call(module, x)
            out = tensors_of(raw)
            loss = None
            in_module = len(saved)
            if loss_fn is not None:
                if isinstance(raw, Mapping) or hasattr(raw, "logits"):
                    value = logits_of(raw)
                else:
                    value = out[0] if len(out) == 1 else tuple(out)
                loss = loss_fn(value, target)
    finally:
        for h in hooks:
            h.remove()
        module.load_state_dict(buffers, strict=False)
        torch.random.set_rng_state(rng)
    held = [*saved, *leaves, *(out if loss is None else []), *([loss] if loss is not None else [])]
    act = _bytes_of(held, params)
    held_keys = {k[0] for k in (_storage_key(t) for t in held) if k is not None}
    captured = [t for t in layer_outs if (k := _storage_key(t)) is not None and k[0] not in held_keys]
    # B to W: the gradient of each layer's output (per-layer pass), else of the stage outputs
    extra = _bytes_of(layer_outs) if layer_outs else (0 if loss is not None else _bytes_of(out))
    freed = 0
    if layer_outs and loss is not None:  # B drops the loss graph: what only it holds is freed
        module_keys = {k[0] for k in (_storage_key(t) for t in [*saved[:in_module], *leaves, *out]) if k is not None}
        freed = _bytes_of([*saved[in_module:], loss], module_keys)
    fp = MicrobatchFootprint(act, _bytes_of(leaves), extra, _bytes_of(captured), freed)
    passed_on = _copied(raw, lambda t: t.requires_grad)  # leaves, marked as the next stage receives them
    return fp, passed_on if isinstance(passed_on, tuple) else (passed_on,)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                          params: Sequence[torch.Tensor]) -> int:
    """Bytes of the state ``optimizer`` keeps for ``params`` once it has stepped.

    ``optimizer``: an optimizer (one of the same class and settings is made) or a factory
    ``params -> optimizer``. Measured with one step of zero gradients on copies of ``params``.
    """
    clones = [nn.Parameter(p.detach().clone(), requires_grad=True) for p in params if p.requires_grad]
    if not clones:
        return 0
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = type(optimizer)(clones, **optimizer.defaults)
    else:
        opt = optimizer(clones)
    for p in clones:
        p.grad = torch.zeros_like(p)
    opt.step()
    return _bytes_of(t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))


# ----------------------------------------------------------------------------- prediction


@dataclass
class StageMemory:
    """A stage's peak memory and its parts at the peak (bytes); ``in_flight``: micro-batches held then."""

    peak: int = 0
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    stashes: int = 0
    in_flight: int = 0
    gpu_peak: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("extra")
        if self.gpu_peak is None:
            out.pop("gpu_peak")
        return out | self.extra


def predict_stage(
    actions: Sequence[Action],
    footprints: Mapping[int, MicrobatchFootprint] | MicrobatchFootprint,
    param_bytes: int,
    optimizer_bytes: int,
    recompute: bool = False,
    stash: str | None = None,
    batch_input: int = 0,
) -> StageMemory:
    """The peak of what a stage holds while it runs ``actions``.

    ``footprints``: per chunk (or one for all chunks) what one micro-batch leaves;
    ``param_bytes``: the stage's trainable parameters (gradients are as large);
    ``optimizer_bytes``: its optimizer state; ``recompute``: only the input is held from ``F``
    to the backward; ``stash``: ``"step"`` (weight stashing, one copy per weight version in
    use) or ``"microbatch"`` (one per stale micro-batch, as under weight prediction), ``None``
    for no stash. The optimizer state is counted as present (it is, from the first step on).
    """
    fps = footprints if isinstance(footprints, Mapping) else None
    split = {(a.chunk, a.mb) for a in actions if a.kind == "W"}
    stale = staleness_at_forward(actions) if stash else {}
    held: dict[tuple[int, int], int] = {}
    grads = False
    steps = 0
    users: dict[Any, int] = {}
    key_of: dict[int, Any] = {}
    best = StageMemory(params=param_bytes, optimizer=optimizer_bytes)
    best.peak = param_bytes + optimizer_bytes

    def fp(chunk: int) -> MicrobatchFootprint:
        return fps[chunk] if fps is not None else footprints  # type: ignore[return-value]

    for a in actions:
        key = (a.chunk, a.mb)
        f = fp(a.chunk) if a.kind != "S" else None
        if a.kind == "F":
            assert f is not None
            if recompute:
                held[key] = f.kept_input
            else:
                held[key] = f.activations + (f.split_captured if key in split else 0)
            if stash and stale.get(a.mb, 0) > 0:
                k = ("step", steps) if stash == "step" else ("mb", a.mb)
                users[k] = users.get(k, 0) + 1
                key_of[a.mb] = k
        elif a.kind == "B":
            assert f is not None
            if key in split:
                held[key] = (f.activations + f.split_captured if recompute else held[key]) + f.split_extra - f.split_freed
            else:
                held.pop(key, None)
                grads = True
            k = key_of.pop(a.mb, None)
            if k is not None:
                users[k] -= 1
                if not users[k]:
                    del users[k]
        elif a.kind == "W":
            held.pop(key, None)
            grads = True
        else:
            grads = False
            steps += 1
        acts = sum(held.values())
        if batch_input:
            live: dict[int, int] = {}
            for _, mb in held:
                live[mb // batch_input] = live.get(mb // batch_input, 0) + 1
            acts += sum((batch_input - n) * fp(0).kept_input for n in live.values())
        total = param_bytes + optimizer_bytes + acts + (param_bytes if grads else 0) + len(users) * param_bytes
        if total > best.peak:
            best = StageMemory(total, param_bytes, param_bytes if grads else 0, optimizer_bytes,
                               acts, len(users) * param_bytes, len(held))
    return best


# ----------------------------------------------------------------------------- measurement


def _saved_tensors(fn: Any) -> Iterable[torch.Tensor]:
    for name in dir(fn):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(fn, name)
        except RuntimeError:  # freed after a backward
            continue
        yield from tensors_of(value)
    var = getattr(fn, "variable", None)  # AccumulateGrad: a leaf (a parameter or a kept input)
    if isinstance(var, torch.Tensor):
        yield var


def _graph_tensors(roots: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        out.extend(_saved_tensors(fn))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return out


def _runtime_tensors(rt: Any) -> list[torch.Tensor]:
    """Every tensor a stage runtime holds for its micro-batches in flight (kept graphs walked)."""
    held: list[torch.Tensor] = []
    roots: list[torch.Tensor] = []
    for rec in getattr(rt, "_records", {}).values():
        held += list(rec.inputs)
        if rec.outputs:
            held += list(rec.outputs)
            roots += list(rec.outputs)
        if rec.loss is not None:
            held.append(rec.loss)
            roots.append(rec.loss)
    for captured in getattr(rt, "_outputs", {}).values():
        held += [t for _, t, _ in captured if isinstance(t, torch.Tensor)]
    for pending in getattr(rt, "_pending", {}).values():
        for out, grad, _ in pending.layers or []:
            held += [out, grad]
            roots.append(out)
        held += list(pending.roots or []) + list(pending.grads or [])
        roots += list(pending.roots or [])
    return held + _graph_tensors(roots)


def held_activation_bytes(runtimes: Sequence[Any]) -> int:
    """Bytes of the unique storages a stage's runtimes hold for micro-batches in flight, parameters excluded."""
    params = _param_storages(p for rt in runtimes for p in rt.module.parameters())
    return _bytes_of((t for rt in runtimes for t in _runtime_tensors(rt)), params)


class MemoryMeter:
    """Samples what one stage holds after each of its actions, and keeps the peak.

    ``attach(runtimes, executor, optimizer, policy)`` wraps the runtimes' ``forward``,
    ``backward``, ``backward_input`` and ``backward_weight`` and the executor's ``step`` on
    these objects only (their classes are untouched), so the stage runs as before and the
    meter samples after each call. :attr:`peak` holds the parts at the largest total.
    ``steps``: stop sampling after this many optimizer steps (``None``: never); a schedule
    repeats from step to step, so its peak is reached in the first steps, and a long run does
    not pay for a walk of its graphs after every action.
    """

    def __init__(self, steps: int | None = None) -> None:
        self.max_steps = steps
        self.steps = 0
        self.error = ""  # why sampling stopped early, if it did
        self.peak = StageMemory()
        self.samples = 0
        self._runtimes: list[Any] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._policy: Any = None
        self._params: list[torch.Tensor] = []
        self._cuda = False

    def attach(self, runtimes: Sequence[Any], executor: Any, optimizer: torch.optim.Optimizer,
               policy: Any = None) -> MemoryMeter:
        self._runtimes = list(runtimes)
        self._optimizer = optimizer
        self._policy = policy
        self._params = [p for rt in self._runtimes for p in rt.module.parameters() if p.requires_grad]
        self._cuda = any(p.is_cuda for p in self._params)
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        for rt in self._runtimes:
            for name in ("forward", "backward", "backward_input", "backward_weight"):
                if hasattr(rt, name):
                    setattr(rt, name, self._wrap(getattr(rt, name)))
        executor.step = self._wrap(executor.step, step=True)
        return self

    @property
    def active(self) -> bool:
        """Whether the meter still samples."""
        return self.max_steps is None or self.steps < self.max_steps

    def _wrap(self, fn: Callable[..., Any], step: bool = False) -> Callable[..., Any]:
        def sampled(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if self.active:
                try:
                    self.sample()
                except Exception as exc:  # noqa: BLE001 - a measurement must never stop the training it watches
                    self.error = f"{type(exc).__name__}: {exc}"
                    self.max_steps = self.steps  # stop sampling
                self.steps += step
            return out

        return sampled

    def sample(self) -> StageMemory:
        """What the stage holds now; updates :attr:`peak`."""
        params = _bytes_of(self._params)
        grads = _bytes_of(p.grad for p in self._params if p.grad is not None)
        opt = 0
        if self._optimizer is not None:
            opt = _bytes_of(t for st in self._optimizer.state.values() for t in st.values()
                            if isinstance(t, torch.Tensor))
        stashes = int(getattr(self._policy, "stashed_bytes", 0) or 0)
        acts = held_activation_bytes(self._runtimes)
        now = StageMemory(params + grads + opt + acts + stashes, params, grads, opt, acts, stashes,
                          sum(rt.in_flight for rt in self._runtimes))
        self.samples += 1
        if now.peak > self.peak.peak:
            self.peak = now
        if self._cuda:
            self.peak.gpu_peak = int(torch.cuda.max_memory_allocated())
        return now


def stash_kind(mitigations: Any) -> str | None:
    """How an asynchronous stage's mitigations keep weights: ``"step"`` (ws), ``"microbatch"`` (ws with wp), or ``None``."""
    if not mitigations:
        return None
    names = set(mitigations.replace("+", " ").split()) if isinstance(mitigations, str) else set(mitigations)
    if "ws" not in names:
        return None
    return "microbatch" if "wp" in names else "step"

