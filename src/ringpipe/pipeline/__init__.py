"""Pipeline model parallelism: partitioning, schedules, stage runtime, recomputation, replicas.

One executor (:class:`PipelineExecutor`) interprets every schedule's actions over one stage
runtime class (:class:`StageRuntime`); ``ChunkedExecutor`` and ``SplitStageRuntime`` are the
former names, kept: the first an alias of :class:`PipelineExecutor`, the second a
:class:`StageRuntime` made with ``split_backward=True``.
"""

from ringpipe.pipeline.bubble import Timing, bubble_fraction, simulate_timing
from ringpipe.pipeline.executor import ChunkedExecutor, PipelineExecutor, RunResult, staleness_of
from ringpipe.pipeline.partition import BalanceError, partition
from ringpipe.pipeline.policy import WeightPolicy
from ringpipe.pipeline.recompute import microbatch_seed, seeded
from ringpipe.pipeline.replicas import PipelineGrid, make_grid
from ringpipe.pipeline.schedules import (
    SCHEDULES,
    Action,
    ScheduleError,
    format_actions,
    get_schedule,
    parse,
    render,
    validate,
    validate_pipeline,
)
from ringpipe.pipeline.schedules_interleaved import interleaved_1f1b
from ringpipe.pipeline.stage import SplitStageRuntime, StageError, StageRuntime
from ringpipe.pipeline.trainer import PipelineTrainer, split_microbatches
from ringpipe.pipeline.zero_bubble import zb_h1, zb_h2

__all__ = [
    "Action",
    "BalanceError",
    "ChunkedExecutor",
    "PipelineExecutor",
    "PipelineGrid",
    "PipelineTrainer",
    "RunResult",
    "SCHEDULES",
    "ScheduleError",
    "StageError",
    "SplitStageRuntime",
    "StageRuntime",
    "Timing",
    "WeightPolicy",
    "bubble_fraction",
    "format_actions",
    "get_schedule",
    "interleaved_1f1b",
    "make_grid",
    "microbatch_seed",
    "parse",
    "partition",
    "render",
    "seeded",
    "simulate_timing",
    "split_microbatches",
    "staleness_of",
    "validate",
    "validate_pipeline",
    "zb_h1",
    "zb_h2",
]
