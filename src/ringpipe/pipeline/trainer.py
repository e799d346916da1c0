"""PipelineTrainer: the high-level entry that builds one rank's stage and trains it with any schedule.

Every rank builds the same full list of layers (same seed), keeps only its stage's layers,
and calls the same methods with the same arguments, except the data: the first stage of each
replica passes the inputs, the last stage passes the targets (from its own data loader; targets
never travel through the pipeline), every other rank passes ``None``. Example::

    trainer = PipelineTrainer(comm, layers, balance=[3, 2], schedule="1f1b", microbatches=4,
                              optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1),
                              loss_fn=torch.nn.functional.cross_entropy)
    loss = trainer.train_step(x if trainer.is_first else None, y if trainer.is_last else None)

With ``async_1f1b``, :meth:`stream_step` feeds batch after batch into a pipeline that never
flushes between them (micro-batches of one batch are still in flight when the next arrives,
the PipeDream steady state); :meth:`drain` finishes them, e.g. at the end of an epoch or before a
checkpoint; :meth:`train_stream` runs a stream of known length in one pass (synchronous schedules
run it as one ``train_step`` per batch). :meth:`state_dict` is a stage's checkpoint and
:meth:`model_state_dict` the whole model's weights.

Batches are split along dimension 0 into ``microbatches`` chunks with ``torch.tensor_split``;
when the count does not divide the batch, the first chunks are one sample larger and each
micro-batch's loss is weighted by its share of the batch, so a step still follows the gradient
of the batch-mean loss (``loss_fn`` must average over the samples, as torch's losses do).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ringpipe.comm.base import Communicator
from ringpipe.pipeline.executor import PipelineExecutor, RunResult
from ringpipe.pipeline.microbatches import _batch_size, _run_lengths, split_microbatches
from ringpipe.pipeline.partition import as_layers, partition
from ringpipe.pipeline.policy import WeightPolicy
from ringpipe.pipeline.replicas import make_grid, replica_group, tied_groups
from ringpipe.pipeline.schedules import (
    ASYNC_SCHEDULES,
    Action,
    async_1f1b,
    async_1f1b_window,
    async_staleness,
    get_schedule,
)
from ringpipe.pipeline.schedules_interleaved import interleaved_1f1b
from ringpipe.pipeline.stage import LossFn, MetricsFn, StageRuntime
from ringpipe.pipeline.tied_owner import TiedOwnership
from ringpipe.pipeline.tracing import split_model, tied_parameters

__all__ = ["PipelineTrainer", "split_microbatches", "SCHEDULE_ALIASES", "CHUNKED_SCHEDULES"]

log = logging.getLogger(__name__)

SCHEDULE_ALIASES = {
    "async": "async_1f1b", "pipedream": "async_1f1b", "pipedream_flush": "1f1b",
    "interleaved": "interleaved_1f1b", "zbh1": "zb_h1", "zero_bubble": "zb_h1", "zbh2": "zb_h2",
}
#: Schedules with model chunks or a split backward (one executor runs every schedule; these are synchronous).
CHUNKED_SCHEDULES = frozenset({"interleaved_1f1b", "zb_h1", "zb_h2"})
#: Schedules whose backward is split into an input-gradient and a weight-gradient pass.
SPLIT_BACKWARD_SCHEDULES = frozenset({"zb_h1", "zb_h2"})


class PipelineTrainer:
    """One rank's view of a pipeline (optionally replicated) training run.

    ``schedule``: ``seq``, ``gpipe``, ``1f1b``, ``interleaved_1f1b`` (alias ``interleaved``),
    ``zb_h1`` (alias ``zbh1``), ``zb_h2`` (alias ``zbh2``) or ``async_1f1b`` (alias ``async``).
    ``balance``: layers per stage, ``"params"``, ``"time"`` (needs ``sample``) or ``None``
    (by parameters). The number of stages is ``len(balance)`` or ``comm.size // replicas``.
    ``chunks`` (``interleaved_1f1b`` only, default 2): model chunks per rank; the model is cut
    into ``stages x chunks`` parts (a ``balance`` list then has that many entries) and rank
    ``r`` holds parts ``r, r + stages, ...``.
    ``mitigations`` (async only): names for :func:`ringpipe.pipeline.staleness.make_policy`
    (``"stale"``, ``"ws"``, ``"wp"``, ``"ga"``, ``"ga_jfl"`` and combinations) or a ready
    :class:`WeightPolicy`; ``mitigation_options`` are passed on to ``make_policy`` (e.g.
    ``ga_stages``, ``nag_with_predictor``). ``step_every`` (async only): optimizer step after that many
    backwards. ``seed``: per-micro-batch seeding of the random generators (dropout does not
    depend on the split). ``loss_on="all"`` makes ``train_step`` return the loss (averaged
    over replicas) on every rank, at the cost of one allreduce per step.
    """

    def __init__(
        self,
        comm: Communicator,
        layers: nn.Module | Sequence[nn.Module],
        balance: Sequence[int] | str | None = None,
        schedule: str = "gpipe",
        microbatches: int = 4,
        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        loss_fn: LossFn | None = None,
        recompute: bool = False,
        replicas: int = 1,
        mitigations: Sequence[str] | str | WeightPolicy | None = None,
        step_every: int = 1,
        mitigation_options: dict[str, Any] | None = None,
        scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None,
        metrics_fn: MetricsFn | None = None,
        seed: int | None = None,
        sample: Any = None,
        loss_on: str = "last",
        device: torch.device | None = None,
        chunks: int | None = None,
        split_points: Sequence[str] | None = None,
    ) -> None:
        self.comm = comm
        self.schedule = SCHEDULE_ALIASES.get(schedule, schedule)
        self.schedule_fn = get_schedule(self.schedule)
        self.is_async = self.schedule in ASYNC_SCHEDULES
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        if step_every < 1:
            raise ValueError(f"step_every must be >= 1, got {step_every}")
        if step_every != 1 and not self.is_async:
            raise ValueError(
                f"step_every={step_every} applies to the asynchronous schedule only; schedule "
                f"{self.schedule!r} steps once per batch (use microbatches for accumulation)"
            )
        if mitigations not in (None, (), [], "", "stale") and not self.is_async:
            raise ValueError(
                f"mitigations {mitigations!r} apply to schedule 'async_1f1b' only; schedule "
                f"{self.schedule!r} flushes, so no weight is ever stale"
            )
        if loss_on not in ("last", "all"):
            raise ValueError(f"loss_on must be 'last' or 'all', got {loss_on!r}")
        self.microbatches = microbatches
        self.step_every = step_every
        self.loss_on = loss_on
        self.chunked = self.schedule in CHUNKED_SCHEDULES
        if chunks is None:
            chunks = 2 if self.schedule == "interleaved_1f1b" else 1
        if chunks < 1 or (chunks > 1 and self.schedule != "interleaved_1f1b"):
            raise ValueError(
                f"chunks={chunks}: several model chunks per rank need schedule 'interleaved_1f1b' "
                f"(schedule {self.schedule!r} holds one); chunks must be >= 1"
            )
        self.chunks = chunks
        self.traced = split_points is not None or (isinstance(layers, nn.Module) and not isinstance(layers, nn.Sequential))
        self.split_points: list[str] | None = None
        parts: Sequence[nn.Module]  # a traced model's stages, or the layer lists' parts (nn.Sequential)
        if self.traced:
            parts, num_parts, num_stages = self._split_traced(layers, split_points, balance, sample, comm.size, replicas)
            all_layers = parts
            self.balance = [1] * num_parts
        else:
            all_layers = as_layers(layers)
            explicit = isinstance(balance, Sequence) and not isinstance(balance, str)
            num_parts = len(balance) if explicit else chunks * (comm.size // max(1, replicas))  # type: ignore[arg-type]
        if num_parts % chunks:
            raise ValueError(
                f"balance {list(balance)} has {num_parts} entries, not a multiple of chunks={chunks}: "  # type: ignore[arg-type]
                f"give layers for every chunk of every stage (stages x chunks entries)"
            )
        num_stages = num_parts // chunks
        if num_parts > len(all_layers):
            raise ValueError(
                f"{num_stages} stages x {chunks} chunks for a model of {len(all_layers)} layers; "
                f"use at most {len(all_layers)} parts" if chunks > 1 else
                f"{num_stages} stages for a model of {len(all_layers)} layers; use at most {len(all_layers)} stages"
            )
        if chunks > 1 and num_stages < 2:
            raise ValueError(f"schedule 'interleaved_1f1b' needs at least 2 stages, got {num_stages}")
        if chunks > 1:
            interleaved_1f1b(num_stages, microbatches, 0, chunks)  # refuses a count of micro-batches it cannot run
        self.grid = make_grid(comm.size, comm.rank, num_stages, replicas)
        if not self.traced:
            parts, self.balance = partition(all_layers, num_parts, balance, sample)
        # weights held by several parts (GPT-2's embedding and LM head): one object per rank, its holders' stages
        holders: dict[int, tuple[nn.Parameter, set[int]]] = {}
        for g, part in enumerate(parts):
            for p in part.parameters():
                holders.setdefault(id(p), (p, set()))[1].add(g % num_stages)
        #: tied weights held by several stages: a name -> the parts holding it
        self.tied_names = self._tied if self.traced else tied_parameters(parts)
        self.stage = self.grid.stage
        self.num_stages = num_stages
        self.is_first = self.stage == 0
        self.is_last = self.stage == num_stages - 1
        self.parts = [c * num_stages + self.stage for c in range(chunks)]  # the model parts this rank holds
        self.part_offsets = [sum(self.balance[:g]) for g in self.parts]
        self.layer_offset = self.part_offsets[0]
        if device is None:
            device = torch.device("cuda", comm.topology.local_rank) if comm.backend == "nccl" else torch.device("cpu")
        self.device = device
        chunk_modules = [parts[g].to(device) for g in self.parts]
        self.module: nn.Module = chunk_modules[0] if chunks == 1 else nn.ModuleList(chunk_modules)
        del parts, all_layers
        if optimizer_factory is None:
            raise ValueError("optimizer_factory is required, e.g. lambda params: torch.optim.SGD(params, lr=0.1)")
        self.optimizer = optimizer_factory(list(self.module.parameters()))
        self.scheduler = scheduler_factory(self.optimizer) if scheduler_factory is not None else None
        self.replica_comm = replica_group(comm, self.grid)
        self.tied = tied_groups(comm, self.grid, [(p, sorted(st)) for p, st in holders.values() if len(st) > 1])
        del holders
        # asynchronous schedules: the first holder of a tied weight steps it, the others keep mirrors
        self.tied_owned = [TiedOwnership(g.params, g.comm, g.stages, step_every) for g in self.tied] if self.is_async else []
        self.policy = self._make_policy(mitigations, recompute, mitigation_options or {})
        split = self.schedule in SPLIT_BACKWARD_SCHEDULES
        self.runtimes = [
            StageRuntime(m, g, num_parts, loss_fn if g == num_parts - 1 else None, metrics_fn, recompute, self.policy,
                         device, live_weights=self.is_async, split_backward=split)
            for m, g in zip(chunk_modules, self.parts, strict=True)
        ]
        self.executor = PipelineExecutor(
            comm, self.runtimes, self.optimizer, num_stages, self.stage,
            lambda s: self.grid.rank_of(s, self.grid.replica), self.scheduler, self.replica_comm, seed, device,
            tied=[] if self.is_async else self.tied, tied_owned=self.tied_owned,
        )
        self.runtime = self.runtimes[0]
        self.last_metrics: dict[str, float] = {}
        self._warned_uneven = False
        self._streamed = 0  # micro-batches fed into the open stream (0: no stream open)

    def _split_traced(self, model: Any, split_points: Sequence[str] | None, balance: Any, sample: Any,
                      world: int, replicas: int) -> tuple[list[nn.Module], int, int]:
        """Stages of a model split by tracing (:func:`~ringpipe.pipeline.tracing.split_model`); same on every rank."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"split_points need the model as one nn.Module, got a {type(model).__name__}")
        if balance not in (None, "params"):
            raise ValueError(
                f"balance {balance!r} applies to a list of layers; a traced {type(model).__name__} is split at "
                "split_points, or balanced by parameters without them"
            )
        if sample is None:
            raise ValueError(
                f"splitting a {type(model).__name__} traces it on a sample batch: pass sample= (a batch input as "
                "the model is called with, at least 2 samples), or pass a list of stage modules"
            )
        parts_wanted = None if split_points is not None else self.chunks * (world // max(1, replicas))
        split = split_model(model, sample, split_points, parts_wanted)
        self.split_points = split.split_points
        self._tied = split.tied
        num_parts = len(split.stages)
        return list(split.stages), num_parts, num_parts // self.chunks

    def _make_policy(self, mitigations: Any, recompute: bool, options: dict[str, Any]) -> WeightPolicy:
        if isinstance(mitigations, WeightPolicy):
            return mitigations
        if mitigations in (None, (), [], "") or not self.is_async:
            return WeightPolicy()
        from ringpipe.pipeline.staleness import make_policy

        return make_policy(
            mitigations, list(self.module.parameters()), self.optimizer, scheduler=self.scheduler,
            stage=self.stage, num_stages=self.num_stages, step_every=self.step_every,
            recompute=recompute, mirrors=[p for owned in self.tied_owned for p in owned.mirrors], **options,
        )

    # ------------------------------------------------------------------ schedules

    def actions(self, num_microbatches: int) -> list[Action]:
        """This stage's action list for a run of ``num_microbatches`` micro-batches."""
        if self.is_async:
            return async_1f1b(self.num_stages, num_microbatches, self.stage, self.step_every)
        if self.schedule == "interleaved_1f1b":
            return interleaved_1f1b(self.num_stages, num_microbatches, self.stage, self.chunks)
        return self.schedule_fn(self.num_stages, num_microbatches, self.stage)

    def _weights_sync(self, chunks: Sequence[Any] | None, total: int) -> Callable[[int], float] | None:
        if chunks is None:
            return None
        sizes = [_batch_size(c) for c in chunks]
        if len(set(sizes)) > 1 and not self._warned_uneven:
            log.warning(
                "batch of %d samples split into micro-batches of %s samples; losses are weighted by "
                "micro-batch size", total, sizes,
            )
            self._warned_uneven = True
        return lambda m: sizes[m] / total

    def _weights_async(self, num_microbatches: int) -> Callable[[int], float]:
        k = self.step_every
        last_group = (num_microbatches - 1) // k

        def weight(m: int) -> float:
            group = m // k
            return 1.0 / (k if group < last_group else num_microbatches - last_group * k)

        return weight

    # ------------------------------------------------------------------ training

    def _split(self, inputs: Any, targets: Any) -> tuple[list[Any] | None, list[Any] | None]:
        m = self.microbatches
        x_chunks = split_microbatches(inputs, m) if self.is_first else None
        y_chunks = split_microbatches(targets, m) if self.is_last else None
        if self.is_last and y_chunks is None:
            raise ValueError(f"rank {self.comm.rank} holds the last stage and needs the targets")
        if self.is_first and x_chunks is None:
            raise ValueError(f"rank {self.comm.rank} holds the first stage and needs the inputs")
        return x_chunks, y_chunks

    def train_step(self, inputs: Any = None, targets: Any = None) -> float | None:
        """Train on one batch (inputs on the first stage, targets on the last, ``None`` elsewhere).

        Synchronous schedules take one optimizer step; ``async_1f1b`` runs the batch's
        micro-batches without flush between them, stepping every ``step_every`` backwards
        (the pipeline fills and drains within the call, after draining an open stream; use
        :meth:`stream_step` or :meth:`train_stream` to keep it full across batches). Returns
        the batch loss on the last stage (every rank with ``loss_on="all"``), else ``None``.
        """
        m = self.microbatches
        self.drain()
        x_chunks, y_chunks = self._split(inputs, targets)
        runs = _run_lengths(x_chunks) if x_chunks is not None else None
        weights: Callable[[int], float] | None = None
        if self.is_async:
            weights = self._weights_async(m)
        elif self.is_last:
            weights = self._weights_sync(y_chunks, _batch_size(targets))
        result = self.executor.run(
            self.actions(m),
            inputs=(lambda i: x_chunks[i]) if x_chunks is not None else None,
            targets=(lambda i: y_chunks[i]) if y_chunks is not None else None,
            weights=weights,
            run_length=(lambda i: runs[i]) if runs is not None else None,
        )
        return self._finish(result)

    def _finish(self, result: RunResult) -> float | None:
        loss = result.mean_loss()
        self.last_metrics = result.mean_metrics()
        if self.loss_on == "all":
            t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
            self.comm.allreduce(t, "sum")
            return float(t) / self.grid.replicas
        return loss

    @torch.no_grad()
    def eval_step(self, inputs: Any = None, targets: Any = None) -> tuple[float | None, dict[str, float]]:
        """Forward one batch in eval mode; ``(loss, metrics)`` on the last stage (weighted by size)."""
        m = self.microbatches
        x_chunks = split_microbatches(inputs, m) if self.is_first else None
        y_chunks = split_microbatches(targets, m) if self.is_last else None
        runs = _run_lengths(x_chunks) if x_chunks is not None else None
        weights = self._weights_sync(y_chunks, _batch_size(targets)) if self.is_last else None
        result = self.executor.evaluate(
            m,
            inputs=(lambda i: x_chunks[i]) if x_chunks is not None else None,
            targets=(lambda i: y_chunks[i]) if y_chunks is not None else None,
            weights=weights,
            run_length=(lambda i: runs[i]) if runs is not None else None,
        )
        return result.mean_loss(), result.mean_metrics()

    # ------------------------------------------------------------------ the asynchronous stream

    def train_stream(self, batches: Iterable[tuple[Any, Any]], num_batches: int) -> float | None:
        """Train on ``num_batches`` batches in one run; returns the mean loss as in :meth:`train_step`.

        ``batches`` yields ``(inputs_or_None, targets_or_None)`` on every rank. With
        ``async_1f1b`` the pipeline stays full from the first batch to the last (the PipeDream
        steady state: this is where the asynchronous schedule gains its throughput); the
        synchronous schedules simply run :meth:`train_step` per batch.
        """
        if not self.is_async:
            losses = [self.train_step(x, y) for x, y in itertools.islice(batches, num_batches)]
            vals = [v for v in losses if v is not None]
            return sum(vals) / len(vals) if vals else None
        self.drain()
        m = self.microbatches
        it = iter(batches)
        cache: dict[str, Any] = {"index": -1, "x": None, "y": None, "runs": None}

        def load(mb: int) -> None:
            b = mb // m
            while cache["index"] < b:
                x, y = next(it)
                cache["index"] += 1
                cache["x"] = split_microbatches(x, m) if self.is_first else None
                cache["y"] = split_microbatches(y, m) if self.is_last else None
                cache["runs"] = _run_lengths(cache["x"]) if cache["x"] is not None else None

        def inputs(mb: int) -> Any:
            load(mb)
            return cache["x"][mb % m]

        def targets(mb: int) -> Any:
            load(mb)
            return cache["y"][mb % m]

        def run_length(mb: int) -> int:
            load(mb)
            return cache["runs"][mb % m]

        total = num_batches * m
        result = self.executor.run(
            self.actions(total),
            inputs=inputs if self.is_first else None,
            targets=targets if self.is_last else None,
            weights=self._weights_async(total),
            run_length=run_length if self.is_first else None,
        )
        return self._finish(result)

    @property
    def streaming(self) -> bool:
        """Whether a stream fed by :meth:`stream_step` is open (micro-batches may be in flight)."""
        return self._streamed > 0

    @property
    def in_flight(self) -> int:
        """Micro-batches this stage forwarded and has not yet backwarded."""
        return sum(rt.in_flight for rt in self.runtimes)

    def stream_step(self, inputs: Any = None, targets: Any = None) -> float | None:
        """Feed one batch into the asynchronous pipeline without draining it (``async_1f1b`` only).

        Arguments and return value as in :meth:`train_step`. The stage runs its window of the
        1F1B stream (:func:`~ringpipe.pipeline.schedules.async_1f1b_window`): the forwards of
        this batch's micro-batches and the backwards and steps between them; its last
        ``stages - stage - 1`` micro-batches stay in flight into the next call, so no batch
        boundary flushes the pipeline and every stage but the last trains on stale weights,
        as in one :meth:`train_stream` over all the batches fed. Call :meth:`drain` (on every
        rank) to finish them before a checkpoint or whenever the weights must be final.
        ``step_every`` must divide ``microbatches``: the stream's length is not known in
        advance, so no optimizer step may straddle a batch boundary. Weights tied across stages
        stay open too: the first holder steps them, the others keep mirrors a few steps late
        (:mod:`~ringpipe.pipeline.tied_owner`), equal again after :meth:`drain`.
        """
        if not self.is_async:
            raise ValueError(
                f"stream_step needs schedule 'async_1f1b'; schedule {self.schedule!r} flushes every batch: "
                "use train_step"
            )
        m, k = self.microbatches, self.step_every
        if m % k:
            raise ValueError(
                f"stream_step needs step_every={k} to divide microbatches={m}, so that every optimizer step "
                "ends with a batch; change one of them, or use train_stream for a stream of known length"
            )
        x_chunks, y_chunks = self._split(inputs, targets)
        start, stop = self._streamed, self._streamed + m
        runs = _run_lengths(x_chunks) if x_chunks is not None else None
        result = self.executor.run(
            async_1f1b_window(self.num_stages, self.stage, start, stop, k),
            inputs=(lambda i: x_chunks[i - start]) if x_chunks is not None else None,
            targets=(lambda i: y_chunks[i - start]) if y_chunks is not None else None,
            weights=lambda i: 1.0 / k,
            run_length=(lambda i: runs[i - start]) if runs is not None else None,
            staleness={mb: async_staleness(self.num_stages, self.stage, mb, k) for mb in range(start, stop)},
            keep_open=True,
        )
        self._streamed = stop
        return self._finish(result)

    def drain(self) -> None:
        """Finish the stream fed by :meth:`stream_step`: the backwards in flight and their steps.

        Every rank calls it at the same point (it exchanges gradients with the neighbour
        stages); without an open stream it does nothing.
        """
        total, self._streamed = self._streamed, 0
        if total:
            self.executor.run(
                async_1f1b_window(self.num_stages, self.stage, total, total, self.step_every, total=total),
                staleness={},
            )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This stage's state: its layers (local names), optimizer, scheduler and place.

        Refused while a stream is open: the micro-batches in flight (their activations and
        stashed weights) are not part of the state; :meth:`drain` first.
        """
        if self.streaming:
            raise ValueError(
                f"stage {self.stage}: state_dict while {self.in_flight} micro-batches of an open stream are in "
                "flight would lose them; call drain() on every rank first"
            )
        return {
            "stage": self.stage,
            "balance": list(self.balance),
            "schedule": self.schedule,
            "steps": self.executor.steps_taken,
            "microbatches": self.executor.microbatches_seen,
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["stage"] != self.stage or list(state["balance"]) != list(self.balance):
            raise ValueError(
                f"state of stage {state['stage']} with balance {state['balance']} cannot be loaded into "
                f"stage {self.stage} with balance {self.balance}"
            )
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.executor.steps_taken = int(state.get("steps", 0))
        self.executor.microbatches_seen = int(state.get("microbatches", 0))

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict on every rank. Collective.

        Keys of ``nn.Sequential(*layers)`` for a list of layers; the model's own names for a traced model.
        """
        local = {}
        if self.traced:  # stages keep the model's own names (a tied weight under each holder's name)
            if self.grid.replica == 0:
                modules = [self.module] if self.chunks == 1 else list(self.module.children())
                for module in modules:
                    for key, value in module.state_dict().items():
                        local[key.removeprefix("graph_module.")] = value.detach().cpu()
            merged_traced: dict[str, torch.Tensor] = {}
            for part in self.comm.allgather_object(local):
                merged_traced.update(part)
            return dict(sorted(merged_traced.items()))
        if self.grid.replica == 0:
            modules = [self.module] if self.chunks == 1 else list(self.module.children())
            for module, offset in zip(modules, self.part_offsets, strict=True):
                for key, value in module.state_dict().items():
                    idx, _, rest = key.partition(".")
                    local[f"{int(idx) + offset}.{rest}"] = value.detach().cpu()
        merged: dict[str, torch.Tensor] = {}
        for part in self.comm.allgather_object(local):
            merged.update(part)
        return dict(sorted(merged.items(), key=lambda kv: (int(kv[0].partition(".")[0]), kv[0])))
