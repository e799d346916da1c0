"""The best checkpoint by a chosen metric (``checkpoint.best``), kept in ``<run-dir>/checkpoints/best/`` beside the last k.

After every evaluation, when the metric improved on every earlier evaluation of the run (higher
accuracy, lower loss; NaN never improves), the state of that step is written there, replacing
the previous best. The decision is the same on every rank (the metric is reduced across ranks);
a resumed run takes the best so far from the evaluation records it keeps. The file is an
ordinary checkpoint (``--resume`` reads only ``checkpoints/step-*.pt``) with ``best: {metric,
value, step}`` added.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ringpipe.comm import Communicator
from ringpipe.observe.regions import expected_work
from ringpipe.train.checkpoints.files import list_checkpoints, save_checkpoint

__all__ = ["BestCheckpoint", "best_checkpoint"]


def best_checkpoint(run_dir: str | Path) -> Path | None:
    """The best checkpoint of a run (None when the run keeps none)."""
    found = list_checkpoints(Path(run_dir) / "checkpoints" / "best")
    return found[-1] if found else None


class BestCheckpoint:
    """Keeps the checkpoint of the best evaluation of ``metric`` so far."""

    def __init__(self, metric: str, run_dir: Path, comm: Communicator) -> None:
        self.metric, self.comm = metric, comm
        self.directory = run_dir / "checkpoints" / "best"
        self.higher = metric.endswith("accuracy")
        self.value: float | None = None
        self.step: int | None = None
        self._known = False

    def _better(self, value: float, than: float | None) -> bool:
        if not math.isfinite(value):
            return False
        return than is None or (value > than if self.higher else value < than)

    def _so_far(self, records: list[dict[str, Any]], step: int) -> None:
        """The best of the evaluations before ``step`` (rank 0 holds the records; every rank gets the result)."""
        best: tuple[float, int] | None = None
        for r in records:
            v = r.get(self.metric)
            if (r.get("kind") == "eval" and r["step"] < step and isinstance(v, int | float)
                    and self._better(float(v), best[0] if best else None)):
                best = (float(v), int(r["step"]))
        if self.comm.size > 1:
            best = self.comm.broadcast_object(best)
        self.value, self.step = best if best is not None else (None, None)
        self._known = True

    def consider(self, step: int, value: float, records: list[dict[str, Any]],
                 gathered: tuple[dict[str, Any] | None] | None, payload: Callable[[], dict[str, Any] | None]) -> bool:
        """After an evaluation: write the step's state as the best if ``value`` improved; returns whether.

        The state is ``gathered[0]`` when the caller already has it, else ``payload()`` (collective).
        """
        if not self._known:
            self._so_far(records, step)
        if not self._better(value, self.value):
            return False
        self.value, self.step = value, step
        state = gathered[0] if gathered is not None else payload()
        if state is not None:  # rank 0
            state = {**state, "best": {"metric": self.metric, "value": value, "step": step}}
            with expected_work("checkpoint"):
                save_checkpoint(self.directory, step, state, keep=1)
        if self.comm.size > 1:
            self.comm.barrier()
        return True

    def summary(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "step": self.step}
