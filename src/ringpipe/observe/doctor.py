"""The doctor: explains locality anomalies — which rank, host or link makes collectives slow.

Seed 000 found that the same ring allreduce on 8 ranks ran at different speeds with ranks
placed 4-2-2 or 4-3-1 over three hosts, and suspected NUMA, binding and links. The doctor
turns those suspicions into measurements and names the culprit:

- **late ranks** (from any job's events): the rank that enters collectives last, again and
  again, while the others wait for it. That is load imbalance or a slow process, not the
  network, and no collective algorithm can fix it. Work a program declares as expected
  (:mod:`ringpipe.observe.regions`: a trainer's checkpoints and logs on rank 0) is discounted.
- **placement** (:mod:`ringpipe.observe.placement`): a placement that a ring pays for (a host
  with a single rank), oversubscribed cores, ranks bound to the same CPUs.
- **links** (:mod:`ringpipe.observe.links`): a host whose link is slow, a slow path between two
  hosts, a slow rank pair; from a probe or from the run's own collective steps.
- **compute** (from a probe): a rank much slower at the same matrix product than the others.
- **fixes**: what the probe's own timings favour at the probed message size (the hierarchical
  or the backend's own allreduce, leaving a slow host out), with the figures.

:func:`diagnose` is pure (events, links and timings in, findings out); the collective probe is
in :mod:`ringpipe.observe.probe`.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ringpipe.comm.events import human_bytes
from ringpipe.observe.collect import JobEvents
from ringpipe.observe.finding import Finding
from ringpipe.observe.links import link_findings, ring_links, run_links, slow_hosts, step_links
from ringpipe.observe.placement import busy_hosts, placement
from ringpipe.observe.regions import EXPECTED_OP

__all__ = ["ANALYZERS", "FIGURES", "Finding", "diagnose", "register_analyzer", "register_figures", "figures", "late_ranks", "placement", "link_findings", "ring_links", "step_links",
           "run_links", "compute_findings", "recommend", "format_report", "COLLECTIVE_OPS", "ALGORITHMS"]

COLLECTIVE_OPS = ("allreduce", "iallreduce", "allgather", "broadcast", "reduce", "reduce_scatter", "alltoall", "barrier")
#: The allreduce algorithms the probe times against each other.
ALGORITHMS = ("ring", "hierarchical", "native")
#: An alternative is recommended when it is at least this much faster than the ring.
BETTER = 1.2


# ----------------------------------------------------------------------------- late ranks


def _expected(job: JobEvents) -> list[list[tuple[int, int]]]:
    """Per rank, the intervals of declared expected work."""
    return [sorted((e.start_ns, e.end_ns) for e in r.events if e.op == EXPECTED_OP) for r in job.ranks]


def _pipeline_stages(job: JobEvents) -> list[int | None]:
    """Per rank, the pipeline stage it ran (the ``stage`` of its ``pipeline.S`` step events), or None."""
    return [next((e.detail.get("stage") for e in reversed(r.events) if e.op == "pipeline.S"), None)
            for r in job.ranks]


def _overlap(intervals: Sequence[tuple[int, int]], lo: int, hi: int) -> int:
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b in intervals if a < hi and b > lo)


def _sequences(job: JobEvents) -> dict[tuple[str, str, int], dict[int, list[tuple[int, int]]]]:
    """Collective calls per (communicator, operation and algorithm, bytes), per rank, in call order.

    Calls of different sizes are different sequences, and ringpipe's own calls (marked internal
    at the choke point) are named as such: a library's own small bookkeeping collectives (an
    announcement before each data allreduce) are then judged apart from the program's data
    collectives instead of diluting them.
    """
    calls: dict[tuple[str, str, int], dict[int, list[tuple[int, int]]]] = defaultdict(dict)
    for rank_events in job.ranks:
        # A call arrives when it starts its consistency header, which may be recorded apart, before it.
        header: dict[tuple[str, str], int] = {}
        for e in rank_events.events:
            op, _, part = e.op.partition(".")
            if part == "header" and op in COLLECTIVE_OPS:
                header.setdefault((e.comm, op), e.start_ns)
            elif e.op in COLLECTIVE_OPS:
                algo = e.detail.get("algorithm")
                name = f"{e.op} ({algo})" if algo else e.op
                if e.detail.get("internal"):
                    name += " (ringpipe's own)"
                start = min(e.start_ns, header.pop((e.comm, e.op), e.start_ns))
                calls[(e.comm, name, e.nbytes)].setdefault(rank_events.rank, []).append((start, e.end_ns))
    return calls


def _work_between(job: JobEvents, rank: int, lo: int, hi: int, expected: Sequence[tuple[int, int]]) -> float:
    """Milliseconds ``rank`` spent outside communication and declared expected work in ``[lo, hi]``."""
    spans = [(max(e.start_ns, lo), min(e.end_ns, hi)) for e in job.ranks[rank].events
             if "." not in e.op and e.op != EXPECTED_OP and e.start_ns < hi and e.end_ns > lo]
    spans += [(max(a, lo), min(b, hi)) for a, b in expected if a < hi and b > lo]
    busy, end = 0, lo
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return max(0, hi - lo - busy) / 1e6


def _late_finding(job: JobEvents, r: int, what: str, comm: str, evidence: str) -> Finding:
    host = job.ranks[r].host
    return Finding(
        "problem", f"rank {r} (host {host}) arrives late at {what} on {comm}", evidence,
        f"the network is not the cause: rank {r} does more work between collectives. Look for "
        "uneven data or model shards, a slower or oversubscribed CPU on its host, data loading "
        "or file I/O on that rank only (mark work a rank does alone by design with "
        "ringpipe.observe.expected_work), or other jobs on that host",
        rank=r, hosts=(host,),
    )


def late_ranks(job: JobEvents, min_calls: int = 5, min_late_ms: float = 1.0, share: float = 0.1) -> list[Finding]:
    """Ranks that keep the others waiting at the same collectives, from the job's events.

    The k-th call of an operation of one size on a communicator is the same collective on every
    rank (ranks call collectives in one order). Two views of the same fault:

    - **arrival**: a rank's arrival is counted without the expected work it declared since its
      previous call of that sequence. A rank is late when it is the last to arrive in at least
      75 % of at least ``min_calls`` calls, by a median of ``min_late_ms`` or more and at least
      three times the median lateness of the other ranks.
    - **work between calls**: the time a rank spent outside any communication (and outside its
      declared expected work) since its previous call. Arrival times also carry when each rank
      left the previous collective, which scheduling scatters on a machine with fewer cores
      than ranks (MPI ranks that spin while they wait); the work between calls does not. A rank
      is late when it works more than the other ranks' median in at least 75 % of the
      intervals, and its median work exceeds theirs by ``min_late_ms`` or more and by at least
      half of it. Compared with the others' median, not with their largest: on a machine busy
      with other jobs, another rank that waited for a core now and then works the most in a few
      intervals (in 3 of 9 once, on 8 ranks sharing 2 busy cores), which must not hide a rank
      that works more in nearly all of them.

    Collectives among ranks of different pipeline stages (the gradient sum of a weight tied
    across stages) are not judged here: their ranks arrive in the schedule's order (in 1F1B the
    first stage's last backward ends last), which the pipeline doctor explains with the bubble.

    The time the others waited for it must be at least ``share`` of the calls' span (a
    millisecond of scheduling noise per call is no fault); for the work between calls, a fifth of
    that: its consistency already rules noise out, and when ranks that spin make every call slow,
    the wait for a late rank is a smaller part of a longer span. Named once per rank, at the
    sequence where it kept the others waiting longest.
    """
    expected = _expected(job)
    stages = _pipeline_stages(job)
    best: dict[int, tuple[float, Finding]] = {}
    for (comm, op, nbytes), per_rank in sorted(_sequences(job).items()):
        if len(per_rank) < 2 or len({stages[r] for r in per_rank}) > 1:
            continue
        ranks = sorted(per_rank)
        n = min(len(v) for v in per_rank.values())
        if n < min_calls:
            continue
        late: dict[int, list[float]] = {r: [] for r in ranks}
        work: dict[int, list[float]] = {r: [] for r in ranks}
        last: Counter[int] = Counter()
        above: Counter[int] = Counter()
        waited: defaultdict[int, float] = defaultdict(float)
        worked_over: defaultdict[int, float] = defaultdict(float)
        excused = 0
        for k in range(n):
            arrivals = {}
            for r in ranks:
                start = per_rank[r][k][0]
                since = per_rank[r][k - 1][1] if k else 0
                arrivals[r] = start - _overlap(expected[r], since, start)
                if k:
                    work[r].append(_work_between(job, r, since, start, expected[r]))
            excused += any(arrivals[r] != per_rank[r][k][0] for r in ranks)
            first = min(arrivals.values())
            order = sorted(ranks, key=lambda r: arrivals[r])
            last[order[-1]] += 1
            waited[order[-1]] += (arrivals[order[-1]] - arrivals[order[-2]]) / 1e9
            for r in ranks:
                late[r].append((arrivals[r] - first) / 1e6)
            if k:
                for r in ranks:
                    typical = statistics.median(work[q][-1] for q in ranks if q != r)
                    above[r] += work[r][-1] > typical
                    worked_over[r] += max(0.0, work[r][-1] - typical) / 1e3
        span = (max(per_rank[r][n - 1][1] for r in ranks) - min(per_rank[r][0][0] for r in ranks)) / 1e9
        what = f"{op} of {human_bytes(nbytes)}" if op != "barrier" else op
        note = f"; declared expected work discounted in {excused} calls" if excused else ""
        if op.endswith("(ringpipe's own)"):
            note += ("; this is ringpipe's own small collective that precedes the program's (a Horovod-style "
                     "call's announcement), so the rank is late for the program's collectives")
        for r in ranks:
            med = statistics.median(late[r])
            others = statistics.median([x for q in ranks if q != r for x in late[q]])
            if last[r] >= 0.75 * n and med >= min_late_ms and med >= 3 * others and waited[r] >= share * span:
                f = _late_finding(job, r, what, comm, (
                    f"last to enter in {last[r]} of {n} calls, a median {med:.1f} ms after the first rank "
                    f"(other ranks: {others:.2f} ms); the others waited {waited[r]:.3f} s for it in total" + note))
                if r not in best or waited[r] > best[r][0]:
                    best[r] = (waited[r], f)
                continue
            mine = statistics.median(work[r])
            theirs = statistics.median([x for q in ranks if q != r for x in work[q]])
            if (above[r] >= 0.75 * (n - 1) and mine - theirs >= max(min_late_ms, 0.5 * theirs)
                    and worked_over[r] >= share / 5 * span):
                f = _late_finding(job, r, what, comm, (
                    f"between its calls it worked a median {mine:.1f} ms outside communication against {theirs:.1f} "
                    f"ms for the other ranks (more than their median in {above[r]} of {n - 1} intervals); the "
                    f"others waited about {worked_over[r]:.3f} s for it in total" + note))
                if r not in best or worked_over[r] > best[r][0]:
                    best[r] = (worked_over[r], f)
    return [best[r][1] for r in sorted(best)]


# ----------------------------------------------------------------------------- compute


def _timed(key: str) -> str:
    return "CPU time, each rank timed alone" if key == "compute_cpu_ms" else "each rank timed alone"


def compute_findings(job: JobEvents, slow_factor: float = 1.5, min_ms: float = 2.0) -> list[Finding]:
    """Ranks whose compute probe took ``slow_factor`` times the median or longer (and ``min_ms`` more).

    Judged on CPU time where the probe recorded it (``compute_cpu_ms``): the wall time also holds
    the time a rank waited for a core, which on a machine busy with other processes strikes
    ranks at random, and an innocent rank must not be named for it. When every rank of a host
    (two or more) is slow, the host is named once: its CPUs are slow, which no rank of it can
    fix alone.
    """
    key = "compute_cpu_ms" if all("compute_cpu_ms" in r.info for r in job.ranks) else "compute_ms"
    times = {r.rank: r.info[key] for r in job.ranks if key in r.info}
    if len(times) < 2:
        return []
    med = statistics.median(times.values())
    slow = {r for r, t in times.items() if t >= slow_factor * med and t - med >= min_ms}
    found: list[Finding] = []
    for host in dict.fromkeys(job.hosts()):
        ranks = [r.rank for r in job.ranks if r.host == host]
        if len(ranks) < 2 or not set(ranks) <= slow or len(ranks) == len(times):
            continue
        slow -= set(ranks)
        found.append(Finding(
            "problem", f"the ranks of host {host} compute slowly",
            f"the same matrix products took {', '.join(f'{times[r]:.1f}' for r in ranks)} ms on ranks "
            f"{ranks} against a median of {med:.1f} ms ({_timed(key)})",
            f"{host}'s CPUs are slower, throttled or their hyperthreads busy with other work (lscpu, top, "
            f"numactl --show on {host}); move the job's ranks off {host} until it is fixed",
            hosts=(host,),
        ))
    return found + [
        Finding(
            "problem",
            f"rank {r} (host {job.ranks[r].host}) computes slowly",
            f"the same matrix products took {times[r]:.1f} ms against a median of {med:.1f} ms ({_timed(key)})",
            "its CPU is slower, throttled, shares a hyperthread with other work, or its memory is on another "
            "NUMA node (numactl --show; bind ranks with mpirun --bind-to core --map-by socket)",
            rank=r, hosts=(job.ranks[r].host,),
        )
        for r in sorted(slow)
    ]


# ----------------------------------------------------------------------------- measured fixes


def without_key(host: str) -> str:
    """The timing key of an allreduce among the ranks of every host but ``host``."""
    return f"without {host}"


def candidate(allreduce_ms: Mapping[str, float], slow: Sequence[str]) -> str | None:
    """The fix the timings favour: leaving a slow host out, else the fastest algorithm if clearly faster."""
    for h in slow:
        if without_key(h) in allreduce_ms:
            return without_key(h)
    algos = {k: v for k, v in allreduce_ms.items() if k in ALGORITHMS}
    if "ring" not in algos or len(algos) < 2:
        return None
    best = min(algos, key=lambda k: algos[k])
    return best if best != "ring" and algos["ring"] >= BETTER * algos[best] else None


def recommend(job: JobEvents, allreduce_ms: Mapping[str, float], nbytes: int, links: Sequence[dict[str, Any]],
              verified: Mapping[str, Any] | None = None) -> list[Finding]:
    """The fix the probe's own allreduce timings favour at ``nbytes``, with before/after figures."""
    if not allreduce_ms or "ring" not in allreduce_ms:
        return []
    size = human_bytes(nbytes)
    fix = candidate(allreduce_ms, slow_hosts(job, links))
    check = ""
    if verified:
        b, a = verified["before_ms"], verified["after_ms"]
        check = (f"; verified with {verified['runs']} more interleaved runs: {b:.2f} ms before, {a:.2f} ms after "
                 f"({b / max(a, 1e-9):.1f}x)")
    ring = allreduce_ms["ring"]
    if fix is None:
        others = ", ".join(f"{k} {v:.2f} ms" for k, v in allreduce_ms.items() if k != "ring")
        return [Finding("info", f"the ring allreduce is as fast as the alternatives at {size}",
                        f"this probe: ring {ring:.2f} ms; {others} (none is {BETTER:g}x faster)" + check)]
    t = allreduce_ms[fix]
    if fix.startswith("without "):
        host = fix.removeprefix("without ")
        left = sum(h != host for h in job.hosts())
        return [Finding(
            "fix", f"leave host {host} out until its link is fixed",
            f"this probe: a ring allreduce of {size} among the {left} ranks of the other hosts took {t:.2f} ms "
            f"against {ring:.2f} ms with {host} ({ring / max(t, 1e-9):.1f}x faster)" + check,
            f"start the job on the other hosts only (or move {host}'s ranks to them) until {host}'s link is fixed",
            hosts=(host,),
        )]
    name = "the backend's own allreduce" if fix == "native" else f"the {fix} allreduce"
    return [Finding(
        "fix", f"use {name} (algorithm='{fix}') for allreduces of about {size}",
        f"this probe: {fix} {t:.2f} ms against ring {ring:.2f} ms ({ring / max(t, 1e-9):.1f}x faster)"
        + "".join(f", {k} {v:.2f} ms" for k, v in allreduce_ms.items() if k not in (fix, "ring")) + check,
        f"ringpipe.allreduce(..., algorithm='{fix}'), or `ringpipe train --set dp.algorithm={fix}`; measured at "
        f"{size} only: probe again with --size at your gradient bucket size",
    )]


# ----------------------------------------------------------------------------- the diagnosis


#: More analyses of a job's events, registered by the layers above (the pipeline doctor,
#: :mod:`ringpipe.pipeline.diagnosis`); each returns its findings, or none when the job is not its kind.
ANALYZERS: list[Callable[[JobEvents], list[Finding]]] = []


def register_analyzer(fn: Callable[[JobEvents], list[Finding]]) -> Callable[[JobEvents], list[Finding]]:
    """Add ``fn`` to the analyses :func:`diagnose` runs (once, however often it is registered)."""
    if fn not in ANALYZERS:
        ANALYZERS.append(fn)
    return fn


#: The figures behind those analyses, for ``ringpipe doctor --json``: ``(key, function)`` pairs registered by the
#: same layers; each function returns a JSON-ready dict, or None when the job is not its kind.
FIGURES: list[tuple[str, Callable[[JobEvents], dict[str, Any] | None]]] = []


def register_figures(key: str, fn: Callable[[JobEvents], dict[str, Any] | None]) -> None:
    """Add ``fn`` to the figures :func:`figures` gathers under ``key`` (once, however often it is registered);
    several functions may share a key, each for its own kind of job."""
    if (key, fn) not in FIGURES:
        FIGURES.append((key, fn))


def figures(job: JobEvents) -> dict[str, Any]:
    """Every registered figure of ``job``: per key, the first function's answer that is not None."""
    out: dict[str, Any] = {}
    for key, fn in FIGURES:
        if key not in out:
            got = fn(job)
            if got is not None:
                out[key] = got
    return out


def diagnose(job: JobEvents, links: list[dict[str, Any]] | None = None,
             allreduce_ms: Mapping[str, float] | None = None, nbytes: int = 0,
             verified: Mapping[str, Any] | None = None, lateness: bool = True) -> list[Finding]:
    """Every finding for ``job``: problems first, then measured fixes, then information.

    ``links``: probed links (default: the run's own collective steps); ``allreduce_ms``: the
    probe's allreduce timings at ``nbytes`` (``ring``, ``hierarchical``, ``native``, ``without
    HOST``), from which a fix is recommended. ``lateness=False``: the events are a probe's own,
    whose collectives start together by design; nobody's arrival is judged.
    """
    if links is None:  # no probe: the job's own collective steps
        links = run_links(job)
    where = placement(job, links)
    late = late_ranks(job) if lateness else []
    found = (where + compute_findings(job)
             + link_findings(job, links, busy_hosts=busy_hosts(where), late=[f.rank for f in late if f.rank is not None])
             + late + recommend(job, allreduce_ms or {}, nbytes, links, verified)
             + [f for analyze in ANALYZERS for f in analyze(job)])
    rank = {"problem": 0, "fix": 1}
    return sorted(found, key=lambda f: rank.get(f.severity, 2))


def format_report(job: JobEvents, findings: list[Finding], extra: Sequence[str] = ()) -> str:
    """The doctor's report: hosts, any measurement lines, then the findings, problems first."""
    hosts = list(dict.fromkeys(job.hosts()))
    lines = [f"ringpipe doctor: {job.size} ranks on {len(hosts)} host(s): {', '.join(hosts)}"]
    lines += list(extra)
    problems = [f for f in findings if f.severity == "problem"]
    lines.append(f"{len(problems)} problem(s) found" if problems else "no problem found")
    lines += [f.text() for f in findings]
    return "\n".join(lines)
