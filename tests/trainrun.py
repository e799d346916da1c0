"""Run ``ringpipe train`` in this process for the trainer tests: the summary and metrics it wrote."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ringpipe.train.command import add_train_parser, run_train
from ringpipe.train.metrics import read_metrics


def sets(items):
    """``["a=1", "b=2"]`` -> ``["--set", "a=1", "--set", "b=2"]``."""
    return [a for item in items for a in ("--set", item)]


def train(run_dir: Path, *argv: str) -> tuple[int, dict, list[dict]]:
    """Exit code, ``summary.json`` ({} if absent) and ``metrics.jsonl`` records ([] if absent)."""
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--run-dir", str(run_dir), "--no-progress", *argv])
    rc = run_train(args)
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    metrics = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    return rc, summary, metrics
