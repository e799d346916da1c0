"""The doctor's probe, run by every rank of a job: compute, links, allreduce algorithms, the fix.

Measurements are taken one at a time while the other ranks wait in a *quiet* barrier
(:mod:`ringpipe.observe.quiet`: they poll with short sleeps instead of spinning, as Open MPI's
blocking calls do), so that on a machine with few cores the measured rank or pair is not slowed
by its waiting peers:

1. a compute probe on each rank in turn (a slow CPU, not contention, makes a rank slow);
2. latency and bandwidth of every pair of ranks (on large jobs: ring neighbours and one pair
   of each two hosts), the best of a few ping-pongs (contention only ever slows a transfer);
3. the ring, the hierarchical and the backend's own allreduce at the user's message size,
   interleaved, and, when a host's link is slow, a ring among the ranks of the other hosts;
4. with ``verify``, more interleaved runs of the ring and of the fix the timings favour.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ringpipe.comm.base import Communicator
from ringpipe.observe.collect import member_hosts
from ringpipe.observe.quiet import quiet_barrier, quiet_wait

__all__ = ["compute_probe", "run_probe", "quiet_barrier", "doctor_job", "probe_pairs"]

_PROBE_TAG = 7_100_000


def probe_pairs(hosts: list[str], all_pairs: bool) -> list[tuple[int, int]]:
    """Rank pairs to probe: every pair, or ring neighbours plus one pair of every two hosts."""
    size = len(hosts)
    if all_pairs:
        return [(a, b) for a in range(size) for b in range(a + 1, size)]
    pairs = {(min(r, (r + 1) % size), max(r, (r + 1) % size)) for r in range(size) if size > 1}
    first = {h: hosts.index(h) for h in dict.fromkeys(hosts)}
    firsts = sorted(first.values())
    pairs |= {(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1:]}
    return sorted(pairs)


def _pingpong(comm: Communicator, peer: int, buf: torch.Tensor, reps: int, first: bool) -> list[float]:
    """One-way times (s) of ``reps`` round trips of ``buf`` with ``peer`` (quiet waits under MPI)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for sending in ((True, False) if first else (False, True)):
            work = comm.isend(buf, peer, _PROBE_TAG) if sending else comm.irecv(buf, peer, _PROBE_TAG)
            quiet_wait(comm, work, longest=0.0002, spin=0.0003)
        times.append((time.perf_counter() - t0) / 2)
    return times


def compute_probe(reps: int = 3, n: int = 256, iters: int = 20) -> tuple[float, float]:
    """Best wall and best CPU time in ms of ``iters`` ``n x n`` matrix products (the same work on every rank).

    The CPU time (this thread's) is what the work costs on this rank's CPU; the wall time also
    holds the time the rank waited for a core while other processes ran.
    """
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    walls, cpus = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(iters):
            a = torch.tanh(a @ a / n)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return 1e3 * min(walls), 1e3 * min(cpus)


def compute_in_turn(comm: Communicator, retries: int = 4) -> tuple[float, float]:
    """This rank's :func:`compute_probe` (wall ms, CPU ms), each rank timed alone while the others wait quietly.

    A rank 1.5x slower than the median in CPU time is timed again (up to ``retries`` times, best
    kept): a moment when another process shared the core (or its hyperthread) is gone the next
    time, a slow CPU is not.
    """
    wall, cpu = float("inf"), float("inf")
    todo = list(range(comm.size))
    for _ in range(1 + retries):
        for r in todo:
            quiet_barrier(comm)
            if comm.rank == r:
                w, c = compute_probe()
                wall, cpu = min(wall, w), min(cpu, c)
        quiet_barrier(comm)
        every = comm.allgather_object(cpu) if comm.size > 1 else [cpu]
        med = statistics.median(every)
        todo = [r for r, t in enumerate(every) if t >= 1.5 * med]
        if not todo:
            break
    return wall, cpu


def _measure(comm: Communicator, a: int, b: int, small: torch.Tensor, big: torch.Tensor) -> dict[str, Any] | None:
    """One link's latency and bandwidth; the lower rank of the pair returns it."""
    if comm.rank not in (a, b):
        return None
    peer, first = (b, True) if comm.rank == a else (a, False)
    _pingpong(comm, peer, small, 2, first)  # connect and warm up
    lat = statistics.median(_pingpong(comm, peer, small, 10, first))
    bw_t = min(_pingpong(comm, peer, big, 3, first))
    if not first:
        return None
    return {"src": a, "dst": b, "latency_us": 1e6 * lat, "gbps": big.numel() * 4 / max(bw_t, 1e-12) / 1e9}


def _suspects(hosts: list[str], links: list[dict[str, Any]], slow: float, groups_too: bool) -> list[tuple[int, int]]:
    """Links worth measuring again: rank pairs below ``slow`` times the median of their host pair,
    and (``groups_too``) every pair of a host pair whose median is below ``slow`` times the
    fastest host pair's (a burst of other work during that host pair's turn reads as a slow path)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for x in links:
        groups.setdefault(tuple(sorted((hosts[x["src"]], hosts[x["dst"]]))), []).append(x)
    meds = {k: statistics.median(x["gbps"] for x in group) for k, group in groups.items()}
    out = set()
    for k, group in groups.items():
        out |= {(x["src"], x["dst"]) for x in group if x["gbps"] < slow * meds[k]}
        if groups_too and meds[k] < slow * max(meds.values()):
            out |= {(x["src"], x["dst"]) for x in group}
    return sorted(out)


def run_probe(comm: Communicator, nbytes: int = 4 << 20, all_pairs: bool | None = None,
              retries: int = 6) -> list[dict[str, Any]]:
    """Measure links pair by pair (one pair at a time); every rank calls it and gets all links.

    All pairs on up to 8 ranks, ring neighbours and one pair per two hosts above. Each link: the
    median one-way latency of 8-byte messages and the bandwidth of the best of three ``nbytes``
    ping-pongs, as seen by the lower rank of the pair. A link far slower than the others of its
    host pair is measured again (up to ``retries`` times, best kept, after pauses that double
    from 50 ms, 3 s in all, so that a burst of other work can pass), and so is every link of a
    host pair far slower than the fastest (twice): a moment of contention passes, a bad link
    stays slow. On a machine with far more runnable processes than cores, a healthy pair still
    read ten times slower than its peers three times running now and then, and with 50 ms pauses
    two pairs stayed 14x slow (with 2 ms latencies: time slices) through all six retries, which
    fell inside one burst of other jobs' work; a shaped link never read fast.
    """
    from ringpipe.observe.links import SLOW

    if all_pairs is None:
        all_pairs = comm.size <= 8
    small = torch.zeros(2, dtype=torch.float32)
    big = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    hosts = member_hosts(comm)
    todo = probe_pairs(hosts, all_pairs)
    best: dict[tuple[int, int], dict[str, Any]] = {}
    for attempt in range(1 + retries):
        mine = []
        for a, b in todo:
            link = _measure(comm, a, b, small, big)
            if link is not None:
                mine.append(link)
            quiet_barrier(comm)
        for part in comm.allgather_object(mine):
            for x in part:
                key = (x["src"], x["dst"])
                if key not in best or x["gbps"] > best[key]["gbps"]:
                    best[key] = x
        links = [best[k] for k in sorted(best)]
        todo = _suspects(hosts, links, SLOW, groups_too=attempt < 2)
        if not todo or attempt == retries:
            break
        time.sleep(0.05 * 2 ** attempt)
    return [best[k] for k in sorted(best)]


def _allreduce(comm: Communicator, name: str, x: torch.Tensor) -> None:
    from ringpipe import collectives

    if name == "native":
        comm.allreduce(x, "sum")
    else:
        collectives.allreduce(comm, x, "sum", algorithm=name)


def _time(world: Communicator, sub: Communicator | None, name: str, x: torch.Tensor) -> float:
    """Seconds of one allreduce ``name`` on ``sub`` (0 on ranks outside it); every world rank calls it."""
    quiet_barrier(world)
    t0 = time.perf_counter()
    if sub is not None:
        _allreduce(sub, name, x)
    return time.perf_counter() - t0 if sub is not None else 0.0


def doctor_job(comm: Communicator, nbytes: int, reps: int, all_pairs: bool | None,
               verify: int = 0) -> dict[str, Any] | None:
    """The probe every rank runs (see the module docstring); rank 0 gets the result, the others None."""
    from ringpipe.observe.collect import collect_events
    from ringpipe.observe.doctor import ALGORITHMS, candidate, diagnose, without_key
    from ringpipe.observe.links import slow_hosts

    comm.log.clear()
    quiet_barrier(comm)
    phases: dict[str, float] = {}
    clock = [time.perf_counter()]

    def phase(name: str) -> None:  # seconds each part of the probe took (on this rank)
        clock.append(time.perf_counter())
        phases[name] = round(clock[-1] - clock[-2], 3)

    compute_ms, compute_cpu_ms = compute_in_turn(comm)
    phase("compute")
    links = run_probe(comm, nbytes, all_pairs) if comm.size > 1 else []
    phase("links")
    hosts = member_hosts(comm)
    x = torch.ones(max(1, nbytes // 4))
    names = [a for a in ALGORITHMS if a != "hierarchical" or len(set(hosts)) > 1]
    subs: dict[str, Communicator | None] = {name: comm for name in names}
    # A slow host (every rank sees the same links, so all agree): time the ring without it.
    from ringpipe.observe.collect import JobEvents, RankEvents

    shape = JobEvents([RankEvents(r, h, []) for r, h in enumerate(hosts)])
    for h in slow_hosts(shape, links) if comm.size > 1 else []:
        others = [r for r, host in enumerate(hosts) if host != h]
        if len(others) > 1:
            subs[without_key(h)] = comm.split(others, name=f"doctor-without-{h}")
    times: dict[str, list[float]] = {k: [] for k in subs}
    for _ in range(reps):
        for key, sub in subs.items():
            times[key].append(_time(comm, sub, "ring" if key.startswith("without ") else key, x))
    every = comm.allgather_object({k: min(v) for k, v in times.items()})
    allreduce_ms = {k: 1e3 * max(s[k] for s in every) for k in times}
    phase("allreduce")
    verified = None
    fix = candidate(allreduce_ms, slow_hosts(shape, links)) if verify > 0 else None
    if fix is not None:
        before, after = [], []
        for _ in range(verify):
            before.append(_time(comm, comm, "ring", x))
            after.append(_time(comm, subs.get(fix, comm), "ring" if fix.startswith("without ") else fix, x))
        runs = comm.allgather_object((before, after))
        b = statistics.median(max(r[0][i] for r in runs) for i in range(verify))
        a = statistics.median(max(r[1][i] for r in runs) for i in range(verify))
        verified = {"fix": fix, "runs": verify, "before_ms": 1e3 * b, "after_ms": 1e3 * a}
    phase("verify")
    job = collect_events(comm, info={"compute_ms": compute_ms, "compute_cpu_ms": compute_cpu_ms,
                                     "threads": torch.get_num_threads()})
    phase("collect")
    if job is None:
        return None
    phases["clock_offsets"] = round(max(r.info.get("clock_sync_ms", 0.0) for r in job.ranks) / 1e3, 3)
    findings = diagnose(job, links, allreduce_ms, nbytes, verified, lateness=False)
    return {"job": job, "links": links, "findings": findings, "allreduce_ms": allreduce_ms, "verified": verified,
            "phases_s": phases}
