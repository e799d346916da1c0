"""DistributedOptimizer: averages gradients across ranks in fused buckets while backward runs.

How it works. At construction the parameters are laid out, in reverse registration order
(the order in which backward produces their gradients, as DDP does), into flat per-dtype
bucket buffers of at most ``bucket_bytes`` each. A post-accumulate-grad hook on every
parameter copies its gradient into its slot of the bucket (or finds it already there) and
makes ``param.grad`` a view of that slot. When every parameter of a bucket is ready, and all
earlier buckets have been launched, the bucket is handed to the communicator's background
:class:`~ringpipe.dp.engine.Engine`. Buckets are therefore launched in the same order on every
rank whatever order the hooks fire in, and ``step()`` waits only for what is still in flight.

The first bucket's reduction is announced (:mod:`ringpipe.dp.announce`), which tells every rank
how many ranks still have data; ranks that called :func:`ringpipe.dp.join.join` take part with
zeros, and averages still divide by the full size, as in Horovod. While a rank is joined, every bucket is
announced (other collectives, such as SyncBatchNorm's in backward, may come between two
buckets), and ``step()`` announces the update and sends the joined ranks its hyper-parameters.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ringpipe.comm.base import Communicator, ReduceOp, Work
from ringpipe.dp.agreement import agree, comparable, layout_of, validate
from ringpipe.dp.announce import RIDE_CAP, Note, announce, settle, start_exchange
from ringpipe.dp.buckets import (
    Bucket,
    Slot,
    explicit_groups,
    groups_setting,
    name_parameters,
    reducer,
    timed,
)
from ringpipe.dp.compression import Compression, Compressor
from ringpipe.dp.engine import Engine

__all__ = ["DistributedOptimizer", "DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
_CREATED = itertools.count()


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer`` so that ``step()`` applies gradients averaged over ranks.

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` and ``state`` are shared).
        named_parameters: ``model.named_parameters()``; names appear in error messages.
        compression: ``Compression.none`` / ``fp16`` / ``bf16`` (or their names) for the wire.
        backward_passes_per_step: backward passes whose gradients are summed locally before one
            reduction (divide the loss by it to average them, as with plain accumulation).
        op: ``ReduceOp.AVERAGE`` (default), ``ReduceOp.SUM`` or ``ReduceOp.ADASUM``. With Adasum, as
            in Horovod, each rank steps on its own gradients and the ranks combine the parameter
            updates by Adasum (``ringpipe.collectives.adasum_allreduce``, one combination per
            parameter) instead of averaging gradients; a power-of-two number of ranks, the global set.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it (helps fp16 range); must be 1.0 for other ops.
        bucket_bytes: fusion buffer size in bytes (``bucket_cap_mb`` of DDP, ``HOROVOD_FUSION_THRESHOLD``);
            a bucket is closed once it reaches this size.
        first_bucket_bytes: the smaller cap of the first bucket, so reduction starts early in backward.
        algorithm: ``"native"`` (the backend's allreduce) or a name from ``ringpipe.collectives.ALGORITHMS``.
        comm: the communicator (default: the one of ``ringpipe.init()``).
        num_groups / groups: Horovod's explicit grouping: ``groups`` lists lists of parameters,
            each reduced as one bucket (other parameters alone); an integer splits the trainable
            parameters, in registration order, into that many buckets (``num_groups`` is its
            deprecated spelling).
        sparse_as_dense: reduce sparse gradients as dense ones and keep them dense; without it
            (the default) they are reduced densely too, and handed back sparse.
        process_set: reduce over the ranks of this process set only; on other ranks the optimizer
            steps on local gradients, as in Horovod.
        join_support: announce every step (one small allreduce before the first bucket) so that
            ranks that ran out of data can call :func:`ringpipe.join` and serve the others, as in
            Horovod. ``False`` saves that round trip when every rank runs the same number of
            steps (even shards, as DDP without its ``Join`` context); :func:`ringpipe.join` then
            refuses, naming this setting.

    Construction is collective: every rank must pass the same settings and parameters (names,
    shapes, dtypes); otherwise every rank raises a ``ValueError`` naming what differs.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        compression: Compressor | str | None = None,
        backward_passes_per_step: int = 1,
        op: ReduceOp | str = ReduceOp.AVERAGE,
        gradient_predivide_factor: float = 1.0,
        bucket_bytes: int | None = None,
        algorithm: str | None = None,
        comm: Communicator | None = None,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        join_support: bool = True,
        num_groups: int = 0,
        groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
        sparse_as_dense: bool = False,
        process_set: Any = None,
    ) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already a DistributedOptimizer; wrap the plain torch optimizer once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        # Defaults from Horovod's environment: HOROVOD_FUSION_THRESHOLD (bytes; 0 turns fusion off:
        # one bucket per gradient) and HOROVOD_HIERARCHICAL_ALLREDUCE=1.
        if bucket_bytes is None:
            raw = os.environ.get("HOROVOD_FUSION_THRESHOLD", "").strip()
            if raw and not raw.isdigit():
                raise ValueError(f"HOROVOD_FUSION_THRESHOLD={raw!r} is not a number of bytes; set bytes (0: no fusion)")
            bucket_bytes = max(1, int(raw)) if raw else DEFAULT_BUCKET_BYTES
        if algorithm is None:
            hier = os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE", "").strip().lower() not in ("", "0", "false")
            algorithm = "hierarchical" if hier else "native"
        if num_groups:
            warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                          DeprecationWarning, stacklevel=2)
            if groups is None:
                groups = num_groups
        settings = {
            "groups": groups_setting(optimizer, groups),
            "sparse_as_dense": bool(sparse_as_dense),
            "bucket_bytes": bucket_bytes,
            "first_bucket_bytes": first_bucket_bytes,
            "compression": compression,
            "algorithm": algorithm,
            "backward_passes_per_step": backward_passes_per_step,
            "op": op,
            "gradient_predivide_factor": gradient_predivide_factor,
            "join_support": bool(join_support),
        }
        # Invalid settings are raised only after every rank compared its settings (agree()), so
        # that a setting wrong on one rank does not leave the others waiting for it.
        problem: Exception | None = None
        try:
            rop = validate(op, gradient_predivide_factor, backward_passes_per_step, bucket_bytes, first_bucket_bytes)
            compressor = Compression.parse(compression)
        except ValueError as exc:
            problem = exc
        if comm is None:
            from ringpipe.dp.process_sets import resolve
            from ringpipe.dp.world import NotInitializedError, current

            try:
                current()
            except NotInitializedError:
                if problem is not None:
                    raise problem from None
                raise
            if process_set is not None and process_set.included() is False:
                self._init_local(optimizer)
                return
            if process_set is not None and process_set.process_set_id != 0 and problem is None \
                    and ReduceOp.parse(op) is ReduceOp.ADASUM:
                raise NotImplementedError("Adasum does not support non-global process sets yet.")
            comm = resolve(process_set, "DistributedOptimizer")[0]
        self._local = False
        try:
            self._reduce = reducer(comm, algorithm)
        except ValueError as exc:
            problem = problem or exc
        named: list[tuple[str, torch.nn.Parameter]] = []

        def layout() -> list[tuple[str, tuple[int, ...], str]]:
            named.extend((n, p) for n, p in name_parameters(optimizer, named_parameters) if p.requires_grad)
            return layout_of(named)

        agree(comm, {k: comparable(k, v) for k, v in settings.items()}, layout, problem)

        # Share the wrapped optimizer's groups and state so schedulers and checkpoints see one object.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

        self.comm = comm
        self.engine = Engine.of(comm)
        self.compression = compressor
        self.backward_passes_per_step = backward_passes_per_step
        self.op = rop
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.bucket_bytes = int(bucket_bytes)
        self.first_bucket_bytes = min(int(first_bucket_bytes), self.bucket_bytes)
        self.algorithm = algorithm
        self.join_support = bool(join_support)

        self.sparse_as_dense = bool(sparse_as_dense)
        self._slots = [Slot(p, n) for n, p in named]
        self._buckets = self._make_buckets(self._slots, explicit_groups(groups, self._slots))
        self._next_launch = 0
        self._synchronized = False
        self._should_synchronize = True
        self._active = float(comm.size)  # ranks with data at the last reduction
        self._peers_joined = False
        self._unused: list[int] = []
        # Adasum combines parameter updates in step(), not gradients in backward (Horovod's delta optimizer)
        self._adasum = rop is ReduceOp.ADASUM and comm.size > 1
        self._overlap_header = algorithm == "native" and not self.engine.complete_in_engine
        self._ride = self._ride_of(self._buckets[0]) if self._buckets and self.join_support and not self._adasum else 0
        if self._ride:
            engine = self.engine  # every rank builds its optimizers in the same order: the same length
            engine.run(lambda: setattr(engine, "ride", max(engine.ride, self._ride)), name="ride")
        self._served: Any = None  # a joined rank: the summed start of the first bucket of the step it serves
        self._hooks = [] if self._adasum else [
            s.param.register_post_accumulate_grad_hook(self._make_hook(s)) for s in self._slots
        ]
        self._created = next(_CREATED)
        #: Seconds spent per phase since the last reset when a dict is set here (benchmarks read it):
        #: "copy" (gradients into buckets), "ready_to_sent" (bucket complete to its task starting),
        #: "engine" (bucket tasks: scaling, casts, posting), "copy_out" (results out of the wire)
        #: and "wait" (step() waiting for reductions still in flight).
        self.clock: dict[str, float] | None = None
        self.engine.optimizers.add(self)
        log.debug("DistributedOptimizer: %d parameters in %d buckets", len(self._slots), len(self._buckets))

    # ------------------------------------------------------------------ set-up

    def _init_local(self, optimizer: torch.optim.Optimizer) -> None:
        """A rank outside the process set: no reduction, ``step()`` applies the local gradients."""
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._local = True
        self._synchronized = False
        self._should_synchronize = True
        self._hooks: list[Any] = []

    def _make_buckets(self, slots: list[Slot], explicit: list[list[Slot]] | None = None) -> list[Bucket]:
        """Group parameters, last registered first, into buckets closed once they reach their cap.

        The first bucket's cap is small (``first_bucket_bytes``, as DDP's 1 MiB) so that the
        first reduction starts early in backward and overlaps with the rest of it. With
        ``explicit`` groups (Horovod's ``groups``), each group of one dtype is one bucket.
        """
        if explicit is not None:
            split = []
            for group in reversed(explicit):
                by_kind: dict[tuple[torch.dtype, torch.device], list[Slot]] = {}
                for s in reversed(group):
                    by_kind.setdefault((s.param.dtype, s.param.device), []).append(s)
                split.extend(by_kind.values())
            last = len(split) - 1
            return [Bucket(i, g, bitmap=len(slots) if i == last else 0) for i, g in enumerate(split)]
        open_: dict[tuple[torch.dtype, torch.device], list[Slot]] = {}
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        groups: list[list[Slot]] = []
        for s in reversed(slots):  # backward produces the last parameters' gradients first
            key = (s.param.dtype, s.param.device)
            current = open_.get(key)
            if current is None:
                current = []
                groups.append(current)
                open_[key], sizes[key] = current, 0
            current.append(s)
            sizes[key] += s.param.numel() * s.param.element_size()
            cap = self.first_bucket_bytes if len(groups) == 1 else self.bucket_bytes
            if sizes[key] >= cap:
                del open_[key]
        last = len(groups) - 1
        return [Bucket(i, g, bitmap=len(slots) if i == last else 0) for i, g in enumerate(groups)]

    def _ride_of(self, bucket: Bucket) -> int:
        """How many elements of the first bucket ride in the step's header (float32 wires only)."""
        wire = self.compression.wire_dtype if self.compression.applies_to(bucket.buffer.dtype) else bucket.buffer.dtype
        return min(RIDE_CAP, bucket.buffer.numel()) if wire == torch.float32 else 0

    def _make_hook(self, slot: Slot) -> Callable[[torch.Tensor], None]:
        passes = self.backward_passes_per_step

        def hook(param: torch.Tensor) -> None:
            slot.count += 1
            if slot.count < passes:
                return
            if slot.count > passes:
                raise RuntimeError(
                    f"the gradient of {slot.name!r} was computed {slot.count} times before step() but "
                    f"backward_passes_per_step={passes}: call optimizer.step() (or synchronize()) after every "
                    f"{passes} backward passes, or raise backward_passes_per_step to accumulate more"
                )
            self._synchronized = False
            slot.used = True
            clock = self.clock
            if clock is None:
                self._take_grad(slot)
            else:
                t0 = time.perf_counter()
                self._take_grad(slot)
                clock["copy"] = clock.get("copy", 0.0) + time.perf_counter() - t0
            bucket = slot.bucket
            assert bucket is not None
            bucket.pending -= 1
            if bucket.pending == 0 and clock is not None:
                bucket.ready = time.perf_counter()
            if bucket.pending == 0 and bucket.index == self._next_launch:
                self._launch_ready()

        return hook

    # ------------------------------------------------------------------ buckets

    @staticmethod
    def _take_grad(slot: Slot) -> None:
        """Make ``param.grad`` the bucket view holding the gradient (copy it in if needed)."""
        param, view = slot.param, slot.view
        assert view is not None
        grad = param.grad
        if grad is not None and grad.is_sparse:
            slot.sparse = True
            grad = grad.to_dense()
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
            view.copy_(grad)
        else:
            return
        param.grad = view

    def _launch_ready(self) -> None:
        buckets = self._buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            self._launch(buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket, contribute: bool = True) -> None:
        # Average divides before the sum, on the engine thread while backward continues:
        # by the predivide factor, and by the world size too when there is no predivide factor.
        average = self.op is ReduceOp.AVERAGE
        size = float(self.comm.size)
        factor = self.gradient_predivide_factor
        prescale = (1.0 / size if factor == 1.0 else 1.0 / factor) if average else 1.0
        compressor = self.compression
        reduce = self._reduce
        buffer = bucket.buffer
        used = (
            torch.tensor([float(s.used) for s in self._slots], dtype=buffer.dtype) if bucket.bitmap else None
        )
        # MPI does not match the blocking header allreduce of a joined rank with a non-blocking one
        overlap = self._overlap_header

        def task() -> Any:
            wire = buffer
            if compressor.applies_to(buffer.dtype):
                if bucket.wire is None:
                    bucket.wire = torch.empty_like(buffer, dtype=compressor.wire_dtype)
                wire = bucket.wire
                if prescale != 1.0:
                    torch.mul(buffer, prescale, out=wire)
                else:
                    wire.copy_(buffer)
            elif prescale != 1.0:
                buffer.mul_(prescale)
            if used is not None:
                wire[bucket.numel : bucket.numel + bucket.bitmap] = used
            if not self.join_support:
                return reduce(wire)
            if bucket.index == 0 and contribute:
                return self._first_bucket(wire, overlap)
            settle(self.comm)  # the step's header, read before anything else is posted
            if bucket.index == 0:  # a joined rank: its zeros for the first elements went out with join's header
                ride, served, self._served = self._ride, self._served, None
                if ride:
                    wire[:ride] = served[:ride]
                return _whole(reduce(wire[ride:]), wire) if ride < wire.numel() else wire
            if contribute and self._active < size:
                announce(self.comm, "bucket")
            return reduce(wire)

        def then(wire: torch.Tensor) -> None:
            if wire is not buffer:
                buffer.copy_(wire)
            if bucket.bitmap:
                nobody = buffer[bucket.numel : bucket.numel + bucket.bitmap] == 0
                self._unused = nobody.nonzero().flatten().tolist() if bool(nobody.any()) else []
            if average:
                # Horovod's Average: divided by the full size, ranks that joined contributing zeros.
                scale = 1.0 if factor == 1.0 else factor / size
                if scale != 1.0:
                    buffer[: bucket.numel].mul_(scale)

        run: Callable[[], Any] = task
        finish: Callable[[Any], None] = then
        if self.clock is not None:
            run, finish = timed(self.clock, bucket, task, then)
        # The last bucket is launched when backward is over: nothing is left to overlap with.
        last = bucket.index == len(self._buckets) - 1
        bucket.handle = self.engine.submit(run, finish, name=f"bucket{bucket.index}", inline=last)

    def _first_bucket(self, wire: torch.Tensor, overlap: bool) -> Any:
        """The step's first bucket (engine thread): its first elements ride in the step's header.

        With ``overlap`` (a thread-safe backend, the native allreduce) the rest of the bucket goes
        out right behind the header and the header is read only when it is needed: by the next
        collective posted on the communicator (:func:`~ringpipe.dp.announce.settle`) or by
        ``step()``; so a one-bucket step is one allreduce, as without join support.
        """
        ride = self._ride
        rest = wire.numel() - ride

        def on_note(note: Note) -> None:
            self._active = float(note.count)

        if overlap:
            pending = start_exchange(self.comm, "step", wire, ride, rest, on_note)
            behind = self._reduce(wire[ride:]) if rest else None
            first = pending.work
            assert first is not None

            def wait() -> None:
                pending.wait()
                if behind is not None:
                    behind.wait()

            def test() -> bool:
                done = first.is_completed() and (behind is None or behind.is_completed())
                return done and pending.wait() is not None

            return Work(wait, test, result=wire)
        pending = start_exchange(self.comm, "step", wire, ride, 0, on_note, blocking=self.engine.complete_in_engine)
        pending.note()
        return _whole(self._reduce(wire[ride:]), wire) if rest else wire

    def _launch_all(self, contribute: bool = True) -> None:
        """Launch every bucket not launched yet, with zeros for parameters that got no gradient."""
        passes = self.backward_passes_per_step
        for bucket in self._buckets[self._next_launch :]:
            if bucket.pending:
                for slot in bucket.slots:
                    if slot.count < passes:
                        slot.used = contribute and (slot.count > 0 or slot.param.grad is not None)
                        self._take_grad(slot)
                bucket.pending = 0
            self._launch(bucket, contribute)
        self._next_launch = len(self._buckets)

    def _wait_all(self) -> None:
        t0 = time.perf_counter()
        try:
            for bucket in self._buckets:
                if bucket.handle is not None:
                    bucket.handle.wait()
        finally:
            for bucket in self._buckets:
                bucket.handle = None
                bucket.pending = len(bucket.slots)
            for slot in self._slots:
                slot.count = 0
                slot.used = False
            self._next_launch = 0
            self._peers_joined = self._active < self.comm.size
            if self.clock is not None:
                self.clock["wait"] = self.clock.get("wait", 0.0) + time.perf_counter() - t0
        if not self.sparse_as_dense:
            for slot in self._slots:
                if slot.sparse and slot.param.grad is not None:
                    slot.param.grad = slot.param.grad.to_sparse()
                    slot.sparse = False
        # Parameters that no rank produced a gradient for keep no gradient, as in one process.
        for i in self._unused:
            self._slots[i].param.grad = None
        self._unused = []

    # ------------------------------------------------------------------ public

    def synchronize(self) -> None:
        """Finish reducing every gradient; afterwards ``param.grad`` holds the averaged gradients."""
        if self._local or self._adasum:
            self._synchronized = True
            return
        self._launch_all()
        self._wait_all()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                # Horovod's warning (the gradients are already reduced; they are not reduced again)
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            else:
                self.synchronize()
        self._synchronized = False
        if self._local:
            return self.optimizer.step(closure)
        if self._adasum:
            return self._adasum_step(closure)
        if self._peers_joined:
            self._announce_update()
        return self.optimizer.step(closure)

    def _adasum_step(self, closure: Callable[[], float] | None) -> Any:
        """Horovod's Adasum delta optimizer: start = p; p = 0; step (p = the local update); p = start + Adasum(updates).

        Stepping from zero makes the local update ``-lr * f(g)`` (a weight-decay term sees zero
        weights, as in Horovod); every parameter's update is combined with its own dot products.
        """
        from ringpipe.collectives import adasum_allreduce

        params = [s.param for s in self._slots]
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
            for p in params:
                if p.grad is None:  # a parameter without a gradient keeps its value: its update is zero
                    p.grad = torch.zeros_like(p)
                p.zero_()
        loss = self.optimizer.step(closure)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p.detach())
        for deltas in by_dtype.values():  # one fused Adasum per dtype
            self.engine.run(lambda deltas=deltas: adasum_allreduce(self.comm, deltas), name="adasum-step")
        with torch.no_grad():
            for p, start in zip(params, starts, strict=True):
                p.add_(start)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self.state = self.optimizer.state
        self.param_groups = self.optimizer.param_groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "optimizer", None) is None:  # called by torch.optim.Optimizer.__init__
            super().add_param_group(param_group)
            return
        raise RuntimeError(
            "DistributedOptimizer cannot add parameter groups after construction: add them to the wrapped "
            "optimizer first, then wrap it"
        )

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer then behaves like the wrapped one, without reduction)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __repr__(self) -> str:
        if self._local:
            return f"DistributedOptimizer({self.optimizer!r}, not in its process set: local steps)"
        return f"DistributedOptimizer({self.optimizer!r}, buckets={len(self._buckets)}, op={self.op.value})"


    # ------------------------------------------------------------------ join

    def _serve_step(self, note: Note) -> None:
        """Take part in an announced reduction from a rank that has joined: contribute zeros."""
        for slot in self._slots:
            slot.count, slot.used = 0, False
            assert slot.view is not None
            slot.param.grad = slot.view
        for bucket in self._buckets:
            bucket.buffer.zero_()
            bucket.pending = 0
        self._active = float(note.count)
        self._next_launch = 0
        self._served = note.payload
        self._serve_bucket()

    def _serve_bucket(self) -> None:
        """Take part in the next announced bucket from a rank that has joined."""
        self._launch(self._buckets[self._next_launch], contribute=False)
        self._next_launch += 1
        if self._next_launch == len(self._buckets):
            self._wait_all()

    def _serve_update(self, note: Note) -> None:
        """Apply the reduced gradients on a joined rank, with the hyper-parameters of a rank with data."""
        root = note.have_data[0]
        groups = self.engine.run(lambda: self.comm.broadcast_object(None, root), name="update")
        self.load_hyperparameters(groups)
        self.optimizer.step()

    def _announce_update(self) -> None:
        """Tell joined ranks to apply this step, and send them its hyper-parameters.

        A joined rank no longer runs the training loop, so its learning-rate scheduler stands
        still; without this its steps would use a stale learning rate and its parameters would
        drift away from those of the ranks still training.
        """
        mine = self.hyperparameters()

        def task() -> Any:
            note = announce(self.comm, "apply")
            return self.comm.broadcast_object(mine, note.have_data[0])

        self.engine.run(task, name="update")

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Every parameter group's settings (learning rate, momentum, ...) without its parameters."""
        return [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]

    def load_hyperparameters(self, groups: Sequence[dict[str, Any]]) -> None:
        """Set the parameter groups' settings to ``groups`` (as returned by :meth:`hyperparameters`)."""
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"{len(groups)} groups of hyper-parameters for an optimizer with {len(self.param_groups)} "
                "parameter groups; build the same optimizer on every rank"
            )
        for group, theirs in zip(self.param_groups, groups, strict=True):
            group.update({k: v for k, v in theirs.items() if k != "params"})


def _whole(part: Any, wire: torch.Tensor) -> Any:
    """The reduction of part of ``wire`` (a Work, or done), as one of the whole ``wire``."""
    return Work(part.wait, part.is_completed, result=wire) if isinstance(part, Work) else wire
