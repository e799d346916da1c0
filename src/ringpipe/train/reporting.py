"""What a training run reports on one rank: the train and evaluation records, the log line, the
progress bar and the summary (the :class:`Reporter` the training loop owns, :mod:`ringpipe.train.loop`).

A train record closes every log window (``log_every`` steps, and each evaluation); an
evaluation record follows each epoch boundary; :meth:`Reporter.summary` is the run's
``summary.json``. The loop measures, this module words and writes what it measured.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringpipe.comm import Communicator
    from ringpipe.train.checkpoints.best import BestCheckpoint
    from ringpipe.train.config import TrainConfig
    from ringpipe.train.metrics import MetricsWriter
    from ringpipe.train.modes import ModeRunner
    from ringpipe.train.progress import RunProgress
    from ringpipe.train.stop import StopRequest

__all__ = ["Reporter"]


class Reporter:
    """Words and writes what the loop of one run measured on one rank.

    ``progress``: where the run stands (read, and its records kept there); ``schedule``: the LR
    schedule (its rate goes into the records); ``evaluate``: evaluates the test set, collective;
    ``log``: the logger of the loop's lines (the loop passes its own, so they carry its name).
    """

    def __init__(self, comm: Communicator, cfg: TrainConfig, progress: RunProgress, runner: ModeRunner, schedule: Any,
                 metrics: MetricsWriter, stop: StopRequest, evaluate: Callable[[], tuple[float, float]],
                 log: logging.Logger, show_bar: bool) -> None:
        self.comm, self.cfg, self.progress, self.runner, self.schedule = comm, cfg, progress, runner, schedule
        self.metrics, self.stop, self.evaluate, self.log = metrics, stop, evaluate, log
        self.is_root = comm.rank == 0
        self.show_bar = show_bar

    def bar(self) -> Any:
        """The progress bar of this part of the run (shown on rank 0 only, and only on a terminal: a
        redirected log, or a launcher's pipe, gets the log lines without carriage returns)."""
        from tqdm.auto import tqdm

        return tqdm(
            total=self.progress.stop_step,
            initial=self.progress.step,
            disable=not (self.is_root and self.show_bar and _on_terminal(sys.stderr)),
            desc=f"{self.cfg.mode} x{self.comm.size}",
            unit="step",
            dynamic_ncols=True,
            leave=False,
        )

    def log_train(self, bar: Any, steps: int, seconds: float, partial: bool = False) -> bool:
        """Log the window's train record; returns whether any rank was asked to stop (Ctrl-C)."""
        p = self.progress
        loss, acc, _, stop = p.window.reduce_flag(self.comm, self.stop.requested)
        rec: dict[str, Any] = {
            "kind": "train",
            "step": p.step,
            "epoch": round(p.epoch_at(p.step), 6),
            "loss": loss,
            "accuracy": acc,
            "lr": self.schedule.get_last_lr()[0],
            "samples_per_second": steps * p.global_batch / seconds if seconds > 0 else 0.0,
        }
        if partial:
            rec["partial"] = True
        p.last_train = rec
        self.metrics.write(rec)
        bar.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.3f}", lr=f"{rec['lr']:.2e}", refresh=False)
        return stop

    def log_eval(self, since: int) -> None:
        """Evaluate and log the epoch's record; ``since``: the index of the epoch's first step window."""
        p = self.progress
        train_loss, train_acc, _ = p.epoch_tally.reduce(self.comm)
        test_loss, test_acc = self.evaluate()
        windows = p.step_windows[since:]
        secs = sum(w1 - w0 for w0, w1, _ in windows) / 1e9
        rec: dict[str, Any] = {
            "kind": "eval",
            "step": p.step,
            "epoch": round(p.epoch_at(p.step), 6),
            "train_loss": train_loss,
            "train_accuracy": train_acc,
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "lr": self.schedule.get_last_lr()[0],
            "samples_per_second": len(windows) * p.global_batch / secs if secs > 0 else 0.0,
            "comm_share": p.comm_share(since),
        }
        p.last_eval = rec
        self.metrics.write(rec)
        if self.is_root:
            self.log.info(
                "epoch %.2f | train loss %.4f acc %.4f | test loss %.4f acc %.4f | lr %.2e | %.0f samples/s | comm %.0f%%",
                rec["epoch"], train_loss, train_acc, test_loss, test_acc, rec["lr"],
                rec["samples_per_second"], 100 * rec["comm_share"],
            )

    def summary(self, final_eval: dict[str, Any], interrupted: bool, wall: float,
                best: BestCheckpoint | None) -> dict[str, Any]:
        """The run's ``summary.json``; ``best``: the best checkpoint kept, if the run keeps one."""
        e, cfg, p = self.runner, self.cfg, self.progress
        samples = p.samples_at(p.step)
        micro, steps_per_batch = _micro_batches(cfg)
        return {
            "mode": cfg.mode,
            "world_size": self.comm.size,
            "replicas": e.replicas,
            "model": _label(cfg.model),
            "dataset": _label(cfg.data),
            "epochs": round(p.epoch_at(p.step), 6),
            "epochs_configured": cfg.epochs,
            "steps": p.step,
            "optimizer_steps": p.step * steps_per_batch,
            "global_batch": p.global_batch,
            "micro_batch": cfg.batch_size // micro,
            "samples": samples,
            "records": p.records,
            "test_accuracy": final_eval["test_accuracy"],
            "test_loss": final_eval["test_loss"],
            "final_loss": p.last_train.get("loss", math.nan),
            "lr": cfg.optimizer.lr,
            "lr_scale": e.lr_scale,
            "final_lr": self.schedule.get_last_lr()[0],
            "samples_per_second": samples / p.train_time if p.train_time > 0 else 0.0,
            "comm_share": p.comm_share(),
            "train_time_s": p.train_time,
            "wall_time_s": wall,
            "complete": not interrupted,
            "stop_reason": p.stop_reason,
            **({"best": best.summary()} if best is not None else {}),
            **({"resized": p.resizes} if p.resizes else {}),
            **e.summary_extra(self.comm),
        }


def _on_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for a file, a pipe, or a stream without a descriptor)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _label(section: Any) -> str:
    """A section's name; for objects handed to fit, their class (``python:Net``)."""
    extra = getattr(section, "model_extra", None) or {}
    return f"{section.name}:{extra['class']}" if section.name == "python" and "class" in extra else str(section.name)


def _micro_batches(cfg: TrainConfig) -> tuple[int, int]:
    """(micro-batches per batch, optimizer steps per batch): gradient accumulation and pipelines
    split each step's batch; only mode async steps more than once per batch (every step_every)."""
    if cfg.dp is not None:
        return cfg.dp.backward_passes_per_step, 1
    if cfg.accumulate > 1:
        return cfg.accumulate, 1
    if cfg.pipeline is not None:
        micro = cfg.pipeline.microbatches
        return micro, micro // (cfg.pipeline.step_every or micro) if cfg.mode == "async" else 1
    return 1, 1
