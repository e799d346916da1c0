"""What a training run reports on one rank: the train and evaluation records, the log line, the
progress bar and the summary (mixed into the loop's run state, :mod:`ringpipe.train.loop`).

A train record closes every log window (``log_every`` steps, and each evaluation); an
evaluation record follows each epoch boundary; :meth:`Reporting._summary` is the run's
``summary.json``. The loop measures, this module words and writes what it measured.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringpipe.comm import Communicator
    from ringpipe.train.best import BestCheckpoint
    from ringpipe.train.config import TrainConfig
    from ringpipe.train.metrics import MetricsWriter
    from ringpipe.train.modes import Engine
    from ringpipe.train.stop import StopRequest
    from ringpipe.train.tally import Tally

__all__ = ["Reporting"]

log = logging.getLogger("ringpipe.train.loop")  # the records' log lines carry the loop's name


class Reporting:
    """The reporting half of a run on one rank (mixed into the loop's run state)."""

    comm: Communicator
    cfg: TrainConfig
    engine: Engine
    metrics: MetricsWriter
    stop: StopRequest
    best: BestCheckpoint | None
    schedule: Any
    window: Tally
    epoch_tally: Tally
    is_root: bool
    progress: bool
    step: int
    stop_step: int
    global_batch: int
    records: int
    train_time: float
    stop_reason: str
    resizes: list[dict[str, Any]]
    step_windows: list[tuple[int, int, int]]
    last_eval: dict[str, Any]
    last_train: dict[str, Any]

    def epoch_at(self, step: int) -> float:
        raise NotImplementedError

    def samples_at(self, step: int) -> int:
        raise NotImplementedError

    def evaluate(self, split: Any = None) -> tuple[float, float]:
        raise NotImplementedError

    def comm_share(self, since: int = 0) -> float:
        """Share of the steps' time this rank spent blocked waiting for communication.

        Communication that overlaps computation (gradient buckets reduced during backward,
        pipeline receives posted ahead) costs nothing here; only the waits that remain do.
        """
        windows = self.step_windows[since:]
        busy = sum(w1 - w0 for w0, w1, _ in windows)
        return sum(b for _, _, b in windows) / busy if busy > 0 else 0.0

    def _bar(self) -> Any:
        from tqdm.auto import tqdm

        return tqdm(
            total=self.stop_step,
            initial=self.step,
            disable=not (self.is_root and self.progress),
            desc=f"{self.cfg.mode} x{self.comm.size}",
            unit="step",
            dynamic_ncols=True,
            leave=False,
        )

    def _log_train(self, bar: Any, steps: int, seconds: float, partial: bool = False) -> bool:
        """Log the window's train record; returns whether any rank was asked to stop (Ctrl-C)."""
        loss, acc, _, stop = self.window.reduce_flag(self.comm, self.stop.requested)
        rec: dict[str, Any] = {
            "kind": "train",
            "step": self.step,
            "epoch": round(self.epoch_at(self.step), 6),
            "loss": loss,
            "accuracy": acc,
            "lr": self.schedule.get_last_lr()[0],
            "samples_per_second": steps * self.global_batch / seconds if seconds > 0 else 0.0,
        }
        if partial:
            rec["partial"] = True
        self.last_train = rec
        self.metrics.write(rec)
        bar.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.3f}", lr=f"{rec['lr']:.2e}", refresh=False)
        return stop

    def _log_eval(self, since: int) -> None:
        train_loss, train_acc, _ = self.epoch_tally.reduce(self.comm)
        test_loss, test_acc = self.evaluate()
        windows = self.step_windows[since:]
        secs = sum(w1 - w0 for w0, w1, _ in windows) / 1e9
        rec: dict[str, Any] = {
            "kind": "eval",
            "step": self.step,
            "epoch": round(self.epoch_at(self.step), 6),
            "train_loss": train_loss,
            "train_accuracy": train_acc,
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "lr": self.schedule.get_last_lr()[0],
            "samples_per_second": len(windows) * self.global_batch / secs if secs > 0 else 0.0,
            "comm_share": self.comm_share(since),
        }
        self.last_eval = rec
        self.metrics.write(rec)
        if self.is_root:
            log.info(
                "epoch %.2f | train loss %.4f acc %.4f | test loss %.4f acc %.4f | lr %.2e | %.0f samples/s | comm %.0f%%",
                rec["epoch"], train_loss, train_acc, test_loss, test_acc, rec["lr"],
                rec["samples_per_second"], 100 * rec["comm_share"],
            )

    def _summary(self, final_eval: dict[str, Any], interrupted: bool, wall: float) -> dict[str, Any]:
        e, cfg = self.engine, self.cfg
        samples = self.samples_at(self.step)
        micro, steps_per_batch = _micro_batches(cfg)
        return {
            "mode": cfg.mode,
            "world_size": self.comm.size,
            "replicas": e.replicas,
            "model": _label(cfg.model),
            "dataset": _label(cfg.data),
            "epochs": round(self.epoch_at(self.step), 6),
            "epochs_configured": cfg.epochs,
            "steps": self.step,
            "optimizer_steps": self.step * steps_per_batch,
            "global_batch": self.global_batch,
            "micro_batch": cfg.batch_size // micro,
            "samples": samples,
            "records": self.records,
            "test_accuracy": final_eval["test_accuracy"],
            "test_loss": final_eval["test_loss"],
            "final_loss": self.last_train.get("loss", math.nan),
            "lr": cfg.optimizer.lr,
            "lr_scale": e.lr_scale,
            "final_lr": self.schedule.get_last_lr()[0],
            "samples_per_second": samples / self.train_time if self.train_time > 0 else 0.0,
            "comm_share": self.comm_share(),
            "train_time_s": self.train_time,
            "wall_time_s": wall,
            "complete": not interrupted,
            "stop_reason": self.stop_reason,
            **({"best": self.best.summary()} if self.best is not None else {}),
            **({"resized": self.resizes} if self.resizes else {}),
        }


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
