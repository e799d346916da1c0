"""Split any ``nn.Module`` into pipeline stages: trace it, cut the graph where named modules begin.

The model is traced with non-strict ``torch.export`` on a sample batch (the batch dimension
dynamic, so micro-batches of any size run). Why export and not ``torch.fx.symbolic_trace``: on
torch 2.13 + transformers 5.24, ``symbolic_trace`` fails on Hugging Face models (their
``forward(**kwargs)`` and data-dependent mask code; transformers 5 no longer ships its own fx
tracer), while non-strict export runs the model's Python as is and records ATen operations,
each tagged with the stack of modules it ran in (``nn_module_stack``). The traced graph keeps
the model's own ``Parameter`` objects, so a weight tied between two stages (GPT-2's token
embedding and LM head) is one object in both stage modules of one process.

A **split point** is the qualified name of a module where a new stage begins (as
``torch.distributed.pipelining``'s ``SplitPoint.BEGINNING``): its stage starts at the first
operation run inside that module. Without split points, stages are balanced over the model's
top-level call sequence (the first-level submodules in the order they first run) by
parameters, as :func:`ringpipe.pipeline.partition.balance_by_params` does for layers.

What crosses a boundary is **relayed**: stage ``s`` returns every value produced before its end
and used after it (hidden states, masks, sizes, model inputs read late), and stage ``s + 1``
takes exactly those. A value made on stage 0 and used on stage 3 travels 0→1→2→3. Relaying keeps
every message between neighbours, which is what every schedule's executor already posts and
prefetches; the price is the bandwidth of relayed values, small next to the hidden states for
the masks and ids of transformer models.

Each stage is a :class:`TracedStage`: called with the tuple of its boundary values (stage 0:
with the batch input, see :mod:`ringpipe.pipeline.model_io`), it returns the tuple of the next
boundary's values; the last stage returns the model's output (a ``ModelOutput`` for a Hugging
Face model). Dropout runs as traced in training mode and is off under ``eval()``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ringpipe.pipeline.model_io import batch_size, call_args

__all__ = ["SplitError", "TracedStage", "ModelSplit", "split_model", "trace_model", "tied_parameters"]


class SplitError(ValueError):
    """A model cannot be traced or split as asked; the message says why and the way out."""


_MANUAL = ("the way out: write the stages yourself and pass a list of stage modules (each takes the "
           "previous stage's output), which every schedule accepts")


def trace_model(model: nn.Module, sample: Any) -> Any:
    """Non-strict ``torch.export`` of ``model`` on batch input ``sample``, batch dimension dynamic."""
    args, kwargs = call_args(sample)
    batch = torch.export.Dim("batch", min=1, max=1 << 20)

    def spec(v: Any) -> Any:
        return {0: batch} if isinstance(v, torch.Tensor) and v.dim() > 0 else None

    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except TypeError as exc:
        raise SplitError(f"the sample batch does not fit {type(model).__name__}.forward: {exc}") from exc
    dynamic = {name: (tuple(spec(v) for v in val) if isinstance(val, tuple) else
                      {k: spec(v) for k, v in val.items()} if isinstance(val, dict) else spec(val))
               for name, val in bound.items()}
    try:
        n = batch_size(sample)
    except TypeError:
        n = 0
    if n < 2:
        raise SplitError("tracing a model needs a sample batch of at least 2 samples (the batch dimension is kept dynamic)")
    try:
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as exc:
        raise SplitError(
            f"cannot trace {type(model).__name__} with torch.export (non-strict, batch dimension dynamic): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; {_MANUAL}"
        ) from exc


def _modules_of(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values()]


def _mutates(node: fx.Node) -> bool:
    """Whether an ATen operation writes into one of its arguments (``relu_``, ``add_``, ``copy_``)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


class TracedStage(nn.Module):
    """One stage of a traced model: a graph over the model's own parameters, one per mode.

    ``forward(values)``: ``values`` is the tuple of boundary values (stage 0: the batch input as
    given to the model). Returns the next boundary's tuple, or the model's output on the last
    stage. The model is traced once in training and once in eval mode (a traced graph keeps
    ``self.training`` as a constant: dropout, attention dropout), so ``train()`` / ``eval()``
    choose the graph; both read the same parameters (registered once, under the train graph).
    """

    #: a stage runtime calls it with its boundary value whole (a mapping is not keyword arguments)
    takes_boundary = True
    #: the graph traced in eval mode, over the train graph's parameters (set past ``nn.Module.__setattr__``)
    eval_graph_module: fx.GraphModule

    def __init__(self, train_graph: fx.GraphModule, eval_graph: fx.GraphModule, index: int, out_spec: Any,
                 in_spec: Any, input_names: list[str] | None, boundary: list[str]) -> None:
        super().__init__()
        self.index = index
        self.first = index == 0
        self.boundary_names = boundary
        self._out_spec = out_spec
        self._in_spec = in_spec
        self._input_names = input_names
        self.graph_module = train_graph
        object.__setattr__(self, "eval_graph_module", eval_graph)  # not a submodule: its parameters are the same

    def _flat_inputs(self, x: Any) -> list[Any]:
        args, kwargs = call_args(x)
        if self._input_names is not None:
            missing = [k for k in self._input_names if k not in kwargs]
            extra = [k for k in kwargs if k not in self._input_names]
            if missing or extra:
                raise SplitError(
                    f"the batch has keys {sorted(kwargs)} but the model was traced with {self._input_names}; "
                    "give every batch the keys of the sample it was split on"
                )
            kwargs = {k: kwargs[k] for k in self._input_names}
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise SplitError(f"the batch's structure {spec} differs from the sample's {self._in_spec} the model was traced with")
        return flat

    def forward(self, values: Any) -> Any:
        flat = self._flat_inputs(values) if self.first else list(values if isinstance(values, tuple | list) else (values,))
        graph = self.graph_module if self.training else self.eval_graph_module
        out = graph(*flat)
        if self._out_spec is not None:
            return pytree.tree_unflatten(list(out), self._out_spec)
        return tuple(out)


def _plain(name: str) -> str:
    """A stage's parameter name without the containers a pipeline wraps it in (``0.``, ``graph_module.``)."""
    parts = name.split(".")
    while parts and (parts[0].isdigit() or parts[0] == "graph_module"):
        parts = parts[1:]
    return ".".join(parts)


def tied_parameters(stages: Sequence[nn.Module], model: nn.Module | None = None) -> dict[str, list[int]]:
    """Parameters held by more than one stage: a name -> the stages holding it, in stage order.

    The name is the parameter's in ``model`` (its first name there) when given, else the first holder's.
    """
    holders: dict[int, list[int]] = {}
    names: dict[int, str] = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            if s not in holders.setdefault(id(p), []):
                holders[id(p)].append(s)
            names.setdefault(id(p), _plain(name))
    return {names[k]: v for k, v in holders.items() if len(v) > 1}


@dataclass
class ModelSplit:
    """Stages of a split model, the modules each begins with, and parameters shared between stages."""

    stages: list[TracedStage]
    split_points: list[str]
    #: per stage, the names of the parameters it holds that another stage also holds (tied weights)
    tied: dict[str, list[int]]


def _auto_points(model: nn.Module, gm: fx.GraphModule, num_stages: int) -> list[str]:
    """Split points balancing parameters over the model's call sequence.

    The units start as the model's top-level modules in the order they first run; while a unit
    holds more than a stage's share of the parameters and calls two or more submodules, it is
    opened into those (GPT-2's ``transformer`` into its embeddings, ``h``, ``ln_f``; ``h`` into
    its blocks). A unit that only wraps one submodule, with no parameters of its own, is opened
    into it too (RoBERTa's ``encoder`` into ``layer``, OPT's ``model`` into ``decoder``), so that
    a wrapper does not hide its blocks. The units are then balanced as layers are
    (:func:`~ringpipe.pipeline.partition.balance_by_size`).
    """
    from ringpipe.pipeline.partition import balance_by_size

    modules = dict(model.named_modules())
    first: dict[str, int] = {}
    for i, n in enumerate(gm.graph.nodes):
        if n.op == "call_function":
            for path in _modules_of(n):
                parts = path.split(".")
                for j in range(1, len(parts) + 1):  # containers never called (ModuleList) count by their children
                    prefix = ".".join(parts[:j])
                    if prefix in modules and prefix not in first:
                        first[prefix] = i

    def size(path: str) -> int:
        return sum(p.numel() for p in modules[path].parameters())

    def called_children(path: str) -> list[str]:
        prefix = f"{path}." if path else ""
        return [prefix + c for c, _ in modules[path].named_children() if prefix + c in first]

    def openable(path: str) -> bool:
        inside = called_children(path)
        wrapper = len(inside) == 1 and not any(True for _ in modules[path].parameters(recurse=False))
        return size(path) > share and (len(inside) >= 2 or wrapper)

    share = sum(p.numel() for p in model.parameters()) / max(1, num_stages)
    units = called_children("")
    while True:
        openable_units = [u for u in units if openable(u)]
        if not openable_units:
            break
        big = max(openable_units, key=size)
        i = units.index(big)
        units[i : i + 1] = called_children(big)
    units.sort(key=lambda u: first[u])
    if len(units) < num_stages:
        raise SplitError(f"cannot split {type(model).__name__} into {num_stages} stages: its call sequence has "
                         f"{len(units)} units ({units}); give split_points or fewer stages")
    bal = balance_by_size([max(1, size(u)) for u in units], num_stages)
    points, i = [], 0
    for b in bal[:-1]:
        i += b
        points.append(units[i])
    return points


def split_model(
    model: nn.Module,
    sample: Any,
    split_points: Sequence[str] | None = None,
    num_stages: int | None = None,
) -> ModelSplit:
    """Split ``model`` into stages beginning at ``split_points`` (or ``num_stages`` balanced by parameters).

    ``sample``: a batch input as the model is called with (tensor, tuple or mapping); its batch
    dimension is kept dynamic. Errors (:class:`SplitError`): a name that is not a submodule, a
    split point the model never runs, points out of call order or leaving a stage empty, a
    model that cannot be traced.
    """
    names = dict(model.named_modules())
    if split_points is not None:
        points = [str(p) for p in split_points]
        unknown = [p for p in points if p not in names or p == ""]
        if unknown:
            near = [n for n in names if n and any(n.startswith(u.rsplit(".", 1)[0]) for u in unknown)][:8]
            top = [n for n, _ in model.named_children()]
            shown = (f"; modules there: {near}" if near else
                     f"; its top-level modules: {top[:8]}{' ...' if len(top) > 8 else ''}" if top else "")
            raise SplitError(
                f"split point(s) {unknown} name no submodule of {type(model).__name__}{shown}"
                "; give qualified names as in model.named_modules()"
            )
        if len(set(points)) != len(points):
            raise SplitError(f"split points {points} repeat a name; each stage begins at its own module")
    was_training = model.training
    try:
        model.train()
        ep_train = trace_model(model, sample)
        model.eval()
        ep_eval = trace_model(model, sample)
    finally:
        model.train(was_training)
    gm_train, gm_eval = ep_train.module(), ep_eval.module()
    if split_points is None:
        if num_stages is None:
            raise SplitError("give split_points or a number of stages")
        points = _auto_points(model, gm_train, num_stages) if num_stages > 1 else []
    train_cut = _cut(gm_train, points)
    eval_cut = _cut(gm_eval, points)
    _, kwargs = call_args(sample)
    input_names = list(kwargs) if kwargs else None
    stages = [
        TracedStage(tg, eg, k, ep_train.call_spec.out_spec if k == len(points) else None,
                    ep_train.call_spec.in_spec, input_names, names)
        for k, ((tg, names), (eg, _)) in enumerate(zip(train_cut, eval_cut, strict=True))
    ]
    return ModelSplit(stages, points, tied_parameters(stages, model))


def _cut(gm: fx.GraphModule, points: list[str]) -> list[tuple[fx.GraphModule, list[str]]]:
    """``gm`` cut where each of ``points`` begins: per stage, its graph module and the names of the values it passes on."""
    nodes = list(gm.graph.nodes)
    begins: list[int] = []
    for p in points:
        pos = next((i for i, n in enumerate(nodes) if n.op == "call_function"
                    and any(m == p or m.startswith(p + ".") for m in _modules_of(n))), None)
        if pos is None:
            raise SplitError(f"split point {p!r} is a module that the traced forward never runs; split at a module it calls")
        begins.append(pos)
    for (a, pa), (b, pb) in zip(zip(begins, points, strict=True), zip(begins[1:], points[1:], strict=True), strict=False):
        if a == b:
            raise SplitError(f"split points {pa!r} and {pb!r} begin at the same operation: the stage between them "
                             "would be empty; drop one of them")
    if any(b > a for a, b in zip(begins[1:], begins, strict=False)):
        order = [p for _, p in sorted(zip(begins, points, strict=True))]
        raise SplitError(f"split points {points} are not in the order the model runs them ({order}); "
                         "list them in call order")
    # stage of every node: how many split points begin at or before it (inputs: stage 0)
    stage_of: dict[fx.Node, int] = {}
    s = 0
    compute = [0] * (len(points) + 1)
    for i, n in enumerate(nodes):
        while s < len(begins) and i >= begins[s]:
            s += 1
        if n.op == "call_function":
            stage_of[n] = s
            compute[s] += 1
        elif n.op == "placeholder":
            stage_of[n] = 0
    empty = [k for k, c in enumerate(compute) if c == 0]
    if empty:
        raise SplitError(f"split points {points} leave stage(s) {empty} without any operation; drop or move a split point")
    last = len(points)
    out_node = next(n for n in nodes if n.op == "output")
    last_use: dict[fx.Node, int] = {}  # value -> last stage using it (the output: the last stage)
    for n in nodes:
        if n.op in ("call_function", "output"):
            user_stage = stage_of.get(n, last)
            for a in n.all_input_nodes:
                if a.op != "get_attr":
                    last_use[a] = max(last_use.get(a, 0), user_stage)
    # relayed: boundary k holds every value made before stage k and used at or after it
    boundaries: list[list[fx.Node]] = [
        [n for n in nodes if n in stage_of and stage_of[n] < k and last_use.get(n, -1) >= k] for k in range(last + 2)
    ]
    out: list[tuple[fx.GraphModule, list[str]]] = []
    for k in range(last + 1):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs = [n for n in nodes if n.op == "placeholder"] if k == 0 else boundaries[k]
        for n in inputs:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
        # an in-place operation on a boundary input (ReLU(inplace=True) where the stage begins) works on a
        # copy: the received tensor is a gradient leaf, kept for recomputation, and may be relayed on unchanged
        given = set(inputs)
        written = {a for n in nodes if n.op == "call_function" and stage_of[n] == k and _mutates(n)
                   for a in n.args if isinstance(a, fx.Node) and a in given}
        for n in (n for n in inputs if n in written):
            env[n] = g.call_function(torch.ops.aten.clone.default, (env[n],))
        for n in nodes:
            if n.op == "call_function" and stage_of[n] == k:
                for a in n.all_input_nodes:
                    if a.op == "get_attr" and a not in env:
                        env[a] = g.get_attr(a.target)
                env[n] = g.node_copy(n, env.__getitem__)
        if k == last:
            g.output(tuple(env[a] if isinstance(a, fx.Node) else a for a in out_node.args[0]))
            names: list[str] = []
        else:
            g.output(tuple(env[n] for n in boundaries[k + 1]))
            names = [n.name for n in boundaries[k + 1]]
        g.eliminate_dead_code()
        out.append((fx.GraphModule(gm, g, class_name=f"Stage{k}"), names))
    return out


def stage_boundary_check(value: Any, where: str) -> None:
    """Raise :class:`SplitError` if ``value`` holds anything but tensors and constants (int, float, bool, None)."""
    if isinstance(value, torch.Tensor | int | float | bool | str) or value is None:
        return
    if isinstance(value, tuple | list):
        for i, v in enumerate(value):
            stage_boundary_check(v, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            stage_boundary_check(v, f"{where}[{k!r}]")
        return
    raise SplitError(f"{where} is a {type(value).__name__}; a stage boundary carries tensors, int, float, bool and None")
