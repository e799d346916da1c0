"""Run directories hold one run each: a reused --run-dir is refused unless --resume or --overwrite,
the checkpoint just written is never pruned, and default names never collide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from ringpipe.train.command import resolve_run_dir
from trainrun import sets, train

SMALL = ["mode=single", "model.hidden=[16]", "log_every=5", "schedule.name=constant", "epochs=20"]


def _files(run):
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}


@pytest.fixture
def finished(tmp_path):
    """A finished run whose last checkpoints are at high steps (as the CNN run of the report)."""
    run = tmp_path / "run"
    rc, summary, _ = train(run, *sets([*SMALL, "epochs=2"]))
    assert rc == 0 and summary["complete"]
    return run


@pytest.mark.timeout(60)
def test_new_run_in_a_used_directory_is_refused(finished, capsys):
    before = _files(finished)
    capsys.readouterr()
    rc, _, _ = train(finished, *sets([*SMALL, "max_steps=5"]))
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--run-dir {finished} already holds files of a run" in err
    assert "--resume" in err and "--overwrite" in err and "new --run-dir" in err
    assert _files(finished) == before


@pytest.mark.timeout(60)
def test_overwrite_replaces_the_run_and_keeps_its_own_checkpoint(finished, capsys):
    old_checkpoints = sorted(p.name for p in (finished / "checkpoints").iterdir())
    assert old_checkpoints[-1] == "step-00000090.pt"
    rc, summary, metrics = train(finished, "--overwrite", *sets([*SMALL, "max_steps=5"]))
    assert rc == 0 and summary["steps"] == 5 and summary["stop_reason"] == "max_steps"
    assert sorted(p.name for p in (finished / "checkpoints").iterdir()) == ["step-00000005.pt"]
    assert max(r["step"] for r in metrics) == 5
    capsys.readouterr()
    rc, resumed, _ = train(finished, "--resume", "--set", "max_steps=8")
    assert rc == 0 and resumed["steps"] == 8  # the new run continues, not the old one


@pytest.mark.timeout(60)
def test_overwrite_refuses_a_directory_that_holds_no_run(tmp_path, capsys):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    rc, _, _ = train(folder, "--overwrite", *sets([*SMALL, "max_steps=2"]))
    err = capsys.readouterr().err
    assert rc == 2 and "holds no ringpipe run" in err
    assert (folder / "thesis.tex").read_text() == "years of work" and len(list(folder.iterdir())) == 1


@pytest.mark.timeout(60)
def test_empty_directory_is_fine(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    rc, summary, _ = train(run, *sets([*SMALL, "max_steps=2"]))
    assert rc == 0 and summary["steps"] == 2


def test_default_names_are_unique_under_concurrency(tmp_path):
    names: list[str] = []

    def make():
        for _ in range(20):
            names.append(str(resolve_run_dir(None, "dp", False, root=tmp_path)))

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(names) == 80 and len(set(names)) == 80
    assert all(os.path.isdir(n) and os.path.basename(n).split("-")[2] == "dp" for n in names)


@pytest.mark.timeout(120)
def test_parallel_runs_with_default_names_get_their_own_directories(tmp_path):
    """Two runs started in the same second (a sweep) on the command line."""
    env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "ringpipe.cli", "train", "--no-progress", *sets([*SMALL, "max_steps=3"])]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=110)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    for run in runs:
        assert json.loads((run / "summary.json").read_text())["steps"] == 3
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000003.pt"]
