"""A real `ringpipe train --mode 1f1b` run: its doctor names the schedule's bubble, its summary holds each
stage's memory predicted and measured, and `ringpipe plan` predicts the same figures before it.

One 2-rank run (gloo) of the bundled 1f1b config, shortened. The doctor's bubble is checked
against the paper's ``(p - 1) / (m + p - 1)`` for 1F1B (an oracle that does not use the run:
the stages of this run are not equal, so only the order of magnitude and the naming are
checked here; the 5-point agreement is the unit tier's, on exact synthetic timings).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

_LAUNCH_VARS = ("RINGPIPE_BACKEND", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _cli(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "ringpipe.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.mark.timeout(240)
def test_a_1f1b_run_gets_its_bubble_named_and_its_memory_predicted_and_measured(tmp_path):
    run = tmp_path / "run"
    out = _cli("train", "--mode", "1f1b", "--run-dir", str(run), "--no-progress", "--set", "max_steps=30",
               "--set", "epochs=1")
    assert out.returncode == 0, out.stderr[-3000:]
    doctor = (run / "doctor.txt").read_text()
    assert "no problem found" not in doctor or "pipeline stages idle" in doctor, doctor
    head = next(line for line in doctor.splitlines() if "pipeline stages idle" in line)
    evidence = doctor.split(head, 1)[1].splitlines()[1]
    bubble = float(evidence.split("the schedule's own bubble ")[1].split("%")[0])
    paper = 100 * (2 - 1) / (4 + 2 - 1)  # 1F1B, 2 stages, 4 micro-batches
    assert abs(bubble - paper) < 10, (bubble, paper, doctor)
    assert "predicted for 1f1b on 2 stages with 4 micro-batches" in evidence

    summary = json.loads((run / "summary.json").read_text())
    per_rank = summary["memory"]["per_rank"]
    assert [r["stage"] for r in per_rank] == [0, 1]
    for r in per_rank:
        assert r["measured"]["peak"] > 0 and abs(r["error"]) <= 0.10, r

    plan = _cli("plan", "--mode", "1f1b", "--json")
    assert plan.returncode == 0, plan.stderr
    planned = {p["mode"]: p for p in json.loads(plan.stdout)["plans"]}
    assert set(planned) == {"seq", "gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "async"}
    assert [s["peak"] for s in planned["1f1b"]["stages"]] == [r["predicted"]["peak"] for r in per_rank]

    tight = _cli("plan", "--mode", "1f1b", "--memory-budget", "10K")
    assert tight.returncode == 2 and "memory budget of 10.00 KiB" in tight.stderr and "stage 0:" in tight.stderr
    refused = _cli("train", "--mode", "1f1b", "--run-dir", str(tmp_path / "r2"), "--no-progress",
                   "--set", "pipeline.memory_budget=10K", "--set", "max_steps=2")
    assert refused.returncode != 0 and "pipeline.memory_budget=10K" in refused.stderr, refused.stderr[-2000:]
