"""The doctor: explains locality anomalies — which rank, host or link makes collectives slow.

Seed 000 found that the same ring allreduce on 8 ranks ran at different speeds with ranks
placed 4-2-2 or 4-3-1 over three hosts, and suspected NUMA, binding and links. The doctor
turns those suspicions into measurements and names the culprit:

- **late ranks** (from any job's events): the rank that enters collectives last, again and
  again, while the others wait for it. That is load imbalance or a slow process, not the
  network, and no collective algorithm can fix it.
- **placement**: ranks per host (unbalanced placements make a ring cross hosts at uneven
  places), more ranks than cores on a host, ranks bound to the same CPUs.
- **links** (from a probe): latency and bandwidth of every pair of ranks (or of ring
  neighbours on large jobs), grouped into same-host and cross-host links; a link much slower
  than its peers is named, and so is the cost of crossing hosts. Without a probe, the ring
  steps of the job's own collectives give the bandwidth of every ring hop
  (:func:`ring_links`), so a training run's events blame links too.
- **compute** (from a probe): a rank much slower at the same matrix product than the others.

:func:`diagnose` is pure (events and probe results in, findings out); :func:`run_probe` is the
collective part that every rank runs under ``ringpipe doctor``.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ringpipe.comm.base import Communicator
from ringpipe.comm.events import Event
from ringpipe.observe.collect import JobEvents

__all__ = ["Finding", "diagnose", "late_ranks", "placement", "link_findings", "ring_links", "compute_findings",
           "run_probe", "format_report", "plot_links", "COLLECTIVE_OPS"]

COLLECTIVE_OPS = ("allreduce", "iallreduce", "allgather", "broadcast", "reduce", "reduce_scatter", "alltoall", "barrier")
_PROBE_TAG = 7_100_000


@dataclass(frozen=True)
class Finding:
    """One diagnosis: how bad (``problem`` or ``info``), what, and what to do about it."""

    severity: str
    what: str
    evidence: str
    fix: str = ""
    rank: int | None = None
    hosts: tuple[str, ...] = ()

    def text(self) -> str:
        out = f"[{self.severity}] {self.what}\n    evidence: {self.evidence}"
        return out + (f"\n    what to do: {self.fix}" if self.fix else "")


# ----------------------------------------------------------------------------- late ranks


def late_ranks(job: JobEvents, min_calls: int = 5, min_late_ms: float = 1.0) -> list[Finding]:
    """Ranks that keep entering the same collectives last, from the job's events.

    The k-th call of an operation on a communicator is the same collective on every rank (ranks
    call collectives in one order). A rank is named when it is the last to arrive in at least
    60 % of at least ``min_calls`` calls, by a median of ``min_late_ms`` or more, and by at least
    three times the median lateness of the other ranks.
    """
    # ringpipe's algorithms and the backend's native collective are separate call sequences.
    calls: dict[tuple[str, str], dict[int, list[tuple[int, int]]]] = defaultdict(dict)
    for rank_events in job.ranks:
        for e in rank_events.events:
            if e.op in COLLECTIVE_OPS:
                algo = e.detail.get("algorithm")
                name = f"{e.op} ({algo})" if algo else e.op
                calls[(e.comm, name)].setdefault(rank_events.rank, []).append((e.start_ns, e.end_ns))
    findings = []
    for (comm, op), per_rank in sorted(calls.items()):
        if len(per_rank) < 2:
            continue
        ranks = sorted(per_rank)
        n = min(len(v) for v in per_rank.values())
        if n < min_calls:
            continue
        late: dict[int, list[float]] = {r: [] for r in ranks}
        last: Counter[int] = Counter()
        waited: defaultdict[int, float] = defaultdict(float)
        for k in range(n):
            arrivals = {r: per_rank[r][k][0] for r in ranks}
            first = min(arrivals.values())
            order = sorted(ranks, key=lambda r: arrivals[r])
            last[order[-1]] += 1
            waited[order[-1]] += (arrivals[order[-1]] - arrivals[order[-2]]) / 1e9
            for r in ranks:
                late[r].append((arrivals[r] - first) / 1e6)
        for r in ranks:
            med = statistics.median(late[r])
            others = statistics.median([x for q in ranks if q != r for x in late[q]])
            if last[r] >= 0.6 * n and med >= min_late_ms and med >= 3 * others:
                host = job.ranks[r].host
                findings.append(Finding(
                    "problem",
                    f"rank {r} (host {host}) arrives late at {op} on {comm}",
                    f"last to enter in {last[r]} of {n} calls, a median {med:.1f} ms after the first rank "
                    f"(other ranks: {others:.2f} ms); the others waited {waited[r]:.3f} s for it in total",
                    f"the network is not the cause: rank {r} does more work between collectives. Look for "
                    "uneven data or model shards, a slower or oversubscribed CPU on its host, data loading "
                    "or file I/O on that rank only (e.g. rank-0 checkpoints inside the step), or other jobs "
                    "on that host",
                    rank=r, hosts=(host,),
                ))
    return findings


# ----------------------------------------------------------------------------- placement


def placement(job: JobEvents) -> list[Finding]:
    """Ranks per host, ring crossings, oversubscribed cores and shared bindings."""
    findings: list[Finding] = []
    hosts = job.hosts()
    per_host = Counter(hosts)
    order = list(dict.fromkeys(hosts))
    shape = "-".join(str(per_host[h]) for h in order)
    p = len(hosts)
    crossings = sum(hosts[r] != hosts[(r + 1) % p] for r in range(p)) if p > 1 else 0
    if len(per_host) > 1 and len(set(per_host.values())) > 1:
        findings.append(Finding(
            "problem",
            f"unbalanced placement {shape} over {len(per_host)} hosts",
            f"ranks per host: {', '.join(f'{h}: {per_host[h]}' for h in order)}; a ring in rank order "
            f"crosses hosts {crossings} times, and the host with {min(per_host.values())} rank(s) carries "
            "a whole ring hop of cross-host traffic on fewer cores",
            "place the same number of ranks on every host, or use the hierarchical allreduce "
            "(algorithm='hierarchical': reduce inside each host, allreduce among one leader per host, "
            "broadcast inside each host), which sends each byte across hosts once per host",
            hosts=tuple(order),
        ))
    elif len(per_host) > 1:
        findings.append(Finding("info", f"placement {shape} over {len(per_host)} hosts",
                                f"a ring in rank order crosses hosts {crossings} times"))
    by_host: dict[str, list[int]] = defaultdict(list)
    for rank_events in job.ranks:
        by_host[rank_events.host].append(rank_events.rank)
    for host, ranks in by_host.items():
        infos = [job.ranks[r].info for r in ranks]
        if not all("cpus" in i for i in infos):
            continue
        cpus = set().union(*(set(i["cpus"]) for i in infos))
        threads = sum(int(i.get("threads", 1)) for i in infos)
        if threads > len(cpus):
            findings.append(Finding(
                "problem",
                f"host {host} is oversubscribed: {len(ranks)} ranks x threads = {threads} on {len(cpus)} CPUs",
                f"ranks {ranks} may run on CPUs {sorted(cpus)}",
                "start fewer ranks per host, or fewer threads per rank (OMP_NUM_THREADS, "
                "torch.set_num_threads); ranks that wait for a core make every collective wait for them",
                hosts=(host,),
            ))
        bound = Counter(tuple(i["cpus"]) for i in infos if len(i["cpus"]) < int(i.get("cpu_count", 0) or 0))
        for cpuset, count in bound.items():
            if count > 1 and len(cpuset) < count:
                share = [r for r, i in zip(ranks, infos, strict=True) if tuple(i["cpus"]) == cpuset]
                findings.append(Finding(
                    "problem",
                    f"ranks {share} on host {host} are bound to the same CPUs {list(cpuset)}",
                    f"{count} ranks share {len(cpuset)} CPU(s) while the host has more",
                    "bind each rank to its own cores (mpirun --bind-to core --map-by socket, or "
                    "--bind-to none) or set distinct affinities",
                    hosts=(host,),
                ))
    return findings


# ----------------------------------------------------------------------------- links and compute


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


def _latency(links: Sequence[dict[str, Any]]) -> float | None:
    values = [x["latency_us"] for x in links if x.get("latency_us") is not None]
    return statistics.median(values) if values else None


def link_findings(job: JobEvents, links: list[dict[str, Any]], slow_factor: float = 1 / 3,
                  busy_hosts: Sequence[str] = ()) -> list[Finding]:
    """Findings from links: ``[{"src", "dst", "latency_us", "gbps"}, ...]``, probed or from :func:`ring_links`.

    A link is slow below ``slow_factor`` times the median of its class (same-host or cross-host).
    On ``busy_hosts`` (oversubscribed) a slow link may be nothing but two ranks waiting for a core:
    it is reported as information, not as a problem.
    """
    if not links:
        return []
    hosts = job.hosts()
    classes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for link in links:
        cross = hosts[link["src"]] != hosts[link["dst"]]
        classes["cross-host" if cross else "same-host"].append(link)
    findings: list[Finding] = []
    medians = {c: statistics.median(x["gbps"] for x in ls) for c, ls in classes.items()}
    lat = {c: _latency(ls) for c, ls in classes.items()}

    def latency(x: dict[str, Any] | None, cls: str) -> str:
        """The evidence besides bandwidth: latencies when probed, else how many ring steps."""
        if lat[cls] is None:
            n = x.get("samples", 0) if x is not None else sum(y.get("samples", 0) for y in classes[cls])
            return f"from {n} ring steps of this job"
        if x is None:
            return f"latency {lat[cls]:.0f} us"
        return f"latency {x['latency_us']:.0f} us, median {lat[cls]:.0f} us"

    for cls, ls in classes.items():
        for x in ls:
            if x["gbps"] < slow_factor * medians[cls]:
                a, b = hosts[x["src"]], hosts[x["dst"]]
                busy = sorted({a, b} & set(busy_hosts))
                findings.append(Finding(
                    "info" if busy else "problem",
                    f"slow link: rank {x['src']} ({a}) <-> rank {x['dst']} ({b})",
                    f"{x['gbps']:.3f} GB/s against a median of {medians[cls]:.3f} GB/s for {cls} links "
                    f"({latency(x, cls)})"
                    + (f"; {', '.join(busy)} is oversubscribed, so this may be core contention" if busy else ""),
                    "a ring allreduce runs at the pace of its slowest hop: check this link's NIC, cable, "
                    "switch port or traffic shaping (same host: a link across sockets), or order the "
                    "ranks so the ring avoids it",
                    hosts=(a, b),
                ))
    if "cross-host" in medians and "same-host" in medians:
        ratio = medians["same-host"] / max(medians["cross-host"], 1e-12)
        sev = "problem" if ratio >= 2 else "info"
        findings.append(Finding(
            sev,
            f"crossing hosts costs {ratio:.1f}x in bandwidth",
            f"same-host links {medians['same-host']:.3f} GB/s ({latency(None, 'same-host')}), "
            f"cross-host links {medians['cross-host']:.3f} GB/s ({latency(None, 'cross-host')})",
            "use the hierarchical allreduce so that only one rank per host sends across hosts"
            if sev == "problem" else "",
            hosts=tuple(dict.fromkeys(hosts)),
        ))
    p = len(hosts)
    ring = [x for x in links if (x["dst"] - x["src"]) % p in (1, p - 1)]
    if p > 2 and ring:
        worst = min(ring, key=lambda x: x["gbps"])
        findings.append(Finding(
            "info", f"slowest ring hop: rank {worst['src']} <-> rank {worst['dst']}",
            f"{worst['gbps']:.3f} GB/s; a ring allreduce of n bytes needs about 2(p-1)/p * n / "
            f"{worst['gbps']:.3f} GB/s on this ring"))
    return findings


def compute_findings(job: JobEvents, slow_factor: float = 1.5) -> list[Finding]:
    """Ranks whose compute probe took ``slow_factor`` times the median or longer."""
    times = {r.rank: r.info["compute_ms"] for r in job.ranks if "compute_ms" in r.info}
    if len(times) < 2:
        return []
    med = statistics.median(times.values())
    return [
        Finding(
            "problem",
            f"rank {r} (host {job.ranks[r].host}) computes slowly",
            f"the same matrix products took {t:.1f} ms against a median of {med:.1f} ms",
            "its CPU is shared (oversubscription, other jobs), slower, or its memory is on another "
            "NUMA node (numactl --show; bind ranks with mpirun --bind-to core --map-by socket)",
            rank=r, hosts=(job.ranks[r].host,),
        )
        for r, t in sorted(times.items()) if t >= slow_factor * med
    ]


def diagnose(job: JobEvents, links: list[dict[str, Any]] | None = None) -> list[Finding]:
    """Every finding for ``job``: problems first."""
    where = placement(job)
    busy = [h for f in where if "oversubscribed" in f.what for h in f.hosts]
    if links is None:  # no probe: the job's own ring steps
        links = ring_links(job)
    found = where + compute_findings(job) + link_findings(job, links, busy_hosts=busy) + late_ranks(job)
    return sorted(found, key=lambda f: f.severity != "problem")


def format_report(job: JobEvents, findings: list[Finding], extra: Sequence[str] = ()) -> str:
    """The doctor's report: hosts, any measurement lines, then the findings, problems first."""
    hosts = list(dict.fromkeys(job.hosts()))
    lines = [f"ringpipe doctor: {job.size} ranks on {len(hosts)} host(s): {', '.join(hosts)}"]
    lines += list(extra)
    problems = [f for f in findings if f.severity == "problem"]
    lines.append(f"{len(problems)} problem(s) found" if problems else "no problem found")
    lines += [f.text() for f in findings]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- probes (collective)


def _pairs(size: int, all_pairs: bool) -> list[tuple[int, int]]:
    if all_pairs:
        return [(a, b) for a in range(size) for b in range(a + 1, size)]
    return sorted({(min(r, (r + 1) % size), max(r, (r + 1) % size)) for r in range(size)})


def _pingpong(comm: Communicator, peer: int, buf: torch.Tensor, reps: int, first: bool) -> float:
    """Median one-way time (s) of ``reps`` round trips of ``buf`` with ``peer``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if first:
            comm.send(buf, peer, _PROBE_TAG)
            comm.recv(buf, peer, _PROBE_TAG)
        else:
            comm.recv(buf, peer, _PROBE_TAG)
            comm.send(buf, peer, _PROBE_TAG)
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def compute_probe(reps: int = 3, n: int = 256, iters: int = 20) -> float:
    """Median time in ms of ``iters`` ``n x n`` matrix products (the same work on every rank)."""
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            a = torch.tanh(a @ a / n)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run_probe(comm: Communicator, nbytes: int = 4 << 20, all_pairs: bool | None = None) -> list[dict[str, Any]]:
    """Measure links pair by pair (one pair at a time); every rank calls it. Returns all links.

    All pairs on up to 8 ranks, ring neighbours above. Each link: median one-way latency of
    8-byte messages and bandwidth of ``nbytes`` messages, as seen by the lower rank of the pair.
    """
    if all_pairs is None:
        all_pairs = comm.size <= 8
    small = torch.zeros(2, dtype=torch.float32)
    big = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    mine: list[dict[str, Any]] = []
    for a, b in _pairs(comm.size, all_pairs):
        if comm.rank in (a, b):
            peer, first = (b, True) if comm.rank == a else (a, False)
            _pingpong(comm, peer, small, 2, first)  # connect and warm up
            lat = _pingpong(comm, peer, small, 10, first)
            bw_t = _pingpong(comm, peer, big, 3, first)
            if first:
                mine.append({"src": a, "dst": b, "latency_us": 1e6 * lat,
                             "gbps": big.numel() * 4 / max(bw_t, 1e-12) / 1e9})
        comm.barrier()
    every = comm.allgather_object(mine)
    return [link for part in every for link in part]


def plot_links(job: JobEvents, links: list[dict[str, Any]], path: str) -> None:
    """A rank x rank heat map of probed bandwidth (GB/s), hosts outlined: slow links stand out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = job.size
    grid = torch.full((p, p), float("nan"))
    for x in links:
        grid[x["src"], x["dst"]] = grid[x["dst"], x["src"]] = x["gbps"]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.8 + 0.55 * p), max(3.8, 1.2 + 0.55 * p)))
    im = ax.imshow(grid.numpy(), cmap="viridis")
    mid = (float(grid.nan_to_num(0).max()) + min(x["gbps"] for x in links)) / 2 if links else 0.0
    fig.colorbar(im, ax=ax, label="GB/s")
    hosts = job.hosts()
    for r in range(1, p):  # lines between hosts
        if hosts[r] != hosts[r - 1]:
            ax.axhline(r - 0.5, color="white", lw=2)
            ax.axvline(r - 0.5, color="white", lw=2)
    for x in links:
        for a, b in ((x["src"], x["dst"]), (x["dst"], x["src"])):
            ax.text(b, a, f"{x['gbps']:.2g}", ha="center", va="center", fontsize=7,
                    color="black" if x["gbps"] > mid else "white")
    ax.set(xticks=range(p), yticks=range(p), xlabel="rank", ylabel="rank",
           title=f"link bandwidth (GB/s)\n{p} ranks on {len(set(hosts))} host(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
