"""Checkpoints you can trust: checksummed, corruption falls back to the newest good one, loads run no code.

Every resumed run here is compared with an undisturbed run of the same config: the metrics,
the summary and the final checkpoint's tensors must be identical, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
import torch

from ringpipe.dp.checkpoint import UnsafeCheckpointError
from ringpipe.dp.checkpoint import load_checkpoint as hvd_load_checkpoint
from ringpipe.launch import spawn
from ringpipe.train.checkpoints.files import (
    CheckpointError,
    content_digest,
    load_checkpoint,
    save_checkpoint,
)
from trainrun import sets, train

#: 1,438 training records in batches of 32: epochs end at steps 45, 90 and 135.
SINGLE = ["mode=single", "epochs=3", "batch_size=32", "log_every=5", "model.hidden=[16]", "model.dropout=0.2",
          "optimizer.name=sgd", "schedule.name=cosine", "schedule.warmup_epochs=0.5"]
CUT = 100  # checkpoints at 45, 90 and 100
TIMING = {"samples_per_second", "comm_share", "train_time_s", "wall_time_s"}


def _strip(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _tensors(obj, prefix=""):
    """Every tensor of a checkpoint, by path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _tensors(val, f"{prefix}/{key}").items()}
    if isinstance(obj, list | tuple):
        return {k: v for i, val in enumerate(obj) for k, v in _tensors(val, f"{prefix}/{i}").items()}
    return {}


def _final_tensors(run):
    ckpt = load_checkpoint(sorted((run / "checkpoints").glob("step-*.pt"))[-1])
    return _tensors({"engine": ckpt["engine"], "ranks": ckpt["ranks"]})


def assert_same_run(run, reference):
    """``run`` ended exactly as ``reference`` did: metrics, summary and every tensor of its last checkpoint."""
    summary, ref = (json.loads((r / "summary.json").read_text()) for r in (run, reference))
    assert {k: v for k, v in summary.items() if k not in TIMING} == {k: v for k, v in ref.items() if k not in TIMING}
    metrics, ref_metrics = ([json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()]
                            for r in (run, reference))
    assert _strip(metrics) == _strip(ref_metrics)
    mine, theirs = _final_tensors(run), _final_tensors(reference)
    assert mine.keys() == theirs.keys()
    differ = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert not differ, differ


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """An undisturbed run, and the same run stopped by max_steps with checkpoints at 45, 90 and 100."""
    root = tmp_path_factory.mktemp("single")
    rc, full, _ = train(root / "full", *sets(SINGLE))
    assert rc == 0 and full["stop_reason"] == "complete"
    rc, cut, _ = train(root / "cut", *sets([*SINGLE, f"max_steps={CUT}"]))
    assert rc == 0 and cut["steps"] == CUT
    names = sorted(p.name for p in (root / "cut" / "checkpoints").iterdir())
    assert names == ["step-00000045.pt", "step-00000090.pt", "step-00000100.pt"]
    return root / "full", root / "cut"


def _copy(single_runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(single_runs[1], run)
    return run


def _flip_tensor_byte(path):
    """Flip one byte in the middle of the largest tensor's data, leaving the file's structure intact."""
    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = np.frombuffer(f.read(4), dtype="<u2")
        at = info.header_offset + 30 + int(name_len) + int(extra_len) + info.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(path):
    path.write_bytes(np.random.default_rng(0).integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())


# ------------------------------------------------------------------------------ the checksum


def test_checksum_covers_every_tensor_byte_and_value(tmp_path):
    payload = {"step": 3, "engine": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, "lr": 0.1}
    digest = content_digest(payload)
    assert digest.startswith("sha256:") and content_digest({**payload, "checksum": "x"}) == digest
    flipped = {**payload, "engine": {"w": payload["engine"]["w"].clone()}}
    flipped["engine"]["w"].view(torch.int32)[0, 1] ^= 1  # one bit of one float
    assert content_digest(flipped) != digest
    assert content_digest({**payload, "lr": 0.1000000001}) != digest
    assert content_digest({**payload, "engine": {"w": payload["engine"]["w"].reshape(3, 2)}}) != digest
    path = save_checkpoint(tmp_path, 3, payload, keep=1)
    assert load_checkpoint(path)["checksum"] == digest
    _flip_tensor_byte(path)
    loaded = torch.load(path, weights_only=True)  # torch itself reads the altered file without a word
    assert not torch.equal(loaded["engine"]["w"], payload["engine"]["w"])
    with pytest.raises(CheckpointError, match="fails its checksum"):
        load_checkpoint(path)


def test_save_never_prunes_the_checkpoint_it_just_wrote(tmp_path):
    for step in (809, 854, 899):  # another run's checkpoints, later steps than this one
        save_checkpoint(tmp_path, step, {"step": step}, keep=3)
    save_checkpoint(tmp_path, 5, {"step": 5}, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005.pt"]
    for step in (10, 15, 20):
        save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000015.pt", "step-00000020.pt"]


# ------------------------------------------------------------------------------ corruption, then --resume


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", [_truncate, _garbage, _flip_tensor_byte], ids=["truncated", "garbage", "flipped"])
def test_unusable_newest_checkpoint_falls_back_to_the_newest_good_one(single_runs, tmp_path, damage, capsys):
    run = _copy(single_runs, tmp_path)
    newest = run / "checkpoints" / "step-00000100.pt"
    damage(newest)
    capsys.readouterr()
    rc, resumed, _ = train(run, "--resume", "--set", "max_steps=null")
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "step-00000100.pt" in err and "moved aside to step-00000100.pt.corrupt" in err
    assert "continuing from" in err and "step-00000090.pt" in err
    assert (run / "checkpoints" / "step-00000100.pt.corrupt").exists()
    assert_same_run(run, single_runs[0])


@pytest.mark.timeout(60)
def test_no_good_checkpoint_names_each_fault(single_runs, tmp_path, capsys):
    run = _copy(single_runs, tmp_path)
    for path, damage in zip(sorted((run / "checkpoints").iterdir()), (_truncate, _garbage, _flip_tensor_byte),
                            strict=True):
        damage(path)
    capsys.readouterr()
    rc, _, _ = train(run, "--resume", "--set", "max_steps=null")
    err = capsys.readouterr().err
    assert rc == 1 and "no usable checkpoint" in err and "without --resume" in err
    assert "step-00000045.pt' cannot be read" in err and "step-00000090.pt' cannot be read" in err
    assert "step-00000100.pt' fails its checksum" in err
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_torn_metrics_tail_is_cut_back_with_a_warning(single_runs, tmp_path, capsys):
    run = _copy(single_runs, tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 105, "epoch": 2.33, "lo')  # a crash in the middle of a record
    capsys.readouterr()
    rc, _, _ = train(run, "--resume", "--set", "max_steps=null")
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "metrics.jsonl ends in 1 incomplete line" in err and "cut back to the last complete record" in err
    assert_same_run(run, single_runs[0])


@pytest.mark.timeout(60)
def test_stale_temporary_file_is_removed(single_runs, tmp_path, capsys):
    run = _copy(single_runs, tmp_path)
    stale = run / "checkpoints" / ".step-00000105.pt.tmp"
    stale.write_bytes(b"half a checkpoint")
    capsys.readouterr()
    rc, _, _ = train(run, "--resume", "--set", "max_steps=null")
    err = capsys.readouterr().err
    assert rc == 0 and not stale.exists() and ".step-00000105.pt.tmp" in err
    assert_same_run(run, single_runs[0])


# ------------------------------------------------------------------------------ multi-process modes


#: 2 replicas of 32: epochs end at steps 23 and 45.
DP = ["mode=dp", "nprocs=2", "epochs=2", "batch_size=32", "log_every=2", "model.hidden=[16]", "model.dropout=0.2",
      "optimizer.name=sgd", "schedule.name=cosine", "schedule.warmup_epochs=0.5", "checkpoint.keep=3"]
ASYNC = ["mode=async", "nprocs=2", "epochs=2", "batch_size=64", "log_every=2", "model.hidden=[32]",
         "mitigations=wp,ws,ga", "step_every=2", "optimizer.name=sgd", "optimizer.lr=0.01",
         "schedule.name=cosine", "schedule.warmup_epochs=0.5"]


@pytest.mark.timeout(300)
def test_dp_falls_back_and_resumes_bit_exact(tmp_path, capfd):
    rc, _, _ = train(tmp_path / "full", *sets(DP))
    assert rc == 0
    run = tmp_path / "run"
    rc, cut, _ = train(run, *sets([*DP, "max_steps=30"]))
    assert rc == 0 and cut["steps"] == 30
    _flip_tensor_byte(run / "checkpoints" / "step-00000030.pt")
    capfd.readouterr()
    rc, _, _ = train(run, "--resume", "--set", "max_steps=null")
    err = capfd.readouterr().err
    assert rc == 0, err
    assert "step-00000030.pt' fails its checksum" in err and "step-00000023.pt" in err
    assert_same_run(run, tmp_path / "full")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cut", [23, 30], ids=["epoch-end", "mid-epoch"])
def test_async_resumes_bit_exact(tmp_path, cut):
    """Gap Aware's statistics travel in the checkpoint; a stop between drains resumes from the last
    drain, so the resumed run drains where the undisturbed one does and sees the same weight versions."""
    rc, _, _ = train(tmp_path / "full", *sets(ASYNC))
    assert rc == 0
    run = tmp_path / "run"
    rc, stopped, _ = train(run, *sets([*ASYNC, f"max_steps={cut}"]))
    assert rc == 0 and stopped["steps"] == cut
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*.pt")) == ["step-00000023.pt"]
    rc, _, _ = train(run, "--resume", "--set", "max_steps=null")
    assert rc == 0
    assert_same_run(run, tmp_path / "full")


def _command(run, *argv):
    return [sys.executable, "-m", "ringpipe.cli", "train", "--no-progress", "--run-dir", str(run), *argv]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.timeout(300)
def test_async_interrupted_by_ctrl_c_resumes_bit_exact(tmp_path):
    """Ctrl-C wherever it lands (a log window inside an epoch): the resumed run equals the undisturbed one."""
    cfg = sets([*ASYNC, "epochs=3", "mitigations=stale"])
    assert subprocess.run(_command(tmp_path / "full", *cfg), env=_env(), capture_output=True).returncode == 0
    run = tmp_path / "run"
    proc = subprocess.Popen(_command(run, *cfg), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watchdog = threading.Timer(120, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "ringpipe.train.loop: epoch" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
    assert proc.returncode == 130, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupt"
    resumed = subprocess.run(_command(run, "--resume"), env=_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, tmp_path / "full")


# ------------------------------------------------------------------------------ ringpipe.load_checkpoint


class _Crafted:
    """A pickle that runs code when loaded: it writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"model": {"w": torch.ones(2)}, "epoch": _Crafted(marker)}, tmp_path / "crafted.pt")
    with pytest.raises(UnsafeCheckpointError) as info:
        hvd_load_checkpoint(tmp_path / "crafted.pt")
    text = str(info.value)
    assert "crafted.pt" in text and "exec" in text and "weights_only=False" in text
    assert not marker.exists()
    # The documented opt-in, for a file one trusts: full pickle (which is why it must be explicit).
    hvd_load_checkpoint(tmp_path / "crafted.pt", weights_only=False)
    assert marker.read_text() == "ran"


def test_safe_load_keeps_optimizer_state_and_numpy_values(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "loss": np.float32(0.25), "seen": np.arange(3), "epoch": 3}
    torch.save(state, tmp_path / "ok.pt")
    loaded = hvd_load_checkpoint(tmp_path / "ok.pt")
    assert loaded["epoch"] == 3 and loaded["loss"] == np.float32(0.25) and list(loaded["seen"]) == [0, 1, 2]
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def _load_on_ranks(comm, path):
    try:
        hvd_load_checkpoint(path, comm=comm)
    except UnsafeCheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.timeout(60)
def test_crafted_checkpoint_is_refused_on_every_rank(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"epoch": _Crafted(marker)}, tmp_path / "crafted.pt")
    results = spawn(_load_on_ranks, 2, args=(str(tmp_path / "crafted.pt"),))
    assert all("was not loaded" in r for r in results), results
    assert not marker.exists()
