"""The cross-rank check: an inconsistent call raises the same error on every rank, on every path.

Each case of ``scripts/consistency_cases.py`` has the last rank call something else than the
others (another length, dtype, op, collective, shape of the same length, root, or an invalid
root). Without the check, gloo aborts the process, hangs or returns wrong numbers for these
(and so does MPI). With it, every rank raises the same error naming the ranks and what they
passed, and the next collective works.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from scripts.consistency_cases import CASES, PATHS, run_all

HERE = Path(__file__).resolve().parents[2]  # tests/: the helper scripts and modules
HAVE_MPI = shutil.which("mpirun") is not None and __import__("importlib").util.find_spec("mpi4py") is not None

#: What the text must name beyond the ranks, per case (the differing values).
NAMED = {
    "shape": ["1024", "1000"],
    "dtype": ["float32", "float64"],
    "op": ["max"],
    "collective": ["allgather", "allreduce"],
    "same_count": ["32, 32", "1024"],
    "root": ["1"],
    "bad_root": ["99"],
    "ag_trailing": ["4", "5"],
}


def _check(results: list[dict], size: int, paths=PATHS) -> None:
    for path in paths:
        for case in CASES:
            key = f"{path}/{case}"
            per_rank = [r[key] for r in results]
            names = {n for n, _, _ in per_rank}
            texts = {t for _, t, _ in per_rank}
            want = "InvalidCallError" if case == "bad_root" else "MismatchError"
            assert names == {want}, (key, per_rank)
            assert len(texts) == 1, (key, texts)  # the same text on every rank
            text = texts.pop()
            assert f"rank {size - 1}" in text, (key, text)
            if want == "MismatchError":
                assert "rank 0" in text, (key, text)
            for word in NAMED[case]:
                assert word in text, (key, word, text)
            assert all(after == size for _, _, after in per_rank), (key, per_rank)  # the world still works


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_path_refuses_inconsistent_calls_over_gloo(worlds, nprocs):
    results = worlds.spawn(run_all, nprocs)
    _check(results, nprocs)


@pytest.mark.timeout(600)
@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and mpi4py")
def test_every_path_refuses_inconsistent_calls_over_mpi(mpi_jobs):
    out = mpi_jobs.run("consistency")  # scripts/consistency_cases.py, CASES_DIR its folder
    results = [json.loads((out.folder / f"rank{r}.json").read_text()) for r in range(2)]
    _check(results, 2)


def _unchecked_opt_out(comm):
    t = torch.ones(8)
    with comm.unchecked():
        comm.allreduce(t)
    comm.check_calls = False
    comm.allreduce(t)
    return float(t[0])


def _checks_on(comm):
    return comm.check_calls


def test_opt_out_for_measured_hot_paths(worlds, monkeypatch):
    assert worlds.spawn(_unchecked_opt_out, 2) == [4.0, 4.0]
    assert worlds.spawn(_checks_on, 2) == [True, True]
    monkeypatch.setenv("RINGPIPE_CHECK_CALLS", "0")
    assert worlds.spawn(_checks_on, 2) == [False, False]


def _header_events(comm):
    from ringpipe.comm import default_log

    default_log().clear()
    comm.allreduce(torch.ones(4))
    return sorted({e.op for e in default_log().events()})


def test_the_check_is_recorded_beside_the_call(worlds):
    ops = worlds.spawn(_header_events, 2)[0]
    assert ops == ["allreduce", "allreduce.header"]


def test_a_mismatch_names_every_rank_call_in_order(worlds):
    text = worlds.spawn(_three_way, 3)
    assert len(set(text)) == 1
    assert re.search(r"rank 0: allreduce\(.*shape=\[8\].*\); rank 1: allreduce\(.*shape=\[8\].*\); "
                     r"rank 2: allreduce\(.*shape=\[9\]", text[0]), text[0]


def _three_way(comm):
    try:
        comm.allreduce(torch.ones(9 if comm.rank == 2 else 8))
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return ""
