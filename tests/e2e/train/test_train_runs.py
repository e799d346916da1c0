"""``ringpipe train`` end to end on real processes: every mode, equivalence with one process, resume."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from ringpipe.train.metrics import format_summary, read_metrics, write_json_atomic
from trainrun import sets, train

TINY = ["epochs=1", "batch_size=32", "log_every=2", "optimizer.scale_lr=false", "optimizer.lr=0.01",
        "schedule.name=constant",
        "model.hidden=[32]"]
TIMING = {"samples_per_second", "comm_share"}




def _losses(records):
    return [r["loss"] for r in records if r["kind"] == "train"]


def _strip(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process on global batches of 64 (data-parallel modes) and 32 (one pipeline replica)."""
    out = {}
    for batch in (64, 32):
        run = tmp_path_factory.mktemp(f"single{batch}")
        rc, summary, metrics = train(run, *sets([*TINY, "mode=single", f"batch_size={batch}"]))
        assert rc == 0
        out[batch] = (summary, metrics)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ddp", "dp", "seq", "gpipe", "1f1b", "async"])
def test_mode_two_processes(tmp_path, mode, reference, capsys):
    run = tmp_path / "run"
    extra = ["pipeline.microbatches=4"] if mode in ("gpipe", "1f1b", "async") else []
    rc, summary, metrics = train(run, *sets([*TINY, f"mode={mode}", "nprocs=2", *extra]))
    assert rc == 0, capsys.readouterr().err
    for key in ("test_accuracy", "final_loss", "samples_per_second", "epochs", "world_size", "mode"):
        assert key in summary
    assert summary["mode"] == mode and summary["world_size"] == 2 and summary["epochs"] >= 1.0
    assert summary["samples_per_second"] > 0 and 0.0 <= summary["comm_share"] <= 1.0
    assert (run / "curves.png").stat().st_size > 0 and (run / "config.yaml").exists()
    # observe.profile (on by default): where the communication time went, per operation and rank.
    profile = (run / "comm_profile.txt").read_text()
    assert "Communication profile: 2 ranks on 1 host" in profile
    assert ("allreduce" if mode in ("ddp", "dp") else "send") in profile
    assert (run / "doctor.txt").read_text().startswith("ringpipe doctor: 2 ranks")
    assert list((run / "checkpoints").glob("step-*.pt"))
    losses = _losses(metrics)
    assert losses[-1] < 0.5 * losses[0], losses
    if mode == "async":
        return  # stale weights: no synchronous single-process equivalent
    # Same seed, same samples per step: the single-process run on the global batch.
    ref_summary, ref_metrics = reference[64 if mode in ("ddp", "dp") else 32]
    assert summary["steps"] == ref_summary["steps"]
    assert losses == pytest.approx(_losses(ref_metrics), rel=1e-4, abs=1e-5)
    assert summary["test_loss"] == pytest.approx(ref_summary["test_loss"], rel=1e-4, abs=1e-5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode,nprocs", [("single", 1), ("ddp", 2), ("dp", 2), ("gpipe", 2)])
def test_resume_equals_uninterrupted(tmp_path, mode, nprocs):
    cfg = [*TINY, "epochs=2", f"mode={mode}", f"nprocs={nprocs}", "model.dropout=0.2", "checkpoint.keep=2",
           "optimizer.name=sgd", "schedule.name=cosine", "schedule.warmup_epochs=0.5"]
    rc, full, full_metrics = train(tmp_path / "full", *sets(cfg))
    assert rc == 0 and full["complete"]
    part = tmp_path / "part"
    rc, cut, _ = train(part, *sets([*cfg, "max_steps=17"]))
    assert rc == 0 and not cut["complete"] and cut["steps"] == 17
    assert (part / "checkpoints" / "step-00000017.pt").exists()
    rc, resumed, resumed_metrics = train(part, "--resume", "--set", "max_steps=null")
    assert rc == 0 and resumed["steps"] == full["steps"]
    assert _strip(resumed_metrics) == _strip(full_metrics)
    for key in ("test_accuracy", "test_loss", "final_loss", "epochs"):
        assert resumed[key] == full[key]
    assert len(list((part / "checkpoints").glob("step-*.pt"))) == 2  # keep last k


def test_failed_resume_keeps_saved_config(tmp_path, capsys):
    """A refused --resume (a pipeline mode) leaves config.yaml as it was, so a later resume still works."""
    run = tmp_path / "run"
    rc, cut, _ = train(run, *sets([*TINY, "mode=single", "max_steps=3"]))
    assert rc == 0 and not cut["complete"]
    saved = (run / "config.yaml").read_text()
    capsys.readouterr()
    rc, _, _ = train(run, "--resume", "--mode", "gpipe")
    assert rc == 1 and "mode 'single'" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == saved
    rc, resumed, _ = train(run, "--resume", "--set", "max_steps=null")
    assert rc == 0 and resumed["mode"] == "single" and resumed["complete"]


def _isolated(tmp_path) -> tuple[dict[str, str], dict[str, object]]:
    """An environment whose working directory, home and temporary folder are fresh folders of tmp_path."""
    dirs = {name: tmp_path / name for name in ("cwd", "home", "tmp")}
    for d in dirs.values():
        d.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "TORCH_HOME", "RINGPIPE_BACKEND")}
    env.update(OMP_NUM_THREADS="1", HOME=str(dirs["home"]), TMPDIR=str(dirs["tmp"]))
    return env, dirs


def _left_behind(d) -> list[str]:
    # torch itself creates its compiler cache folder in the temporary folder at the first optimizer
    # step (also in a plain torch script); anything else there would come from ringpipe.
    return sorted(p.name for p in d.iterdir() if not p.name.startswith("torchinductor_"))


@pytest.mark.timeout(120)
def test_single_outputs_only_in_run_dir(tmp_path):
    """Nothing is written outside the run directory: not the working directory, home or temp folder."""
    env, dirs = _isolated(tmp_path)
    run = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ringpipe.cli", "train", "--no-progress", "--run-dir", str(run),
                           *sets([*TINY, "mode=single", "epochs=2"])],
                          cwd=dirs["cwd"], env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "home", "out", "tmp"]
    assert list(dirs["cwd"].iterdir()) == [] and list(dirs["home"].iterdir()) == []
    assert _left_behind(dirs["tmp"]) == []
    names = {p.name for p in run.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "summary.json", "curves.png", "checkpoints"} <= names
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert [math.floor(r["epoch"]) for r in evals] == [1, 2]
    assert "test_accuracy" in proc.stdout  # the closing table


def _strict_json(path):
    """Parse ``path`` refusing NaN and Infinity (not JSON, though Python writes them by default)."""
    def refuse(constant):
        raise AssertionError(f"{constant} in {path.name}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_non_finite_numbers_are_written_null(tmp_path):
    write_json_atomic(tmp_path / "s.json", {"loss": math.nan, "rate": math.inf, "xs": [1.0, -math.inf]})
    assert _strict_json(tmp_path / "s.json") == {"loss": None, "rate": None, "xs": [1.0, None]}
    assert "| loss | - |" in format_summary({"loss": None})


def test_run_shorter_than_log_every(tmp_path):
    """max_steps < log_every: the open window is logged (partial), summary.json is valid JSON, curves drawn."""
    run = tmp_path / "run"
    rc, summary, metrics = train(run, *sets([*TINY, "mode=single", "log_every=10", "max_steps=3"]))
    assert rc == 0 and not summary["complete"] and summary["steps"] == 3
    summary = _strict_json(run / "summary.json")
    assert all(v is not None for v in summary.values()), summary
    assert math.isfinite(summary["final_loss"])
    assert [(r["step"], r.get("partial")) for r in metrics if r["kind"] == "train"] == [(3, True)]
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
    assert (run / "curves.png").stat().st_size > 0
    # Resuming drops the partial record: the window is logged in full at its end.
    rc, _, metrics = train(run, "--resume", "--set", "max_steps=10")
    assert rc == 0
    assert [(r["step"], r.get("partial")) for r in metrics if r["kind"] == "train"] == [(10, None)]


def test_config_error_exit_code(tmp_path, capsys):
    rc, _, _ = train(tmp_path / "x", "--set", "model.name=vgg")
    assert rc == 2
    err = capsys.readouterr().err
    assert "model.name='vgg'" in err and "'mlp'" in err
    assert not (tmp_path / "x").exists()


def test_mpi_backend_without_mpirun_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no mpirun, no mpiexec
    rc, _, _ = train(tmp_path / "x", "--backend", "mpi", "--nprocs", "2")
    err = capsys.readouterr().err
    assert rc == 1 and "mpirun/mpiexec not found" in err and "--backend gloo" in err
    assert "Traceback" not in err


def test_incomplete_launcher_environment_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    rc, _, _ = train(tmp_path / "x", "--mode", "single")
    err = capsys.readouterr().err
    assert rc == 2 and "LOCAL_RANK is not" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.timeout(120)
def test_default_run_reaches_accuracy(tmp_path):
    """``ringpipe train`` with no arguments: MLP, digits, dp on 2 processes, >= 0.95 test accuracy."""
    env, dirs = _isolated(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "ringpipe.cli", "train", "--no-progress"], cwd=dirs["cwd"],
                          env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in dirs["cwd"].iterdir()] == ["runs"]
    assert list(dirs["home"].iterdir()) == [] and _left_behind(dirs["tmp"]) == []
    (run,) = (dirs["cwd"] / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mode"] == "dp" and summary["world_size"] == 2 and summary["model"] == "mlp"
    assert summary["test_accuracy"] >= 0.95


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["launch", "mpirun"])
def test_under_launchers(tmp_path, launcher):
    """The same config under ``ringpipe launch`` (torchrun's agent) and ``mpirun`` detects the world."""
    script = tmp_path / "main.py"
    script.write_text("import sys\nfrom ringpipe.cli import main\nsys.exit(main())\n")
    train = [str(script), "train", "--run-dir", str(tmp_path / "run"), "--no-progress",
             *sets([*TINY, "mode=dp", "nprocs=1"])]
    if launcher == "launch":
        cmd = [sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2", *train]
    else:
        if shutil.which("mpirun") is None:
            pytest.skip("mpirun is not installed")
        from ringpipe.launch import mpirun_command

        cmd = mpirun_command(2, [sys.executable, *train])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["mode"] == "dp"
    assert "ignored" in proc.stdout + proc.stderr  # nprocs=1 vs the launched 2 ranks


@pytest.mark.timeout(120)
def test_timeline_of_a_training_run(tmp_path):
    """observe.timeline: every rank's communication on one clock, as a Chrome trace and an events file."""
    from ringpipe.observe import load_events

    run = tmp_path / "run"
    rc, summary, _ = train(run, *sets([*TINY, "mode=dp", "nprocs=2", "max_steps=6", "observe.timeline=true"]))
    assert rc == 0 and summary["steps"] == 6
    trace = json.loads((run / "timeline.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1} and all(e["dur"] >= 0 for e in spans)
    job = load_events(run / "events.json")
    grads = [e for e in job.ranks[1].events if e.op == "allreduce"]
    assert len(grads) >= 6  # at least one gradient bucket per step


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model", [
    ["model.name=cnn", "model.dropout=0.0"],
    ["model.name=resnet"],
    ["model.name=transformer", "model.dropout=0.0", "data.name=synthetic_lm"],
])
def test_every_model_splits_into_two_stages(tmp_path, model):
    """CNN, ResNet (BatchNorm) and transformer cut into 2 stages train as in one process (one micro-batch)."""
    base = ["epochs=1", "batch_size=16", "max_steps=3", "log_every=1", "optimizer.scale_lr=false",
            "schedule.name=constant", *model]
    rc, ref, ref_metrics = train(tmp_path / "single", *sets([*base, "mode=single"]))
    assert rc == 0
    rc, summary, metrics = train(tmp_path / "gpipe", *sets([*base, "mode=gpipe", "nprocs=2",
                                                                "pipeline.microbatches=1"]))
    assert rc == 0 and summary["world_size"] == 2 and summary["steps"] == 3
    assert _losses(metrics) == pytest.approx(_losses(ref_metrics), rel=1e-4, abs=1e-5)
