"""``ringpipe train`` with modes ``interleaved``, ``zb_h1`` and ``zb_h2``: the same losses as one process on the global batch.

The reference is mode ``single`` on the same batches (a plain torch loop; the pipeline modes
seq, gpipe and 1f1b are held to it the same way in ``test_train_runs.py``). Bad settings
of the new keys are refused with the fix.
"""

from __future__ import annotations

import pytest

from trainrun import sets, train

TINY = ["epochs=1", "batch_size=32", "log_every=2", "optimizer.scale_lr=false", "optimizer.lr=0.01",
        "schedule.name=constant", "model.hidden=[32,32]", "max_steps=12"]


def _losses(records):
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("single")
    rc, summary, metrics = train(run, *sets([*TINY, "mode=single"]))
    assert rc == 0
    return summary, metrics


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,extra", [
    ("interleaved", ["pipeline.balance=[2,2,1,1]", "pipeline.chunks=2"]),  # rank 0: parts 0 and 2
    ("zb_h1", ["pipeline.recompute=true"]),
    ("zb_h2", []),
])
def test_new_schedules_train_as_one_process(tmp_path, mode, extra, reference, capsys):
    rc, summary, metrics = train(tmp_path / "run", *sets([*TINY, f"mode={mode}", "nprocs=2",
                                                         "pipeline.microbatches=4", *extra]))
    assert rc == 0, capsys.readouterr().err
    ref_summary, ref_metrics = reference
    assert summary["mode"] == mode and summary["steps"] == ref_summary["steps"]
    assert _losses(metrics) == pytest.approx(_losses(ref_metrics), rel=1e-4, abs=1e-5)
    assert summary["test_loss"] == pytest.approx(ref_summary["test_loss"], rel=1e-4, abs=1e-5)


@pytest.mark.timeout(120)
def test_bad_settings_name_the_fix(tmp_path, capsys):
    rc, _, _ = train(tmp_path / "a", *sets([*TINY, "mode=1f1b", "nprocs=2", "pipeline.chunks=2"]))
    assert rc != 0 and "pipeline.chunks=2 is read only by mode 'interleaved'" in capsys.readouterr().err
    rc, _, _ = train(tmp_path / "b", *sets([*TINY, "mode=interleaved", "nprocs=2", "pipeline.microbatches=3"]))
    assert rc != 0 and "must be a multiple of pipeline.stages=2" in capsys.readouterr().err
    rc, _, _ = train(tmp_path / "c", *sets([*TINY, "mode=interleaved", "nprocs=2", "pipeline.balance=[3,3]"]))
    assert rc != 0 and "has 2 entries but pipeline.stages=2 x pipeline.chunks=2 = 4 parts" in capsys.readouterr().err
