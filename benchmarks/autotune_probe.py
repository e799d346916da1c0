"""How reliably ``auto``'s probe picks the faster allreduce: the probe run several times, two rules on its rounds.

    python benchmarks/autotune_probe.py                      # gloo, 2 ranks, 5 probes, 4 KiB - 64 MiB
    python benchmarks/autotune_probe.py --ranks 4 --trials 3

One job of ``--ranks`` processes runs ``ringpipe.collectives.autotune.probe`` ``--trials`` times
one after another (the table forgotten in between). For every size this prints, over the
trials: how often the probe's rule (:func:`ringpipe.collectives.autotune.decide`: median paired
ratio at most 0.9 and faster than native in two thirds of the rounds) chose each algorithm; how
often the rule it replaced would have chosen each on the same measurements (another algorithm only
if its slowest round is 10 % below native's fastest, over the first 4 rounds, as the probe of
``ringpipe bench`` ran them); recursive doubling's and the ring's median paired ratio to native
(time over native's time in the same round; the median over the trials); and the probe's time.
The load average is printed before and after; ``--json FILE`` keeps every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter

OLD_ROUNDS = 4


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def old_rule(times: dict[str, list[float]], rounds: int = OLD_ROUNDS, margin: float = 0.10) -> str:
    """The earlier choice: native unless the fastest-looking candidate's slowest round beats native's fastest by ``margin``."""
    first = {a: t[:rounds] for a, t in times.items() if t}
    worst = {a: max(t) for a, t in first.items()}
    choice = min(worst, key=lambda a: (worst[a], a))
    if choice != "native" and worst[choice] > (1.0 - margin) * min(first["native"]):
        return "native"
    return choice


def _job(comm, trials: int, sizes: list[int]) -> list[dict]:  # noqa: ANN001
    import torch

    from ringpipe.collectives import autotune

    torch.set_num_threads(1)
    out = []
    for _ in range(trials):
        autotune.forget()
        t0 = time.perf_counter()
        table = autotune.probe(comm, sizes)
        took = max(comm.allgather_object(time.perf_counter() - t0))
        out.append({"seconds": took, "rows": [(b, c, t) for b, c, t in table.rows]})
    autotune.forget()
    return out


def _short(name: str) -> str:
    return {"recursive_doubling": "rd", "rabenseifner": "rab", "hierarchical": "hier"}.get(name, name)


def _tally(names: list[str]) -> str:
    return " ".join(f"{_short(a)}x{n}" for a, n in sorted(Counter(names).items(), key=lambda kv: -kv[1]))


def main() -> None:
    from ringpipe.collectives import autotune
    from ringpipe.launch import spawn
    from ringpipe.observe.bench_measure import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backend", default="gloo", help="gloo (mpi needs mpirun: run ringpipe bench --backend mpi)")
    ap.add_argument("--trials", type=int, default=5, help="probes one after another in the same job")
    ap.add_argument("--max-size", default="64M")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write every probe's rounds to FILE")
    a = ap.parse_args()
    if a.trials < 1 or a.ranks < 2:
        ap.error("needs --trials >= 1 and --ranks >= 2")
    sizes = [s for s in autotune.PROBE_SIZES if s <= parse_size(a.max_size)]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"# {a.trials} probes, {a.backend}, {a.ranks} ranks; before: {_load()}", flush=True)
    trials = spawn(_job, a.ranks, a.backend, args=(a.trials, sizes))[0]
    print(f"# after: {_load()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(trials, f)
    took = ", ".join(f"{t['seconds']:.1f}" for t in trials)
    print(f"# probe seconds: {took}\n")
    print("| size | paired rule chose | earlier rule chose (same rounds) | rd / native paired | ring / native paired |")
    print("| --- | --- | --- | ---: | ---: |")
    for k, nbytes in enumerate(sizes):
        rows = [t["rows"][k][2] for t in trials]
        new = [t["rows"][k][1] for t in trials]
        old = [old_rule(r) for r in rows]

        def ratio(name: str, rows: list[dict] = rows) -> str:
            got = [autotune.paired(r, name)[0] for r in rows if r.get(name)]
            return f"{statistics.median(got):.2f}" if got else "-"

        label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        print(f"| {label} | {_tally(new)} | {_tally(old)} | {ratio('recursive_doubling')} | {ratio('ring')} |")


if __name__ == "__main__":
    main()
