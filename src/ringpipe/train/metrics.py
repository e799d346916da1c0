"""Run outputs: ``metrics.jsonl``, ``summary.json``, a PNG of the loss, accuracy and rate curves, the summary table."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ringpipe.observe.regions import expected_work

__all__ = [
    "MetricsWriter",
    "finite",
    "read_metrics",
    "write_json_atomic",
    "plot_curves",
    "curves_figure",
    "format_summary",
]


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None (JSON has no NaN: it is written null)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def _dumps(obj: Any, **kwargs: Any) -> str:
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def _parse(text: str) -> tuple[list[dict[str, Any]], int]:
    """The complete records of a metrics file, and the number of its lines after the first
    that is not one (a record torn by a crash while it was written, and what follows it)."""
    records: list[dict[str, Any]] = []
    lines = text.split("\n")
    complete = lines[:-1]  # a last line without its newline was cut short, unless it parses
    if lines[-1].strip():
        complete.append(lines[-1])
    for i, line in enumerate(complete):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or "step" not in record:
            return records, len([rest for rest in complete[i:] if rest.strip()])
        records.append(record)
    return records, 0


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` up to the first incomplete one ([] if the file is absent)."""
    p = Path(path)
    if not p.is_file():
        return []
    return _parse(p.read_text())[0]


class MetricsWriter:
    """Appends one JSON record per line to ``<run-dir>/metrics.jsonl`` (rank 0 only; others no-op),
    and each record to the loggers of :mod:`ringpipe.train.metric_loggers` (``metrics.csv``, TensorBoard)."""

    def __init__(self, run_dir: str | Path, enabled: bool, logger: str = "csv") -> None:
        from ringpipe.train.metric_loggers import CsvLogger, TensorBoardLogger

        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self.loggers: list[Any] = [CsvLogger(Path(run_dir))] if enabled else []
        if enabled and logger == "tensorboard":
            self.loggers.append(TensorBoardLogger(Path(run_dir)))

    def close(self) -> None:
        for logger in self.loggers:
            if hasattr(logger, "close"):
                logger.close()

    def truncate_after(self, step: int) -> None:
        """Keep only records up to ``step`` (resuming from a checkpoint taken at that step).

        Partial train records (a log window closed early because the run stopped) go too: the
        resumed run logs that window in full. A torn tail (a crash while a record was written)
        is cut back to the last complete record, with a warning.
        """
        if not self.enabled:
            return
        records, torn = _parse(self.path.read_text()) if self.path.is_file() else ([], 0)
        if torn:
            last = f"step {records[-1]['step']}" if records else "none"
            logging.getLogger(__name__).warning(
                "%s ends in %d incomplete line%s (a run stopped while writing it): cut back to the last "
                "complete record (%s)", self.path, torn, "s" if torn > 1 else "", last)
        self.records = [r for r in records if r["step"] <= step and not r.get("partial")]
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(_dumps(r) + "\n" for r in self.records))
        os.replace(tmp, self.path)
        for logger in self.loggers:
            logger.rewrite(self.records)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        with expected_work("metrics"):  # rank 0 alone writes: the doctor does not call it lateness
            with self.path.open("a") as f:
                f.write(_dumps(record) + "\n")
            for logger in self.loggers:
                logger.write(record)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(_dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, p)


@contextlib.contextmanager
def _matplotlib_cache() -> Iterator[None]:
    """Where matplotlib builds its font cache when it is first imported, quietly.

    The user's choice (``MPLCONFIGDIR``) or matplotlib's own cache folder when it exists;
    otherwise a temporary folder, removed afterwards, so that a run leaves nothing outside its
    run directory. The "generated new fontManager" record is silenced unless its level was set.
    """
    fm_log = logging.getLogger("matplotlib.font_manager")
    if fm_log.level == logging.NOTSET:
        fm_log.setLevel(logging.WARNING)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "matplotlib"
    if "matplotlib" in sys.modules or "MPLCONFIGDIR" in os.environ or (cache.is_dir() and os.access(cache, os.W_OK)):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="ringpipe-matplotlib-") as tmp:
        os.environ["MPLCONFIGDIR"] = tmp
        try:
            yield
        finally:
            del os.environ["MPLCONFIGDIR"]


def curves_figure(records: Sequence[dict[str, Any]], title: str = "") -> Any:
    """The figure of ``curves.png``: loss, accuracy (train and test) and learning rate against epochs."""
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    with _matplotlib_cache():
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    def series(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
        return [math.nan if r.get(key) is None else r[key] for r in rows]  # null: a missing point

    fig, (ax_loss, ax_acc, ax_lr) = plt.subplots(1, 3, figsize=(15, 4))
    if train:
        ax_loss.plot(series(train, "epoch"), series(train, "loss"), ".-", label="train", alpha=0.7)
        ax_acc.plot(series(train, "epoch"), series(train, "accuracy"), ".-", label="train", alpha=0.7)
        ax_lr.plot(series(train, "epoch"), series(train, "lr"), ".-", label="lr")
    if evals:
        ax_loss.plot(series(evals, "epoch"), series(evals, "test_loss"), "o-", label="test")
        ax_acc.plot(series(evals, "epoch"), series(evals, "test_accuracy"), "o-", label="test")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1.02))
    ax_lr.set(xlabel="epoch", ylabel="learning rate", title="learning rate (as scaled for the replicas)")
    for ax in (ax_loss, ax_acc, ax_lr):
        ax.grid(alpha=0.3)
        if train or evals:
            if ax is not ax_lr:
                ax.legend()
        else:
            ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_curves(run_dir: str | Path, records: Sequence[dict[str, Any]], title: str = "") -> Path:
    """:func:`curves_figure` as ``<run-dir>/curves.png`` (empty axes without data); ``title`` names the run."""
    fig = curves_figure(records, title)  # imports matplotlib with its cache kept out of the user's folders
    import matplotlib.pyplot as plt

    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100, metadata={"Title": title} if title else None)
    plt.close(fig)
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _notes(summary: dict[str, Any]) -> list[str]:
    """What the table's numbers mean where they could mislead."""
    notes = []
    epochs, configured = summary.get("epochs"), summary.get("epochs_configured")
    samples, records = summary.get("samples"), summary.get("records")
    if epochs is not None and configured is not None and samples and records and epochs > configured:
        over = samples - configured * records
        notes.append(f"epochs = samples / records = {samples} / {records}: a step takes a whole global batch, so "
                     f"the last one ran {over:.0f} samples past epoch {configured:g}")
    if summary.get("micro_batch") not in (None, summary.get("global_batch")):
        notes.append(f"steps count batches of global_batch samples, each split into parts of micro_batch="
                     f"{summary['micro_batch']} samples per replica; optimizer_steps counts the updates")
    scale = summary.get("lr_scale")
    if scale not in (None, 1.0) and summary.get("lr") is not None:
        notes.append(f"lr {summary['lr']:g} is the single-process rate; optimizer.scale_lr (default true) "
                     f"multiplied it by {scale:g}, the rate logged and in final_lr")
    for change in summary.get("resized", []):
        notes.append(f"resumed at step {change['step']} ({change['samples']} samples) from mode "
                     f"{change['from_mode']} on {change['from_replicas']} replicas to mode {change['mode']} on "
                     f"{change['replicas']}; global_batch and lr_scale are those of the last part, samples counts "
                     f"every part")
    return notes


def format_summary(summary: dict[str, Any]) -> str:
    """The closing table: one ``key  value`` row per summary entry, then notes on what may mislead."""
    rows = [(k, _fmt(v)) for k, v in summary.items() if not isinstance(v, dict | list)]
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * (vwidth + 2) + "+"
    body = [f"| {k.ljust(width)} | {v.rjust(vwidth)} |" for k, v in rows]
    return "\n".join([line, *body, line, *(f"note: {n}" for n in _notes(summary))])
