"""What ``ringpipe train --resume`` (and ``--eval-only``) checks of a checkpoint before any process starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ringpipe.train.config import TrainConfig

__all__ = ["check_resume_world", "nothing_left", "resume_world"]


def check_resume_world(header: dict[str, Any], raw: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint in a mode or on a number of processes it cannot continue on."""
    from ringpipe.train.checkpoints.files import CheckpointError
    from ringpipe.train.checkpoints.resize import resume_refusal

    mode = raw.get("mode", TrainConfig.model_fields["mode"].default)
    nprocs = raw.get("nprocs", TrainConfig.model_fields["nprocs"].default)
    if not isinstance(mode, str) or not isinstance(nprocs, int):
        return  # validation names the bad value
    world = resume_world(mode, nprocs)
    error = resume_refusal(header["path"], header, mode, world)
    if error:
        raise CheckpointError(error)


def nothing_left(header: dict[str, Any], cfg: TrainConfig, run_dir: Path) -> str:
    """Why resuming checkpoint ``header`` with ``cfg`` would train no step ("" if it would)."""
    from ringpipe.train.checkpoints.checkpointer import nothing_to_resume
    from ringpipe.train.checkpoints.resize import (
        DATA_PARALLEL_MODES,
        samples_seen,
        total_steps_from,
    )

    records, replicas = header.get("records"), header.get("replicas")
    if not records or not replicas:
        return ""  # a checkpoint that does not say: the ranks check it after loading the data
    step, samples = int(header["step"]), samples_seen(header, replicas)
    if cfg.mode in DATA_PARALLEL_MODES:  # continued on the replicas of this run (see ringpipe.train.checkpoints.resize)
        replicas = resume_world(cfg.mode, cfg.nprocs)
    total = total_steps_from(cfg.epochs, records, cfg.batch_size * replicas, step, samples)
    if samples == step * cfg.batch_size * replicas:
        total = cfg.total_steps(records, replicas)
    return nothing_to_resume(run_dir, step, total, cfg.max_steps)


def resume_world(mode: str, nprocs: int) -> int:
    """The number of ranks this run will have: the launcher's world, else 1 for mode single, else nprocs."""
    from ringpipe.env import detect

    topology = detect()
    return topology.size if topology.launcher != "single" else 1 if mode == "single" else nprocs
