"""``ringpipe train --eval-only``: evaluate a run's checkpoint without training, in any mode.

The run's own config builds the runner as training does, on the processes given (modes
``single``, ``ddp`` and ``dp`` on any number, pipeline modes on the world that wrote the
checkpoint); the checkpoint is loaded as ``--resume`` loads it, then the test set and the
training set are evaluated once, each sample once across the replicas. Nothing of the training
run changes: rank 0 writes ``eval-step-<N>.json`` beside ``summary.json``, ``metrics.jsonl`` and
the checkpoints, and no checkpoint is moved or removed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ringpipe.comm import Communicator
from ringpipe.train.config import TrainConfig
from ringpipe.train.metrics import write_json_atomic

__all__ = ["evaluate_checkpoint", "eval_path", "resolve_checkpoint"]


def resolve_checkpoint(run_dir: Path, name: str | None) -> Path | None:
    """The checkpoint ``--checkpoint`` names: a file, ``best`` (the kept best one) or None (the newest good one)."""
    if name is None:
        return None
    if name == "best":
        from ringpipe.train.checkpoints.files import CheckpointError, latest_checkpoint

        best = latest_checkpoint(run_dir / "checkpoints" / "best")
        if best is None:
            raise CheckpointError(f"--checkpoint best: {run_dir / 'checkpoints' / 'best'} holds no checkpoint "
                                  f"(the run kept none: set checkpoint.best when training)")
        return best
    path = Path(name)
    return path if path.is_absolute() or path.exists() else run_dir / "checkpoints" / name


def eval_path(run_dir: Path, step: int) -> Path:
    return run_dir / f"eval-step-{step:08d}.json"


def evaluate_checkpoint(comm: Communicator, cfg: TrainConfig, run_dir: Path, checkpoint: str | Path | None,
                        make_run: Callable[..., Any]) -> dict[str, Any]:
    """Evaluate ``checkpoint`` of ``run_dir`` (default: its newest good one) on this rank; rank 0 writes it.

    ``make_run``: builds the loop's per-rank run state (runner, data) without writing anything.
    """
    state = make_run()
    try:
        state.checkpointer.resume(checkpoint, evaluating=True)
        start = time.perf_counter()
        test_loss, test_acc = state.evaluate()
        train_loss, train_acc = state.evaluate(state.data.train)
        seconds = time.perf_counter() - start
    finally:
        state.runner.close()
        state.metrics.close()
    record = {
        "eval_only": True,
        "checkpoint": str(state.checkpointer.resumed_from),
        "step": state.progress.step,
        "epoch": round(state.progress.epoch_at(state.progress.step), 6),
        "mode": cfg.mode,
        "world_size": comm.size,
        "replicas": state.runner.replicas,
        "test_loss": test_loss,
        "test_accuracy": test_acc,
        "train_loss": train_loss,
        "train_accuracy": train_acc,
        "test_records": len(state.data.test),
        "train_records": len(state.data.train),
        "eval_time_s": seconds,
    }
    if comm.rank == 0:
        write_json_atomic(eval_path(run_dir, state.progress.step), record)
    return record
