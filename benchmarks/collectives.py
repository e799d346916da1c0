"""ringpipe's allreduce against the backend's own: its algorithms and ``auto``, ring chunking, auto's probe, a pairwise sum.

    python benchmarks/collectives.py                                  # algorithms: gloo 2 and 4 ranks, MPI 2 ranks, 4 KiB - 64 MiB
    python benchmarks/collectives.py --configs gloo:2 --max-size 1M --repeats 3
    python benchmarks/collectives.py --measure chunks --ranks 2,4     # ring message chunking against native
    python benchmarks/collectives.py --measure probe --trials 5       # how reliably auto's probe picks
    python benchmarks/collectives.py --measure pairwise --compute 4   # 2 ranks: gloo's allreduce against a swap and an add
    python benchmarks/collectives.py --quick                          # seconds: every measure, tiny sizes

``--measure algorithms`` (the default): every configuration is one ``ringpipe bench allreduce -n N
--backend B -b 4K -e MAX -f 4 -r R`` job: it probes ``auto``'s table first
(``ringpipe.collectives.autotune``; ``--no-probe`` leaves auto on its rules), then times the
native collective, each of ringpipe's algorithms and ``auto`` in interleaved rounds at every size.
Printed per configuration: the load average before and after, the exact command, and one row
per size: native, the best own algorithm and ``auto`` (median time per call and min-max over the
rounds), the ratios native time / variant time, whether the spreads overlap (``inconclusive``) or
not, and auto / native paired per round. ``--json FILE`` keeps every row.

``--measure chunks`` (was ``chunks.py``): every setting of ``ringpipe.collectives.common.MAX_CHUNKS``
(how many chunks a ring message is cut into, chunks of at least ``CHUNK_BYTES``) is timed in turn
with the native gloo allreduce, interleaved (the order rotated every iteration, after one warm-up
iteration), for 1-64 MiB; per iteration the slowest rank's time counts, and the median over
iterations is printed with native / ring.

``--measure probe`` (was ``autotune_probe.py``): one job of ``--ranks`` processes runs
``autotune.probe`` ``--trials`` times one after another (the table forgotten in between). For
every size: how often the probe's rule (``autotune.decide``: median paired ratio at most 0.9 and
faster than native in two thirds of the rounds) chose each algorithm; how often the rule it
replaced would have chosen each on the same rounds (another algorithm only if its slowest round is
10 % below native's fastest, over the first 4 rounds); recursive doubling's and the ring's median
paired ratio to native; and the probe's time.

``--measure pairwise`` (was ``pairwise_exchange.py``): why the data-parallel path keeps gloo's
allreduce on two ranks although a swap and an add looks cheaper. For every size, in interleaved
rounds, the time of one blocking sum of a float32 vector: ``native`` is the communicator's
``iallreduce`` (gloo's allreduce), ``pairwise`` posts the vector to the other rank and a receive
of the other's (the communicator's ``isend``/``irecv``, which record each message: about 2 µs
against gloo's 50-120 µs per message), waits for both and adds. Each result is checked against
the sum written here. ``--compute N`` puts N 128x128 matrix products before each call, as a
training step has computation between its reductions. Reported per size: median and p10-p90 over
every call of the slowest rank, the ratio of medians, "apart" when the p10-p90 ranges do not
overlap.

Dropped: ``auto_dispatch_cost.py`` timed auto's choice alone through a private function of
``ringpipe.collectives``; its figures stay in HISTORY.md with the commit that made them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import machine, procs, report, sizes, stats, timing  # noqa: E402

__all__ = ["main"]

CHUNK_SETTINGS = [64, 8, 4]
OLD_ROUNDS = 4


# --- algorithms: ringpipe bench allreduce --------------------------------------------------------

def bench_job(backend: str, nprocs: int, max_size: str, repeats: int, timeout: float, probe: bool,
              iters: int | None = None) -> tuple[list[str], list[dict]]:
    """One ``ringpipe bench`` job; (its command line, every JSON object rank 0 printed)."""
    args = ["bench", "allreduce", "-n", str(nprocs), "--backend", backend, "-b", "4K", "-e", max_size,
            "-f", "4", "-r", str(repeats), "--json"]
    args += [] if probe else ["--no-probe"]
    args += ["-i", str(iters)] if iters else []
    env = {"OMP_NUM_THREADS": "1", "RINGPIPE_BACKEND": backend}
    text = procs.run(procs.ringpipe_cli(*args), timeout, env)
    objs = []
    for line in text.splitlines():
        start = line.find("{")
        if start >= 0:
            objs.append(json.JSONDecoder().raw_decode(line, start)[0])
    return ["ringpipe", *args], objs


def _cell(r: dict) -> str:
    return f"{r['time_us']:.0f} [{r['time_min_us']:.0f}–{r['time_max_us']:.0f}]"


def _paired(p: list[float] | None) -> str:
    return f"{p[0]:.2f} ({p[1]:.2f}–{p[2]:.2f})" if p else "–"


def algorithms_table(objs: list[dict]) -> str:
    """One Markdown row per size from the bench's rows and comparisons."""
    rows = [o for o in objs if not o.get("summary")]
    by = {(r["bytes"], r["algorithm"]): r for r in rows}
    cells = []
    for c in (o for o in objs if o.get("summary")):
        n = c["bytes"]
        native, best, auto = by[(n, "native")], by[(n, c["best"])], by[(n, "auto")]
        cells.append((sizes.label(n), _cell(native), f"{c['best']} {_cell(best)}",
                      f"{c['best_ratio']:.2f} ({c['best_verdict']})", f"{c['auto_chose']} {_cell(auto)}",
                      f"{c['auto_ratio']:.2f} ({c['auto_verdict']})", _paired(c.get("auto_paired"))))
    text = report.table(("size", "native µs [min–max]", "best own: algorithm, µs [min–max]", "best/native",
                         "auto chose, µs [min–max]", "auto/native", "auto/native paired per round, median (IQR)"),
                        cells, (False, False, False, True, False, True, True))
    wrong = sum(r["wrong"] for r in rows)
    return text + f"\n\nwrong results: {wrong}; {rows[0]['repeats'] if rows else '?'} interleaved rounds per size"


def measure_algorithms(args: argparse.Namespace) -> list[tuple[str, str, stats.Spread]]:
    everything, headline = [], []
    for config in args.configs.split(","):
        backend, _, n = config.partition(":")
        before = machine.load()
        cmd, objs = bench_job(backend, int(n or 2), args.max_size, args.repeats, args.timeout, args.probe,
                              args.iters)
        print(f"\n### allreduce, {n} ranks, {backend}\n\n`{' '.join(cmd)}`; load before: {before}; "
              f"after: {machine.load()}\n", flush=True)
        print(algorithms_table(objs), flush=True)
        everything += objs
        for c in (o for o in objs if o.get("summary")):
            p = c.get("auto_paired") or [c["auto_ratio"]] * 3
            # auto_paired is native / auto per round: the headline's ratio is ringpipe's time over the peer's
            headline.append((f"allreduce with algorithm=\"auto\", {sizes.label(c['bytes'])}, {n} ranks",
                             f"native {backend} allreduce", stats.Spread(1 / p[0], 1 / p[2], 1 / p[1], "IQR")))
    if args.json:
        Path(args.json).write_text("".join(json.dumps(o) + "\n" for o in everything))
    return headline


# --- chunks: ring message chunking -----------------------------------------------------------------

def chunks_ranks(comm: Any, iters: int, chunk_sizes: list[int]) -> dict:
    """Per (size, setting) the time of every iteration on this rank (iteration 0 a warm-up, not kept)."""
    import torch

    import ringpipe.collectives.common as common
    from ringpipe import collectives

    torch.set_num_threads(1)
    out: dict = {}
    for size in chunk_sizes:
        x = torch.ones(size // 4)
        order = [*CHUNK_SETTINGS, "native"]
        for i in range(iters + 1):
            for v in order[i % len(order):] + order[:i % len(order)]:  # rotated: no setting always first
                if v != "native":
                    common.MAX_CHUNKS = v  # the same on every rank: message tags depend on it
                comm.barrier()
                t = time.perf_counter()
                if v == "native":
                    comm.allreduce(x, "sum")
                else:
                    collectives.allreduce(comm, x, "sum", algorithm="ring")
                if i:
                    out.setdefault((size, v), []).append(time.perf_counter() - t)
    return out


def chunks_report(res: list[dict], n: int, iters: int, chunk_sizes: list[int]) -> str:
    def t(size: int, v: object) -> float:
        return statistics.median(max(r[(size, v)][i] for r in res) for i in range(iters))

    rows = []
    for size in chunk_sizes:
        nat = t(size, "native")
        rows.append((sizes.label(size), f"{nat * 1e3:.2f}",
                     *(f"{t(size, v) * 1e3:.2f} ({nat / t(size, v):.2f}x)" for v in CHUNK_SETTINGS)))
    return (f"\n### ring allreduce over gloo, {n} ranks: median ms (native / ring)\n\n"
            + report.table(("size", "native", *(f"max_chunks={v}" for v in CHUNK_SETTINGS)), rows,
                           (False, True, *([True] * len(CHUNK_SETTINGS)))))


# --- probe: how reliably auto's probe picks --------------------------------------------------------

def old_rule(times: dict[str, list[float]], rounds: int = OLD_ROUNDS, margin: float = 0.10) -> str:
    """The earlier choice: native unless the fastest-looking candidate's slowest round beats native's fastest by ``margin``."""
    first = {a: t[:rounds] for a, t in times.items() if t}
    worst = {a: max(t) for a, t in first.items()}
    choice = min(worst, key=lambda a: (worst[a], a))
    if choice != "native" and worst[choice] > (1.0 - margin) * min(first["native"]):
        return "native"
    return choice


def probe_ranks(comm: Any, trials: int, probe_sizes: list[int]) -> list[dict]:
    import torch

    from ringpipe.collectives import autotune

    torch.set_num_threads(1)
    out = []
    for _ in range(trials):
        autotune.forget()
        t0 = time.perf_counter()
        table = autotune.probe(comm, probe_sizes)
        took = max(comm.allgather_object(time.perf_counter() - t0))
        out.append({"seconds": took, "rows": [(b, c, t) for b, c, t in table.rows]})
    autotune.forget()
    return out


def _tally(names: list[str]) -> str:
    short = {"recursive_doubling": "rd", "rabenseifner": "rab", "hierarchical": "hier"}
    return " ".join(f"{short.get(a, a)}x{n}" for a, n in sorted(Counter(names).items(), key=lambda kv: -kv[1]))


def probe_report(trials: list[dict], probe_sizes: list[int]) -> str:
    from ringpipe.collectives import autotune

    rows = []
    for k, nbytes in enumerate(probe_sizes):
        rounds = [t["rows"][k][2] for t in trials]

        def ratio(name: str, rounds: list[dict] = rounds) -> str:
            got = [autotune.paired(r, name)[0] for r in rounds if r.get(name)]
            return f"{statistics.median(got):.2f}" if got else "-"

        rows.append((sizes.label(nbytes), _tally([t["rows"][k][1] for t in trials]),
                     _tally([old_rule(r) for r in rounds]), ratio("recursive_doubling"), ratio("ring")))
    took = ", ".join(f"{t['seconds']:.1f}" for t in trials)
    return (f"\nprobe seconds: {took}\n\n"
            + report.table(("size", "paired rule chose", "earlier rule chose (same rounds)", "rd / native paired",
                            "ring / native paired"), rows, (False, False, False, True, True)))


# --- pairwise: gloo's allreduce against a swap and an add ----------------------------------------

def _pairwise(comm: Any, x: Any) -> None:
    import torch

    theirs = torch.empty_like(x)
    send = comm.isend(x, 1 - comm.rank, 7_200_001)
    recv = comm.irecv(theirs, 1 - comm.rank, 7_200_001)
    recv.wait()
    send.wait()
    x.add_(theirs)


def _calls(nbytes: int) -> int:
    return 100 if nbytes <= 256 * 1024 else 20 if nbytes <= 4 << 20 else 6


def pairwise_ranks(comm: Any, pair_sizes: tuple[int, ...], rounds: int, compute: int = 0,
                   calls: int | None = None) -> dict[int, dict[str, list[float]]]:
    import torch

    torch.set_num_threads(1)
    a = torch.rand(128, 128)
    out: dict[int, dict[str, list[float]]] = {}
    for nbytes in pair_sizes:
        n = nbytes // 4
        x = torch.empty(n)
        variants = {"native": lambda x=x: comm.iallreduce(x).wait(), "pairwise": lambda x=x: _pairwise(comm, x)}
        expected = torch.full((n,), 3.0)  # 1 + 2 from ranks 0 and 1
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(rounds):
            for name in timing.order(list(variants), r):
                f = variants[name]
                x.fill_(comm.rank + 1.0)
                f()
                if not torch.equal(x, expected):
                    raise SystemExit(f"{name} at {nbytes} B: wrong sum on rank {comm.rank}")
                comm.barrier()
                for _ in range(calls or _calls(nbytes)):
                    x.fill_(comm.rank + 1.0)
                    t0 = time.perf_counter()
                    for _ in range(compute):
                        a @ a
                    f()
                    times[name].append(time.perf_counter() - t0)
        every = comm.allgather_object(times)
        out[nbytes] = {k: [max(e[k][i] for e in every) for i in range(len(times[k]))] for k in times}
    return out


def pairwise_report(results: dict[int, dict[str, list[float]]]) -> str:
    rows = []
    for nbytes, v in results.items():
        sp = {k: stats.spread(v[k], "p10-p90") for k in ("native", "pairwise")}
        rows.append((sizes.label(nbytes), sp["native"].fmt(0, 1e6), sp["pairwise"].fmt(0, 1e6),
                     f"{sp['native'].median / sp['pairwise'].median:.2f}",
                     "apart" if stats.apart(sp["native"], sp["pairwise"]) else "overlap"))
    return report.table(("size", "native us, median (p10-p90)", "pairwise us, median (p10-p90)", "native / pairwise",
                         ""), rows, (True, False, False, True, False))


# --- driver ---------------------------------------------------------------------------------------

def quick_ranks(comm: Any) -> dict[str, Any]:
    """Every spawned measure at tiny sizes in one job (the ``--quick`` run)."""
    return {"chunks": chunks_ranks(comm, 1, [1 << 16]), "probe": probe_ranks(comm, 1, [4096]),
            "pairwise": pairwise_ranks(comm, (4096,), 2, 1, calls=3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", choices=("algorithms", "chunks", "probe", "pairwise"), default="algorithms")
    ap.add_argument("--configs", default="gloo:2,gloo:4,mpi:2",
                    help="algorithms: backend:ranks pairs, comma-separated (4 ranks oversubscribe a 2-core host)")
    ap.add_argument("--max-size", default="64M", help="algorithms, probe: the largest size")
    ap.add_argument("--repeats", type=int, default=9, help="algorithms: interleaved rounds per size (-r of ringpipe bench)")
    ap.add_argument("--iters", type=int, default=None,
                    help="algorithms: calls per timed block (-i of ringpipe bench); chunks: iterations (default 12)")
    ap.add_argument("--no-probe", dest="probe", action="store_false", help="algorithms: auto on its rules, no probe")
    ap.add_argument("--timeout", type=float, default=3600, help="algorithms: seconds per configuration")
    ap.add_argument("--json", default=None, help="algorithms: also write every row to this file")
    ap.add_argument("--ranks", default="2,4", help="chunks: world sizes; probe: the first one")
    ap.add_argument("--trials", type=int, default=5, help="probe: probes one after another in the same job")
    ap.add_argument("--sizes", default=",".join(map(str, sizes.powers(4096, 16 << 20))), help="pairwise: bytes")
    ap.add_argument("--rounds", type=int, default=6, help="pairwise: interleaved rounds")
    ap.add_argument("--compute", type=int, default=0, help="pairwise: 128x128 matrix products before each call")
    ap.add_argument("--quick", action="store_true", help="seconds: every measure at tiny sizes, 2 ranks, one round")
    args = ap.parse_args(argv)
    report.header("collectives", argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from ringpipe.launch import spawn

    headline: list[tuple[str, str, stats.Spread]] = []
    if args.quick:
        args.configs, args.max_size, args.repeats, args.iters, args.probe = "gloo:2", "4K", 1, 2, False
        headline = measure_algorithms(args)
        got = spawn(quick_ranks, 2)
        print(chunks_report([g["chunks"] for g in got], 2, 1, [1 << 16]))
        print(probe_report(got[0]["probe"], [4096]))
        print("\n" + pairwise_report(got[0]["pairwise"]))
    elif args.measure == "algorithms":
        headline = measure_algorithms(args)
    elif args.measure == "chunks":
        chunk_sizes = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
        for n in (int(r) for r in args.ranks.split(",")):
            res = spawn(chunks_ranks, n, args=(args.iters or 12, chunk_sizes))
            print(chunks_report(res, n, args.iters or 12, chunk_sizes), flush=True)
    elif args.measure == "probe":
        from ringpipe.collectives import autotune

        probe_sizes = [s for s in autotune.PROBE_SIZES if s <= sizes.parse(args.max_size)]
        n = int(args.ranks.split(",")[0])
        print(f"\n{args.trials} probes, gloo, {n} ranks; load before: {machine.load()}", flush=True)
        print(probe_report(spawn(probe_ranks, n, args=(args.trials, probe_sizes))[0], probe_sizes))
    else:
        pair_sizes = tuple(int(s) for s in args.sizes.split(","))
        results = spawn(pairwise_ranks, 2, args=(pair_sizes, args.rounds, args.compute))[0]
        print(f"\n2 ranks, gloo, float32, {args.rounds} interleaved rounds, {args.compute} matrix products before "
              f"each call\n")
        print(pairwise_report(results))
    if headline:
        report.headline(headline)
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
