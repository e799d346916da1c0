"""DistributedOptimizer: averages gradients across ranks in fused buckets while backward runs.

How it works. At construction the parameters are laid out, in reverse registration order
(the order in which backward produces their gradients, as DDP does), into flat per-dtype
bucket buffers of at most ``bucket_bytes`` each. A post-accumulate-grad hook on every
parameter copies its gradient into its slot of the bucket (or finds it already there) and
makes ``param.grad`` a view of that slot. When every parameter of a bucket is ready, and all
earlier buckets have been launched, the bucket is handed to the communicator's background
:class:`~ringpipe.core.engine.Engine`. Buckets are therefore launched in the same order on every
rank whatever order the hooks fire in, and ``step()`` waits only for what is still in flight
(the buckets, hooks, launches and waits belong to the optimizer's
:class:`~ringpipe.dp.gradient_reducer.GradientReducer`, its ``reducer``). With a per-parameter
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
import functools
import itertools
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ringpipe.check.announcement import Note, announce
from ringpipe.check.settings import agree, comparable, layout_of, validate
from ringpipe.comm.base import Communicator, ReduceOp
from ringpipe.core.compression import Compression, Compressor
from ringpipe.core.engine import Engine
from ringpipe.dp.bucket_step import step_only, steps_by_bucket
from ringpipe.dp.buckets import Bucket, bucket_allreduce, groups_setting, name_parameters
from ringpipe.dp.gradient_reducer import GradientReducer
from ringpipe.dp.overlap import comparable_policy, policy_setting

__all__ = ["DistributedOptimizer", "DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
_SERIALS = itertools.count()


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

    The gradients' buckets, hooks, launches and waits are those of :attr:`reducer`, a
    :class:`~ringpipe.dp.gradient_reducer.GradientReducer` (None on a rank outside ``process_set``);
    the settings above read back from the optimizer (``opt.bucket_bytes``, ``opt.op``, ...) are its.
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
        reduce: Any = None
        try:
            reduce = bucket_allreduce(comm, algorithm)
        except ValueError as exc:
            problem = problem or exc
        named: list[tuple[str, torch.nn.Parameter]] = []

        def layout() -> list[tuple[str, tuple[int, ...], str]]:
            named.extend((n, p) for n, p in name_parameters(optimizer, named_parameters) if p.requires_grad)
            return layout_of(named)

        from ringpipe.comm import elastic_rendezvous

        if elastic_rendezvous.active() and elastic_rendezvous.joined_version() > 1:
            # a worker joining a running elastic world: the others compared their settings when
            # they built theirs, and compare nothing now (Horovod's optimizer makes no collective)
            layout()
            if problem is not None:
                raise problem
        else:
            agree(comm, {k: comparable(k, v) for k, v in settings.items()}, layout, problem)

        # Share the wrapped optimizer's groups and state so schedulers and checkpoints see one object.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

        self.sparse_as_dense = bool(sparse_as_dense)
        gradient_reducer = GradientReducer(
            comm, named, reduce, algorithm=algorithm, compression=compressor, op=rop,
            gradient_predivide_factor=gradient_predivide_factor, backward_passes_per_step=backward_passes_per_step,
            join_support=join_support, groups=groups, first_bucket_bytes=first_bucket_bytes,
            bucket_bytes=bucket_bytes, hold=settings["overlap"] == "after_backward",
        )
        #: The gradients' buckets, hooks, launches and waits (None on a rank outside the process set).
        self.reducer: GradientReducer | None = gradient_reducer
        self._synchronized = False
        self._should_synchronize = True
        #: This optimizer's place in the order of construction in this process (join serves the newest).
        self.serial = next(_SERIALS)
        gradient_reducer.engine.optimizers.add(self)
        log.debug("DistributedOptimizer: %d parameters in %d buckets", len(gradient_reducer.slots), len(gradient_reducer.buckets))

    # ------------------------------------------------------------------ set-up

    def _init_local(self, optimizer: torch.optim.Optimizer) -> None:
        """A rank outside the process set: no reduction, ``step()`` applies the local gradients."""
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.reducer = None
        self._synchronized = False
        self._should_synchronize = True

    def follow_world(self) -> None:
        """Reduce over the current world from now on: after an elastic reset made a new one.

        Only for an optimizer over the whole world (not a process set): the buckets stay, the
        communicator, its engine and the interrupted step's state are the new world's.
        """
        from ringpipe.core.world import current

        if self.reducer is None:
            return
        comm = current().comm
        if comm is self.reducer.comm:
            return
        self.reducer.rebind(comm, bucket_allreduce(comm, self.reducer.algorithm))
        self.reducer.engine.optimizers.add(self)
        self._synchronized = False
        self._should_synchronize = True

    def _reducing(self, name: str) -> GradientReducer:
        """The reducer, for reading its setting ``name``; a rank outside the process set has none."""
        if self.reducer is None:
            raise AttributeError(f"DistributedOptimizer.{name}: this rank is not in the optimizer's process set; "
                                 "it reduces nothing and steps on its local gradients")
        return self.reducer

    # ------------------------------------------------------------------ settings (the reducer's)

    @property
    def comm(self) -> Communicator:
        """The communicator the gradients are reduced over."""
        return self._reducing("comm").comm

    @property
    def engine(self) -> Engine:
        """The communicator's background engine, which runs the reductions."""
        return self._reducing("engine").engine

    @property
    def compression(self) -> Compressor:
        """The wire's compressor."""
        return self._reducing("compression").compression

    @property
    def op(self) -> ReduceOp:
        """Average, Sum or Adasum."""
        return self._reducing("op").op

    @property
    def gradient_predivide_factor(self) -> float:
        """With Average: divide by this before the sum and by ``size / factor`` after it."""
        return self._reducing("gradient_predivide_factor").gradient_predivide_factor

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes whose gradients are summed locally before one reduction."""
        return self._reducing("backward_passes_per_step").backward_passes_per_step

    @property
    def bucket_bytes(self) -> int:
        """The fusion buffer size in bytes."""
        return self._reducing("bucket_bytes").bucket_bytes

    @property
    def first_bucket_bytes(self) -> int:
        """The cap of the first and the tail bucket (at most :attr:`bucket_bytes`)."""
        return self._reducing("first_bucket_bytes").first_bucket_bytes

    @property
    def algorithm(self) -> str:
        """The allreduce of the buckets: ``"native"`` or a name from ``ringpipe.collectives.ALGORITHMS``."""
        return self._reducing("algorithm").algorithm

    @property
    def join_support(self) -> bool:
        """Whether every step is announced, so that ranks that ran out of data can join."""
        return self._reducing("join_support").join_support

    @property
    def clock(self) -> dict[str, float] | None:
        """Seconds spent per phase when a dict is set here (see ``GradientReducer.clock``)."""
        return self._reducing("clock").clock

    @clock.setter
    def clock(self, value: dict[str, float] | None) -> None:
        self._reducing("clock").clock = value

    # ------------------------------------------------------------------ public

    def synchronize(self) -> None:
        """Finish reducing every gradient; afterwards ``param.grad`` holds the averaged gradients."""
        if self.reducer is not None and not self.reducer.adasum:
            self.reducer.synchronize()
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
            # a gradient that arrived after synchronize() (a new backward) is reduced again
            if self._synchronized and not (self.reducer is not None and self.reducer.unreduced):
                # Horovod's warning (the gradients are already reduced; they are not reduced again)
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            elif closure is None and self._step_by_bucket():
                return None
            else:
                self.synchronize()
        self._synchronized = False
        if self.reducer is None:
            return self.optimizer.step(closure)
        if self.reducer.adasum:
            return self._adasum_step(closure)
        if self.reducer.peers_joined:
            self._announce_update()
        return self.optimizer.step(closure)

    def _step_by_bucket(self) -> bool:
        """Reduce and update together: each bucket's parameters are stepped once it is reduced.

        For a ``step()`` that has to synchronize and got no closure. Only where that gives the
        parameters of one update after the last reduction (:func:`~ringpipe.dp.bucket_step.steps_by_bucket`,
        see :mod:`ringpipe.dp.bucket_step`); returns False, having done nothing, elsewhere. A bucket
        with a parameter that had no gradient on this rank, or a sparse one, is stepped after the
        last reduction with the rest.
        """
        reducer = self.reducer
        if reducer is None or reducer.adasum or len(reducer.buckets) < 2 or not steps_by_bucket(self.optimizer):
            return False
        inner = self.optimizer
        stepped: set[int] = set()
        clock = reducer.clock

        def after(bucket: Bucket) -> None:
            if not all(s.used and not s.sparse for s in bucket.slots):
                return
            t0 = time.perf_counter()
            step_only(inner, (s.param for s in bucket.slots))
            stepped.add(bucket.index)
            if clock is not None:  # optimizer arithmetic, not waiting
                spent = time.perf_counter() - t0
                clock["bucket_step"] = clock.get("bucket_step", 0.0) + spent
                clock["wait"] = clock.get("wait", 0.0) - spent

        reducer.synchronize(after)
        self._synchronized = False
        if reducer.peers_joined:  # ranks that joined apply the update with this rank's hyper-parameters
            self._announce_update()
        if len(stepped) < len(reducer.buckets):
            step_only(inner, (s.param for b in reducer.buckets if b.index not in stepped for s in b.slots))
        return True

    def _adasum_step(self, closure: Callable[[], float] | None) -> Any:
        """Horovod's Adasum delta optimizer: start = p; p = 0; step (p = the local update); p = start + Adasum(updates).

        Stepping from zero makes the local update ``-lr * f(g)`` (a weight-decay term sees zero
        weights, as in Horovod); every parameter's update is combined with its own dot products.
        """
        from ringpipe.collectives import adasum_allreduce

        assert self.reducer is not None
        params = [s.param for s in self.reducer.slots]
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
            self.engine.run(functools.partial(adasum_allreduce, self.comm, deltas), name="adasum-step")
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
        if self.reducer is not None:
            self.reducer.remove_hooks()

    def __repr__(self) -> str:
        if self.reducer is None:
            return f"DistributedOptimizer({self.optimizer!r}, not in its process set: local steps)"
        return f"DistributedOptimizer({self.optimizer!r}, buckets={len(self.reducer.buckets)}, op={self.op.value})"

    # ------------------------------------------------------------------ join

    def serve(self, note: Note) -> None:
        """Take part, on a rank that has joined, in the step announced by ``note`` (:func:`ringpipe.dp.join.join`).

        ``"step"`` and ``"bucket"``: the gradients' reductions, with zeros; ``"apply"``: the update.
        """
        assert self.reducer is not None  # a rank outside the process set joins nothing of it
        if note.op == "step":
            self.reducer.serve_step(note)
        elif note.op == "bucket":
            self.reducer.serve_bucket()
        else:
            self._serve_update(note)

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
        return self._reducing("_parameter_names").parameter_names

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
