"""The timeline a Horovod user asks for: written while the job runs, readable however the job ends.

Specification from Horovod's documentation (docs/timeline.rst) and its own tests
(test/parallel/test_timeline.py, test_torch.py::test_timeline_api): ``HOROVOD_TIMELINE=FILE``
records without code changes, the file is valid JSON for ``chrome://tracing`` as it is written,
a tensor's ``name=`` gives it a row of its own (``allreduce.<name>``),
``HOROVOD_TIMELINE_MARK_CYCLES=1`` adds ``CYCLE_START`` instants, and ``hvd.start_timeline`` /
``hvd.stop_timeline`` record between their calls only. Every job here starts real processes
through ``ringpipe launch`` and never calls ``shutdown()``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ringpipe.observe.live import CLOSE, create_file

RINGPIPE = [sys.executable, "-m", "ringpipe.cli"]

PROGRAM = textwrap.dedent("""
    import os, sys, time, torch
    import ringpipe as hvd
    hvd.init()
    for i in range(3):
        hvd.allreduce(torch.ones(4) * hvd.rank(), name="avg_loss")
        hvd.allreduce(torch.ones(1000))
    print("ready", hvd.rank(), flush=True)
    if os.environ.get("HANG"):
        time.sleep(1000)
""")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("HOROVOD_TIMELINE", "RINGPIPE_TIMELINE", "HOROVOD_TIMELINE_MARK_CYCLES"):
        env.pop(k, None)
    env.update(extra)
    return env


def _events(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def _rows(events: list[dict]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}


def _named_spans(events: list[dict], row: str, nbytes: int) -> dict[int, int]:
    """Per rank, how many spans on ``row`` carry the tensor's data: ``nbytes`` of it alone, or the call's
    agreement with the data in the same message (``negotiated``: a small allreduce riding in it)."""
    rows = _rows(events)
    out: dict[int, int] = {}
    for e in events:
        if e["ph"] == "X" and rows.get((e["pid"], e["tid"])) == row and (
                e["args"]["bytes"] == nbytes or e["args"].get("negotiated")):
            out[e["pid"]] = out.get(e["pid"], 0) + 1
    return out


def test_an_empty_timeline_is_valid_json(tmp_path):
    path = create_file(tmp_path / "sub" / "t.json")
    assert path.read_bytes().endswith(CLOSE)
    data = json.loads(path.read_text())
    assert data["traceEvents"] == [] and data["otherData"]["start_time_since_epoch_in_micros"] > 0


@pytest.mark.timeout(240)
def test_timeline_of_a_program_killed_with_sigkill_is_valid_and_has_both_ranks(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    timeline = tmp_path / "timeline.json"
    env = _env(HOROVOD_TIMELINE=str(timeline), HOROVOD_TIMELINE_MARK_CYCLES="1", HANG="1")
    proc = subprocess.Popen([*RINGPIPE, "launch", "-np", "2", "prog.py"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        # Wait (no time assertion) until both ranks' named allreduces reached the file.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if _named_spans(_events(timeline), "allreduce.avg_loss", 16) == {0: 3, 1: 3}:
                    break
            except (OSError, ValueError, KeyError):
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    events = _events(timeline)  # valid JSON after SIGKILL of every process of the job
    assert _named_spans(events, "allreduce.avg_loss", 16) == {0: 3, 1: 3}
    # before each named call, the ranks' agreement on it: Horovod's NEGOTIATE_ALLREDUCE on the tensor's row
    rows = _rows(events)
    negotiations = {e["pid"] for e in events if e["ph"] == "X" and e["name"] == "NEGOTIATE_ALLREDUCE"
                    and rows.get((e["pid"], e["tid"])) == "allreduce.avg_loss"}
    assert negotiations == {0, 1}
    # the unnamed allreduce stays on its communicator's row, apart from the named one
    assert {(pid, row) for (pid, _), row in _rows(events).items()} >= {(0, "world"), (1, "world")}
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names[0].startswith("rank 0 @ ") and names[1].startswith("rank 1 @ ")
    for rank in (0, 1):
        starts = [e for e in events if e["ph"] == "i" and e["name"] == "start_timeline" and e["pid"] == rank]
        cycles = [e for e in events if e["ph"] == "i" and e["name"] == "CYCLE_START" and e["pid"] == rank]
        assert len(starts) == 1 and len(cycles) >= 6  # one per collective: 3 named + 3 unnamed at least


STARTSTOP = textwrap.dedent("""
    import sys, torch
    import ringpipe as hvd
    hvd.init()
    hvd.allreduce(torch.ones(3), name="before")
    hvd.start_timeline(sys.argv[1], mark_cycles=sys.argv[2] == "1")
    hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name="test_allreduce")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(3), name="after")
    print("ok", hvd.rank(), flush=True)
""")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mark_cycles", ["1", "0"])
def test_start_and_stop_timeline_record_between_their_marks(tmp_path, mark_cycles):
    (tmp_path / "prog.py").write_text(STARTSTOP)
    timeline = tmp_path / "dyn.json"
    out = subprocess.run([*RINGPIPE, "launch", "-np", "2", "prog.py", str(timeline), mark_cycles], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    events = _events(timeline)
    rows = set(_rows(events).values())
    assert "allreduce.test_allreduce" in rows and not rows & {"allreduce.before", "allreduce.after"}
    assert _named_spans(events, "allreduce.test_allreduce", 12) == {0: 1, 1: 1}
    for rank in (0, 1):
        marks = {e["name"]: e["ts"] for e in events if e["ph"] == "i" and e["pid"] == rank}
        span = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        assert marks["start_timeline"] <= min(e["ts"] for e in span)
        assert max(e["ts"] + e["dur"] for e in span) <= marks["stop_timeline"] + 1e-3
        assert ("CYCLE_START" in marks) == (mark_cycles == "1")


def test_start_timeline_before_init_is_refused_as_in_horovod():
    code = "import ringpipe as hvd\ntry:\n    hvd.start_timeline('x.json')\nexcept ValueError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert "Horovod has not been initialized; use hvd.init()." in out.stdout, out.stderr[-2000:]


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_timeline_under_mpi_survives_sigterm_of_every_rank(tmp_path):
    import shutil

    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    (tmp_path / "prog.py").write_text(PROGRAM)
    timeline = tmp_path / "timeline.json"
    env = _env(RINGPIPE_TIMELINE=str(timeline), HANG="1")
    proc = subprocess.Popen([*RINGPIPE, "launch", "--backend", "mpi", "-np", "2", "prog.py"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        ready = 0
        for line in proc.stdout:
            ready += "ready" in line
            if ready == 2:
                break
        assert ready == 2
        ranks = subprocess.run(["pgrep", "-f", "-s", str(proc.pid), "prog.py"], capture_output=True, text=True)
        pids = [int(p) for p in ranks.stdout.split() if int(p) != proc.pid]
        for pid in pids:  # the ranks themselves, before any periodic flush could be counted on
            os.kill(pid, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    events = _events(timeline)
    assert _named_spans(events, "allreduce.avg_loss", 16) == {0: 3, 1: 3}
    assert {e["pid"] for e in events if e["ph"] == "i" and e["name"] == "SIGTERM"} == {0, 1}
