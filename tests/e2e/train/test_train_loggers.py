"""Loggers beside metrics.jsonl: metrics.csv always (rank 0, inside the run directory), TensorBoard on request.

The oracle of the CSV is metrics.jsonl itself: one row per record, the same values, in order,
also after a run stopped by max_steps is resumed.
"""

from __future__ import annotations

import csv
import importlib.util
import math

import pytest

from ringpipe.train.config import ConfigError, load_config
from ringpipe.train.metric_loggers import CSV_COLUMNS
from trainrun import sets, train

QUICK = ["mode=single", "epochs=2", "batch_size=64", "log_every=5", "model.hidden=[16]"]


def _csv_rows(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _same(row, record):
    for column in CSV_COLUMNS:
        value = record.get(column)
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            assert row[column] == "", (column, row, record)
        elif isinstance(value, bool):
            assert row[column] == str(value)
        elif isinstance(value, str):
            assert row[column] == value
        else:
            assert float(row[column]) == pytest.approx(value, rel=1e-12), column


@pytest.mark.timeout(300)
def test_csv_holds_every_record_of_metrics_jsonl(tmp_path):
    rc, summary, records = train(tmp_path / "run", *sets(QUICK))
    assert rc == 0 and records
    rows = _csv_rows(tmp_path / "run" / "metrics.csv")
    assert list(rows[0]) == list(CSV_COLUMNS) and len(rows) == len(records)
    for row, record in zip(rows, records, strict=True):
        _same(row, record)
    assert {r["kind"] for r in rows} == {"train", "eval"}


@pytest.mark.timeout(300)
def test_csv_of_a_resumed_run_equals_its_metrics(tmp_path):
    run = tmp_path / "run"
    rc, _, _ = train(run, *sets([*QUICK, "max_steps=12"]))
    assert rc == 0
    rc, summary, records = train(run, "--resume", *sets([*QUICK, "max_steps=null"]))
    assert rc == 0 and summary["complete"]
    rows = _csv_rows(run / "metrics.csv")
    assert len(rows) == len(records)
    for row, record in zip(rows, records, strict=True):
        _same(row, record)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_without_the_package_is_refused_with_the_install_line():
    with pytest.raises(ConfigError, match=r"logger=tensorboard needs the tensorboard package.*ringpipe\[tensorboard\]"):
        load_config(overrides=["logger=tensorboard"])


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard is not installed (optional extra: pip install 'ringpipe[tensorboard]')")
@pytest.mark.timeout(300)
def test_tensorboard_events_are_written_inside_the_run_directory(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rc, _, records = train(tmp_path / "run", *sets([*QUICK, "logger=tensorboard"]))
    assert rc == 0
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    want = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses == pytest.approx(want, rel=1e-6)
    assert (tmp_path / "run" / "metrics.csv").is_file()
