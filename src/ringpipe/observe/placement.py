"""Where the ranks run: ranks per host, what that costs a ring, cores shared by too many ranks.

Seed 000 calls 4-2-2 over three hosts the normal case and 4-3-1 the anomaly. Unequal counts as
such cost a ring nothing: a ring in rank order crosses hosts once into and once out of every
host whatever the counts. What costs is a host whose single rank carries both of its host's
cross-host flows (the receive from the previous host and the send to the next) while on the
other hosts two ranks share them: that process alternates between receiving and sending (seed
000 §5), so its hops run at about half the link's bandwidth. :func:`ring_model` turns that and
the probed link bandwidths into a modelled ring time for the placement and for the most
balanced placement of the same ranks on the same hosts; a placement is a problem only when the
model says it costs materially more.

Hosts may be containers or network namespaces of one machine (same ``machine`` id, the kernel's
boot id): their ranks share that machine's CPUs, which :func:`placement` counts once.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from ringpipe.observe.collect import JobEvents
from ringpipe.observe.finding import Finding

__all__ = ["placement", "ring_model", "balanced_counts", "shape_of"]

#: A placement is a problem when the model gives it this many times the balanced placement's time.
MATERIAL = 1.25


def shape_of(hosts: Sequence[str]) -> tuple[list[str], list[int]]:
    """Hosts in rank order and their rank counts: ``(["a", "b", "c"], [4, 3, 1])``."""
    per_host = Counter(hosts)
    order = list(dict.fromkeys(hosts))
    return order, [per_host[h] for h in order]


def balanced_counts(ranks: int, hosts: int) -> list[int]:
    """The most even spread of ``ranks`` over ``hosts`` (8 on 3: ``[3, 3, 2]``)."""
    q, r = divmod(ranks, hosts)
    return [q + 1] * r + [q] * (hosts - r)


def ring_model(counts: Sequence[int], cross_gbps: Sequence[float] | float = 1.0,
               same_gbps: float | None = None) -> float:
    """Relative time of a ring step for ranks placed ``counts`` per host, in rank order.

    ``cross_gbps``: the bandwidth of each host's cross-host link (one figure for all, or one per
    host); ``same_gbps``: inside a host (default: as fast as the fastest cross-host link). A
    hop across hosts runs at the slower of the two hosts' links, halved at a host with a single
    rank (that rank receives from one host and sends to the next). The ring runs at its slowest
    hop: the result is ``1 / slowest hop bandwidth``.
    """
    h = len(counts)
    cross = [float(cross_gbps)] * h if isinstance(cross_gbps, int | float) else [float(x) for x in cross_gbps]
    same = same_gbps if same_gbps is not None else max(cross)
    hops: list[float] = []
    for i, n in enumerate(counts):
        if n > 1:
            hops.append(same)
        if h > 1:
            j = (i + 1) % h
            bw = min(cross[i], cross[j])
            if counts[i] == 1 or counts[j] == 1:
                bw /= 2
            hops.append(bw)
    return 1.0 / min(hops) if hops else 0.0


def _host_links(job: JobEvents, links: Sequence[dict[str, Any]]) -> tuple[list[float], float | None]:
    """Per host (in rank order), the median bandwidth of its cross-host links; the same-host median."""
    hosts = job.hosts()
    order = list(dict.fromkeys(hosts))
    cross: dict[str, list[float]] = defaultdict(list)
    same: list[float] = []
    for x in links:
        a, b = hosts[x["src"]], hosts[x["dst"]]
        if a == b:
            same.append(x["gbps"])
        else:
            cross[a].append(x["gbps"])
            cross[b].append(x["gbps"])
    if not cross:
        return [1.0] * len(order), None
    fallback = statistics.median([v for vs in cross.values() for v in vs])
    return [statistics.median(cross[h]) if cross[h] else fallback for h in order], (
        statistics.median(same) if same else None)


def _ring_placement(job: JobEvents, links: Sequence[dict[str, Any]]) -> list[Finding]:
    hosts = job.hosts()
    order, counts = shape_of(hosts)
    if len(order) < 2:
        return []
    shape = "-".join(map(str, counts))
    p = len(hosts)
    crossings = sum(hosts[r] != hosts[(r + 1) % p] for r in range(p))
    balanced = balanced_counts(p, len(order))
    even = sorted(counts, reverse=True) == balanced
    cross, same = _host_links(job, links)
    # The balanced placement keeps the hosts and their links; only the counts move.
    ranked = sorted(range(len(order)), key=lambda i: -counts[i])
    alt = [0] * len(order)
    for i, n in zip(ranked, balanced, strict=True):
        alt[i] = n
    now, best = ring_model(counts, cross, same), ring_model(alt, cross, same)
    ratio = now / best if best else 1.0
    contiguous = crossings == len(order)
    if ratio >= MATERIAL:
        lone = [order[i] for i, n in enumerate(counts) if n == 1]
        figures = "the probed links" if links else "equal links"
        alt_text = "-".join(map(str, alt))
        who = (f"host {lone[0]} runs a single rank" if len(lone) == 1
               else f"hosts {', '.join(lone)} run a single rank each") if lone else "its cross-host hops are uneven"
        return [Finding(
            "problem",
            f"placement {shape}: {who}, which carries the ring's cross-host traffic in both directions",
            f"ranks per host: {', '.join(f'{h}: {n}' for h, n in zip(order, counts, strict=True))}; a single rank "
            "must receive the ring's blocks from the previous host and send them to the next alone (on the other "
            f"hosts two ranks share that). A ring step modelled from {figures} takes {ratio:.1f}x as long as with "
            f"{alt_text} on the same hosts",
            f"place the ranks {alt_text} (e.g. mpirun -H "
            + ",".join(f"{h}:{n}" for h, n in zip(order, alt, strict=True))
            + "), so that no host has a single rank",
            hosts=tuple(lone) or tuple(order),
        )]
    alt_text = "-".join(map(str, alt))
    note = (f"as even as {p} ranks on {len(order)} hosts can be" if even else
            f"not as even as {alt_text}, but no host has a single rank: a ring step is modelled to take as long "
            f"as with {alt_text}")
    return [Finding(
        "info", f"placement {shape} over {len(order)} hosts",
        f"{note}; a ring in rank order crosses hosts {crossings} times"
        + ("" if contiguous else " (ranks of a host are not consecutive: order them host by host so it crosses "
                                 f"only {len(order)} times)"),
    )]


def _machines(job: JobEvents) -> dict[str, list[int]]:
    """Ranks per machine (ranks without a machine id: one machine per host)."""
    out: dict[str, list[int]] = defaultdict(list)
    for r in job.ranks:
        out[str(r.info.get("machine") or f"host:{r.host}")].append(r.rank)
    return out


def _cores(job: JobEvents) -> list[Finding]:
    findings: list[Finding] = []
    for ranks in _machines(job).values():
        infos = [job.ranks[r].info for r in ranks]
        if not all("cpus" in i for i in infos):
            continue
        cpus = set().union(*(set(i["cpus"]) for i in infos))
        threads = sum(int(i.get("threads", 1)) for i in infos)
        hosts = list(dict.fromkeys(job.ranks[r].host for r in ranks))
        if threads > len(cpus):
            shared = len(hosts) > 1
            findings.append(Finding(
                "info" if shared else "problem",
                (f"hosts {', '.join(hosts)} share one machine with {len(cpus)} CPUs for {threads} threads"
                 if shared else
                 f"host {hosts[0]} is oversubscribed: {len(ranks)} ranks x threads = {threads} on {len(cpus)} CPUs"),
                f"ranks {ranks} may run on CPUs {sorted(cpus)}"
                + ("; they are containers or namespaces of one machine (same boot id): every rank waits for a "
                   "core alike, so hosts compare fairly with each other but times are slower than on separate "
                   "machines" if shared else ""),
                "" if shared else "start fewer ranks per host, or fewer threads per rank (OMP_NUM_THREADS, "
                "torch.set_num_threads); ranks that wait for a core make every collective wait for them",
                hosts=tuple(hosts),
            ))
        bound = Counter(tuple(i["cpus"]) for i in infos if len(i["cpus"]) < int(i.get("cpu_count", 0) or 0))
        for cpuset, count in bound.items():
            if count > 1 and len(cpuset) < count:
                share = [r for r, i in zip(ranks, infos, strict=True) if tuple(i["cpus"]) == cpuset]
                host = job.ranks[share[0]].host
                findings.append(Finding(
                    "problem",
                    f"ranks {share} on host {host} are bound to the same CPUs {list(cpuset)}",
                    f"{count} ranks share {len(cpuset)} CPU(s) while the host has more",
                    "bind each rank to its own cores (mpirun --bind-to core --map-by socket, or "
                    "--bind-to none) or set distinct affinities",
                    hosts=(host,),
                ))
    return findings


def _load(job: JobEvents, busy: float = 2.0) -> list[Finding]:
    """Machines whose load average was ``busy`` times their CPUs or more when the events were gathered."""
    findings = []
    for ranks in _machines(job).values():
        infos = [job.ranks[r].info for r in ranks]
        loads = [float(i["loadavg"]) for i in infos if "loadavg" in i]
        cpus = max((int(i.get("cpu_count", 0) or 0) for i in infos), default=0)
        if loads and cpus and max(loads) >= busy * cpus:
            hosts = list(dict.fromkeys(job.ranks[r].host for r in ranks))
            probed = any("compute_ms" in i for i in infos)  # a probe's job, not a run's events
            findings.append(Finding(
                "info", f"{'hosts ' + ', '.join(hosts) + ' were' if len(hosts) > 1 else 'host ' + hosts[0] + ' was'} "
                f"busy: load average {max(loads):.1f} on {cpus} CPUs",
                "processes waited for a core while they were measured: times are longer and noisier than the links "
                "and CPUs alone would give; what is compared within this job still is (links to links, ranks to "
                "ranks, each measured again when it looked slow)" if probed else
                "processes waited for a core during the run (load average when its events were gathered): its "
                "collectives and the work between them took longer and varied more than the links and CPUs alone "
                "would give; a rank is named late only when it keeps the others waiting call after call",
                hosts=tuple(hosts),
            ))
    return findings


def placement(job: JobEvents, links: Sequence[dict[str, Any]] = ()) -> list[Finding]:
    """The placement's cost for a ring (modelled from ``links`` when given), oversubscribed and shared cores, load."""
    return _ring_placement(job, links) + _cores(job) + _load(job)


def busy_hosts(findings: Sequence[Finding]) -> list[str]:
    """Hosts that a placement finding calls oversubscribed (their ranks wait for cores)."""
    return [h for f in findings if "oversubscribed" in f.what or "share one machine" in f.what for h in f.hosts]
