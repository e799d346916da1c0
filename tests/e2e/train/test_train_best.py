"""checkpoint.best: the checkpoint of the best evaluation so far, kept in checkpoints/best/ beside the last k.

The oracle is the run's own evaluation records (metrics.jsonl): the kept step is the first step
at which the metric reached its best (highest accuracy, lowest loss), and the kept state is the
one the regular checkpoint of that step holds.
"""

from __future__ import annotations

import pytest
import torch

from ringpipe.train.checkpoints.best import best_checkpoint
from ringpipe.train.checkpoints.files import load_checkpoint
from ringpipe.train.config import ConfigError, load_config
from trainrun import sets, train

QUICK = ["epochs=6", "batch_size=64", "log_every=5", "model.hidden=[16]", "checkpoint.keep=20",
         "schedule.name=constant", "optimizer.lr=0.05"]


def _expected(metrics, metric, higher):
    evals = [r for r in metrics if r["kind"] == "eval"]
    best = max(evals, key=lambda r: r[metric]) if higher else min(evals, key=lambda r: r[metric])
    return next(r for r in evals if r[metric] == best[metric])  # the first to reach it


def _same_state(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,nprocs,metric", [("single", 1, "test_accuracy"), ("dp", 2, "test_loss")])
def test_best_checkpoint_is_the_best_evaluation(tmp_path, mode, nprocs, metric):
    run = tmp_path / "run"
    rc, summary, metrics = train(run, *sets([*QUICK, f"mode={mode}", f"nprocs={nprocs}", f"checkpoint.best={metric}"]))
    assert rc == 0
    want = _expected(metrics, metric, metric.endswith("accuracy"))
    path = best_checkpoint(run)
    assert path is not None and len(list((run / "checkpoints" / "best").glob("step-*.pt"))) == 1
    best = load_checkpoint(path)
    assert best["best"] == {"metric": metric, "value": want[metric], "step": want["step"]}
    assert summary["best"] == best["best"]
    regular = load_checkpoint(run / "checkpoints" / f"step-{want['step']:08d}.pt")
    assert _same_state(best["engine"], regular["engine"])


def test_best_metric_names_are_checked():
    with pytest.raises(ConfigError, match="checkpoint.best='accuracy'"):
        load_config(overrides=["checkpoint.best=accuracy"])
