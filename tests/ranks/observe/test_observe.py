"""Where the time goes: events gathered on one clock, the Chrome timeline, the profile table, the doctor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import netns
from ringpipe import collectives
from ringpipe.comm.events import Event
from ringpipe.launch import spawn
from ringpipe.observe.collect import JobEvents, RankEvents, collect_events, load_events, save_events
from ringpipe.observe.doctor import diagnose, late_ranks, link_findings, placement, ring_links
from ringpipe.observe.table import busy_ns, format_profile, profile
from ringpipe.observe.timeline import chrome_trace, write_timeline

MS = 1_000_000


def _ev(op, start_ms, end_ms, nbytes=4096, peer=-1, comm="world", **detail):
    return Event(op, nbytes, peer, int(start_ms * MS), int(end_ms * MS), 0, comm, detail)


def _job(per_rank_events, hosts=None, infos=None):
    hosts = hosts or ["h0"] * len(per_rank_events)
    infos = infos or [{} for _ in per_rank_events]
    return JobEvents([RankEvents(r, hosts[r], evs, infos[r]) for r, evs in enumerate(per_rank_events)],
                     {"backend": "gloo"})


# ----------------------------------------------------------------------------- pure analysis


def _allreduces(late_rank, n=10, size=3, late_ms=20.0):
    """n allreduces every 100 ms; ``late_rank`` enters each one ``late_ms`` after the others."""
    out = []
    for r in range(size):
        evs = []
        for k in range(n):
            t0 = 100.0 * k + (late_ms if r == late_rank else 0.1 * r)
            evs.append(_ev("allreduce", t0, 100.0 * k + late_ms + 2.0))
        out.append(evs)
    return out


def test_late_rank_is_named_with_its_lateness_and_the_cost_to_others():
    found = late_ranks(_job(_allreduces(late_rank=2)))
    assert len(found) == 1
    f = found[0]
    assert f.rank == 2 and f.severity == "problem"
    assert "last to enter in 10 of 10 calls" in f.evidence and "20.0 ms" in f.evidence
    assert "network is not the cause" in f.fix


def test_balanced_ranks_are_not_blamed():
    # Lateness of at most 0.2 ms and rotating: nobody is named.
    assert late_ranks(_job(_allreduces(late_rank=None))) == []


def test_too_few_calls_give_no_verdict():
    assert late_ranks(_job(_allreduces(late_rank=1, n=3))) == []


def test_a_single_rank_host_is_the_placement_problem_and_even_spreads_are_not():
    hosts = ["a"] * 4 + ["b"] * 3 + ["c"]
    found = placement(_job([[] for _ in hosts], hosts=hosts))
    f = found[0]
    assert f.severity == "problem" and f.what.startswith("placement 4-3-1: host c runs a single rank")
    assert f.hosts == ("c",) and "2.0x as long as with 3-3-2" in f.evidence and "3-3-2" in f.fix
    for shape in ([4, 2, 2], [3, 3, 2], [4, 4]):
        hosts = [h for h, n in zip("abc", shape, strict=False) for _ in range(n)]
        assert [f.severity for f in placement(_job([[] for _ in hosts], hosts=hosts))] == ["info"], shape


def test_oversubscribed_host_and_shared_binding():
    infos = [{"cpus": [0], "cpu_count": 8, "threads": 1} for _ in range(3)]
    found = placement(_job([[] for _ in range(3)], infos=infos))
    whats = " | ".join(f.what for f in found)
    assert "oversubscribed: 3 ranks x threads = 3 on 1 CPUs" in whats
    assert "ranks [0, 1, 2] on host h0 are bound to the same CPUs [0]" in whats
    fine = [{"cpus": [r], "cpu_count": 8, "threads": 1} for r in range(3)]
    assert placement(_job([[] for _ in range(3)], infos=fine)) == []


def test_slow_link_and_the_cost_of_crossing_hosts():
    hosts = ["a", "a", "b", "b"]
    job = _job([[] for _ in hosts], hosts=hosts)
    links = [
        {"src": 0, "dst": 1, "latency_us": 20, "gbps": 8.0},
        {"src": 2, "dst": 3, "latency_us": 20, "gbps": 8.0},
        {"src": 0, "dst": 2, "latency_us": 200, "gbps": 1.0},
        {"src": 0, "dst": 3, "latency_us": 200, "gbps": 1.0},
        {"src": 1, "dst": 2, "latency_us": 200, "gbps": 0.2},  # the bad cable
        {"src": 1, "dst": 3, "latency_us": 200, "gbps": 1.0},
    ]
    found = link_findings(job, links)
    slow = [f for f in found if f.what.startswith("slow link")]
    assert [f.what for f in slow] == ["slow link: rank 1 (a) <-> rank 2 (b)"]
    crossing = [f for f in found if "crossing hosts" in f.what]
    # Slower links between hosts than inside them are normal: information, not a problem.
    assert crossing[0].what == "crossing hosts costs 8.0x in bandwidth" and crossing[0].severity == "info"
    # Problems come first in the full diagnosis.
    sev = [f.severity for f in diagnose(job, links)]
    assert sev == sorted(sev, key=lambda s: s != "problem")


def _ring_job(gbps, late_ms=(), hosts=("a", "a", "b", "b"), reps=4, nbytes=1 << 20):
    """Ring allreduces on ``len(hosts)`` ranks, timed from per-hop bandwidths ``gbps[(src, dst)]``.

    Rank ``r`` starts each collective ``late_ms[r]`` late. In step ``s`` a rank receives from its
    predecessor once both have reached the step (the sender at the end of its step ``s - 1``),
    and the block takes ``nbytes / gbps`` on that hop: what the ring records.
    """
    p = len(hosts)
    late = list(late_ms) + [0.0] * (p - len(late_ms))
    events = [[] for _ in range(p)]
    t0 = 0.0
    for cid in range(1, reps + 1):
        done = {}
        for step in range(2 * (p - 1)):
            for r in range(p):
                pred = (r - 1) % p
                posted = t0 + late[r] if step == 0 else done[(r, step - 1)]
                sent = t0 + late[pred] if step == 0 else done[(pred, step - 1)]
                done[(r, step)] = max(posted, sent) + nbytes / gbps[(pred, r)] / MS
                events[r].append(_ev("allreduce.step", posted, done[(r, step)], nbytes=nbytes, peer=pred,
                                     collective="allreduce", cid=cid, step=step, algorithm="ring", reduce_ns=0))
        t0 = max(done.values()) + 10.0
    return _job(events, hosts=list(hosts))


def test_ring_links_measure_each_hop_from_the_runs_ring_steps():
    hops = {(0, 1): 8.0, (1, 2): 1.0, (2, 3): 8.0, (3, 0): 1.0}
    links = ring_links(_ring_job(hops))
    assert [(x["src"], x["dst"]) for x in links] == [(0, 1), (1, 2), (2, 3), (3, 0)]
    for x in links:
        assert x["gbps"] == pytest.approx(hops[(x["src"], x["dst"])], rel=1e-6) and x["samples"] == 24
    found = diagnose(_ring_job(hops))
    crossing = [f for f in found if "crossing hosts" in f.what]
    assert crossing[0].what == "crossing hosts costs 8.0x in bandwidth" and crossing[0].severity == "info"
    assert "from 96 collective steps of this job" in crossing[0].evidence  # 4 hops x 24 steps


def test_a_late_rank_does_not_make_its_links_look_slow():
    """Rank 2 starts every allreduce 50 ms late: its hops keep their bandwidth, no link is blamed."""
    hops = {(0, 1): 2.0, (1, 2): 2.0, (2, 3): 2.0, (3, 0): 2.0}
    job = _ring_job(hops, late_ms=(0, 0, 50.0), hosts=("h",) * 4)
    assert all(x["gbps"] == pytest.approx(2.0, rel=1e-6) for x in ring_links(job))
    assert not [f for f in diagnose(job) if "link" in f.what]


def test_a_slow_hop_is_named_from_the_runs_ring_steps():
    hops = {(r, (r + 1) % 6): 2.0 for r in range(6)} | {(2, 3): 0.2}
    found = diagnose(_ring_job(hops, hosts=("h",) * 6))
    slow = [f for f in found if f.what.startswith("slow link")]
    assert [f.what for f in slow] == ["slow link: rank 2 (h) <-> rank 3 (h)"]
    assert slow[0].severity == "problem" and "collective steps of this job" in slow[0].evidence
    assert any(f.what == "slowest ring hop: rank 2 <-> rank 3" for f in found)


def test_busy_time_counts_overlapping_operations_once():
    evs = [_ev("isend", 0, 10), _ev("irecv", 5, 12), _ev("allreduce", 20, 25)]
    assert busy_ns(evs) == 17 * MS


def test_profile_rows_per_operation_and_rank():
    r0 = [_ev("allreduce", 0, 4, nbytes=1024), _ev("allreduce.step", 1, 2, peer=1), _ev("send", 10, 11, peer=1)]
    r1 = [_ev("allreduce", 0, 6, nbytes=1024), _ev("recv", 9, 11, peer=0)]
    p = profile(_job([r0, r1]))
    ops = {row["op"]: row for row in p["ops"]}
    assert set(ops) == {"allreduce", "send", "recv"}  # steps belong to their call
    assert ops["allreduce"]["calls"] == 2 and ops["allreduce"]["max_rank"] == 1
    assert ops["allreduce"]["max_ms"] == pytest.approx(6.0) and ops["allreduce"]["min_ms"] == pytest.approx(4.0)
    assert p["ranks"][0]["in_flight_ms"] == pytest.approx(5.0) and p["ranks"][0]["wall_ms"] == pytest.approx(11.0)
    text = format_profile(_job([r0, r1]))
    assert "allreduce" in text and "1.0 KiB" in text and "in flight %" in text


def _user_and_internal(comm):
    from ringpipe.comm import comm_stats

    t = torch.ones(1 << 14)
    comm.allreduce(t)  # the communicator's own allreduce: one call, checked by a header exchange
    collectives.allreduce(comm, t, algorithm="ring")  # one call, made of messages between ranks
    other = 1 - comm.rank
    if comm.rank == 0:
        comm.send(t, other, tag=3)
    else:
        comm.recv(t, other, tag=3)
    mine, own = comm_stats(), comm_stats(internal=True)
    job = collect_events(comm)
    return mine, own, (format_profile(job) if job is not None else None)


def test_comm_stats_and_the_profile_show_ringpipes_own_calls_apart_from_the_programs(worlds):
    """The program made 2 allreduces and 1 send (rank 0) or recv (rank 1); everything else is ringpipe's.

    The ranks are forked from this process, whose record already holds a call: a new rank's
    record starts empty all the same.
    """
    from ringpipe.comm import default_log

    default_log().record("broadcast", 8, -1, 1, 2, 0, "world")  # the parent's, not the ranks'
    try:
        (mine0, own0, text), (mine1, _, _) = worlds.spawn(_user_and_internal, 2)
    finally:
        default_log().clear()
    assert set(mine0) == {"allreduce", "send"} and set(mine1) == {"allreduce", "recv"}
    assert mine0["allreduce"]["calls"] == 2 and mine0["send"]["calls"] == 1
    assert mine0["allreduce"]["bytes"] == 2 * 4 * (1 << 14)
    # start-up's hostname exchange, the consistency headers, the ring's messages and steps
    assert {"allgather_object", "allreduce.header", "isend", "irecv", "allreduce.step"} <= set(own0)
    assert "isend" not in mine0 and "allgather_object" not in mine0
    program, _, own = text.partition("ringpipe's own calls")
    assert own and "isend" in own and "allgather_object" in own
    assert "isend" not in program and "allgather_object" not in program and "allreduce" in program


HOROVOD_STYLE = """
import torch, ringpipe as hvd
from ringpipe.comm import comm_stats
hvd.init()
hvd.allreduce(torch.ones(1000), op=hvd.Sum)
mine, own = comm_stats(), comm_stats(internal=True)
print("stats", hvd.rank(), {k: [v["calls"], v["bytes"]] for k, v in mine.items()}, sorted(own), flush=True)
"""


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_horovod_style_calls_announcement_is_listed_as_ringpipes_own(tmp_path):
    """hvd.allreduce agrees on the call with a small header allreduce first: that one is not the program's."""
    (tmp_path / "prog.py").write_text(HOROVOD_STYLE)
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2", "prog.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    for r in range(2):
        assert f"stats {r} {{'allreduce': [1, 4000]}}" in out.stdout, out.stdout
    assert "'allreduce'" in out.stdout.split("stats 0", 1)[1].split("\n", 1)[0].split("}", 1)[1]


def test_chrome_trace_has_a_process_per_rank_and_steps_on_their_own_row(tmp_path):
    r0 = [_ev("allreduce", 1, 4), _ev("allreduce.step", 2, 3, peer=1, step=0, cid=5)]
    r1 = [_ev("allreduce", 1.5, 4)]
    job = _job([r0, r1], hosts=["a", "b"])
    trace = chrome_trace(job)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 @ a", 1: "rank 1 @ b"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0.0
    step = next(e for e in spans if e["name"] == "allreduce.step")
    call = next(e for e in spans if e["name"] == "allreduce" and e["pid"] == 0)
    assert step["tid"] != call["tid"] and step["args"]["cid"] == 5 and step["dur"] == pytest.approx(1000.0)
    path = write_timeline(tmp_path / "t.json", job)
    assert json.loads(path.read_text())["traceEvents"]


def test_events_file_round_trip_and_clear_errors(tmp_path):
    job = _job([[_ev("allreduce", 0, 1, cid=3)], [_ev("allreduce", 0, 2)]], infos=[{"compute_ms": 1.0}, {}])
    back = load_events(save_events(tmp_path / "ev.json", job))
    assert back.ranks[0].events == job.ranks[0].events and back.ranks[0].info == {"compute_ms": 1.0}
    with pytest.raises(FileNotFoundError, match="no such events file"):
        load_events(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match="not a ringpipe events file"):
        load_events(tmp_path / "other.json")


# ----------------------------------------------------------------------------- real processes


def _late_job(comm, late_rank):
    comm.log.clear()
    x = torch.ones(1024)
    for _ in range(8):
        if comm.rank == late_rank:
            time.sleep(0.05)  # this rank does more work between collectives
        comm.allreduce(x)
        collectives.allreduce(comm, x, "sum", algorithm="ring")
    job = collect_events(comm)
    if job is None:
        return None
    return job, [(f.rank, f.what) for f in diagnose(job)]


@pytest.mark.timeout(120)
def test_doctor_names_the_rank_that_keeps_the_others_waiting(tmp_path):
    # fresh ranks: which collective the late rank is found late at depends on the process's first calls
    job, findings = spawn(_late_job, 3, args=(1,))[0]
    late = [f for f in findings if "arrives late" in f[1]]
    # Rank 1 arrives last at the native allreduce; the ring allreduce right after it starts together.
    assert {rank for rank, _ in late} == {1}, findings
    assert "rank 1 (host " in late[0][1] and late[0][1].endswith("arrives late at allreduce (ring) of 4.0 KiB on world")
    assert {r.rank for r in job.ranks} == {0, 1, 2}
    steps = [e for e in job.ranks[0].events if e.op == "allreduce.step"]
    assert steps and all(e.detail["algorithm"] == "ring" for e in steps)
    trace = chrome_trace(job)
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1, 2}


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "RINGPIPE_BACKEND"):
        env.pop(k, None)
    return env


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_doctor_and_trace_commands(tmp_path):
    events = tmp_path / "ev.json"
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", "doctor", "-n", "2", "--size", "64K", "--json",
                          "--save-events", str(events), "--plot", str(tmp_path / "links.png")],
                         capture_output=True, text=True, env=_env(), timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ranks"] == 2 and len(report["compute_ms"]) == 2
    assert [(x["src"], x["dst"]) for x in report["links"]] == [(0, 1)]
    assert report["links"][0]["gbps"] > 0 and report["allreduce_ms"]["ring"] > 0
    assert (tmp_path / "links.png").stat().st_size > 0
    trace = subprocess.run([sys.executable, "-m", "ringpipe.cli", "trace", str(events), "-o",
                            str(tmp_path / "timeline.json")], capture_output=True, text=True, env=_env(), timeout=60)
    assert trace.returncode == 0, trace.stderr
    assert "Communication profile: 2 ranks on 1 host" in trace.stdout and "allreduce" in trace.stdout
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    offline = subprocess.run([sys.executable, "-m", "ringpipe.cli", "doctor", str(events)],
                             capture_output=True, text=True, env=_env(), timeout=60)
    assert offline.returncode == 0 and "ringpipe doctor: 2 ranks on 1 host(s)" in offline.stdout


REASON = netns.can_create()


@pytest.mark.netns
@pytest.mark.timeout(180)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_doctor_finds_the_slow_cross_host_links():
    """Two namespace hosts whose link is shaped to 200 Mbit/s: every cross-host link reads slower than the others."""
    env = _env()
    with netns.two_hosts(rate="200mbit") as (a, b):
        procs = []
        for node, host in enumerate((a, b)):
            cmd = [*host.prefix(), sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2", "--nnodes", "2",
                   "--node-rank", str(node), "--rdzv-endpoint", f"{a.addr}:29641", "-m", "ringpipe.cli",
                   "doctor", "--json", "--size", "1M", "--pairs", "all"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        outs = [p.communicate(timeout=150) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    line = next(x for x in outs[0][0].splitlines() if '"findings"' in x)
    report = json.loads(line.split(":", 1)[1] if not line.startswith("{") else line)
    assert report["hosts"] == ["rp-host-a", "rp-host-a", "rp-host-b", "rp-host-b"]
    crossing = [f for f in report["findings"] if "crossing hosts costs" in f["what"]]
    assert crossing and crossing[0]["severity"] == "info", report["findings"]
    cross = [x["gbps"] for x in report["links"] if (x["src"] < 2) != (x["dst"] < 2)]
    same = [x["gbps"] for x in report["links"] if (x["src"] < 2) == (x["dst"] < 2)]
    assert len(cross) == 4 and len(same) == 2 and max(cross) < min(same)


@pytest.mark.netns
@pytest.mark.timeout(180)
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_doctor_blames_the_cross_host_hops_from_a_runs_events(tmp_path):
    """No probe: ring allreduces over two hosts joined by a 200 Mbit/s link, then `ringpipe doctor EVENTS`: the
    cross-host hops read slower (with two hosts there is no third to tell a slow host from crossing hosts)."""
    env = _env()
    events = tmp_path / "events.json"
    script = str(Path(__file__).resolve().parents[2] / "scripts" / "ring_events.py")
    with netns.two_hosts(rate="200mbit") as (a, b):
        procs = []
        for node, host in enumerate((a, b)):
            cmd = [*host.prefix(), sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2", "--nnodes", "2",
                   "--node-rank", str(node), "--rdzv-endpoint", f"{a.addr}:29643", script, str(events),
                   str(1 << 20), "4"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        outs = [p.communicate(timeout=150) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", "doctor", "--json", str(events)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["hosts"] == ["rp-host-a", "rp-host-a", "rp-host-b", "rp-host-b"]
    hops = {(x["src"], x["dst"]): x["gbps"] for x in report["links"]}
    assert sorted(hops) == [(0, 1), (1, 2), (2, 3), (3, 0)], report["links"]
    assert max(hops[(1, 2)], hops[(3, 0)]) < min(hops[(0, 1)], hops[(2, 3)]), hops
    crossing = [f for f in report["findings"] if "crossing hosts costs" in f["what"]]
    assert crossing and crossing[0]["severity"] == "info", report["findings"]
