"""``ringpipe train`` on a Hugging Face GPT-2 from a model factory: mode single and mode 1f1b split by name.

The factory (``examples/hf_models.py:gpt2``) returns a ``GPT2LMHeadModel``, whose output is a
``ModelOutput`` and whose LM head is tied to its token embedding. Mode ``single`` is the
reference (a plain torch loop); ``1f1b`` on 2 ranks, cut at ``transformer.h.2``, must give the
same loss at every logged step (dropout 0, so the split does not change the random masks).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainrun import sets, train

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
BASE = ["epochs=1", "batch_size=16", "max_steps=4", "log_every=1", "optimizer.scale_lr=false",
        "schedule.name=constant", "optimizer.lr=0.01", "model.name=hf_models:gpt2", "model.width=32",
        "model.dropout=0.0", "data.name=synthetic_lm", "data.seq_len=8", "data.samples=256"]


def _losses(records):
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.mark.timeout(300)
def test_gpt2_factory_trains_single_and_split_1f1b_alike(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]))
    rc, ref, ref_metrics = train(tmp_path / "single", *sets([*BASE, "mode=single"]))
    assert rc == 0, capsys.readouterr().err
    rc, summary, metrics = train(tmp_path / "1f1b", *sets([*BASE, "mode=1f1b", "nprocs=2", "pipeline.microbatches=4",
                                                           "pipeline.split_points=[transformer.h.2]"]))
    assert rc == 0, capsys.readouterr().err
    assert summary["world_size"] == 2 and summary["steps"] == ref["steps"] == 4
    assert _losses(metrics) == pytest.approx(_losses(ref_metrics), rel=1e-4, abs=1e-5)
    assert summary["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-4, abs=1e-5)
