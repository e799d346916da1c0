"""ringpipe's allreduce algorithms and ``auto`` against the backend's own, over gloo and MPI, in one command.

    python benchmarks/collectives.py                       # gloo 2 and 4 ranks, MPI 2 ranks, 4 KiB - 64 MiB
    python benchmarks/collectives.py --configs gloo:2 --max-size 1M --repeats 3

Every configuration is one ``ringpipe bench allreduce -n N --backend B -b 4K -e MAX -f 4 -r R``
job: it probes ``auto``'s table first (``ringpipe.collectives.autotune``), then times the
native collective, each of ringpipe's algorithms and ``auto`` in interleaved rounds at every
size (``ringpipe.observe.bench_measure``). This script prints, per configuration, the load
average before and after, the exact command, and one Markdown row per size: native, the best
own algorithm and ``auto`` (median time per call and min-max over the rounds), the ratios
native time / variant time, whether the spreads overlap (``inconclusive``) or not, and auto /
native paired within each round (median and interquartile range of the per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def _load() -> str:
    """The 1-, 5- and 15-minute load averages and the number of CPUs."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def run(backend: str, nprocs: int, max_size: str, repeats: int, timeout: float) -> tuple[list[str], list[dict]]:
    """One ``ringpipe bench`` job; (its command line, every JSON object rank 0 printed)."""
    cmd = ["ringpipe", "bench", "allreduce", "-n", str(nprocs), "--backend", backend, "-b", "4K", "-e", max_size,
           "-f", "4", "-r", str(repeats), "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RINGPIPE_BACKEND", None)
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", *cmd[1:]], capture_output=True, text=True,
                         env=env, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{backend} x{nprocs} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    objs = []
    for line in out.stdout.splitlines():
        start = line.find("{")
        if start >= 0:
            objs.append(json.JSONDecoder().raw_decode(line, start)[0])
    return cmd, objs


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _cell(r: dict) -> str:
    return f"{r['time_us']:.0f} [{r['time_min_us']:.0f}–{r['time_max_us']:.0f}]"


def _paired(p: list[float] | None) -> str:
    return f"{p[0]:.2f} ({p[1]:.2f}–{p[2]:.2f})" if p else "–"


def table(objs: list[dict]) -> str:
    """One Markdown row per size from the bench's rows and comparisons."""
    rows = [o for o in objs if not o.get("summary")]
    by = {(r["bytes"], r["algorithm"]): r for r in rows}
    lines = ["| size | native µs [min–max] | best own: algorithm, µs [min–max] | best/native | "
             "auto chose, µs [min–max] | auto/native | auto/native paired per round, median (IQR) |",
             "| --- | --- | --- | ---: | --- | ---: | ---: |"]
    for c in (o for o in objs if o.get("summary")):
        n = c["bytes"]
        native, best, auto = by[(n, "native")], by[(n, c["best"])], by[(n, "auto")]
        lines.append(f"| {_size(n)} | {_cell(native)} | {c['best']} {_cell(best)} | "
                     f"{c['best_ratio']:.2f} ({c['best_verdict']}) | {c['auto_chose']} {_cell(auto)} | "
                     f"{c['auto_ratio']:.2f} ({c['auto_verdict']}) | {_paired(c.get('auto_paired'))} |")
    wrong = sum(r["wrong"] for r in rows)
    lines.append(f"\nwrong results: {wrong}; {rows[0]['repeats'] if rows else '?'} interleaved rounds per size")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="gloo:2,gloo:4,mpi:2",
                    help="backend:ranks pairs, comma-separated (4 ranks oversubscribe a 2-core host)")
    ap.add_argument("--max-size", default="64M")
    ap.add_argument("--repeats", type=int, default=9, help="interleaved rounds per size (-r of ringpipe bench)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per configuration")
    ap.add_argument("--json", default=None, help="also write every row to this file")
    args = ap.parse_args()
    everything = []
    for config in args.configs.split(","):
        backend, _, n = config.partition(":")
        before = _load()
        cmd, objs = run(backend, int(n or 2), args.max_size, args.repeats, args.timeout)
        after = _load()
        print(f"\n### allreduce, {n} ranks, {backend}\n\n`{' '.join(cmd)}`; before: {before}; after: {after}\n",
              flush=True)
        print(table(objs), flush=True)
        everything += objs
    if args.json:
        Path(args.json).write_text("".join(json.dumps(o) + "\n" for o in everything))


if __name__ == "__main__":
    main()
