"""GradientReducer: from a gradient ready in backward to its bucket reduced across ranks.

The object a :class:`~ringpipe.dp.optimizer.DistributedOptimizer` owns for everything that runs
every step between backward and the update: at construction the parameters are laid out in
fusion buckets (:mod:`ringpipe.dp.buckets`); a post-accumulate-grad hook per parameter copies
its gradient into its slot of a bucket, already divided as an Average needs it (one pass over
the gradient, not a copy and a scaling), and makes ``param.grad`` a view of that slot; a complete
bucket is launched on the communicator's :class:`~ringpipe.core.engine.Engine` once every earlier
bucket is, so buckets go out in the same order on every rank; :meth:`GradientReducer.synchronize`
waits only for what is still in flight, and hands each bucket to a caller's function as soon as
it is reduced (the optimizer steps by bucket that way, :mod:`ringpipe.dp.bucket_step`). With
join support the first bucket's start rides in the step's announcement
(:mod:`ringpipe.check.announcement`), and a rank that joined takes part in the buckets of the ranks
with data with zeros (:meth:`GradientReducer.serve_step`, :meth:`GradientReducer.serve_bucket`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ringpipe.check.announcement import RIDE_CAP, RIDING, Note, announce, settle, start_exchange
from ringpipe.comm.base import Communicator, ReduceOp, Work
from ringpipe.core.compression import Compressor
from ringpipe.core.engine import Engine
from ringpipe.core.errors import from_transport
from ringpipe.dp.buckets import Bucket, Slot, explicit_groups, make_buckets, timed

__all__ = ["GradientReducer"]


class GradientReducer:
    """The buckets of a ``DistributedOptimizer``'s gradients, their hooks, launches and waits.

    Args:
        comm: the communicator the gradients are reduced over.
        named: the (name, parameter) pairs to reduce, in registration order.
        reduce: the sum-allreduce of a bucket (:func:`ringpipe.dp.buckets.bucket_allreduce` of ``algorithm``).
        algorithm: the name ``reduce`` was built from.
        compression: the wire's compressor.
        op: Average, Sum or Adasum (Adasum: no hooks, the optimizer combines updates in ``step()``).
        gradient_predivide_factor, backward_passes_per_step, join_support: as the optimizer's.
        groups: Horovod's ``groups`` (validated here against the parameters).
        first_bucket_bytes, bucket_bytes: the caps of the first (and tail) bucket and of the others.
        hold: ready buckets wait for :meth:`synchronize` instead of going out during backward.
    """

    def __init__(
        self,
        comm: Communicator,
        named: list[tuple[str, torch.nn.Parameter]],
        reduce: Callable[[torch.Tensor], Any],
        *,
        algorithm: str,
        compression: Compressor,
        op: ReduceOp,
        gradient_predivide_factor: float,
        backward_passes_per_step: int,
        join_support: bool,
        groups: Any,
        first_bucket_bytes: int,
        bucket_bytes: int,
        hold: bool,
    ) -> None:
        self.comm = comm
        self.engine = Engine.of(comm)
        self.algorithm = algorithm
        self.compression = compression
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.backward_passes_per_step = backward_passes_per_step
        self.join_support = bool(join_support)
        self.bucket_bytes = int(bucket_bytes)
        self.first_bucket_bytes = min(int(first_bucket_bytes), self.bucket_bytes)
        self.slots = [Slot(p, n) for n, p in named]
        self.buckets = make_buckets(self.slots, explicit_groups(groups, self.slots), self.first_bucket_bytes,
                                    self.bucket_bytes, tail_cap=self.first_bucket_bytes)
        #: Adasum combines parameter updates in the optimizer's step(), not gradients in backward
        #: (Horovod's delta optimizer): no hooks then.
        self.adasum = op is ReduceOp.ADASUM and comm.size > 1
        #: Whether some rank had joined at the last reduction (the optimizer then announces its update).
        self.peers_joined = False
        #: Whether a gradient has arrived since the last reduction finished (``synchronize()`` must run again).
        self.unreduced = False
        #: Seconds spent per phase since the last reset when a dict is set here (benchmarks read it,
        #: through ``DistributedOptimizer.clock``): "copy" (gradients into buckets), "ready_to_sent"
        #: (bucket complete to its task starting), "engine" (bucket tasks: scaling, casts, posting),
        #: "copy_out" (results out of the wire), "wait" (waiting for reductions still in flight) and
        #: "bucket_step" (the optimizer's updates by bucket while later buckets travel).
        self.clock: dict[str, float] | None = None
        self._reduce = reduce
        self._hold = hold
        self._next_launch = 0
        self._active = float(comm.size)  # ranks with data at the last reduction
        self._unused: list[int] = []
        self._overlap_header = algorithm == "native" and not self.engine.complete_in_engine
        average = op is ReduceOp.AVERAGE
        factor = self.gradient_predivide_factor
        self._prescale = (1.0 / comm.size if factor == 1.0 else 1.0 / factor) if average else 1.0
        self._ride = self._ride_of(self.buckets[0]) if self.buckets and self.join_support and not self.adasum else 0
        if self._ride:
            engine = self.engine  # every rank builds its optimizers in the same order: the same length
            engine.run(lambda: setattr(engine, "ride", max(engine.ride, self._ride)), name="ride")
        self._served: torch.Tensor | None = None  # a joined rank: the summed start of the first bucket it serves
        self._hooks: list[Any] = [] if self.adasum else [
            s.param.register_post_accumulate_grad_hook(self._make_hook(s)) for s in self.slots
        ]

    # ------------------------------------------------------------------ public

    def rebind(self, comm: Communicator, reduce: Callable[[torch.Tensor], Any]) -> None:
        """Reduce over ``comm`` from now on (an elastic job's new world); forget any step in flight.

        The buckets keep their layout (the parameters did not change); what belonged to the old
        world (its engine, its size, launched buckets and counts of the interrupted step) starts afresh.
        """
        self.comm, self.engine, self._reduce = comm, Engine.of(comm), reduce
        self.adasum = self.op is ReduceOp.ADASUM and comm.size > 1
        self._active = float(comm.size)
        self._overlap_header = self.algorithm == "native" and not self.engine.complete_in_engine
        if self.op is ReduceOp.AVERAGE:
            factor = self.gradient_predivide_factor
            self._prescale = 1.0 / comm.size if factor == 1.0 else 1.0 / factor
        for slot in self.slots:
            slot.count, slot.used = 0, False
        for bucket in self.buckets:
            bucket.handle, bucket.wire = None, None
            bucket.pending = len(bucket.slots)
        self._next_launch = 0
        self.unreduced = False
        self.peers_joined = False
        if self._ride:  # the new engine carries this optimizer's first bucket in its announcements, as at build
            engine = self.engine
            engine.run(lambda: setattr(engine, "ride", max(engine.ride, self._ride)), name="ride")

    @property
    def parameter_names(self) -> dict[torch.Tensor, str]:
        """Each reduced parameter's name (unique, the same on every rank)."""
        return {slot.param: slot.name for slot in self.slots}

    def synchronize(self, after: Callable[[Bucket], None] | None = None) -> None:
        """Launch every bucket not launched yet and wait for all of them, in launch order.

        ``after(bucket)`` runs as soon as each one is reduced (while later ones may still travel).
        Afterwards ``param.grad`` holds the reduced gradients.
        """
        self._launch_all()
        self._wait_all(after)

    def serve_step(self, note: Note) -> None:
        """Take part in an announced reduction from a rank that has joined: contribute zeros."""
        for slot in self.slots:
            slot.count, slot.used = 0, False
            assert slot.view is not None
            slot.param.grad = slot.view
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.pending = 0
        self._active = float(note.count)
        self._next_launch = 0
        self._served = note.payload
        self.serve_bucket()

    def serve_bucket(self) -> None:
        """Take part in the next announced bucket from a rank that has joined."""
        self._launch(self.buckets[self._next_launch], contribute=False)
        self._next_launch += 1
        if self._next_launch == len(self.buckets):
            self._wait_all()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (gradients then stay local)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ every step

    def _ride_of(self, bucket: Bucket) -> int:
        """How many elements of the first bucket ride in the step's header (a float32 message).

        float32, and the float16 and bfloat16 wires of compression: float32 holds those values
        exactly, so they ride widened and are rounded back once summed (a single rounding of the
        sum, as the backend's widened half-precision sum gives); float64 would lose digits.
        """
        wire = self.compression.wire_dtype if self.compression.applies_to(bucket.buffer.dtype) else bucket.buffer.dtype
        return min(RIDE_CAP, bucket.buffer.numel()) if wire in RIDING else 0

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
            self.unreduced = True
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
            if bucket.pending == 0 and bucket.index == self._next_launch and not self._hold:
                self._launch_ready()

        return hook

    def _take_grad(self, slot: Slot) -> None:
        """Make ``param.grad`` the bucket view holding the gradient, divided as an Average needs it.

        Average divides before the sum: by the predivide factor, and by the world size too when
        there is no predivide factor (:attr:`_prescale`); fused with the copy into the bucket.
        """
        param, view = slot.param, slot.view
        assert view is not None
        scale = self._prescale
        grad = param.grad
        if grad is not None and grad.is_sparse:
            slot.sparse = True
            grad = grad.to_dense()
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
            if scale == 1.0:
                view.copy_(grad)
            else:
                torch.mul(grad, scale, out=view)
        else:  # accumulated into the bucket already
            if scale != 1.0:
                view.mul_(scale)
            return
        param.grad = view

    def _launch_ready(self) -> None:
        buckets = self.buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            self._launch(buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket, contribute: bool = True) -> None:
        # The gradients were divided before the sum as they were copied in (_take_grad).
        average = self.op is ReduceOp.AVERAGE
        size = float(self.comm.size)
        factor = self.gradient_predivide_factor
        compressor = self.compression
        reduce = self._reduce
        buffer = bucket.buffer
        # The last bucket carries, per parameter, whether this rank had its gradient (summed: how
        # many ranks had it). A rank that had every gradient sends ones and, as then no parameter
        # can lack a gradient on every rank, has nothing to look for in the sum.
        everywhere = bool(bucket.bitmap) and all(s.used for s in self.slots)
        used = (
            torch.tensor([float(s.used) for s in self.slots], dtype=buffer.dtype)
            if bucket.bitmap and not everywhere else None
        )
        # MPI does not match the blocking header allreduce of a joined rank with a non-blocking one
        overlap = self._overlap_header

        def task() -> Any:
            wire = buffer
            if compressor.applies_to(buffer.dtype):
                if bucket.wire is None:
                    bucket.wire = torch.empty_like(buffer, dtype=compressor.wire_dtype)
                wire = bucket.wire
                wire.copy_(buffer)
            if everywhere:
                wire[bucket.numel :].fill_(1.0)
            elif used is not None:
                wire[bucket.numel : bucket.numel + bucket.bitmap] = used
            if not self.join_support:
                return reduce(wire)
            if bucket.index == 0 and contribute:
                return self._first_bucket(wire, overlap)
            settle(self.comm)  # the step's header, read before anything else is posted
            if bucket.index == 0:  # a joined rank: its zeros for the first elements went out with join's header
                ride, served, self._served = self._ride, self._served, None
                if ride:
                    assert served is not None
                    wire[:ride] = served[:ride]
                return _whole(reduce(wire[ride:]), wire) if ride < wire.numel() else wire
            if contribute and self._active < size:
                announce(self.comm, "bucket")
            return reduce(wire)

        def then(wire: torch.Tensor) -> None:
            if wire is not buffer:
                buffer.copy_(wire)
            if bucket.bitmap and not everywhere:
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
        last = bucket.index == len(self.buckets) - 1
        bucket.handle = self.engine.submit(run, finish, name=f"bucket{bucket.index}", inline=last)

    def _first_bucket(self, wire: torch.Tensor, overlap: bool) -> Any:
        """The step's first bucket (engine thread): its first elements ride in the step's header.

        With ``overlap`` (a thread-safe backend, the native allreduce) the rest of the bucket goes
        out right behind the header and the header is read only when it is needed: by the next
        collective posted on the communicator (:func:`~ringpipe.check.announcement.settle`) or by
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
        for bucket in self.buckets[self._next_launch :]:
            if bucket.pending:
                for slot in bucket.slots:
                    if slot.count < passes:
                        slot.used = contribute and (slot.count > 0 or slot.param.grad is not None)
                        self._take_grad(slot)
                bucket.pending = 0
            self._launch(bucket, contribute)
        self._next_launch = len(self.buckets)

    def _wait_all(self, after: Callable[[Bucket], None] | None = None) -> None:
        """Wait for every bucket in launch order; ``after(bucket)`` runs as soon as one is reduced."""
        t0 = time.perf_counter()
        try:
            for bucket in self.buckets:
                if bucket.handle is not None:
                    try:
                        bucket.handle.wait()
                    except RuntimeError as exc:  # a transport's failure is Horovod's HorovodInternalError
                        internal = from_transport(exc)
                        if internal is None:
                            raise
                        raise internal from exc
                if after is not None:
                    after(bucket)
        finally:
            for bucket in self.buckets:
                bucket.handle = None
                bucket.pending = len(bucket.slots)
            for slot in self.slots:
                slot.count = 0
                slot.used = False
            self._next_launch = 0
            self.unreduced = False
            self.peers_joined = self._active < self.comm.size
            if self.clock is not None:
                self.clock["wait"] = self.clock.get("wait", 0.0) + time.perf_counter() - t0
        # Sparse gradients go back sparse, with sparse_as_dense too (Horovod converts them back before the update).
        for slot in self.slots:
            if slot.sparse and slot.param.grad is not None:
                slot.param.grad = slot.param.grad.to_sparse()
                slot.sparse = False
        # Parameters that no rank produced a gradient for keep no gradient, as in one process.
        for i in self._unused:
            self.slots[i].param.grad = None
        self._unused = []


def _whole(part: Any, wire: torch.Tensor) -> Any:
    """The reduction of part of ``wire`` (a Work, or done), as one of the whole ``wire``."""
    return Work(part.wait, part.is_completed, result=wire) if isinstance(part, Work) else wire
