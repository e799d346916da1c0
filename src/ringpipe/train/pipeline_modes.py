"""Pipeline-parallel modes (seq, gpipe, 1f1b, interleaved, zb_h1, zb_h2, async) as adapters over ringpipe.pipeline's PipelineTrainer.

The world is ``stages x replicas``: each replica is one pipeline reading its own data shard,
and each stage's gradients are averaged over the replicas. Every rank of a replica reads the
same batch; the first stage feeds the inputs, the last stage uses the targets, and the loss
and accuracy are known on the last stage only (other ranks report zeros, which the loop's
sum over ranks ignores).

The synchronous modes step once per batch, and the loop's LR schedule drives their optimizer.
Mode ``interleaved`` cuts the model into ``stages x pipeline.chunks`` parts, ``chunks`` per
rank (interleaved 1F1B); mode ``zb_h1`` splits each backward into an input-gradient and a
weight-gradient pass (zero-bubble ZB-H1), and mode ``zb_h2`` also lets a stage hold up to
``2 x stages - 1`` micro-batches so that, from step to step, no stage idles when the passes take
equal time (ZB-H2). All three run with ``pipeline.recompute``.

Mode ``async`` streams: each batch is fed into a pipeline that does not flush between batches
(:meth:`PipelineTrainer.stream_step`), so the micro-batches of one batch are still in flight
on the earlier stages when the next batch arrives, as in PipeDream. The pipeline drains at
the end of every epoch and of the run (where the loop evaluates and checkpoints), and before
any evaluation or checkpoint; a run interrupted mid-epoch therefore drains where it stops,
and its resumption starts a fresh stream there. Each stage steps every ``step_every``
micro-batches and owns its LR schedule (given to PipelineTrainer, which steps it after every
optimizer step and lets scheduler-aware weight prediction read the rates to come); the
schedule counts epochs as ``optimizer steps / (steps per batch x batches per epoch)``, so the
last stage agrees with the loop's per-batch schedule at every batch boundary, and an earlier
stage, whose latest micro-batches are still in flight, at every drain. The loop's schedule
then only drives a stand-in optimizer for the logged rate.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from ringpipe.pipeline.model_io import batch_size
from ringpipe.train.config import ConfigError, PipelineConfig
from ringpipe.train.lr_schedules import build_schedule
from ringpipe.train.modes import ModeContext, ModeRunner, ModeUnavailable, correct, register_mode
from ringpipe.train.precision import GradStep, autocast_layers

__all__ = ["PipelineRunner", "SCHEDULE_OF_MODE", "rate_stand_in", "async_options"]

#: ringpipe.pipeline schedule behind each mode
SCHEDULE_OF_MODE = {
    "seq": "seq", "gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved_1f1b", "zb_h1": "zb_h1",
    "zb_h2": "zb_h2", "async": "async_1f1b",
}


def _accuracy(out: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    return {"accuracy": correct(out, y) / max(1, y.numel())}


class _ScaledLoss:
    """The loss times the fp16 loss scale while training (1 while evaluating): the backward of every
    stage then carries the scaled gradient, which each stage's :class:`GradStep` unscales."""

    def __init__(self, loss: Any) -> None:
        self.loss, self.scale = loss, 1.0

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        value = self.loss(out, y)
        return value * self.scale if self.scale != 1.0 else value


def rate_stand_in(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer over one dummy tensor with ``optimizer``'s initial rates: a schedule may drive it freely."""
    groups = [
        {"params": [torch.zeros(1, requires_grad=True)], "lr": float(g.get("initial_lr", g["lr"]))}
        for g in optimizer.param_groups
    ]
    stand_in = torch.optim.SGD(groups)
    stand_in._opt_called = True  # type: ignore[attr-defined]  # never stepped: no step-order warning
    return stand_in


def async_options(pc: PipelineConfig) -> dict[str, Any]:
    """PipelineTrainer's keyword arguments for mode ``async`` from a resolved pipeline section."""
    options: dict[str, Any] = {}
    if pc.ga_stages is not None:
        options["ga_stages"] = pc.ga_stages
    if pc.nag_with_predictor is not None:
        options["nag_with_predictor"] = pc.nag_with_predictor
    return {
        "mitigations": list(pc.mitigations or ["stale"]),
        "step_every": pc.step_every or 1,
        "mitigation_options": options,
    }


class PipelineRunner(ModeRunner):
    """One rank's stage of a (replicated) pipeline."""

    shared_state = False

    def __init__(self, ctx: ModeContext, mode: str) -> None:
        try:
            from ringpipe.pipeline import PipelineTrainer
        except ImportError as exc:
            raise ModeUnavailable(
                f"mode {mode!r} is not available in this build: ringpipe.pipeline cannot be imported ({exc})"
            ) from None
        pc = ctx.cfg.pipeline
        assert pc is not None
        size = ctx.comm.size
        if size % pc.stages:
            raise ModeUnavailable(
                f"mode {mode!r}: the world has {size} ranks, not a multiple of pipeline.stages={pc.stages}; "
                f"start a multiple of {pc.stages} processes or change pipeline.stages"
            )
        if pc.chunks is not None and mode != "interleaved":
            raise ConfigError(
                f"pipeline.chunks={pc.chunks} is read only by mode 'interleaved', not by mode {mode!r}: "
                "remove it or set mode=interleaved"
            )
        chunks = (pc.chunks or 2) if mode == "interleaved" else 1
        parts = pc.stages * chunks
        if mode == "interleaved" and pc.microbatches % pc.stages:
            raise ConfigError(
                f"mode 'interleaved': pipeline.microbatches={pc.microbatches} must be a multiple of "
                f"pipeline.stages={pc.stages} (micro-batches go through each chunk in groups of stages)"
            )
        if pc.balance is not None and len(pc.balance) != parts:
            per = f" x pipeline.chunks={chunks} = {parts} parts" if chunks > 1 else ""
            raise ValueError(
                f"pipeline.balance={pc.balance} has {len(pc.balance)} entries but pipeline.stages={pc.stages}{per}"
            )
        replicas = size // pc.stages
        model = ctx.build_model()
        # an nn.Sequential without split points is split by layer counts; any other model is traced
        sequential = model if isinstance(model, nn.Sequential) and pc.split_points is None else None
        traced = sequential is None
        assert ctx.device is not None
        if sequential is None:
            _check_traced(pc, model, parts)
            self.hooks: list[Any] = []
        else:
            self.hooks = autocast_layers(list(sequential), ctx.cfg.precision, ctx.device.type)
        self.scaler = ctx.scaler()
        clip = ctx.cfg.optimizer.clip_grad_norm
        self.loss = _ScaledLoss(ctx.loss)
        balance: Any
        if sequential is None:
            balance = None
        elif pc.balance is not None:
            balance = list(pc.balance)
        elif pc.partition == "uniform":
            n = len(sequential)
            balance = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
        else:
            balance = "params" if pc.partition == "parameters" else "time"
        if sequential is not None:
            _check_stages(list(sequential), balance, pc, ctx.cfg.model.name, parts)
        scales: list[float] = []

        def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            if not params:  # a split measured on this rank (partition=time): checked here
                raise ConfigError(
                    f"mode {mode!r}: the pipeline stage of rank {ctx.comm.rank} got no layer with "
                    f"parameters from pipeline.partition={pc.partition}; {_stage_fix(ctx.cfg.model.name)}"
                )
            opt, scale = ctx.optimizer(params, replicas)
            scales.append(scale)
            if clip is not None or self.scaler is not None:  # the whole model's gradient: every stage's
                GradStep(params, clip, self.scaler, ctx.comm, copies=replicas).install(opt)
            return opt

        extra: dict[str, Any] = {}
        if mode == "async":
            extra = async_options(pc)
            steps_per_batch = pc.microbatches // extra["step_every"]
            batches_per_epoch = len(ctx.data.train) / (ctx.cfg.batch_size * replicas)

            def scheduler_factory(opt: torch.optim.Optimizer) -> Any:
                return build_schedule(opt, ctx.cfg.schedule, ctx.cfg.epochs,
                                      batches_per_epoch * steps_per_batch, scales[0])

            extra["scheduler_factory"] = scheduler_factory

        self.trainer = PipelineTrainer(
            ctx.comm,
            model,
            balance=balance,
            schedule=SCHEDULE_OF_MODE[mode],
            microbatches=pc.microbatches,
            optimizer_factory=factory,
            loss_fn=self.loss,
            recompute=pc.recompute,
            replicas=replicas,
            metrics_fn=_accuracy,
            seed=ctx.cfg.seed,
            sample=_sample(ctx) if balance == "time" or traced else None,
            device=ctx.device,
            chunks=chunks if mode == "interleaved" else None,
            split_points=pc.split_points,
            **extra,
        )
        if traced:  # the traced stages run the model's operations themselves: autocast around each stage
            t = self.trainer
            stages = [t.module] if t.chunks == 1 else list(t.module.children())
            self.hooks = autocast_layers(stages, ctx.cfg.precision, ctx.device.type)
        # Under async the stage's own scheduler sets its rates; the loop's schedule gets a stand-in.
        self.optimizer = rate_stand_in(self.trainer.optimizer) if mode == "async" else self.trainer.optimizer
        self.lr_scale = scales[0] if scales else 1.0
        self.replicas = replicas
        self.replica_rank = self.trainer.grid.replica
        self.streams = mode == "async"
        self.batches = 0  # batches trained (the loop's step), to drain at the loop's epoch ends
        self.records = len(ctx.data.train)
        self.memory_plan, self.memory_meter = self._memory(ctx, mode, pc, chunks, extra)
        self.global_batch = ctx.cfg.batch_size * replicas
        self.total_batches = ctx.cfg.total_steps(self.records, replicas)

    def _epoch_ends(self, step: int) -> bool:
        """Whether the loop's step ``step`` crosses an epoch boundary or ends the run (the loop's rule)."""
        def epoch(s: int) -> int:
            return math.floor(s * self.global_batch / self.records + 1e-9)

        return step >= self.total_batches or epoch(step) > epoch(step - 1)

    def _tally(self, loss: float | None, y: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if not self.trainer.is_last or loss is None:
            return torch.zeros(3, dtype=torch.float64)
        loss /= scale  # the loss the last stage saw was scaled for fp16
        n = y.numel()
        acc = self.trainer.last_metrics.get("accuracy", 0.0)
        return torch.tensor([loss * n, acc * n, float(n)], dtype=torch.float64)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = self.trainer
        self.batches += 1
        scale = self.loss.scale = self.scaler.scale if self.scaler is not None else 1.0
        try:
            if not self.streams:
                loss = t.train_step(x if t.is_first else None, y if t.is_last else None)
                return self._tally(loss, y, scale)
            loss = t.stream_step(x if t.is_first else None, y if t.is_last else None)
        finally:
            self.loss.scale = 1.0
        tally = self._tally(loss, y)  # the batch's losses are known on the last stage: its forwards ran
        if self._epoch_ends(self.batches):
            t.drain()
        return tally

    def eval_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = self.trainer
        t.drain()  # evaluate the weights of every batch trained so far
        m = t.microbatches
        # A short last batch gets fewer micro-batches, as many as split it evenly (the split
        # warning is about training batches; an evaluation weighs micro-batches by size anyway).
        n = batch_size(x)
        t.microbatches = next(k for k in range(max(1, min(m, n)), 0, -1) if n % k == 0)
        try:
            loss, metrics = t.eval_step(x if t.is_first else None, y if t.is_last else None)
        finally:
            t.microbatches = m
        t.last_metrics = metrics
        return self._tally(loss, y)

    def _memory(self, ctx: ModeContext, mode: str, pc: PipelineConfig, chunks: int,
                extra: dict[str, Any]) -> tuple[Any, Any]:
        """The predicted peak per stage of this run (refused over ``pipeline.memory_budget``) and the meter."""
        from ringpipe.pipeline.memory import MemoryMeter
        from ringpipe.train.pipeline_memory import plan_for, refuse_over_budget

        t = self.trainer
        try:
            plan = plan_for(ctx.build_model, ctx.data.train, ctx.cfg.batch_size, pc.microbatches, pc.stages,
                            list(t.balance), self.loss, lambda ps: ctx.optimizer(ps, self.replicas)[0], [mode],
                            chunks=chunks, recompute=pc.recompute, step_every=extra.get("step_every", 1),
                            mitigations=pc.mitigations, split_points=t.split_points if t.traced else None)[0]
        except Exception as exc:  # noqa: BLE001 - a prediction must never stop a run it cannot model
            if pc.memory_budget is not None:
                raise ConfigError(f"pipeline.memory_budget={pc.memory_budget}: cannot predict this run's memory "
                                  f"({exc}); remove the budget") from None
            plan = None
        if plan is not None:
            refuse_over_budget(plan, pc.memory_budget)
        import ringpipe.pipeline.diagnosis  # noqa: F401 - registers the pipeline doctor with the run's doctor.txt
        import ringpipe.pipeline.stream_diagnosis  # noqa: F401 - and the asynchronous pipeline's
        from ringpipe.pipeline.action_events import record_actions

        record_actions(ctx.comm.log, t.runtimes, t.executor, schedule=t.schedule, stage=t.stage, stages=t.num_stages,
                       microbatches=pc.microbatches, chunks=t.chunks, balance=list(t.balance),
                       recompute=pc.recompute, step_every=extra.get("step_every", 1))
        # after the recorder, so that the passes it times leave out the meter's own sampling
        meter = MemoryMeter(steps=2 * pc.stages * pc.microbatches + 4).attach(t.runtimes, t.executor, t.optimizer,
                                                                              t.policy)
        return plan, meter

    def summary_extra(self, comm: Any) -> dict[str, Any]:
        from ringpipe.train.pipeline_memory import memory_summary

        return memory_summary(comm, self.trainer.stage, self.memory_meter, self.memory_plan)

    def close(self) -> None:
        for handle in self.hooks:  # the user's layers are left as they were given
            handle.remove()

    def state_dict(self) -> dict[str, Any]:
        self.trainer.drain()  # a checkpoint holds no micro-batch in flight
        state = {**self.trainer.state_dict(), "batches": self.batches}
        if self.scaler is not None:
            state["loss_scale"] = self.scaler.state_dict()
        gap_aware = _gap_aware(self.trainer)
        if gap_aware is not None:  # Gap Aware's running statistics shape every later step
            state["gap_aware"] = _gap_aware_state(gap_aware)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)
        self.batches = int(state.get("batches", 0))
        if self.scaler is not None and "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])
        gap_aware = _gap_aware(self.trainer)
        if gap_aware is not None and "gap_aware" in state:
            _load_gap_aware_state(gap_aware, state["gap_aware"])


#: Gap Aware's statistics, for a GapAware without a state_dict of its own.
_GAP_AWARE_STATE = ("updates", "running", "eta_max")


def _gap_aware(trainer: Any) -> Any:
    return getattr(getattr(trainer, "policy", None), "gap_aware", None)


def _gap_aware_state(ga: Any) -> dict[str, Any]:
    if hasattr(ga, "state_dict"):
        return dict(ga.state_dict())
    return {k: copy.deepcopy(getattr(ga, k)) for k in _GAP_AWARE_STATE if hasattr(ga, k)}


def _load_gap_aware_state(ga: Any, state: dict[str, Any]) -> None:
    if hasattr(ga, "load_state_dict"):
        ga.load_state_dict(state)
        return
    for key, value in state.items():
        if key == "running":
            for mine, saved in zip(ga.running, value, strict=True):
                mine.copy_(saved)
        else:
            setattr(ga, key, copy.deepcopy(value))


#: The key that adds layers to each model (a deeper model gives every stage something to train).
_DEPTH_KEY = {"mlp": "model.hidden", "cnn": "model.channels", "resnet": "model.blocks", "transformer": "model.layers"}


def _stage_fix(model: str) -> str:
    more = f"more layers via {_DEPTH_KEY[model]}" if model in _DEPTH_KEY else "a model with more layers"
    return (f"use fewer pipeline.stages, a pipeline.balance (layers per stage) that gives every stage a layer "
            f"with parameters, or {more}")


def _check_stages(layers: list[torch.nn.Module], balance: Any, pc: PipelineConfig, model: str, parts: int) -> None:
    """Refuse a split that leaves a stage without parameters (its optimizer would have nothing to train).

    The split is the one PipelineTrainer makes for a balance given as layer counts or by parameters;
    an impossible split is left for it to report.
    """
    from ringpipe.pipeline.partition import BalanceError, balance_by_params, check_balance

    try:
        if balance == "params":
            counts = balance_by_params(layers, parts)
        elif isinstance(balance, list):
            counts = check_balance(balance, len(layers))
        else:
            return  # measured on each rank: the optimizer factory checks its own stage
    except BalanceError:
        return
    how = {"parameters": "by parameters", "uniform": "uniformly"}.get(pc.partition, "")
    how = f"pipeline.balance={pc.balance}" if pc.balance is not None else f"pipeline.partition={pc.partition} ({how})"
    start = 0
    held: list[list[torch.nn.Module]] = [[] for _ in range(pc.stages)]  # a rank's layers, every chunk of it
    for index, count in enumerate(counts):
        held[index % pc.stages] += layers[start:start + count]
        start += count
    for stage, part in enumerate(held):
        if not any(p.numel() for layer in part for p in layer.parameters()):
            names = ", ".join(type(layer).__name__ for layer in part)
            count = len(part)
            raise ConfigError(
                f"pipeline stage {stage} of {pc.stages} got {count} layer{'s' if count != 1 else ''} ({names}) "
                f"and no parameters: {how} split the model's {len(layers)} layers as {counts}; {_stage_fix(model)}"
            )


def _check_traced(pc: PipelineConfig, model: nn.Module, parts: int) -> None:
    """Refuse settings that a model split by tracing does not read, and a count of split points that does not fit."""
    name = type(model).__name__
    if pc.balance is not None:
        raise ConfigError(
            f"pipeline.balance={pc.balance} counts layers of an nn.Sequential; the model is a {name}, split by "
            "tracing: give pipeline.split_points (module names where stages begin) instead"
        )
    if pc.partition != "parameters":
        raise ConfigError(
            f"pipeline.partition={pc.partition} applies to an nn.Sequential; a traced {name} is cut at "
            "pipeline.split_points, or balanced by parameters without them"
        )
    if pc.split_points is not None and len(pc.split_points) + 1 != parts:
        raise ConfigError(
            f"pipeline.split_points={pc.split_points} cut the model into {len(pc.split_points) + 1} parts, but "
            f"pipeline.stages={pc.stages}" + (f" x pipeline.chunks = {parts}" if parts != pc.stages else "")
            + f" parts are needed; give {parts - 1} split points"
        )


def _sample(ctx: ModeContext) -> Any:
    """A batch of inputs to time the layers with (pipeline.partition=time) or to trace the model on."""
    n = max(2, min(ctx.cfg.batch_size, len(ctx.data.train)))
    return ctx.data.train.batch(torch.arange(n))[0]


def _register(mode: str, description: str) -> None:
    register_mode(mode, description)(lambda ctx: PipelineRunner(ctx, mode))


_register("seq", "naive model parallelism: the model cut into stages, one micro-batch at a time")
_register("gpipe", "GPipe fill-drain pipeline over micro-batches (Huang et al. 2019)")
_register("1f1b", "PipeDream-flush: one forward, one backward (Narayanan et al. 2021)")
_register("interleaved", "interleaved 1F1B: pipeline.chunks model chunks per rank, a bubble pipeline.chunks "
          "times smaller for as many more messages (Narayanan et al. 2021)")
_register("zb_h1", "zero-bubble ZB-H1: each backward split into an input-gradient pass and a weight-gradient "
          "pass run later, in what would be bubble; 1F1B's peak memory (Qi et al. 2024)")
_register("zb_h2", "zero-bubble ZB-H2: ZB-H1's split backward with up to 2 x stages - 1 micro-batches held "
          "per stage, so consecutive steps leave no stage idle with equal passes (Qi et al. 2024)")
_register("async", "asynchronous PipeDream-style pipeline, no flush, a step every pipeline.step_every "
          "micro-batches, staleness mitigations (pipeline.mitigations)")
