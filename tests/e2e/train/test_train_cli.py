"""``ringpipe train`` on the command line: Ctrl-C, resume checks, errors reported before training starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
import yaml

from ringpipe.train import loop
from ringpipe.train.checkpoints.files import latest_checkpoint, load_checkpoint
from ringpipe.train.loop import StopRequest
from trainrun import sets, train

SMALL = ["model.hidden=[16]", "log_every=5", "schedule.name=constant"]


def _command(run, *argv: str) -> list[str]:
    return [sys.executable, "-m", "ringpipe.cli", "train", "--no-progress", "--run-dir", str(run), *argv]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _files(run) -> dict[str, tuple[bytes, int]]:
    """Every file of a run directory: its bytes and modification time."""
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def _interrupt(run, *argv: str, to_group: bool = True) -> tuple[int, str]:
    """Start ``ringpipe train``, send SIGINT after its first evaluation line; exit code and output."""
    # SIGINT as a terminal leaves it: a test runner started in the background (or under nohup)
    # passes it on ignored, and a program started with SIGINT ignored keeps ignoring it.
    proc = subprocess.Popen(_command(run, *argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=run.parent, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watchdog = threading.Timer(50, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        assert proc.stdout is not None
        head = []
        for line in proc.stdout:
            head.append(line)
            if "ringpipe.train.loop: epoch" in line:
                break
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal
        else:
            os.kill(proc.pid, signal.SIGINT)
        tail, _ = proc.communicate(timeout=50)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, "".join(head) + tail


# --------------------------------------------------------------------------------- Ctrl-C


def test_stop_request_counts_a_repeat_within_a_second_as_one(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: now[0])
    stop = StopRequest()
    assert not stop.requested
    stop(signal.SIGINT, None)
    assert stop.requested
    now[0] += loop.REPEAT_S / 2
    stop(signal.SIGINT, None)  # the same Ctrl-C, also forwarded by a parent
    now[0] += loop.REPEAT_S
    with pytest.raises(KeyboardInterrupt):
        stop(signal.SIGINT, None)


@pytest.fixture
def sigint_as_in_a_terminal():
    """Python's own SIGINT handler, whatever this test process inherited (ignored when run in the background)."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


def test_stop_request_is_left_out_where_sigint_is_ignored():
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequest().installed():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # as nohup or a background job asked
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_stop_request_is_installed_for_its_block_and_keeps_an_earlier_request(sigint_as_in_a_terminal):
    before = signal.getsignal(signal.SIGINT)
    earlier = StopRequest()
    earlier.at = 1.0
    with earlier.installed():
        with StopRequest().installed() as inner:  # e.g. a rank forked after its parent was asked to stop
            assert signal.getsignal(signal.SIGINT) is inner and inner.requested
        assert signal.getsignal(signal.SIGINT) is earlier
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.timeout(60)
def test_ctrl_c_single_process_stops_gracefully(tmp_path):
    run = tmp_path / "run"
    rc, out = _interrupt(run, *sets([*SMALL, "mode=single", "epochs=2000"]))
    assert rc == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupt" and not summary["complete"]
    step = summary["steps"]
    assert f"ringpipe train: interrupted at step {step}; continue with: ringpipe train --resume --run-dir {run}" in out
    assert latest_checkpoint(run / "checkpoints").name == f"step-{step:08d}.pt"
    assert "test_accuracy" in out  # the closing table
    # The hint works: the run continues from that step.
    rc, resumed, _ = train(run, "--resume", "--set", f"max_steps={step + 3}")
    assert rc == 0 and resumed["steps"] == step + 3 and resumed["stop_reason"] == "max_steps"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("to_group", [True, False], ids=["group", "parent"])
def test_ctrl_c_spawned_ranks_stop_gracefully(tmp_path, to_group):
    """Ctrl-C reaches every process of the group; a SIGINT to the parent alone is passed on to the ranks."""
    run = tmp_path / "run"
    rc, out = _interrupt(run, *sets([*SMALL, "mode=dp", "nprocs=2", "epochs=2000"]), to_group=to_group)
    assert rc == 130, out[-3000:]
    assert "Traceback" not in out and "failed" not in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupt" and summary["world_size"] == 2
    step = summary["steps"]
    assert f"interrupted at step {step}; continue with: ringpipe train --resume --run-dir {run}" in out
    assert latest_checkpoint(run / "checkpoints").name == f"step-{step:08d}.pt"


# --------------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """A run of mode dp on 2 processes, stopped by max_steps (resumable)."""
    run = tmp_path_factory.mktemp("dp") / "run"
    rc, summary, _ = train(run, *sets([*SMALL, "mode=dp", "nprocs=2", "epochs=1", "max_steps=3"]))
    assert rc == 0 and summary["stop_reason"] == "max_steps"
    return run


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["gpipe", "1f1b"])
def test_resume_in_a_pipeline_mode_names_the_checkpoint_mode(dp_run, mode, capsys):
    """The saved config's dp section is not blamed: the mode that differs from the checkpoint's is."""
    before = _files(dp_run)
    rc, _, _ = train(dp_run, "--resume", "--mode", mode)
    err = capsys.readouterr().err
    assert rc == 1
    assert f"written by mode 'dp' on 2 ranks; this run is mode {mode!r} on 2" in err
    assert "continues only in a data-parallel mode" in err and "--mode dp" in err and "dp section" not in err
    assert _files(dp_run) == before


@pytest.mark.timeout(30)
def test_resume_errors_come_before_any_process_starts(tmp_path, monkeypatch, capsys):
    import ringpipe.launch

    def no_spawn(*args, **kwargs):
        raise AssertionError("processes were started")

    monkeypatch.setattr(ringpipe.launch, "spawn", no_spawn)
    rc, _, _ = train(tmp_path / "nonexist", "--resume")
    err = capsys.readouterr().err
    assert rc == 1 and "the run directory" in err and "does not exist" in err and "--run-dir of an earlier run" in err
    (tmp_path / "empty").mkdir()
    rc, _, _ = train(tmp_path / "empty", "--resume")
    err = capsys.readouterr().err
    assert rc == 1 and "no checkpoint in" in err and "without --resume" in err
    rc, _, _ = train(tmp_path / "pipe", "--mode", "gpipe", "--set", "pipeline.stages=3")
    err = capsys.readouterr().err
    assert rc == 2 and "nprocs=2 is not a multiple of 3" in err and "pipeline.stages" in err
    assert not (tmp_path / "pipe").exists()


@pytest.mark.timeout(60)
def test_resume_with_another_model_is_refused_clearly(tmp_path, capsys):
    run = tmp_path / "run"
    rc, _, _ = train(run, *sets([*SMALL, "mode=single", "epochs=1", "max_steps=3"]))
    assert rc == 0
    before = _files(run)
    capsys.readouterr()
    rc, _, _ = train(run, "--resume", *sets(["max_steps=null", "model.hidden=[8]"]))
    err = capsys.readouterr().err
    assert rc == 1
    assert "does not match this config's model" in err
    assert "1.weight has shape [16, 64] in the checkpoint, [8, 64] in this model" in err
    assert f"{run / 'config.yaml'}" in err and "start a new run" in err
    assert "size mismatch" not in err and "rank 0 failed" not in err
    assert _files(run) == before


@pytest.mark.timeout(60)
def test_resume_with_another_pipeline_model_is_refused_clearly(tmp_path, capsys):
    run = tmp_path / "run"
    rc, _, _ = train(run, *sets([*SMALL, "mode=gpipe", "nprocs=2", "epochs=1", "max_steps=2"]))
    assert rc == 0
    capsys.readouterr()
    rc, _, _ = train(run, "--resume", *sets(["max_steps=null", "model.hidden=[8]"]))
    err = capsys.readouterr().err
    assert rc == 1 and "does not match this config's model (stage 0: 1.weight has shape [16, 64]" in err
    assert "rank 0 failed" not in err


@pytest.mark.timeout(60)
def test_resume_of_a_finished_run_leaves_it_untouched(tmp_path, capsys):
    run = tmp_path / "run"
    rc, summary, _ = train(run, *sets([*SMALL, "mode=single", "epochs=0.2"]))
    assert rc == 0 and summary["stop_reason"] == "complete" and summary["complete"]
    steps = summary["steps"]
    before = _files(run)
    capsys.readouterr()
    rc, _, _ = train(run, "--resume")
    err = capsys.readouterr().err
    assert rc == 0
    assert f"ringpipe train: the run in {run} is already complete (step {steps} of {steps}); nothing to resume" in err
    assert _files(run) == before


@pytest.mark.timeout(60)
def test_resume_at_max_steps_says_how_to_continue(tmp_path, capsys):
    run = tmp_path / "run"
    rc, summary, _ = train(run, *sets([*SMALL, "mode=single", "epochs=1", "max_steps=4"]))
    assert rc == 0 and summary["stop_reason"] == "max_steps"
    before = _files(run)
    capsys.readouterr()
    rc, _, _ = train(run, "--resume")
    err = capsys.readouterr().err
    assert rc == 0 and "already stopped at max_steps=4 (step 4 of" in err and "max_steps=null" in err
    assert _files(run) == before


@pytest.mark.timeout(60)
def test_nothing_to_resume_is_also_found_by_the_ranks(tmp_path, capsys):
    """A checkpoint that does not record its data size (older ringpipe): the ranks find the run complete."""
    run = tmp_path / "run"
    rc, summary, _ = train(run, *sets([*SMALL, "mode=single", "epochs=0.2"]))
    assert rc == 0
    path = latest_checkpoint(run / "checkpoints")
    ckpt = load_checkpoint(path)
    del ckpt["records"], ckpt["replicas"], ckpt["wall_time"], ckpt["checksum"]  # as an older ringpipe wrote it
    torch.save(ckpt, path)
    before = _files(run)
    capsys.readouterr()
    rc, _, _ = train(run, "--resume")
    assert rc == 0 and "is already complete" in capsys.readouterr().err
    assert _files(run) == before


@pytest.mark.timeout(60)
def test_wall_time_counts_every_part_of_a_resumed_run(tmp_path):
    run = tmp_path / "run"
    rc, cut, _ = train(run, *sets([*SMALL, "mode=single", "epochs=1", "max_steps=20"]))
    assert rc == 0 and cut["wall_time_s"] >= cut["train_time_s"]
    saved = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert cut["train_time_s"] <= saved["wall_time"] <= cut["wall_time_s"]
    rc, full, _ = train(run, "--resume", "--set", "max_steps=null")
    assert rc == 0 and full["stop_reason"] == "complete"
    assert full["train_time_s"] > cut["train_time_s"]
    assert full["wall_time_s"] >= full["train_time_s"]
    assert full["wall_time_s"] > saved["wall_time"]


# --------------------------------------------------------------------------------- errors before training


@pytest.mark.timeout(60)
def test_pipeline_stage_without_parameters_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    rc, summary, _ = train(run, "--mode", "gpipe", *sets(["model.hidden=[]", "epochs=0.2"]))
    err = capsys.readouterr().err
    assert rc == 1 and summary == {}
    assert "pipeline stage 0 of 2 got 1 layer (Flatten) and no parameters" in err
    assert "split the model's 2 layers as [1, 1]" in err
    assert "fewer pipeline.stages" in err and "pipeline.balance" in err and "model.hidden" in err
    assert "empty parameter list" not in err and "rank 0 failed" not in err


@pytest.mark.timeout(30)
def test_pipeline_stage_without_parameters_from_an_explicit_balance(tmp_path, capsys):
    rc, _, _ = train(tmp_path / "run", "--mode", "gpipe", *sets(["pipeline.balance=[1, 3]", "epochs=0.2",
                                                                  "model.hidden=[16]"]))
    err = capsys.readouterr().err
    assert rc == 1
    assert "pipeline stage 0 of 2 got 1 layer (Flatten) and no parameters: pipeline.balance=[1, 3] split" in err


def test_config_that_is_a_directory(tmp_path, capsys):
    rc, _, _ = train(tmp_path / "run", "--config", str(tmp_path))
    err = capsys.readouterr().err
    assert rc == 2 and "is a directory" in err and "YAML or JSON config file" in err
    assert "does not exist" not in err


# --------------------------------------------------------------------------------- quiet, tidy runs


@pytest.mark.timeout(90)
def test_pipeline_run_is_quiet_and_tidy(tmp_path):
    """No matplotlib cache in the run directory or left in the temporary folder, no font-cache log
    line, and no micro-batch split warning for the short last evaluation batch."""
    tmp, home = tmp_path / "tmp", tmp_path / "home"
    tmp.mkdir()
    home.mkdir()
    env = _env(TMPDIR=str(tmp), HOME=str(home))
    for key in ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
        env.pop(key, None)
    run = tmp_path / "run"
    proc = subprocess.run(_command(run, "--mode", "gpipe", *sets(["epochs=0.2", "model.hidden=[16]"])),
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=80)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "fontManager" not in out and "micro-batches of" not in out and "WARNING" not in out
    assert not (run / ".mplconfig").exists() and (run / "curves.png").stat().st_size > 0
    # On a GPU host torch's own optimizer step asks torch.cuda.is_available(), whose driver
    # start makes $HOME/.nv: torch's doing, not the run's (a plain torch loop leaves it too).
    assert not [p for p in tmp.iterdir() if "matplotlib" in p.name]
    assert [p.name for p in home.iterdir() if p.name != ".nv"] == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "complete" and summary["complete"]
    assert yaml.safe_load((run / "config.yaml").read_text())["mode"] == "gpipe"
