"""ringpipe.train.fit: the user's model, data, loss and optimizer through every mode, equal to one plain process.

Each run is a real job (``ringpipe launch -n N python job.py``) whose model and dataset are
defined in the job file. The batch is the whole training set (``batch_size x replicas = N``), so
every step follows the full-batch gradient whatever the sharding, and the reference below is a
plain torch loop written from the definitions: full-batch SGD, ``torch.autocast`` for bf16/fp16,
``torch.amp.GradScaler`` for fp16, ``torch.nn.utils.clip_grad_norm_`` over the whole model. The
run's final test loss (the same set, evaluated under the same autocast) must equal the
reference's: 1e-5 relative in fp32; in bf16/fp16 within the rounding of an 8-/11-bit mantissa
(2e-2 / 1e-2 relative), since micro-batches and shards sum the low-precision products in
another order.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
N, STEPS, LR = 48, 3, 0.5

JOB = textwrap.dedent('''
    import json, sys
    import torch
    from torch import nn
    import ringpipe.train as rt

    class Pairs(torch.utils.data.Dataset):  # a map-style dataset of the user's own
        def __init__(self, x, y):
            self.x, self.y = x, y
        def __len__(self):
            return len(self.y)
        def __getitem__(self, i):
            return self.x[i], int(self.y[i])

    def make():
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def data():
        g = torch.Generator().manual_seed(1)
        return torch.randn(%(n)d, 6, generator=g), torch.randint(0, 3, (%(n)d,), generator=g)

    if __name__ == "__main__":
        cfg = json.loads(sys.argv[1])
        torch.manual_seed(0)
        model = make()
        x, y = data()
        ds = Pairs(x, y) if cfg.pop("as_pairs", True) else torch.utils.data.TensorDataset(x, y)
        rt.fit(model, ds, ds, loss=nn.functional.cross_entropy,
               optimizer=lambda params: torch.optim.SGD(params, lr=%(lr)r), config=cfg, run_dir=sys.argv[2])
''') % {"n": N, "lr": LR}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)


def _make() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def reference(precision: str = "fp32", clip: float | None = None, accumulate: int = 1) -> dict[str, float]:
    """Full-batch SGD on one process, written plainly; returns the final loss and the first step's gradient norm."""
    torch.manual_seed(0)
    model = _make()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    first_norm = math.nan
    for step in range(STEPS):
        opt.zero_grad()
        for xc, yc in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(model(xc), yc) / accumulate
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else math.inf)
        if step == 0:
            first_norm = float(norm)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        final = float(nn.functional.cross_entropy(model(x), y))
    return {"test_loss": final, "first_norm": first_norm}


def run_job(tmp_path: Path, nprocs: int, mode: str, **config: object) -> dict[str, object]:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    run_dir = tmp_path / f"run-{mode}-{nprocs}"
    pipeline = mode in ("seq", "gpipe", "1f1b", "async")
    stages = 2 if pipeline else 1
    cfg = {"mode": mode, "epochs": STEPS, "batch_size": N // (nprocs // stages), "log_every": 1,
           "schedule": {"name": "constant"}, "checkpoint": {"every_epochs": 0}, **config}
    if pipeline:
        cfg["pipeline"] = {"stages": 2, "microbatches": 4, "partition": "uniform", **cfg.get("pipeline", {})}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(nprocs), "python", str(job), json.dumps(cfg),
           str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def _close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * abs(want)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("dp", 2), ("ddp", 2), ("seq", 2), ("gpipe", 2),
                                         ("1f1b", 2)])
def test_user_model_and_dataset_equal_one_process(tmp_path, mode, nprocs):
    want = reference()
    got = run_job(tmp_path, nprocs, mode)
    assert got["steps"] == STEPS and got["model"] == "python:Sequential" and got["dataset"] == "python:Pairs"
    assert _close(got["test_loss"], want["test_loss"], 1e-5), (got["test_loss"], want)


@pytest.mark.timeout(600)
def test_async_mode_trains_the_user_model(tmp_path):
    got = run_job(tmp_path, 2, "async", as_pairs=False)  # a TensorDataset, read as tensors
    assert got["complete"] and got["steps"] == STEPS and math.isfinite(got["test_loss"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("dp", 2), ("gpipe", 2)])
def test_bf16_autocast_equals_one_process_under_the_same_autocast(tmp_path, mode, nprocs):
    want = reference("bf16")
    got = run_job(tmp_path, nprocs, mode, precision="bf16")
    assert _close(got["test_loss"], want["test_loss"], 2e-2), (got["test_loss"], want)
    assert not _close(reference()["test_loss"], want["test_loss"], 1e-6)  # bf16 did change the numbers


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("gpipe", 2)])
def test_fp16_loss_scaling_equals_gradscaler(tmp_path, mode, nprocs):
    want = reference("fp16")
    got = run_job(tmp_path, nprocs, mode, precision="fp16")
    assert _close(got["test_loss"], want["test_loss"], 1e-2), (got["test_loss"], want)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("dp", 2), ("gpipe", 2), ("1f1b", 4)])
def test_clipping_uses_the_whole_models_norm(tmp_path, mode, nprocs):
    """1f1b on 4 ranks: 2 stages x 2 replicas, the norm summed over stages and not counted twice."""
    clip = 0.05
    want = reference(clip=clip)
    assert want["first_norm"] > 4 * clip  # the clipping is active
    got = run_job(tmp_path, nprocs, mode, optimizer={"name": "sgd", "clip_grad_norm": clip})
    assert _close(got["test_loss"], want["test_loss"], 1e-5), (got["test_loss"], want)
    assert not _close(reference()["test_loss"], want["test_loss"], 1e-3)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("ddp", 2), ("dp", 2)])
def test_accumulation_equals_the_larger_batch(tmp_path, mode, nprocs):
    want = reference(accumulate=1)
    got = run_job(tmp_path, nprocs, mode, accumulate=2)
    assert got["micro_batch"] == N // nprocs // 2
    assert _close(got["test_loss"], want["test_loss"], 1e-5), (got["test_loss"], want)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("dp", 2), ("gpipe", 2)])
def test_the_example_trains_its_own_model(tmp_path, mode, nprocs):
    example = ROOT / "examples" / "train_your_model.py"
    cmd = [sys.executable, str(example), "--mode", mode, "--epochs", "2", "--run-dir", str(tmp_path / "run")]
    if nprocs > 1:
        cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(nprocs), "python", *cmd[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mode"] == mode and summary["test_accuracy"] > 0.9


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["single", "dp", "ddp"])
def test_nccl_ranks_train_on_their_gpu_equal_to_one_process(tmp_path, mode):
    """Under backend nccl each rank pins the GPU of its local rank; the result equals the CPU reference
    within the GPU's float32 rounding (TF32 is off by default for matmuls in torch)."""
    nprocs = 1 if mode == "single" else torch.cuda.device_count()
    if N % nprocs:
        pytest.skip(f"{nprocs} GPUs do not split {N} samples evenly")
    want = reference()
    got = run_job(tmp_path, nprocs, mode, backend="nccl")
    assert _close(got["test_loss"], want["test_loss"], 1e-4), (got["test_loss"], want)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one per pipeline stage)")
@pytest.mark.timeout(600)
def test_pipeline_stages_exchange_cuda_tensors_over_nccl(tmp_path):
    want = reference("bf16")
    got = run_job(tmp_path, 2, "gpipe", backend="nccl", precision="bf16")
    assert _close(got["test_loss"], want["test_loss"], 2e-2), (got["test_loss"], want)
