"""One communication figure: the share of the training steps' time blocked on communication.

It is the same number in the epoch log lines (metrics.jsonl), summary.json's ``comm_share``,
comm_profile.txt's ``comm %``, ``ringpipe doctor RUN`` and ``ringpipe trace RUN``; the time with a
call in flight is a column of its own, named so; windows leave start-up out; no share exceeds
100 %; and the default run directory is readable by the doctor and trace.

The references are figures worked out by hand from the events (a synthetic run) and, for a real
run, the train.window event the run recorded (its steps' time and blocked time).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ringpipe.comm.events import Event
from ringpipe.observe.collect import JobEvents, RankEvents, save_events
from ringpipe.observe.runreport import WINDOW_OP

MS = 1_000_000
_LAUNCH_VARS = ("RINGPIPE_BACKEND", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _ev(op, start_ms, end_ms, nbytes=4096, **detail):
    return Event(op, nbytes, -1, int(start_ms * MS), int(end_ms * MS), 0, "world", detail)


def _run_events():
    """Two ranks: start-up (a broadcast, a 1.5 s barrier, a 1.1 s allreduce) before a 100 ms window of
    4 steps (80 ms of steps, 20 ms of them blocked on rank 0, 30 ms on rank 1), allreduces inside it."""
    ranks = []
    for rank, blocked in ((0, 20), (1, 30)):
        events = [
            _ev("broadcast", 0, 50),
            _ev("barrier", 50, 1550, nbytes=0),
            _ev("allreduce", 1550, 2650),
            Event(WINDOW_OP, 0, -1, 3000 * MS, 3100 * MS, 0, "training",
                  {"steps": 4, "step_ns": 80 * MS, "blocked_ns": blocked * MS}),
            _ev("allreduce", 3010, 3020), _ev("allreduce", 3030, 3040),
            _ev("allreduce", 3050, 3060), _ev("allreduce", 3070, 3105),  # ends past the window: cut to it
            _ev("barrier", 3200, 3300, nbytes=0),  # shutdown, after the window
        ]
        ranks.append(RankEvents(rank, "h0", events, {}))
    return JobEvents(ranks, {"backend": "gloo"})


def _shares(text):
    return [float(x) for x in re.findall(r"(-?\d+(?:\.\d+)?)%", text)]


def _rank_rows(text):
    return {int(line.split()[0]): line.split() for line in text.splitlines() if re.match(r"\s+\d+\s+h0\s", line)}


@pytest.mark.parametrize("command", ["doctor", "trace"])
def test_doctor_and_trace_count_the_training_steps_only(tmp_path, command, capsys):
    from ringpipe.cli import main

    save_events(tmp_path / "events.json", _run_events())
    argv = [command, str(tmp_path)] + (["-o", str(tmp_path / "t.json")] if command == "trace" else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "the 4 training steps" in out
    ops = {line.split()[0]: line.split() for line in out.splitlines()
           if line.split() and line.split()[0] in ("allreduce", "barrier", "broadcast")}
    assert set(ops) == {"allreduce"} and ops["allreduce"][1] == "8"  # 4 calls a rank; no start-up, no shutdown
    assert all(0 <= s <= 100 for s in _shares(out)), out
    rows = _rank_rows(out)
    # in flight: 10+10+10+(3100-3070=30) = 60 ms of the 100 ms window; comm: 20/80 and 30/80 of the steps
    assert rows[0][3:] == ["100.00", "60.00", "60.0%", "80.00", "20.00", "25.0%"], rows[0]
    assert rows[1][-1] == "37.5%"
    if command == "doctor":
        assert "comm 25.0%: rank 0's 4 training steps were blocked on communication for 25.0% of their time" in out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_default_run_directory_gives_one_comm_figure_everywhere(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    run = tmp_path / "run"

    def cli(*argv, timeout=600):
        return subprocess.run([sys.executable, "-m", "ringpipe.cli", *argv], capture_output=True, text=True,
                              env=env, timeout=timeout)

    # The default run (no observe settings), one epoch so that the epoch's log line covers every step.
    out = cli("train", "--run-dir", str(run), "--no-progress", "--set", "epochs=1", "--set", "nprocs=2")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    events = json.loads((run / "events.json").read_text())  # written without observe.timeline
    win = next(e for e in events["ranks"][0]["events"] if e[0] == WINDOW_OP)[7]
    reference = win["blocked_ns"] / win["step_ns"]  # rank 0's steps, as the run measured them
    assert summary["comm_share"] == pytest.approx(reference, rel=1e-9)

    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    epoch = [r for r in logged if r["kind"] == "eval"]
    assert len(epoch) == 1 and epoch[0]["comm_share"] == pytest.approx(reference, rel=1e-9)
    assert re.search(rf"\| comm {100 * reference:.0f}%", out.stderr), out.stderr[-2000:]

    figure = f"{100 * reference:.1f}%"
    profile = (run / "comm_profile.txt").read_text()
    doctor = cli("doctor", str(run))
    trace = cli("trace", str(run))
    assert doctor.returncode == 0 and trace.returncode == 0, (doctor.stderr, trace.stderr)
    for text in (profile, doctor.stdout, trace.stdout):
        rank0 = next(line for line in text.splitlines() if re.match(r"\s+0\s", line))
        assert "comm %" in text and "in flight %" in text
        assert rank0.split()[-1] == figure, (rank0, figure)
        assert all(0 <= s <= 100 for s in _shares(text)), text
    assert f"comm {figure}: rank 0's {summary['steps']} training steps" in doctor.stdout
    assert f"comm {figure}: rank 0's" in (run / "doctor.txt").read_text()
