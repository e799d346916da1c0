"""The kept worlds themselves: results in rank order, one start for many checks, a failed rank's
traceback, a hung check timed out and the world restarted for the next."""

from __future__ import annotations

import os
import time

import pytest
import torch

from ranks.worlds import CheckTimeout, RankFailed
from ringpipe.launch import WorkerFailed


def _ranks_and_sum(comm, scale):
    t = torch.tensor([float(comm.rank + 1)])
    comm.allreduce(t, "sum")
    return comm.rank, comm.size, scale * t.item(), os.getpid()


def _fail_on_last(comm):
    if comm.rank == comm.size - 1:
        raise ValueError(f"rank {comm.rank} says no")
    return comm.rank


def _hang_on_first(comm):
    if comm.rank == 0:
        time.sleep(60)
    return comm.rank


def _env_of(comm):
    os.environ["WORLDS_TEST_LEAK"] = "1"
    return os.environ.get("WORLDS_TEST_SETTING"), os.environ["RANK"], os.environ["WORLD_SIZE"]


def _leaked(comm):
    return os.environ.get("WORLDS_TEST_LEAK")


@pytest.mark.parametrize("n", [2, 3])
def test_checks_run_on_every_rank_of_one_kept_world(worlds, n):
    first = worlds.spawn(_ranks_and_sum, n, args=(2.0,))
    again = worlds.spawn(_ranks_and_sum, n, args=(1.0,))
    total = n * (n + 1) / 2
    assert [(r, s, v) for r, s, v, _ in first] == [(r, n, 2 * total) for r in range(n)]
    assert [(r, s, v) for r, s, v, _ in again] == [(r, n, total) for r in range(n)]
    assert [pid for *_, pid in first] == [pid for *_, pid in again]  # the same processes
    assert worlds.world(n).starts == 1


def test_a_closure_travels_by_value(worlds):
    offset = 10
    assert worlds.spawn(lambda comm: comm.rank + offset, 2) == [10, 11]


def test_a_failed_rank_is_named_with_its_traceback_and_the_world_goes_on(worlds):
    with pytest.raises(RankFailed) as info:
        worlds.spawn(_fail_on_last, 3)
    assert isinstance(info.value, WorkerFailed) and info.value.rank == 2
    assert str(info.value).startswith("rank 2 failed: ValueError: rank 2 says no")
    assert "in _fail_on_last" in str(info.value) and "--- rank 2 ---" in str(info.value)
    starts = worlds.world(3).starts
    assert worlds.spawn(_ranks_and_sum, 3, args=(1.0,))[2][:3] == (2, 3, 6.0)
    assert worlds.world(3).starts == starts  # every rank answered: the same ranks go on


def test_a_hung_check_times_out_and_the_next_check_gets_a_fresh_world(worlds):
    world = worlds.world(2)
    worlds.spawn(_ranks_and_sum, 2, args=(1.0,))
    starts = world.starts
    t0 = time.monotonic()
    with pytest.raises(CheckTimeout, match=r"_hang_on_first did not finish within 2 s on rank\(s\) \[0\]"):
        worlds.spawn(_hang_on_first, 2, timeout=2)
    assert time.monotonic() - t0 < 30
    assert [r for r, *_ in worlds.spawn(_ranks_and_sum, 2, args=(1.0,))] == [0, 1]
    assert world.starts == starts + 1


def test_each_check_sees_its_own_environment_and_leaves_none_behind(worlds):
    got = worlds.spawn(_env_of, 2, env={"WORLDS_TEST_SETTING": "x"})
    assert got == [("x", "0", "2"), ("x", "1", "2")]
    assert worlds.spawn(_leaked, 2) == [None, None]
