"""Where the metric records go besides ``metrics.jsonl``: ``metrics.csv`` always, TensorBoard on request.

Rank 0 writes both inside the run directory. The CSV has one row per record with a fixed set of
columns (train and evaluation records leave each other's columns empty), so a spreadsheet or
``pandas.read_csv`` reads it as is; a resumed run rewrites it from the records it keeps.
``logger: tensorboard`` also writes event files to ``<run-dir>/tensorboard`` (``tensorboard
--logdir <run-dir>/tensorboard``), through ``torch.utils.tensorboard``, which needs the
``tensorboard`` package (``pip install 'ringpipe[tensorboard]'``); a resumed run purges the
events after its checkpoint's step.
"""

from __future__ import annotations

import csv
import importlib.util
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["CSV_COLUMNS", "CsvLogger", "TensorBoardLogger", "tensorboard_problem"]

CSV_COLUMNS = ("kind", "step", "epoch", "loss", "accuracy", "train_loss", "train_accuracy", "test_loss",
               "test_accuracy", "lr", "samples_per_second", "comm_share", "partial")

#: TensorBoard tag of each record field, by record kind.
_TAGS = {
    "train": {"loss": "train/loss", "accuracy": "train/accuracy", "lr": "lr",
              "samples_per_second": "train/samples_per_second"},
    "eval": {"train_loss": "epoch/train_loss", "train_accuracy": "epoch/train_accuracy", "test_loss": "test/loss",
             "test_accuracy": "test/accuracy", "comm_share": "epoch/comm_share"},
}


def tensorboard_problem() -> str:
    """Why ``logger: tensorboard`` cannot write ("" if it can)."""
    if importlib.util.find_spec("tensorboard") is None:
        return ("logger=tensorboard needs the tensorboard package, which is not installed: "
                "pip install 'ringpipe[tensorboard]' (or pip install tensorboard), or use logger=csv")
    return ""


def _cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return value


class CsvLogger:
    """``<run-dir>/metrics.csv``: a header, then one row per record."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.csv"

    def rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        tmp = self.path.with_name(".metrics.csv.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(CSV_COLUMNS)
            writer.writerows([_cell(r.get(c)) for c in CSV_COLUMNS] for r in records)
        tmp.replace(self.path)

    def write(self, record: dict[str, Any]) -> None:
        if not self.path.is_file():
            self.rewrite([])
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerow([_cell(record.get(c)) for c in CSV_COLUMNS])


class TensorBoardLogger:
    """Scalars of every record in ``<run-dir>/tensorboard``, at the record's step."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "tensorboard"
        self._writer: Any = None
        self._purge: int | None = None

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.dir), purge_step=self._purge)
        return self._writer

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Resuming: events after the last kept record's step are purged when the writer opens."""
        self._purge = (max(r["step"] for r in records) + 1) if records else 0

    def write(self, record: dict[str, Any]) -> None:
        writer = self._open()
        for key, tag in _TAGS.get(record.get("kind", ""), {}).items():
            value = record.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                writer.add_scalar(tag, value, global_step=int(record["step"]))
        writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
