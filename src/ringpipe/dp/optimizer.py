"""DistributedOptimizer: averages gradients across ranks in fused buckets while backward runs.

How it works. At construction the parameters are laid out, in reverse registration order
(the order in which backward produces their gradients, as DDP does), into flat per-dtype
bucket buffers of at most ``bucket_bytes`` each. A post-accumulate-grad hook on every
parameter copies its gradient into its slot of the bucket (or finds it already there) and
makes ``param.grad`` a view of that slot. When every parameter of a bucket is ready, and all
earlier buckets have been launched, the bucket is handed to the communicator's background
:class:`~ringpipe.core.engine.Engine`. Buckets are therefore launched in the same order on every
rank whatever order the hooks fire in, and ``step()`` waits only for what is still in flight
(the hooks, launches and waits are in :mod:`ringpipe.dp.reduction`). With a per-parameter
``torch.optim`` optimizer, ``step()`` updates each bucket's parameters as soon as that bucket is
reduced, while later ones are still in flight (:mod:`ringpipe.dp.bucket_step`).

The first bucket's reduction is announced (:mod:`ringpipe.check.announcement`: its start rides in the
step's announcement, so this costs no message of its own), which tells every rank
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
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ringpipe.check.announcement import Note, announce
from ringpipe.check.settings import agree, comparable, layout_of, validate
from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.core.compression import Compression, Compressor
from ringpipe.core.engine import Engine
from ringpipe.dp.bucket_step import step_by_bucket
from ringpipe.dp.buckets import (
    Slot,
    explicit_groups,
    groups_setting,
    make_buckets,
    name_parameters,
    reducer,
)
from ringpipe.dp.overlap import comparable_policy, policy_setting
from ringpipe.dp.reduction import GradientReduction

__all__ = ["DistributedOptimizer", "DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
_CREATED = itertools.count()


class DistributedOptimizer(GradientReduction, torch.optim.Optimizer):
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
        first_bucket_bytes: the smaller cap of the first bucket, so reduction starts early in backward,
            and of the last one (the first registered modules' parameters, whose gradients come last),
            so little reduction is left when backward ends.
        algorithm: ``"native"`` (the backend's allreduce) or a name from ``ringpipe.collectives.ALGORITHMS``.
        comm: the communicator (default: the one of ``ringpipe.init()``).
        num_groups / groups: Horovod's explicit grouping: ``groups`` lists lists of parameters,
            each reduced as one bucket (other parameters alone); an integer splits the trainable
            parameters, in registration order, into that many buckets (``num_groups`` is its
            deprecated spelling).
        sparse_as_dense: Horovod's switch between reducing sparse gradients by allgather and as
            dense tensors; ringpipe reduces them densely either way and, as Horovod documents,
            hands them back sparse for the update (``SparseAdam`` needs them so).
        process_set: reduce over the ranks of this process set only; on other ranks the optimizer
            steps on local gradients, as in Horovod.
        join_support: announce every step so that ranks that ran out of data can call
            :func:`ringpipe.join` and serve the others, as in Horovod. The announcement travels
            in the first bucket's message (up to ``RIDE_CAP`` float32 gradients ride in it), so a
            one-bucket step is still one allreduce; other announced collectives then carry that
            many zeros too. ``False`` (even shards, as DDP without its ``Join`` context) leaves
            them out; :func:`ringpipe.join` then refuses, naming this setting.
        overlap: when buckets are launched (ringpipe's own setting; ``RINGPIPE_OVERLAP`` when
            None): ``"overlap"`` or ``True`` (the default) as soon as each is full during
            backward, ``"after_backward"`` or ``False`` all once backward ends
            (:mod:`ringpipe.dp.overlap`). The numbers are the same either way.

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
        overlap: str | bool | None = None,
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
            "overlap": comparable_policy(overlap),
        }
        # Invalid settings are raised only after every rank compared its settings (agree()), so
        # that a setting wrong on one rank does not leave the others waiting for it.
        problem: Exception | None = None
        try:
            rop = validate(op, gradient_predivide_factor, backward_passes_per_step, bucket_bytes, first_bucket_bytes)
            compressor = Compression.parse(compression)
            policy_setting(overlap)
        except ValueError as exc:
            problem = exc
        if comm is None:
            from ringpipe.core.errors import NotInitializedError
            from ringpipe.core.process_sets import resolve
            from ringpipe.core.world import current

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
        self._buckets = make_buckets(self._slots, explicit_groups(groups, self._slots), self.first_bucket_bytes,
                                     self.bucket_bytes, tail_cap=self.first_bucket_bytes)
        self._hold = settings["overlap"] == "after_backward"  # ready buckets wait for step() / synchronize()
        self._next_launch = 0
        self._synchronized = False
        self._should_synchronize = True
        self._active = float(comm.size)  # ranks with data at the last reduction
        self._peers_joined = False
        self._unused: list[int] = []
        # Adasum combines parameter updates in step(), not gradients in backward (Horovod's delta optimizer)
        self._adasum = rop is ReduceOp.ADASUM and comm.size > 1
        self._overlap_header = algorithm == "native" and not self.engine.complete_in_engine
        average = rop is ReduceOp.AVERAGE
        factor = self.gradient_predivide_factor
        self._prescale = (1.0 / comm.size if factor == 1.0 else 1.0 / factor) if average else 1.0
        self._ride = self._ride_of(self._buckets[0]) if self._buckets and self.join_support and not self._adasum else 0
        if self._ride:
            engine = self.engine  # every rank builds its optimizers in the same order: the same length
            engine.run(lambda: setattr(engine, "ride", max(engine.ride, self._ride)), name="ride")
        self._served = None  # a joined rank: the summed start of the first bucket of the step it serves
        self._hooks: list[Any] = [] if self._adasum else [
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
        self._hooks = []

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
            elif closure is None and step_by_bucket(self):
                return None
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

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Horovod's map from each reduced parameter to its name (unique, the same on every rank)."""
        return {slot.param: slot.name for slot in self._slots}

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
