"""Mode registry: each training mode is one adapter that turns (config, communicator, model) into a ModeRunner.

The training loop only talks to a :class:`ModeRunner` (the per-mode step runner; the name
``ringpipe.train.Engine`` still refers to it): one optimizer step on a batch, one
evaluation batch, state for checkpoints, and which data shard (replica) this rank reads.
Data-parallel modes (``single``, ``ddp``, ``dp``) are here; pipeline modes live in
:mod:`ringpipe.train.pipeline_modes` and register themselves into the same registry.
A mode whose machinery is missing from the build says so when it is chosen.
"""

from __future__ import annotations

import importlib
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringpipe.comm import Communicator, default_log
from ringpipe.comm.events import START, EventLog, add_blocked
from ringpipe.pipeline.model_io import batch_chunk, batch_to, call_model, logits_of
from ringpipe.train.config import TrainConfig
from ringpipe.train.datasets import Dataset
from ringpipe.train.optimizers import build_optimizer, scaled_lr
from ringpipe.train.precision import GradStep, LossScale, autocast
from ringpipe.train.registry import Registry

__all__ = [
    "MODES",
    "ModeRunner",
    "ModeContext",
    "ModeSpec",
    "ModeUnavailable",
    "DataParallelRunner",
    "tally",
    "correct",
    "default_device",
    "loss_fn",
    "build_runner",
]


class ModeUnavailable(RuntimeError):
    """The chosen mode needs a part of ringpipe (or of the environment) that is not there."""


def loss_fn(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean cross-entropy over samples (classification) or tokens (language model)."""
    if kind == "lm":
        return lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy


def tally(out: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``[loss_sum, correct, count]`` of one batch (tokens count for language models), float64."""
    count = y.numel()
    return torch.tensor([float(loss.detach()) * count, correct(out, y), float(count)], dtype=torch.float64)


def correct(out: torch.Tensor, y: torch.Tensor) -> float:
    """Samples (tokens) whose arg-max output is the target; NaN where the targets are not class labels."""
    if y.dtype.is_floating_point or y.dtype == torch.bool or out.shape[:-1] != y.shape:
        return math.nan
    return float((out.detach().argmax(dim=-1) == y).sum())


@dataclass
class ModeContext:
    """What an adapter gets: the validated config, the world, the data and a seeded model factory."""

    cfg: TrainConfig
    comm: Communicator
    data: Dataset
    build_model: Callable[[], nn.Module]
    #: the user's loss ``(output, target) -> mean loss`` (default: cross-entropy for the data's kind)
    user_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    #: the user's optimizer factory ``params -> Optimizer`` (default: the config's optimizer, rate scaled)
    user_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    #: where this rank computes (default: the GPU of its local rank under nccl, else the CPU)
    device: torch.device | None = None

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = default_device(self.comm)

    @property
    def loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return self.user_loss if self.user_loss is not None else loss_fn(self.data.kind)

    def optimizer(self, params: Any, replicas: int) -> tuple[torch.optim.Optimizer, float]:
        """The optimizer with the rate scaled for ``replicas``; returns (optimizer, scale).

        The user's factory is called as given: its rate is not scaled (the scale is 1).
        """
        if self.user_optimizer is not None:
            opt = self.user_optimizer(params)
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"the optimizer factory returned a {type(opt).__name__}; it must return a torch.optim.Optimizer "
                    f"over the parameters it is given, e.g. lambda params: torch.optim.SGD(params, lr=0.1)"
                )
            return opt, 1.0
        lr, scale = scaled_lr(self.cfg.optimizer, replicas)
        return build_optimizer(params, self.cfg.optimizer, lr), scale

    def scaler(self) -> LossScale | None:
        """The loss scale of ``precision: fp16`` (None otherwise)."""
        return LossScale() if self.cfg.precision == "fp16" else None


def default_device(comm: Communicator) -> torch.device:
    """The GPU of this rank's local rank when the communicator carries CUDA tensors (nccl), else the CPU."""
    if comm.backend == "nccl":
        from ringpipe.comm import pin_device

        return pin_device(comm.topology)
    return torch.device("cpu")


class ModeRunner(ABC):
    """One rank's view of a training mode, driven by :func:`ringpipe.train.loop.train`."""

    #: number of data-parallel replicas (data shards) and this rank's replica
    replicas: int = 1
    replica_rank: int = 0
    #: the optimizer the LR schedule drives on this rank, and the factor its rate was scaled by
    optimizer: torch.optim.Optimizer
    lr_scale: float = 1.0
    #: True when every rank holds the same model and optimizer state (only rank 0's is saved)
    shared_state: bool = True
    #: True when micro-batches stay in flight from one step into the next (mode async): the state
    #: is whole only where the runner drains (epoch ends, the end of the run), so a run stopped
    #: between drains is checkpointed as it was at its last drain
    streams: bool = False

    @abstractmethod
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on this rank's batch; returns this rank's tally (zeros if it sees no loss)."""

    @abstractmethod
    def eval_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Evaluate a batch without changing any state; returns this rank's tally."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def summary_extra(self, comm: Any) -> dict[str, Any]:
        """Entries this mode adds to ``summary.json`` (every rank calls it; it may gather). None by default."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, most runners hold nothing to release
        """Release communication resources (background threads, hooks)."""


@dataclass(frozen=True)
class ModeSpec:
    """A registered mode: its adapter and a one-line description for ``--help``."""

    name: str
    build: Callable[[ModeContext], ModeRunner]
    description: str
    requires: str | None = None  # module that must be importable, e.g. ringpipe.dp

    def check(self) -> None:
        if self.requires is None:
            return
        try:
            importlib.import_module(self.requires)
        except ImportError as exc:
            raise ModeUnavailable(
                f"mode {self.name!r} is not available in this build: it needs {self.requires} ({exc}); "
                f"use mode single, ddp or another available mode"
            ) from None


MODES: Registry[ModeSpec] = Registry("mode")


def register_mode(name: str, description: str, requires: str | None = None) -> Callable[[Any], Any]:
    def deco(build: Callable[[ModeContext], ModeRunner]) -> Callable[[ModeContext], ModeRunner]:
        MODES.register(name)(ModeSpec(name, build, description, requires))
        return build

    return deco


def build_runner(ctx: ModeContext) -> ModeRunner:
    """The runner of ``ctx.cfg.mode`` (pipeline modes are registered on first use)."""
    importlib.import_module("ringpipe.train.pipeline_modes")
    spec = MODES.get(ctx.cfg.mode)
    spec.check()
    return spec.build(ctx)


# --------------------------------------------------------------------------------- data parallel


class DataParallelRunner(ModeRunner):
    """Every rank holds the whole model and reads its own shard: ``single``, ``ddp`` and ``dp``."""

    def __init__(self, ctx: ModeContext, model: nn.Module, train_model: nn.Module, optimizer: torch.optim.Optimizer,
                 scale: float, accumulate: int = 1, base: torch.optim.Optimizer | None = None) -> None:
        self.model = model  # the plain module (evaluation, checkpoints)
        self.train_model = train_model  # what the forward of a training step goes through
        self.optimizer = optimizer
        self.lr_scale = scale
        self.loss = ctx.loss
        self.replicas = ctx.comm.size
        self.replica_rank = ctx.comm.rank
        self.accumulate = accumulate  # backward passes (equal chunks of the batch) per optimizer step
        assert ctx.device is not None
        self.device = ctx.device
        self.precision = ctx.cfg.precision
        self.scaler = ctx.scaler()
        # After the replicas' average (the base optimizer steps once the gradients are reduced): the
        # average is the same on every replica, so its norm is the global one without a message.
        clip = ctx.cfg.optimizer.clip_grad_norm
        self.grad_step = (GradStep(list(model.parameters()), clip, self.scaler).install(base or optimizer)
                          if clip is not None or self.scaler is not None else None)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.train_model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(3, dtype=torch.float64)
        x, y = batch_to(x, self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        for xc, yc in zip(batch_chunk(x, self.accumulate), y.chunk(self.accumulate), strict=True):
            with autocast(self.precision, self.device):
                out = logits_of(call_model(self.train_model, xc))
                loss = self.loss(out, yc)
            scaled = loss * self.scaler.scale if self.scaler is not None else loss
            self._backward(scaled / self.accumulate)
            total += tally(out, yc, loss)
        self.optimizer.step()
        return total

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @torch.no_grad()
    def eval_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        x, y = batch_to(x, self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with autocast(self.precision, self.device):
            out = logits_of(call_model(self.model, x))
            loss = self.loss(out, y)
        return tally(out, y, loss)

    def state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["loss_scale"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])


@register_mode("single", "one process, no communication: the reference")
def _single(ctx: ModeContext) -> ModeRunner:
    if ctx.comm.size != 1:
        raise ModeUnavailable(
            f"mode 'single' runs on one process but the world has {ctx.comm.size} ranks: "
            "use mode ddp or dp, or start one process"
        )
    model = ctx.build_model().to(ctx.device)
    opt, scale = ctx.optimizer(model.parameters(), 1)
    return DataParallelRunner(ctx, model, model, opt, scale, accumulate=ctx.cfg.accumulate)


def _timed_allreduce_hook(log: EventLog, launches: list[int]) -> Callable[[Any, Any], torch.futures.Future[torch.Tensor]]:
    """A DDP communication hook doing DDP's own average, timed into ringpipe's event log.

    ``launches`` receives the launch time of every bucket (the last one: when backward's
    computation ended).
    """

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        ev = log.begin("ddp_allreduce", buf.numel() * buf.element_size(), -1, 0, "ddp")
        launches.append(ev[START])
        buf.div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f: torch.futures.Future[Any]) -> torch.Tensor:
            EventLog.end(ev)
            return f.value()[0]

        return fut.then(done)

    # DDP checks the hook's annotations as objects; postponed (string) annotations fail that check.
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook


@register_mode("ddp", "torch DistributedDataParallel over the world process group (baseline)")
def _ddp(ctx: ModeContext) -> ModeRunner:
    if not dist.is_available() or not dist.is_initialized():
        raise ModeUnavailable(
            f"mode 'ddp' needs torch.distributed's default process group, which the {ctx.comm.backend!r} "
            "communicator does not create: use backend gloo (CPU) or nccl (GPU)"
        )
    from torch.nn.parallel import DistributedDataParallel

    model = ctx.build_model().to(ctx.device)
    ddp = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device is not None and ctx.device.type == "cuda" else None)
    runner = _DDPRunner(ctx, model, ddp, *ctx.optimizer(model.parameters(), ctx.comm.size),
                        accumulate=ctx.cfg.accumulate)
    ddp.register_comm_hook(None, _timed_allreduce_hook(default_log(), runner.launches))
    return runner


class _DDPRunner(DataParallelRunner):
    """``ddp``: DDP's reducer waits for its last allreduces inside ``backward()``, in C++.

    That wait, the time from the last bucket's launch (the end of backward's computation) to the
    return of ``backward()``, is counted as time blocked on communication, as the waits of the
    other modes are.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.launches: list[int] = []

    def _backward(self, loss: torch.Tensor) -> None:
        self.launches.clear()
        loss.backward()
        if self.launches:
            add_blocked(max(0, time.perf_counter_ns() - self.launches[-1]))


def _import_dp() -> tuple[Any, Any, Any]:
    """(DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state) from ringpipe.dp."""
    try:
        from ringpipe.dp.broadcast import broadcast_optimizer_state, broadcast_parameters
        from ringpipe.dp.optimizer import DistributedOptimizer
    except ImportError as exc:
        raise ModeUnavailable(
            f"mode 'dp' is not available in this build: ringpipe.dp cannot be imported ({exc}); use mode ddp"
        ) from None
    return DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state


class _DPRunner(DataParallelRunner):
    """``dp``: gradients averaged by ringpipe's DistributedOptimizer while backward runs."""

    def close(self) -> None:
        self.optimizer.remove_hooks()  # type: ignore[attr-defined]


@register_mode("dp", "ringpipe's DistributedOptimizer (Horovod-style, overlapped bucketed allreduce)")
def _dp(ctx: ModeContext) -> ModeRunner:
    distributed_optimizer, broadcast_parameters, broadcast_optimizer_state = _import_dp()
    dpc = ctx.cfg.dp
    assert dpc is not None
    model = ctx.build_model().to(ctx.device)
    base, scale = ctx.optimizer(model.parameters(), ctx.comm.size)
    broadcast_parameters(model.state_dict(), root_rank=0, comm=ctx.comm)
    broadcast_optimizer_state(base, root_rank=0, comm=ctx.comm)
    opt = distributed_optimizer(
        base,
        named_parameters=model.named_parameters(),
        compression=dpc.compression,
        backward_passes_per_step=dpc.backward_passes_per_step,
        bucket_bytes=int(dpc.bucket_mb * 1024 * 1024),
        algorithm=dpc.algorithm,
        comm=ctx.comm,
        join_support=False,  # every replica runs the same number of steps (ShardStream)
    )
    return _DPRunner(ctx, model, model, opt, scale, accumulate=dpc.backward_passes_per_step, base=base)
