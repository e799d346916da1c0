"""Where a training run stands on one rank: its step, epochs, clocks, partial metric sums and last records.

The loop advances it, the :class:`~ringpipe.train.reporting.Reporter` words it, the
:class:`~ringpipe.train.checkpoints.checkpointer.Checkpointer` saves it and restores it on
``--resume``. Epochs are counted from the global step as ``step * global_batch / records``
(fractional), from the samples seen at the step a resumed run started from (``base_step``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ringpipe.train.tally import Tally

__all__ = ["RunProgress"]


@dataclass
class RunProgress:
    """The state of one run on one rank that is neither the model nor the data stream."""

    records: int  # training records (samples) per epoch
    global_batch: int  # samples per step, all replicas together
    total_steps: int  # the step the run completes at
    stop_step: int  # the step this part stops at (``max_steps``)
    step: int = 0
    base_step: int = 0  # a resumed run's checkpoint step ...
    base_samples: int = 0  # ... and the samples read by then
    saved_step: int = -1  # the step of the last checkpoint written (or resumed from)
    train_time: float = 0.0  # seconds spent in training steps, over the run's parts
    wall_before: float = 0.0  # wall time of the run's earlier parts (resumed runs)
    wall_start: float | None = None  # when this part's loop started
    stop_reason: str = ""
    #: (start ns, end ns, blocked ns) of every training step of this part
    step_windows: list[tuple[int, int, int]] = field(default_factory=list)
    #: changes of mode or replicas at resumes (:mod:`ringpipe.train.checkpoints.resize`)
    resizes: list[dict[str, Any]] = field(default_factory=list)
    last_eval: dict[str, Any] = field(default_factory=dict)
    last_train: dict[str, Any] = field(default_factory=dict)
    window: Tally = field(default_factory=Tally)  # the open log window's sums
    epoch_tally: Tally = field(default_factory=Tally)  # the open epoch's sums

    def samples_at(self, step: int) -> int:
        return self.base_samples + (step - self.base_step) * self.global_batch

    def epoch_at(self, step: int) -> float:
        return self.samples_at(step) / self.records

    def crossed_epoch(self, step: int) -> int | None:
        """The whole epoch reached by ``step`` if step-1 was still before it."""
        before, after = math.floor(self.epoch_at(step - 1) + 1e-9), math.floor(self.epoch_at(step) + 1e-9)
        return after if after > before else None

    def wall_time(self) -> float:
        """Wall time of the loop over the run's parts so far (resumed runs count every part)."""
        now = time.perf_counter() - self.wall_start if self.wall_start is not None else 0.0
        return self.wall_before + now

    def comm_share(self, since: int = 0) -> float:
        """Share of the steps' time this rank spent blocked waiting for communication.

        Communication that overlaps computation (gradient buckets reduced during backward,
        pipeline receives posted ahead) costs nothing here; only the waits that remain do.
        """
        windows = self.step_windows[since:]
        busy = sum(w1 - w0 for w0, w1, _ in windows)
        return sum(b for _, _, b in windows) / busy if busy > 0 else 0.0
