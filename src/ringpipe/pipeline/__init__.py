"""Pipeline model parallelism: partitioning, schedules, stage runtime, recomputation, replicas."""

from ringpipe.pipeline.executor import PipelineExecutor, RunResult, staleness_of
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
from ringpipe.pipeline.stage import StageError, StageRuntime
from ringpipe.pipeline.trainer import PipelineTrainer, split_microbatches

__all__ = [
    "Action",
    "BalanceError",
    "PipelineExecutor",
    "PipelineGrid",
    "PipelineTrainer",
    "RunResult",
    "SCHEDULES",
    "ScheduleError",
    "StageError",
    "StageRuntime",
    "WeightPolicy",
    "format_actions",
    "get_schedule",
    "make_grid",
    "microbatch_seed",
    "parse",
    "partition",
    "render",
    "seeded",
    "split_microbatches",
    "staleness_of",
    "validate",
    "validate_pipeline",
]
