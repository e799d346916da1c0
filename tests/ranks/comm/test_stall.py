"""The stall inspector: a rank waiting too long in a communication says what the other ranks do."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from ringpipe.comm.events import EventLog
from ringpipe.comm.rendezvous import stall_inspector
from ringpipe.comm.stall import StallInspector, describe

LATE_RANK = Path(__file__).resolve().parents[2] / "scripts" / "stall_late_rank.py"
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None


def late_rank_reports(stdout: str, size: int) -> dict[int, list[str]]:
    """The reports each rank of ``scripts/stall_late_rank.py`` printed (``--tag-output`` prefixes allowed)."""
    # Not line by line: Open MPI's --tag-output can join two ranks' lines, or glue the next tag on.
    out = {}
    decoder = json.JSONDecoder()
    for m in re.finditer(r"stall-reports (\d+) ", stdout):
        out[int(m.group(1))] = decoder.raw_decode(stdout, m.end())[0]
    assert sorted(out) == list(range(size)), stdout
    return out


def assert_late_rank_named(reports: dict[int, list[str]], size: int) -> None:
    late = size - 1
    assert reports[late] == []  # the late rank never waited
    for rank in range(late):
        assert reports[rank], reports
        text = reports[rank][0]
        assert text.startswith(f"rank {rank} has waited") and "in allreduce (4.0 KiB) on world" in text
        # The late rank's real idle time: it has not communicated since before the others began to wait.
        # (a waiting rank whose state was not published yet at this first report is listed there too, before it)
        idle = re.search(rf"not in any communication: (?:rank \d+ \(no report from it\), )*rank {late} for "
                         rf"([0-9.]+) s \(still computing", text)
        assert idle and float(idle.group(1)) >= 1.0, text
        for other in range(late):  # every waiting rank published its state (by the second report)
            if other != rank:
                assert any(f"rank {other} in allreduce (4.0 KiB) on world" in t for t in reports[rank]), reports


def _state(op, waiting_s=70.0, comm="world", nbytes=4 << 20, peer=-1):
    return {"state": "waiting", "op": op, "bytes": nbytes, "peer": peer, "comm": comm, "waiting_s": waiting_s}


def test_message_names_waiting_and_idle_ranks_with_their_real_idle_time():
    others = {1: _state("allreduce", 60), 2: {"state": "idle", "since": 1000.0}, 3: {"state": "ok"}, 4: None}
    text = describe(0, _state("allreduce", 61), others, 60, now=1011.0)
    assert text.startswith("rank 0 has waited 61 s in allreduce (4.0 MiB) on world")
    assert "waiting too: rank 1 in allreduce (4.0 MiB) on world (60 s)" in text
    assert ("not in any communication: rank 2 for 11 s, rank 3 for less than 30 s, rank 4 (no report from it) "
            "(still computing") in text
    assert "different collectives" not in text


def test_an_idle_rank_publishes_since_when_it_is_out_of_communication():
    class Store(dict):
        def set(self, k, v):
            self[k] = v

    store = Store()
    log = EventLog()
    ev = log.begin("allreduce", 4096, -1, 0, "world")
    EventLog.end(ev)
    inspector = StallInspector(1, 2, log, seconds=0.2, store=store)
    assert inspector.check() is None and "ringpipe/stall/1" not in store  # idle for less than 0.1 s
    time.sleep(0.35)
    inspector.check()
    state = json.loads(store["ringpipe/stall/1"])
    assert state["state"] == "idle" and time.time() - state["since"] >= 0.35


def test_message_names_collectives_called_in_different_orders():
    text = describe(0, _state("allreduce"), {1: _state("barrier", nbytes=0)}, 60)
    assert "rank 1 in barrier (0 B) on world" in text
    assert "the ranks wait in different collectives" in text


def test_inspector_reports_an_old_operation_in_flight_once():
    log = EventLog()
    inspector = StallInspector(0, 2, log, seconds=0.2)
    assert inspector.check() is None
    ev = log.begin("recv", 4096, 1, 0, "world")
    time.sleep(0.3)
    text = inspector.check()
    assert text is not None and "in recv (4.0 KiB) on world with rank 1" in text
    assert inspector.check() is None  # reported again only after another `seconds`
    EventLog.end(ev)
    assert inspector.check() is None and inspector.reports == [text]


def _late_rank(comm):
    if comm.rank == 2:
        time.sleep(3.0)  # rank 2 computes while the others already wait in the allreduce
    comm.allreduce(torch.ones(1024))
    inspector = stall_inspector()
    return list(inspector.reports) if inspector else None


@pytest.mark.timeout(120)
def test_ranks_waiting_for_a_late_rank_name_it(worlds):
    reports = worlds.spawn(_late_rank, 3, env={"RINGPIPE_STALL_CHECK_SECONDS": "1"})
    assert_late_rank_named(dict(enumerate(reports)), 3)


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_mpi_backend_late_rank_is_named(mpi_jobs):
    """Under MPI (no c10d store) rank 0 serves a store for the inspector: the warnings still name the late rank."""
    out = mpi_jobs.run("stall")  # scripts/stall_late_rank.py with RINGPIPE_STALL_CHECK_SECONDS=1
    assert_late_rank_named(late_rank_reports(out.stdout, 3), 3)
