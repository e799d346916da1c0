"""What the schedules imply for the pipeline benchmark's variants, from their action lists alone.

For each variant measured by ``pipeline_vs_torch.py``: the bubble of one step run alone, the time
per step in the steady state of consecutive steps (both with ``lib/pipeline/schedule_sim.py``'s unit costs,
F = 1, B = 2, I = W = 1 per stage), the time per step with the variant's own measured thread CPU
per action, and the steady-state bubble ``1 - ideal / time per step``. ringpipe's action lists
come from its schedule functions, torch's from what its ranks were seen to run.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from lib.pipeline.schedule_sim import Op, ringpipe_ops, simulate
from ringpipe.pipeline.schedules import async_1f1b, get_schedule

__all__ = ["steady", "theory"]


def theory(args: argparse.Namespace, r0: dict[str, list[dict]], r1: dict[str, list[dict]]) -> dict[str, tuple[float, float, float, float]]:
    """Per variant: the bubble fraction of one step alone (async: of the whole stream), the time
    per step per micro-batch in the steady state of consecutive steps (units of one stage's
    forward of a micro-batch; async: the stream's mean), both with F = 1, B = 2, I = W = 1 per
    stage, the ms per step the schedule implies with the variant's own measured CPU costs per
    chunk and kind of action (medians over blocks of the median call; messages and optimizer step
    not counted), and the steady-state bubble ``1 - ideal / time per step`` (ideal: a rank's
    compute per micro-batch)."""
    m, t = args.microbatches, args.steps
    out: dict[str, tuple[float, float, float, float]] = {}
    for name, reps in r0.items():
        sched = name.split()[1].split("+")[0]
        costs: dict[tuple[int, str], float] = {}
        for res in (r0, r1):
            keys = {k for rep in res[name] for k in rep.get("costs", {})}
            for k in keys:
                chunk, kind = k.split(":")
                costs[(int(chunk), kind)] = 1e3 * statistics.median(
                    rep["costs"][k] for rep in res[name] if k in rep.get("costs", {}))
        if name.startswith("torch"):
            per = {r: [Op(*o) for o in res[name][0]["ops"]] for r, res in enumerate((r0, r1))}
            kw: dict[str, Any] = {"num_chunks": reps[0]["chunks"], "chunks_per_rank": reps[0]["chunks"] // 2}
            steps = 1
        elif sched == "async_1f1b":
            per = ringpipe_ops([async_1f1b(2, m * t, s, m) for s in range(2)])
            kw, steps = {"num_chunks": 2}, t
        elif sched == "interleaved_1f1b":
            per = ringpipe_ops([get_schedule(sched)(2, m, s, 2) for s in range(2)])
            kw, steps = {"num_chunks": 4, "chunks_per_rank": 2}, 1
        else:
            per = ringpipe_ops([get_schedule(sched)(2, m, s) for s in range(2)])
            kw, steps = {"num_chunks": 2}, 1
        tm = simulate(per, **kw)
        if steps == 1:  # consecutive steps: a rank starts the next one when it is done (no barrier)
            unit = steady(per, m, kw)
            measured = steady(per, m, kw, costs) if costs else float("nan")
        else:
            unit = tm.makespan / steps
            measured = simulate(per, **kw, costs=costs).makespan / steps if costs else float("nan")
        ideal = tm.busy / (tm.ranks * steps * m)  # a rank's compute per micro-batch: 3 units
        out[name] = (tm.bubble, unit / m, measured, 1.0 - ideal / (unit / m))
    return out


def steady(per: dict[int, list[Op]], m: int, kw: dict[str, Any], costs: Any = None) -> float:
    """Time one more step adds to a run of consecutive steps of one step's ops (the steady state).

    A rank takes its optimizer step on its own and goes on with the next step's actions (both
    systems: no barrier between steps), so a schedule whose first rank finishes before the last
    (ZB-H2's parallelogram, V shapes) overlaps the next step's start with this step's end.
    """
    def tiled(k: int) -> dict[int, list[Op]]:
        return {r: [Op(o.chunk, o.kind, o.mb + i * m) for i in range(k) for o in ops] for r, ops in per.items()}
    return simulate(tiled(4), **kw, costs=costs).makespan - simulate(tiled(3), **kw, costs=costs).makespan
