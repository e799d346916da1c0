"""Where a data-parallel step's CPU goes: per-thread CPU time and run-queue wait, per phase, DDP against ringpipe.

    nice -n -20 python benchmarks/dp_threads.py --models mlp --steps 20

Runs the variants of ``benchmarks/dp_vs_ddp.py`` (bound, DDP, ringpipe) on 2 gloo ranks and reads,
at each phase boundary of every timed step (forward, backward, step), every thread's CPU time and
the time it waited on a run queue for a core (``/proc/self/task/*/schedstat``). Threads are grouped
as ``main`` (the training thread), ``engine`` (ringpipe's background engine) and the rest by their
kernel name (gloo's and torch's own threads). Printed per variant, per phase, milliseconds per step
(median of the slowest rank over the steps): wall time, the CPU time of each group, the run-queue wait
of each group, and ``idle`` = 2 cores x wall - the CPU of both ranks (an estimate from one rank x 2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dp_vs_ddp import _loss, _variants  # noqa: E402

PHASES = ("forward", "backward", "step")


def _threads() -> dict[int, str]:
    names = {os.getpid(): "main"}
    for t in threading.enumerate():
        if t.name.startswith("ringpipe-engine") and t.native_id is not None:
            names[t.native_id] = "engine"
    return names


def _sample(known: dict[int, str]) -> dict[str, tuple[int, int]]:
    """CPU ns and run-queue wait ns per thread group."""
    out: dict[str, list[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, _ = (int(v) for v in f.read().split())
            name = known.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except OSError:
            continue
        acc = out.setdefault(name, [0, 0])
        acc[0] += run
        acc[1] += wait
    return {k: (v[0], v[1]) for k, v in out.items()}


def _diff(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> dict[str, tuple[float, float]]:
    return {k: ((b[k][0] - a.get(k, (0, 0))[0]) * 1e-6, (b[k][1] - a.get(k, (0, 0))[1]) * 1e-6) for k in b}


def _profile(variant: dict[str, Any], n: int) -> list[dict[str, Any]]:
    model, opt, x, y = variant["model"], variant["opt"], variant["x"], variant["y"]
    rows = []
    for _ in range(n):
        known = _threads()
        s0, t0 = _sample(known), time.perf_counter()
        opt.zero_grad()
        loss = _loss(model(x), y)
        s1, t1 = _sample(known), time.perf_counter()
        loss.backward()
        s2, t2 = _sample(known), time.perf_counter()
        opt.step()
        s3, t3 = _sample(known), time.perf_counter()
        rows.append({"forward": (t1 - t0, _diff(s0, s1)), "backward": (t2 - t1, _diff(s1, s2)),
                     "step": (t3 - t2, _diff(s2, s3))})
    return rows


def run_ranks(comm: Any, kind: str, steps: int, names: list[str]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    variants = {k: v for k, v in _variants(comm, kind, "none", False, torch.device("cpu")).items() if k in names}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    for v in variants.values():
        _profile(v, 3)
    for block in range(4):
        order = list(variants) if block % 2 == 0 else list(variants)[::-1]
        for name in order:
            comm.barrier()
            rows[name] += _profile(variants[name], max(1, steps // 4))
    out: dict[str, Any] = {}
    for name, rs in rows.items():
        per: dict[str, Any] = {}
        for ph in PHASES:
            groups = sorted({g for r in rs for g in r[ph][1]})
            per[ph] = {
                "wall": statistics.median(r[ph][0] * 1e3 for r in rs),
                "cpu": {g: statistics.median(r[ph][1].get(g, (0.0, 0.0))[0] for r in rs) for g in groups},
                "wait": {g: statistics.median(r[ph][1].get(g, (0.0, 0.0))[1] for r in rs) for g in groups},
            }
        out[name] = per
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--variants", default="bound,ddp,ringpipe")
    args = p.parse_args(argv)
    from ringpipe.launch import spawn

    for kind in args.models.split(","):
        res = spawn(run_ranks, 2, args=(kind, args.steps, args.variants.split(",")))
        print(f"== {kind} (load {os.getloadavg()[0]:.1f})")
        for rank, r in enumerate(res):
            for name, per in r.items():
                for ph in PHASES:
                    d = per[ph]
                    cpu = " ".join(f"{g}={v:.1f}" for g, v in d["cpu"].items() if v >= 0.05)
                    wait = " ".join(f"{g}={v:.1f}" for g, v in d["wait"].items() if v >= 0.05)
                    print(f"rank{rank} {name:9s} {ph:8s} wall={d['wall']:6.2f} cpu[{cpu}] runq[{wait}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
