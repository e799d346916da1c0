"""ringpipe.train.fit: the user's model, data, loss and optimizer through every mode, equal to one plain process.

Each run is a real job (``ringpipe launch -n N python job.py``) whose model and dataset are
defined in the job file; the runs of one world size share one job (one launch for each of 1, 2
and 4 ranks, each fit() in turn on the job's world), and each test asserts on its own run. The batch is the whole training set (``batch_size x replicas = N``), so
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
CLIP = 0.05  # clip_grad_norm of the clipping runs

JOB = textwrap.dedent('''
    import json, sys
    import torch
    from torch import nn
    import ringpipe.train as rt

    fit = rt.fit  # rt.fit stays the function however often it is called (the module is train/fitting.py)

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

    def run(cfg, run_dir, comm=None):
        torch.manual_seed(0)
        model = make()
        x, y = data()
        ds = Pairs(x, y) if cfg.pop("as_pairs", True) else torch.utils.data.TensorDataset(x, y)
        fit(model, ds, ds, loss=nn.functional.cross_entropy,
               optimizer=lambda params: torch.optim.SGD(params, lr=%(lr)r), config=cfg, run_dir=run_dir,
               comm=comm)

    if __name__ == "__main__":
        if len(sys.argv) == 3:  # one run: CONFIG RUN_DIR
            run(json.loads(sys.argv[1]), sys.argv[2])
        else:  # every run of a list in FILE ([[config, run_dir], ...]), one after another on one world
            import traceback
            from pathlib import Path
            from ringpipe.comm import init_world, shutdown_world

            comm = init_world("gloo")
            try:
                for cfg, run_dir in json.loads(Path(sys.argv[1]).read_text()):
                    try:
                        run(cfg, run_dir, comm)
                    except Exception:
                        Path(run_dir).mkdir(parents=True, exist_ok=True)
                        Path(run_dir, f"error{comm.rank}.txt").write_text(traceback.format_exc())
                        raise
            finally:
                shutdown_world()
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


def job_config(nprocs: int, mode: str, **config: object) -> dict[str, object]:
    """The job's fit() configuration for ``mode`` on ``nprocs`` ranks, the whole set in one global batch."""
    pipeline = mode in ("seq", "gpipe", "1f1b", "async")
    stages = 2 if pipeline else 1
    cfg = {"mode": mode, "epochs": STEPS, "batch_size": N // (nprocs // stages), "log_every": 1,
           "schedule": {"name": "constant"}, "checkpoint": {"every_epochs": 0}, **config}
    if pipeline:
        cfg["pipeline"] = {"stages": 2, "microbatches": 4, "partition": "uniform", **cfg.get("pipeline", {})}
    return cfg


def run_job(tmp_path: Path, nprocs: int, mode: str, **config: object) -> dict[str, object]:
    """One run, one launch (the runs on GPUs, which not every host can fold with the others)."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    run_dir = tmp_path / f"run-{mode}-{nprocs}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(nprocs), "python", str(job),
           json.dumps(job_config(nprocs, mode, **config)), str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


#: Every CPU run of this file: (test, mode, ranks, config) -> its summary, from one job per world size.
RUNS: list[tuple[str, str, int, dict[str, object]]] = [
    *(("plain", m, n, {}) for m, n in [("single", 1), ("dp", 2), ("ddp", 2), ("seq", 2), ("gpipe", 2), ("1f1b", 2)]),
    ("async", "async", 2, {"as_pairs": False}),  # a TensorDataset, read as tensors
    *(("bf16", m, n, {"precision": "bf16"}) for m, n in [("single", 1), ("dp", 2), ("gpipe", 2)]),
    *(("fp16", m, n, {"precision": "fp16"}) for m, n in [("single", 1), ("gpipe", 2)]),
    *(("clip", m, n, {"optimizer": {"name": "sgd", "clip_grad_norm": CLIP}})
      for m, n in [("single", 1), ("dp", 2), ("gpipe", 2), ("1f1b", 4)]),
    *(("accumulate", m, n, {"accumulate": 2}) for m, n in [("single", 1), ("ddp", 2), ("dp", 2)]),
]


@pytest.fixture(scope="module")
def fit_runs(tmp_path_factory) -> dict[tuple[str, str, int], dict[str, object]]:
    """Run every entry of :data:`RUNS`: one ``ringpipe launch`` per world size, every fit() in turn.

    A run that failed has no summary; its test fails with the error its ranks wrote and the job's
    output.
    """
    root = tmp_path_factory.mktemp("fit")
    job = root / "job.py"
    job.write_text(JOB)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    summaries: dict[tuple[str, str, int], dict[str, object]] = {}
    for nprocs in sorted({n for _, _, n, _ in RUNS}):
        runs = [(test, mode, cfg) for test, mode, n, cfg in RUNS if n == nprocs]
        plan = [[job_config(nprocs, mode, **cfg), str(root / f"{test}-{mode}-{nprocs}")] for test, mode, cfg in runs]
        (root / f"runs{nprocs}.json").write_text(json.dumps(plan))
        cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", str(nprocs), "python", str(job),
               str(root / f"runs{nprocs}.json")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=420 + 60 * len(runs), env=env, cwd=root)
        for (test, mode, _), (_, run_dir) in zip(runs, plan, strict=True):
            path = Path(run_dir) / "summary.json"
            if path.exists():
                summaries[test, mode, nprocs] = json.loads(path.read_text())
            else:
                errors = "".join(p.read_text() for p in sorted(Path(run_dir).glob("error*.txt")))
                summaries[test, mode, nprocs] = {"error": errors + out.stdout[-3000:] + out.stderr[-3000:]}
    return summaries


def fit_run(fit_runs: dict, test: str, mode: str, nprocs: int) -> dict[str, object]:
    """The summary of one run of :func:`fit_runs` (the test fails here if the run failed)."""
    got = fit_runs[test, mode, nprocs]
    assert "error" not in got, got["error"]
    return got


def _close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * abs(want)


@pytest.mark.timeout(1800)  # the first test to ask runs every job of fit_runs
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("dp", 2), ("ddp", 2), ("seq", 2), ("gpipe", 2),
                                         ("1f1b", 2)])
def test_user_model_and_dataset_equal_one_process(fit_runs, mode, nprocs):
    want = reference()
    got = fit_run(fit_runs, "plain", mode, nprocs)
    assert got["steps"] == STEPS and got["model"] == "python:Sequential" and got["dataset"] == "python:Pairs"
    assert _close(got["test_loss"], want["test_loss"], 1e-5), (got["test_loss"], want)


@pytest.mark.timeout(1800)  # the first test to ask runs every job of fit_runs
def test_async_mode_trains_the_user_model(fit_runs):
    got = fit_run(fit_runs, "async", "async", 2)  # a TensorDataset, read as tensors
    assert got["complete"] and got["steps"] == STEPS and math.isfinite(got["test_loss"])


@pytest.mark.timeout(1800)  # the first test to ask runs every job of fit_runs
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("dp", 2), ("gpipe", 2)])
def test_bf16_autocast_equals_one_process_under_the_same_autocast(fit_runs, mode, nprocs):
    want = reference("bf16")
    got = fit_run(fit_runs, "bf16", mode, nprocs)
    assert _close(got["test_loss"], want["test_loss"], 2e-2), (got["test_loss"], want)
    assert not _close(reference()["test_loss"], want["test_loss"], 1e-6)  # bf16 did change the numbers


@pytest.mark.timeout(1800)  # the first test to ask runs every job of fit_runs
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("gpipe", 2)])
def test_fp16_loss_scaling_equals_gradscaler(fit_runs, mode, nprocs):
    want = reference("fp16")
    got = fit_run(fit_runs, "fp16", mode, nprocs)
    assert _close(got["test_loss"], want["test_loss"], 1e-2), (got["test_loss"], want)


@pytest.mark.timeout(1800)  # the first test to ask runs every job of fit_runs
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("dp", 2), ("gpipe", 2), ("1f1b", 4)])
def test_clipping_uses_the_whole_models_norm(fit_runs, mode, nprocs):
    """1f1b on 4 ranks: 2 stages x 2 replicas, the norm summed over stages and not counted twice."""
    clip = CLIP
    want = reference(clip=clip)
    assert want["first_norm"] > 4 * clip  # the clipping is active
    got = fit_run(fit_runs, "clip", mode, nprocs)  # clip_grad_norm=CLIP
    assert _close(got["test_loss"], want["test_loss"], 1e-5), (got["test_loss"], want)
    assert not _close(reference()["test_loss"], want["test_loss"], 1e-3)


@pytest.mark.timeout(1800)  # the first test to ask runs every job of fit_runs
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("ddp", 2), ("dp", 2)])
def test_accumulation_equals_the_larger_batch(fit_runs, mode, nprocs):
    want = reference(accumulate=1)
    got = fit_run(fit_runs, "accumulate", mode, nprocs)
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
