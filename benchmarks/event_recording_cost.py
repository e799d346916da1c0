"""What the default run pays for ``ringpipe doctor RUN`` and ``ringpipe trace RUN``: events recorded and saved.

Every communication call is recorded as an event (always on) and, since the default run writes
``events.json``, saved when the run ends. This measures both on the default training step
(``ringpipe train``'s default: an MLP 64-128-64-10, batch 32 per rank, Adam, ringpipe's
DistributedOptimizer over gloo, 2 ranks):

- recording: steps with the event log on and off (its ``begin``/``record`` replaced by a no-op),
  alternating one step of each, the order swapped every pair, after a warm-up; the median step
  time of each (the slower rank's), and the difference as a share of the step;
- recording, by its parts: the time of one event (``begin`` + ``end`` on an EventLog, a million
  times, less the empty loop) times the events a step records, over the median step: a figure
  that the load of a shared host does not blur as it blurs the alternated one;
- saving: ``collect_events`` (which the default profile already did) and ``save_events`` of the
  steps' events, as a share of the time of those steps.

    python benchmarks/event_recording_cost.py                 # 2 ranks, 300 pairs of steps
    python benchmarks/event_recording_cost.py --pairs 1000
    python benchmarks/event_recording_cost.py --quick        # seconds: 20 pairs, 5 warm-up
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import report, stats  # noqa: E402


def _work(comm, pairs: int, warmup: int) -> dict:  # noqa: ANN001
    import torch
    from torch import nn

    import ringpipe as hvd
    from ringpipe.comm.events import EventLog
    from ringpipe.observe.collect import collect_events, save_events

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hvd.init(comm)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    loss_fn = nn.CrossEntropyLoss()
    real_begin, real_record = EventLog.begin, EventLog.record
    scratch = ["", 0, 0, 0, 0, 0, "", None]

    def off_begin(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        return scratch

    def off_record(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        return None

    def step() -> float:
        comm.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"on": [], "off": []}
    comm.log.clear()
    for i in range(warmup + pairs):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        for kind in order:
            EventLog.begin, EventLog.record = (real_begin, real_record) if kind == "on" else (off_begin, off_record)
            dt = step()
            if i >= warmup:
                times[kind].append(dt)
    EventLog.begin, EventLog.record = real_begin, real_record
    steps_s = sum(times["on"])
    t = time.perf_counter()
    job = collect_events(comm)
    collect_s = time.perf_counter() - t
    out = {"times": times, "steps_s": steps_s, "collect_s": collect_s, "events": len(comm.log)}
    if job is not None:
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            path = save_events(Path(d) / "events.json", job)
            out["save_s"] = time.perf_counter() - t
            out["bytes"] = path.stat().st_size
    return out


def event_cost_s(n: int = 1_000_000) -> float:
    """Seconds one recorded event costs (``begin`` and ``end``), the empty loop taken off; best of 5."""
    from ringpipe.comm.events import EventLog

    best = float("inf")
    for _ in range(5):
        log = EventLog()
        t = time.perf_counter()
        for _ in range(n):
            log.end(log.begin("allreduce", 4096, -1, 0, "world"))
        full = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(n):
            pass
        best = min(best, (full - (time.perf_counter() - t)) / n)
    return best


def main() -> None:
    from ringpipe.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="seconds: 20 pairs of steps after 5 warm-up pairs")
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.warmup = 20, 5
    report.header("event_recording_cost")
    results = spawn(_work, args.ranks, args=(args.pairs, args.warmup))
    # per step pair, the slower rank's time counts (the job waits for it)
    on = [max(r["times"]["on"][i] for r in results) for i in range(args.pairs)]
    off = [max(r["times"]["off"][i] for r in results) for i in range(args.pairs)]
    m_on, m_off = statistics.median(on), statistics.median(off)
    diffs = [a - b for a, b in zip(on, off, strict=True)]
    d = stats.spread(diffs, "p10-p90")
    r0 = results[0]
    per_event = event_cost_s(100_000 if args.quick else 1_000_000)
    per_step = r0["events"] / (args.pairs + args.warmup)  # events of the recorded steps (and their barrier)
    print(f"{args.ranks} ranks, {args.pairs} pairs of steps (recording on / off alternated), "
          f"{r0['events']} events recorded on rank 0\n")
    rows = [
        ["recording, alternated: step median on / off", f"{1e3 * m_on:.3f} / {1e3 * m_off:.3f} ms",
         f"{100 * (m_on - m_off) / m_off:+.2f} %"],
        ["recording, paired difference (on - off) per step, median (p10..p90)",
         f"{1e6 * d.median:+.1f} us ({1e6 * d.low:+.1f} .. {1e6 * d.high:+.1f})", f"{100 * d.median / m_off:+.2f} %"],
        [f"recording, by parts: one event x {per_step:.1f} events a step",
         f"{1e6 * per_event:.2f} us x {per_step:.1f} = {1e6 * per_event * per_step:.1f} us",
         f"{100 * per_event * per_step / m_off:.3f} %"],
    ]
    if "save_s" in r0:
        rows.append(["end of run: collect_events (the profile's, already paid)", f"{1e3 * r0['collect_s']:.1f} ms once", "not new"])
        rows.append([f"end of run: save_events ({r0['bytes'] / 1024:.0f} KiB)", f"{1e3 * r0['save_s']:.1f} ms once",
                     f"{100 * r0['save_s'] / r0['steps_s']:.2f} % of the {args.pairs} recorded steps' time"])
    print(report.table(["what", "measured", "share of the step"], rows))
    report.footer()


if __name__ == "__main__":
    main()
