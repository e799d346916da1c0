"""Links between ranks: their bandwidth from a probe or from a run's own collective steps, and what is slow.

A slow link is judged against links that share nothing with it. In a three-host ring, one
host's links are two of the three host pairs, so a median over all cross-host links is itself
slow when one host's link is: :func:`link_findings` therefore takes the median of every host
pair, and names a **host** whose every pair is far below the fastest pair (its NIC, cable,
switch port or shaping), a **host pair** that is slow on its own (a path between two hosts),
and a single **rank pair** that is far below the other links of its host pair. That crossing
hosts is slower than shared memory is normal and said as information only.

Without a probe, the steps of a run's collectives give the links: :func:`ring_links` from the
ring's steps (the sender of each step is known), :func:`step_links` from the steps of any other
algorithm whose two sides record the same step with each other (recursive doubling, tree).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ringpipe.comm.events import Event
from ringpipe.observe.collect import JobEvents
from ringpipe.observe.finding import Finding

__all__ = ["ring_links", "step_links", "run_links", "link_findings", "host_pairs", "slow_hosts", "SLOW"]

#: A link (host, host pair, rank pair) is slow below this fraction of what it is compared with.
SLOW = 0.25
#: On an oversubscribed host a rank pair this much slower or less may be two ranks waiting for a core.
CONTENTION = 0.1


def ring_links(job: JobEvents, min_bytes: int = 1 << 16, min_samples: int = 3) -> list[dict[str, Any]]:
    """The bandwidth of every ring hop ``pred -> rank`` as the job's ring collectives saw it.

    Only receives are recorded, but a ring's sender is known: in step ``s`` rank ``r`` receives
    from ``pred = r - 1``, which sends that block as soon as its own step ``s - 1`` is done (the
    first step's block at once). So each recorded step gives a transfer time that a late rank
    does not inflate: from ``max(receive posted, sender's step s-1 done)`` to the end of the
    receive, less the reduction time. Steps under ``min_bytes`` (latency-bound) are skipped;
    a hop needs ``min_samples`` steps. Times are on rank 0's clock (see
    :mod:`ringpipe.observe.collect`). Returns ``[{"src", "dst", "gbps", "latency_us": None,
    "samples", "source": "ring"}, ...]``, the median over the hop's steps, for
    :func:`link_findings`.
    """
    p = job.size
    if p < 2:
        return []
    world = job.meta.get("comm", "world")
    steps: dict[tuple[int, str, int, int], Event] = {}  # (rank, collective, cid, step) -> its receive
    for r in job.ranks:
        pred = (r.rank - 1) % p
        for e in r.events:
            d = e.detail or {}
            if not (e.op.endswith(".step") and d.get("algorithm") == "ring" and e.comm == world and e.peer == pred):
                continue
            steps[(r.rank, str(d.get("collective")), int(d.get("cid", -1)), int(d.get("step", -1)))] = e
    samples: dict[tuple[int, int], list[float]] = defaultdict(list)
    for (rank, coll, cid, step), e in steps.items():
        if e.nbytes < min_bytes:
            continue
        pred = (rank - 1) % p
        before = steps.get((pred, coll, cid, step - 1))
        if before is not None:
            sent = before.end_ns
        else:  # the first step of the collective: the sender posted its block when it started
            first = steps.get((pred, coll, cid, step))
            if first is None:
                continue
            sent = first.start_ns
        took = e.end_ns - int((e.detail or {}).get("reduce_ns", 0)) - max(e.start_ns, sent)
        if took > 0:
            samples[(pred, rank)].append(e.nbytes / took)  # bytes per ns = GB/s
    return [
        {"src": src, "dst": dst, "gbps": statistics.median(v), "latency_us": None, "samples": len(v),
         "source": "ring"}
        for (src, dst), v in sorted(samples.items()) if len(v) >= min_samples
    ]


def step_links(job: JobEvents, min_bytes: int = 1 << 16, min_samples: int = 3) -> list[dict[str, Any]]:
    """Links from the steps of algorithms other than the ring (recursive doubling, tree, ...).

    Both ranks of a step record it with each other as peer under the same collective, call id
    and step. The transfer cannot start before both have posted it, so each record gives a
    time ``end - reduction - max(this rank posted, the peer posted)``; the shorter of the two
    sides' times (lateness only lengthens them) is one sample of the rank pair. Steps on other
    communicators than the job's world (a hierarchical allreduce's sub-groups) are left out:
    their ranks are not the world's. Returns links like :func:`ring_links`, ``src < dst``.
    """
    world = job.meta.get("comm", "world")
    steps: dict[tuple[str, int, int], dict[tuple[int, int], list[Event]]] = defaultdict(lambda: defaultdict(list))
    for r in job.ranks:
        for e in r.events:
            d = e.detail or {}
            if (e.op.endswith(".step") and d.get("algorithm") not in (None, "ring") and e.comm == world
                    and e.peer >= 0 and e.nbytes >= min_bytes):
                key = (str(d.get("collective")), int(d.get("cid", -1)), int(d.get("step", -1)))
                steps[key][(r.rank, e.peer)].append(e)
    samples: dict[tuple[int, int], list[float]] = defaultdict(list)
    for sides in steps.values():
        for (a, b), mine in sides.items():
            theirs = sides.get((b, a))
            if a > b or not theirs:
                continue
            posted = max(min(e.start_ns for e in mine), min(e.start_ns for e in theirs))
            took = [e.end_ns - int((e.detail or {}).get("reduce_ns", 0)) - posted for e in (*mine, *theirs)]
            took = [t for t in took if t > 0]
            if took:
                samples[(a, b)].append(max(e.nbytes for e in mine) / min(took))
    return [
        {"src": a, "dst": b, "gbps": statistics.median(v), "latency_us": None, "samples": len(v),
         "source": "steps"}
        for (a, b), v in sorted(samples.items()) if len(v) >= min_samples
    ]


def run_links(job: JobEvents) -> list[dict[str, Any]]:
    """Every link a run's own collective steps measure: ring hops, then other algorithms' rank pairs."""
    ring = ring_links(job)
    seen = {(min(x["src"], x["dst"]), max(x["src"], x["dst"])) for x in ring}
    return ring + [x for x in step_links(job) if (x["src"], x["dst"]) not in seen]


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def host_pairs(job: JobEvents, links: Sequence[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Links grouped by the hosts they join (``(h, h)`` for links inside host ``h``)."""
    hosts = job.hosts()
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for x in links:
        groups[_pair(hosts[x["src"]], hosts[x["dst"]])].append(x)
    return dict(groups)


def _medians(groups: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[tuple[str, str], float]:
    return {k: statistics.median(x["gbps"] for x in v) for k, v in groups.items()}


def slow_hosts(job: JobEvents, links: Sequence[dict[str, Any]], slow: float = SLOW) -> list[str]:
    """Hosts whose every cross-host pair is below ``slow`` times the fastest pair that avoids them."""
    med = {k: v for k, v in _medians(host_pairs(job, links)).items() if k[0] != k[1]}
    out = []
    for h in dict.fromkeys(job.hosts()):
        mine = [v for k, v in med.items() if h in k]
        others = [v for k, v in med.items() if h not in k]
        if mine and others and max(mine) < slow * max(others):
            out.append(h)
    return out


def _gbps(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.3f} GB/s" if abs(hi - lo) <= 0.0005 else f"{lo:.3f}-{hi:.3f} GB/s"


def _how(links: Sequence[dict[str, Any]]) -> str:
    if all(x.get("latency_us") is not None for x in links):
        return "probed"
    return f"from {sum(x.get('samples', 0) for x in links)} collective steps of this job"


def link_findings(job: JobEvents, links: list[dict[str, Any]], slow_factor: float = SLOW,
                  busy_hosts: Sequence[str] = (), late: Sequence[int] = ()) -> list[Finding]:
    """Findings from links ``[{"src", "dst", "latency_us", "gbps"}, ...]``, probed or from a run's steps.

    Slow hosts and host pairs first (see the module docstring), then single rank pairs below
    ``slow_factor`` times the median of their group (same hosts, at least three links). A rank
    pair on an oversubscribed host (``busy_hosts``) that is at most ten times slower may be two
    ranks waiting for a core: information, not a problem. Links of ``late`` ranks are not blamed
    on the network (a late rank's hops read slow when its peers wait for it).
    """
    if not links:
        return []
    hosts = job.hosts()
    order = list(dict.fromkeys(hosts))
    groups = host_pairs(job, links)
    med = _medians(groups)
    cross = {k: v for k, v in med.items() if k[0] != k[1]}
    findings: list[Finding] = []
    bad_hosts = slow_hosts(job, links, slow_factor)
    explained: set[tuple[str, str]] = set()
    for h in bad_hosts:
        mine = {k: v for k, v in cross.items() if h in k}
        others = {k: v for k, v in cross.items() if h not in k}
        best_k = max(others, key=lambda k: others[k])
        explained |= set(mine)
        mine_links = [x for k in mine for x in groups[k]]
        findings.append(Finding(
            "problem",
            f"host {h}'s network link is slow: {_gbps([x['gbps'] for x in mine_links])} to every other host, "
            f"against {others[best_k]:.3f} GB/s between {best_k[0]} and {best_k[1]}",
            "; ".join(f"{a} <-> {b}: {_gbps([x['gbps'] for x in groups[(a, b)]])} over {len(groups[(a, b)])} "
                      "rank pair(s)" for (a, b) in sorted(cross))
            + f" ({_how(links)}); {h}'s links are {max(mine.values()) / others[best_k]:.3g}x the fastest host pair "
            "that avoids it",
            f"check host {h}'s NIC, cable, switch port and traffic shaping (`tc qdisc show` on {h}). Until it is "
            f"fixed, run without {h} (its ranks on the other hosts): every allreduce algorithm, ring, hierarchical "
            f"or the backend's own, sends across {h}'s link while {h} takes part",
            hosts=(h,),
        ))
    if len(cross) >= 2:
        fastest = max(cross.values())
        for k, v in sorted(cross.items()):
            if k not in explained and v < slow_factor * fastest:
                explained.add(k)
                findings.append(Finding(
                    "problem", f"slow path between hosts {k[0]} and {k[1]}: {v:.3f} GB/s against {fastest:.3f} "
                    "GB/s for the fastest host pair",
                    f"{len(groups[k])} rank pair(s) of {k[0]} and {k[1]}: {_gbps([x['gbps'] for x in groups[k]])} "
                    f"({_how(groups[k])}); the other host pairs of these hosts are fast",
                    f"check the route between {k[0]} and {k[1]} (switches, VLAN, shaping), or order the ranks so "
                    "that the ring does not cross it",
                    hosts=k,
                ))
    for k, group in sorted(groups.items()):
        if k in explained or len(group) < 3:
            continue
        m = med[k]
        for x in group:
            if x["gbps"] >= slow_factor * m:
                continue
            a, b = hosts[x["src"]], hosts[x["dst"]]
            where = f"rank {x['src']} ({a}) <-> rank {x['dst']} ({b})"
            if {x["src"], x["dst"]} & set(late):
                findings.append(Finding("info", f"link {where} reads slow next to a late rank",
                                        f"{x['gbps']:.3f} GB/s against a median of {m:.3f} GB/s; the rank that "
                                        "arrives late makes its hops wait, not the network"))
                continue
            busy = sorted({a, b} & set(busy_hosts))
            contention = bool(busy) and x["gbps"] >= CONTENTION * m
            findings.append(Finding(
                "info" if contention else "problem",
                f"slow link: {where}",
                f"{x['gbps']:.3f} GB/s against a median of {m:.3f} GB/s for the other links "
                f"{'inside ' + a if a == b else 'between ' + a + ' and ' + b} ({_how(group)})"
                + (f"; {', '.join(busy)} has more threads than CPUs, so this may be core contention"
                   if contention else ""),
                "a ring allreduce runs at the pace of its slowest hop: check this link (same host: a link across "
                "sockets), or order the ranks so the ring avoids it",
                hosts=(a, b),
            ))
    same = [v for k, v in med.items() if k[0] == k[1]]
    healthy = [v for k, v in cross.items() if k not in explained]  # a slow host is named above already
    if healthy and same:
        c = statistics.median(healthy)
        s = statistics.median(same)
        ratio = s / max(c, 1e-12)
        worded = (f"crossing hosts costs {ratio:.1f}x in bandwidth" if ratio >= 1.05 else
                  f"crossing hosts is {1 / ratio:.1f}x faster than staying on a host" if ratio <= 1 / 1.05 else
                  "crossing hosts costs nothing measurable in bandwidth")
        findings.append(Finding(
            "info", worded,
            f"links inside hosts: median {s:.3f} GB/s; between hosts: median {c:.3f} GB/s ({_how(links)}); "
            "cross-host links slower than shared memory are normal",
        ))
    p = len(hosts)
    ring = [x for x in links if (x["dst"] - x["src"]) % p in (1, p - 1)]
    if p > 2 and ring and len(order) > 0:
        worst = min(ring, key=lambda x: x["gbps"])
        findings.append(Finding(
            "info", f"slowest ring hop: rank {worst['src']} <-> rank {worst['dst']}",
            f"{worst['gbps']:.3f} GB/s; a ring allreduce of n bytes needs about 2(p-1)/p * n / "
            f"{worst['gbps']:.3f} GB/s on this ring"))
    return findings
