"""`ringpipe doctor` on three namespace hosts joined by a bridge (seed 000's setup): real processes, real links.

A fast subset of benchmarks/doctor_accuracy.py: host c's link shaped to 50 Mbit/s under `ringpipe launch
--nnodes 3` and under `mpirun` (the doctor names host c's link, nothing else, and proves the fix), and a
late rank in a script's events.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import netns

REASON = netns.can_create()
#: one worker for every job on namespace hosts timed by the doctor (this file and its twin in tests/e2e/{observe,pipeline}):
#: two at once on the 2 cores would slow each other's messages, and the doctor reads message waits
pytestmark = pytest.mark.xdist_group("doctor_on_namespace_hosts")
LATE = str(Path(__file__).resolve().parents[2] / "scripts" / "doctor_late_rank.py")



def _report(text):
    """The JSON report in a launcher's output (mpirun's --tag-output tags taken out)."""
    text = netns.untagged(text)
    return json.JSONDecoder().raw_decode(text, text.index('{"ranks"'))[0]


def _problems(report):
    return [f for f in report["findings"] if f["severity"] == "problem"]


@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_a_shaped_link_of_host_c_is_named_and_leaving_c_out_is_measured_faster():
    with netns.bridged_hosts(3, rates={2: "50mbit"}) as hosts:
        outs = netns.launch_across(hosts, (4, 2, 2), ["-m", "ringpipe.cli", "doctor", "--json", "--size", "256K",
                                                       "--verify", "3"], 29661, netns.job_env(), timeout=280)
    for o in outs:
        assert o.returncode == 0, o.stdout[-2000:] + o.stderr[-3000:]
    text = outs[0].stdout
    report = json.JSONDecoder().raw_decode(text, text.index('{"ranks"'))[0]
    assert report["hosts"] == ["rp-host-a"] * 4 + ["rp-host-b"] * 2 + ["rp-host-c"] * 2
    problems = _problems(report)
    assert [f["hosts"] for f in problems] == [["rp-host-c"]], problems
    assert problems[0]["what"].startswith("host rp-host-c's network link is slow")
    # 50 Mbit/s is 0.00625 GB/s: every link of c is far below the links between a and b.
    c = [x["gbps"] for x in report["links"] if (x["src"] >= 6) != (x["dst"] >= 6)]
    ab = [x["gbps"] for x in report["links"] if x["src"] < 6 and x["dst"] < 6 and (x["src"] < 4) != (x["dst"] < 4)]
    assert max(c) < 0.01 < 0.1 < min(ab) / 2, (c, ab)
    fix = next(f for f in report["findings"] if f["severity"] == "fix")
    assert fix["what"] == "leave host rp-host-c out until its link is fixed"
    ms = report["allreduce_ms"]
    assert ms["without rp-host-c"] < ms["ring"]
    assert report["verified"]["after_ms"] < report["verified"]["before_ms"]


@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_a_late_rank_in_a_scripts_events_is_named_and_nothing_else(tmp_path):
    events = tmp_path / "events.json"
    with netns.bridged_hosts(3) as hosts:
        outs = netns.launch_across(hosts, (4, 2, 2), [LATE, str(events), "5"], 29663, netns.job_env(), timeout=280)
    for o in outs:
        assert o.returncode == 0, o.stdout[-2000:] + o.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", "doctor", "--json", str(events)],
                         capture_output=True, text=True, env=netns.job_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    problems = _problems(report)
    assert [(f["rank"], f["what"].split(" arrives")[0]) for f in problems] == [(5, "rank 5 (host rp-host-b)")], problems


@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.skipif(REASON is not None or shutil.which("mpirun") is None, reason=REASON or "needs Open MPI's mpirun")
def test_under_mpirun_eight_ranks_on_few_cores_accuse_no_link_but_host_cs(tmp_path):
    """8 MPI ranks on a small machine: waiting ranks that spin must not make healthy links read slow."""
    with netns.bridged_hosts(3, rates={2: "50mbit"}) as hosts:
        cmd, extra = netns.mpirun_across(hosts, [sys.executable, "-m", "ringpipe.cli", "doctor", "--json", "--size",
                                                 "256K"], tmp_path / "hostfile", (4, 2, 2))
        out = subprocess.run(cmd, capture_output=True, text=True, env={**netns.job_env(), "RINGPIPE_BACKEND": "mpi", **extra},
                             timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # A user strips the tag off the front of rank 0's lines and gets valid JSON: every line of the
    # indented report arrives whole, none cut with a tag in the middle.
    report = json.loads(netns.rank_lines(out.stdout, 0))
    assert report == _report(out.stdout)
    problems = _problems(report)
    assert [f["hosts"] for f in problems] == [["rp-host-c"]], problems
    assert problems[0]["what"].startswith("host rp-host-c's network link is slow")
    # every link that avoids c is far faster than c's (50 Mbit/s = 0.00625 GB/s)
    others = [x["gbps"] for x in report["links"] if x["src"] < 6 and x["dst"] < 6]
    assert min(others) > 10 * 0.00625, sorted(others)[:5]


CLOCK = str(Path(__file__).resolve().parents[2] / "scripts" / "doctor_clock.py")


@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.skipif(REASON is not None or shutil.which("mpirun") is None, reason=REASON or "needs Open MPI's mpirun")
def test_clock_offsets_under_mpirun_agree_on_every_rank_and_find_the_one_clock_the_hosts_share(tmp_path):
    """The namespace hosts run on one kernel, so their monotonic clocks are one clock: the true offset is 0.

    The estimate is within its own error bound: half the best round trip, which is shorter than
    the whole call (on a loaded machine a round trip under mpirun can take tens of ms, so no fixed
    figure is the bound). Every rank gets rank 0's table (sent point to point with quiet waits,
    not broadcast).
    """
    with netns.bridged_hosts(3) as hosts:
        cmd, extra = netns.mpirun_across(hosts, [sys.executable, CLOCK, "3"], tmp_path / "hostfile", (2, 1, 1))
        out = subprocess.run(cmd, capture_output=True, text=True, env={**netns.job_env(), "RINGPIPE_BACKEND": "mpi", **extra},
                             timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    text = netns.untagged(out.stdout)
    got = json.JSONDecoder().raw_decode(text, text.index("CLOCK ") + len("CLOCK "))[0]
    assert got["agreed"], got
    assert got["offsets_ns"][:2] == [0, 0]  # rank 1 shares rank 0's host: nothing to estimate
    # the last call's offsets; its duration (the slowest rank's) exceeds any of its round trips
    assert all(abs(o) <= got["ms"][-1] * 1e6 / 2 for o in got["offsets_ns"]), got
