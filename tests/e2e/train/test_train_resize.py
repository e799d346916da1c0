"""A data-parallel run resumed on another number of ranks continues the same training, re-sharded.

The runs are real jobs (``ringpipe train`` on 2 processes, cut by ``max_steps``, then
``--resume`` on 3 processes, on 1, or in another data-parallel mode). The oracle is one plain
process on the global batch, written here from the rules the trainer documents:

* within a pass, the replicas read the pass's shuffled permutation (``torch.randperm`` seeded
  with ``seed + pass``, as ``DistributedSampler``) contiguously, ``replicas x batch_size``
  positions a step; the permutation of a pass is padded to a multiple of the replicas by
  repeating its first samples;
* resumed on R' replicas after ``c`` positions of the pass, the rest of the pass (positions
  ``c..N``) is padded to a multiple of R' the same way, then the next passes follow for R';
* the loss of a step is the mean over its global batch; SGD with momentum (``v = mu v + g``,
  ``p -= lr v``) at ``lr x replicas`` (``scale_lr``) times the cosine schedule with warmup at
  the epoch ``samples seen / N``, whose warmup starts at ``1 / replicas``.

The resumed run's final weights must equal the oracle's within 1e-5.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from ringpipe.train.checkpoints.files import latest_checkpoint, load_checkpoint
from ringpipe.train.checkpoints.resize import resharded_stream
from ringpipe.train.sampling import ShardStream

N, BATCH, EPOCHS, LR, MU, WARMUP, SEED = 30, 4, 2.0, 0.05, 0.9, 0.5, 0

JOB = textwrap.dedent('''
    import torch
    from torch import nn

    def net(data=None):
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def points(n=%(n)d):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(n, 5, generator=g)
        y = torch.randint(0, 3, (n,), generator=g)
        ds = torch.utils.data.TensorDataset(x, y)
        return ds, ds
''') % {"n": N}

CONFIG = ["model.name=resize_job:net", "data.name=resize_job:points", f"epochs={EPOCHS}", f"batch_size={BATCH}",
          "optimizer.name=sgd", f"optimizer.lr={LR}", f"optimizer.momentum={MU}", "schedule.name=cosine",
          f"schedule.warmup_epochs={WARMUP}", "log_every=1", "observe.profile=false", f"seed={SEED}"]


# --------------------------------------------------------------------------------- the oracle


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=g)
    return x, torch.randint(0, 3, (N,), generator=g)


def _permutation(pass_: int) -> list[int]:
    g = torch.Generator()
    g.manual_seed(SEED + pass_)
    return torch.randperm(N, generator=g).tolist()


def _pass(pass_: int, start: int, replicas: int) -> list[tuple[int, int]]:
    """``(pass, position)`` of the pass's permutation from ``start``, padded to a multiple of ``replicas``
    by repeating its first entries."""
    items = [(pass_, pos) for pos in range(start, N)]
    size = math.ceil(len(items) / replicas) * replicas
    return (items * math.ceil(size / len(items)))[:size]


def _lr_factor(epoch: float, replicas: int) -> float:
    start = 1.0 / replicas if replicas > 1 else 0.1
    if epoch < WARMUP:
        return start + (1.0 - start) * epoch / WARMUP
    t = min(max((epoch - WARMUP) / (EPOCHS - WARMUP), 0.0), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * t))


def oracle(worlds: list[tuple[int, int | None]]) -> tuple[dict[str, torch.Tensor], int, int]:
    """One process on the global batches of ``worlds``: ``[(replicas, until step or None), ...]``.

    Returns the final weights, the steps and the samples.
    """
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    params = list(model.parameters())
    momentum = [torch.zeros_like(p) for p in params]
    x, y = _data()
    step = samples = 0
    pass_, start = 0, 0  # the next world begins at this position of this pass's permutation
    for replicas, until in worlds:
        stream = _pass(pass_, start, replicas)
        read: list[tuple[int, int]] = []
        while samples < EPOCHS * N and (until is None or step < until):
            g_batch = replicas * BATCH
            while len(stream) < g_batch:
                stream += _pass((stream or read)[-1][0] + 1, 0, replicas)
            items, stream = stream[:g_batch], stream[g_batch:]
            read += items
            batch = [_permutation(p)[pos] for p, pos in items]
            lr = LR * replicas * _lr_factor(samples / N, replicas)
            model.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            with torch.no_grad():
                for p, v in zip(params, momentum, strict=True):
                    v.mul_(MU).add_(p.grad)
                    p.sub_(lr * v)
            step, samples = step + 1, samples + g_batch
        # positions are read in order, the padding last: the next world starts after the highest one read
        pass_ = read[-1][0]
        start = 1 + max(pos for p, pos in read if p == pass_)
        if start >= N:
            pass_, start = pass_ + 1, 0
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, step, samples


# --------------------------------------------------------------------------------- runs


def _train(tmp_path: Path, run: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "resize_job.py").write_text(JOB)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("RINGPIPE_BACKEND", None)
    cmd = [sys.executable, "-m", "ringpipe.cli", "train", "--no-progress", "--run-dir", str(run), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory):
    """Mode dp on 2 processes, stopped by max_steps=2 (16 of the first pass's 30 samples read)."""
    tmp = tmp_path_factory.mktemp("cut")
    out = _train(tmp, tmp / "run", "--mode", "dp", "--nprocs", "2", *_sets([*CONFIG, "max_steps=2"]))
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp / "run"


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    return ckpt["engine"]["model"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv,replicas", [
    (["--nprocs", "3"], 3),
    (["--mode", "single"], 1),
    (["--mode", "ddp", "--nprocs", "3"], 3),
], ids=["dp-on-3", "single-on-1", "ddp-on-3"])
def test_a_dp_run_resumed_on_another_world_equals_one_process_on_the_global_batches(
        tmp_path, cut_run, argv, replicas):
    run = tmp_path / "run"
    shutil.copytree(cut_run, run)
    out = _train(tmp_path, run, "--resume", *argv, "--set", "max_steps=null")
    assert out.returncode == 0, out.stderr[-3000:]
    want, steps, samples = oracle([(2, 2), (replicas, None)])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["samples"] == samples and summary["complete"]
    assert summary["global_batch"] == BATCH * replicas and summary["lr_scale"] == replicas
    assert summary["epochs"] == pytest.approx(samples / N)
    assert summary["resized"] == [{"step": 2, "samples": 16, "from_mode": "dp", "from_replicas": 2,
                                   "mode": summary["mode"], "replicas": replicas}]
    got = _final_weights(run)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # One log line says what changed.
    line = next(ln for ln in out.stderr.splitlines() if "replicas as mode" in ln)
    assert f"on 2 replicas as mode {summary['mode']} on {replicas} at step 2 (16 samples" in line
    assert f"global batch 8 -> {BATCH * replicas}" in line and f"lr scale 2 -> {replicas}" in line
    assert "the 14 samples not yet seen in the interrupted pass" in line


@pytest.mark.timeout(300)
def test_resized_twice_then_resumed_as_it_is_stays_on_the_oracle(tmp_path, cut_run):
    """2 ranks, then 3 (cut again at step 4), then 1: every change of world continues the same run."""
    run = tmp_path / "run"
    shutil.copytree(cut_run, run)
    out = _train(tmp_path, run, "--resume", "--nprocs", "3", "--set", "max_steps=4")
    assert out.returncode == 0, out.stderr[-3000:]
    out = _train(tmp_path, run, "--resume", "--mode", "single", "--set", "max_steps=null")
    assert out.returncode == 0, out.stderr[-3000:]
    want, steps, samples = oracle([(2, 2), (3, 4), (1, None)])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["samples"] == samples
    assert [r["replicas"] for r in summary["resized"]] == [3, 1]
    got = _final_weights(run)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


# --------------------------------------------------------------------------------- refusals


@pytest.mark.timeout(120)
def test_a_pipeline_run_on_another_world_is_refused_naming_the_fix(tmp_path):
    run = tmp_path / "run"
    out = _train(tmp_path, run, "--mode", "gpipe", "--nprocs", "2",
                 *_sets([*CONFIG, "max_steps=2", "pipeline.microbatches=2", "pipeline.partition=uniform"]))
    assert out.returncode == 0, out.stderr[-3000:]
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    refused = _train(tmp_path, run, "--resume", "--nprocs", "4")
    assert refused.returncode == 1
    assert "written by mode 'gpipe' on 2 ranks; this run is mode 'gpipe' on 4" in refused.stderr
    assert "holds each rank's own stage" in refused.stderr and "--nprocs 2" in refused.stderr
    refused = _train(tmp_path, run, "--resume", "--mode", "dp")
    assert refused.returncode == 1 and "continues only in a pipeline mode" in refused.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


# --------------------------------------------------------------------------------- the streams alone


@pytest.mark.parametrize("old,new,steps", [(2, 3, 2), (2, 1, 3), (3, 2, 1), (2, 3, 0), (4, 3, 3)])
def test_resharding_reads_every_unseen_sample_of_the_pass_once_plus_padding(old, new, steps):
    streams = [ShardStream(N, old, r, BATCH, SEED) for r in range(old)]
    seen = [int(i) for _ in range(steps) for s in streams for i in s.next_batch()]
    state = resharded_stream([s.state_dict() for s in streams], old, N)
    resumed = [ShardStream(N, new, r, BATCH, SEED) for r in range(new)]
    for s in resumed:
        s.load_state_dict(state)
    rest = [int(i) for s in resumed for i in s._current()]  # each new replica's share of the pass
    unseen = [i for i in _permutation(0) if i not in seen[: old * BATCH * steps]]
    if old * BATCH * steps >= N:
        assert state["pass"] == 1
        return
    assert sorted(set(rest)) == sorted(unseen)  # nothing skipped, nothing seen before
    assert len(rest) - len(unseen) == (-len(unseen)) % new  # the only repeats: padding to even shards
