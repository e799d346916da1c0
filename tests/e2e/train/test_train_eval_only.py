"""``ringpipe train --eval-only``: a run's checkpoint evaluated without training, in every mode.

The evaluation of a finished run's last checkpoint must give the test loss and accuracy its
summary reports for those weights; a data-parallel checkpoint evaluated on another number of
processes must give the loss of its weights computed here plainly (one forward pass over the
test set); the training outputs stay byte for byte as they were.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from ringpipe.train.checkpoints.files import latest_checkpoint, load_checkpoint
from trainrun import sets, train

TINY = ["epochs=1", "batch_size=32", "log_every=2", "optimizer.lr=0.01", "schedule.name=constant", "model.hidden=[32]",
        "observe.profile=false"]
OUTPUTS = ("summary.json", "metrics.jsonl", "metrics.csv", "config.yaml", "curves.png")


def _bytes(run):
    files = {name: (run / name).read_bytes() for name in OUTPUTS if (run / name).exists()}
    files.update({p.name: p.read_bytes() for p in (run / "checkpoints").glob("step-*.pt")})
    return files


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("dp", 2), ("ddp", 2), ("seq", 2), ("gpipe", 2), ("1f1b", 2),
                                         ("async", 2)])
def test_eval_only_reports_the_summarys_metrics_and_changes_nothing(tmp_path, mode, nprocs, capsys):
    run = tmp_path / "run"
    extra = ["pipeline.microbatches=4"] if mode in ("gpipe", "1f1b", "async") else []
    rc, summary, _ = train(run, *sets([*TINY, f"mode={mode}", f"nprocs={nprocs}", *extra]))
    assert rc == 0 and summary["complete"]
    before = _bytes(run)
    capsys.readouterr()
    rc, _, _ = train(run, "--eval-only")
    out = capsys.readouterr().out
    assert rc == 0, out
    path = run / f"eval-step-{summary['steps']:08d}.json"
    got = json.loads(path.read_text())
    assert f"evaluation written to {path}" in out
    assert got["eval_only"] and got["step"] == summary["steps"] and got["mode"] == mode
    assert got["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-6)
    assert got["test_accuracy"] == pytest.approx(summary["test_accuracy"], rel=1e-6)
    assert 0 < got["train_accuracy"] <= 1 and got["train_records"] > got["test_records"] > 0
    assert _bytes(run) == before


JOB = textwrap.dedent('''
    import torch
    from torch import nn

    def net(data=None):
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def points(n=30):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(n, 5, generator=g)
        y = torch.randint(0, 3, (n,), generator=g)
        ds = torch.utils.data.TensorDataset(x, y)
        g = torch.Generator().manual_seed(2)
        xt = torch.randn(21, 5, generator=g)
        yt = torch.randint(0, 3, (21,), generator=g)
        return ds, torch.utils.data.TensorDataset(xt, yt)
''')


def _cli(tmp_path, run, *argv):
    (tmp_path / "eval_job.py").write_text(JOB)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("RINGPIPE_BACKEND", None)
    cmd = [sys.executable, "-m", "ringpipe.cli", "train", "--no-progress", "--run-dir", str(run), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.timeout(300)
def test_a_dp_checkpoint_evaluated_on_another_world_equals_a_plain_forward_pass(tmp_path):
    run = tmp_path / "run"
    cfg = ["model.name=eval_job:net", "data.name=eval_job:points", "epochs=1", "batch_size=4", "max_steps=2",
           "checkpoint.keep=5"]
    out = _cli(tmp_path, run, "--mode", "dp", "--nprocs", "2", *sets(cfg))
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt_path = latest_checkpoint(run / "checkpoints")
    weights = load_checkpoint(ckpt_path)["engine"]["model"]
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    model.load_state_dict(weights)
    g = torch.Generator().manual_seed(2)
    xt, yt = torch.randn(21, 5, generator=g), torch.randint(0, 3, (21,), generator=g)
    with torch.no_grad():
        logits = model(xt)
    want_loss = float(nn.functional.cross_entropy(logits, yt))
    want_acc = float((logits.argmax(-1) == yt).float().mean())
    for argv in (["--nprocs", "3"], ["--mode", "single"], ["--checkpoint", ckpt_path.name, "--nprocs", "2"]):
        out = _cli(tmp_path, run, "--eval-only", *argv)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads((run / "eval-step-00000002.json").read_text())
        assert got["test_loss"] == pytest.approx(want_loss, rel=1e-6), argv
        assert got["test_accuracy"] == pytest.approx(want_acc), argv
        assert "resuming" not in out.stderr
    assert not (run / "summary.json").read_text().count('"eval_only"')


@pytest.mark.timeout(300)
def test_eval_only_mistakes_are_named(tmp_path):
    run = tmp_path / "run"
    rc, _, _ = train(run, *sets([*TINY, "mode=gpipe", "nprocs=2", "max_steps=2", "pipeline.microbatches=2"]))
    assert rc == 0
    out = _cli(tmp_path, run, "--eval-only", "--nprocs", "4")
    assert out.returncode == 1 and "--eval-only: " in out.stderr and "--nprocs 2" in out.stderr
    out = _cli(tmp_path, run, "--checkpoint", "best")
    assert out.returncode == 2 and "add --eval-only" in out.stderr
    out = _cli(tmp_path, run, "--eval-only", "--checkpoint", "best")
    assert out.returncode == 1 and "holds no checkpoint" in out.stderr and "checkpoint.best" in out.stderr
    out = _cli(tmp_path, run, "--eval-only", "--checkpoint", "step-99.pt")
    assert out.returncode == 1 and "step-99.pt" in out.stderr
