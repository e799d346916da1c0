"""The elastic driver's pure parts against Horovod's documented rules: discovery lines, blacklist cooldown, ranks."""

import pytest

from ringpipe.launch.elastic_hosts import Blacklist, DiscoveryError, assign, parse_discovery


def test_discovery_lines_are_host_or_host_colon_slots():
    text = "node-a:4\n\n  node-b  \n10.0.0.3:2\nnode-a:8\n"
    # a host without slots gets --slots-per-host; a later line for a host replaces the earlier one
    assert parse_discovery(text, default_slots=2) == [("node-a", 8), ("node-b", 2), ("10.0.0.3", 2)]
    assert parse_discovery("h1\n") == [("h1", 1)]  # one slot when --slots-per-host is not given
    assert parse_discovery("") == []


@pytest.mark.parametrize("bad", ["h1:x", "h1:-1", "a b:2"])
def test_a_bad_discovery_line_is_named(bad):
    with pytest.raises(DiscoveryError, match="line 1"):
        parse_discovery(bad)


def test_blacklist_without_a_cooldown_range_is_for_ever():
    bl = Blacklist()
    bl.add("h1", now=0.0)
    assert bl.blocked("h1", 1e9) and not bl.blocked("h2", 0.0)


def test_blacklist_cooldown_grows_exponentially_within_the_range():
    # Horovod: delay = A * 2**n + uniform(0,1) * A, clamped to [A, B], after the n-th blacklisting
    bl = Blacklist((2, 30), uniform=lambda: 0.5)
    assert bl.add("h", now=100.0) == 100.0 + 2 * 2 + 0.5 * 2  # n = 1: 5 s
    assert bl.blocked("h", 104.9) and not bl.blocked("h", 105.0)
    assert bl.add("h", now=200.0) == 200.0 + 2 * 4 + 1  # n = 2: 9 s
    assert bl.add("h", now=300.0) == 300.0 + 17  # n = 3
    assert bl.add("h", now=400.0) == 400.0 + 30  # n = 4: 33 s, clamped to B
    assert bl.count("h") == 4
    with pytest.raises(ValueError):
        Blacklist((0, 5))


def test_first_world_fills_hosts_in_discovery_order():
    world = assign([], [("a", 2), ("b", 2)])
    assert [(p.host, p.slot, p.rank) for p in world] == [("a", 0, 0), ("a", 1, 1), ("b", 0, 2), ("b", 1, 3)]
    assert [(p.local_rank, p.local_size, p.cross_rank, p.cross_size, p.node) for p in world] == [
        (0, 2, 0, 2, 0), (1, 2, 0, 2, 0), (0, 2, 1, 2, 1), (1, 2, 1, 2, 1)]
    assert world[3].env()["HOROVOD_RANK"] == "3" and world[3].env()["HOROVOD_HOSTNAME"] == "b"


def test_survivors_keep_the_lowest_ranks_in_their_order_and_max_np_caps():
    previous = [("a", 0), ("b", 0), ("c", 0)]
    # host a removed: b's worker becomes rank 0, c's rank 1; the new host d comes after them
    world = assign(previous, [("b", 1), ("c", 1), ("d", 1)], host_order=["a", "b", "c", "d"])
    assert [p.key for p in world] == [("b", 0), ("c", 0), ("d", 0)]
    # a host discovered earlier but added later still comes after the survivors
    world = assign([("c", 0)], [("a", 2), ("c", 1)], max_np=2, host_order=["a", "c"])
    assert [p.key for p in world] == [("c", 0), ("a", 0)]
    # cross ranks: hosts that hold a local rank, in rank order
    world = assign([], [("a", 2), ("b", 1)])
    assert [(p.local_rank, p.cross_rank, p.cross_size) for p in world] == [(0, 0, 2), (1, 0, 1), (0, 1, 2)]


def test_discovery_runs_every_second_unless_the_environment_says_otherwise():
    from ringpipe.launch.elastic_driver import DISCOVERY_SECONDS, discovery_interval

    assert discovery_interval({}) == 1.0  # Horovod's DISCOVER_HOSTS_FREQUENCY_SECS
    assert discovery_interval({DISCOVERY_SECONDS: " "}) == 1.0
    assert discovery_interval({DISCOVERY_SECONDS: "0.2"}) == 0.2
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match=f"{DISCOVERY_SECONDS}='{bad}': give the seconds between two discoveries"):
            discovery_interval({DISCOVERY_SECONDS: bad})
