"""How often `ringpipe doctor` names the right culprit on three hosts, and how often it accuses the innocent.

Seed 000's setup on one machine: three network-namespace hosts joined by a bridge (needs root),
8 ranks placed 4-2-2, 3-3-2 or 4-3-1. Scenarios: nothing wrong; a single-rank host (4-3-1);
host c's link shaped with ``tc tbf``; a rank that arrives late at every allreduce (a script's
events, then ``ringpipe doctor EVENTS``). Each trial runs the doctor under ``ringpipe launch
--nnodes 3`` (gloo) or Open MPI's ``mpirun`` (mpi backend) and scores its JSON report: the
expected problem named, and every other problem counted as a false accusation. Prints a
markdown table; for the shaped link, also the allreduce time with and without host c that the
doctor measured (the fix it recommends, proven in the same run).

    python benchmarks/doctor_trials.py --trials 10 [--launchers launch,mpirun] [--size 256K]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import netns  # noqa: E402

LATE = str(HERE.parent / "tests" / "scripts" / "doctor_late_rank.py")
C = "rp-host-c"

#: name -> (ranks per host, rate of host c's link, late rank, how the problems must read)
SCENARIOS: dict[str, tuple[tuple[int, int, int], str | None, int | None, list[str]]] = {
    "4-2-2, nothing wrong": ((4, 2, 2), None, None, []),
    "3-3-2, nothing wrong": ((3, 3, 2), None, None, []),
    "4-3-1": ((4, 3, 1), None, None, [f"placement 4-3-1: host {C} runs a single rank"]),
    "4-2-2, host c's link at 50 Mbit/s": ((4, 2, 2), "50mbit", None, [f"host {C}'s network link is slow"]),
    "4-3-1, host c's link at 50 Mbit/s": ((4, 3, 1), "50mbit", None,
                                          [f"host {C}'s network link is slow", "placement 4-3-1: host"]),
    "4-2-2, rank 5 late (events)": ((4, 2, 2), None, 5, ["rank 5 (host rp-host-b) arrives late"]),
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RINGPIPE_BACKEND", "WORLD_SIZE", "RANK")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def report_of(text: str) -> dict[str, Any]:
    """The doctor's JSON report in a launcher's output (prefixes such as ``[0]:`` allowed)."""
    # Open MPI's --tag-output may cut a long line and tag each piece: glue the pieces back.
    text = re.sub(r"\n?\[\d+,\d+\]<std(out|err)>:", "", text)
    start = text.index('{"ranks"')
    report = json.JSONDecoder().raw_decode(text, start)[0]
    if not all("severity" in f for f in report.get("findings", [])):
        raise ValueError(f"a report that does not parse whole: {text[start:start + 3000]}")
    return report


def run_trial(shape: tuple[int, ...], rate: str | None, late: int | None, launcher: str, size: str,
              port: int, work: Path) -> dict[str, Any]:
    """One trial: build the hosts, run the doctor (or the late-rank script and then the doctor), return its report."""
    rates = {2: rate} if rate else None
    with netns.bridged_hosts(3, rates) as hosts:
        if late is not None:
            events = work / f"events-{port}.json"
            argv = [LATE, str(events), str(late)]
            if launcher == "launch":
                outs = netns.launch_across(hosts, shape, argv, port, _env())
                failed = [o for o in outs if o.returncode]
            else:
                cmd, extra = netns.mpirun_across(hosts, [sys.executable, *argv], work / "hostfile", shape)
                out = subprocess.run(cmd, capture_output=True, text=True, env=_env(RINGPIPE_BACKEND="mpi", **extra),
                                     timeout=300)
                failed = [out] if out.returncode else []
            if failed:
                raise RuntimeError(failed[0].stdout[-2000:] + failed[0].stderr[-3000:])
            done = subprocess.run([sys.executable, "-m", "ringpipe.cli", "doctor", "--json", str(events)],
                                  capture_output=True, text=True, env=_env(), timeout=120)
            return report_of(done.stdout)
        args = ["doctor", "--json", "--size", size, "--verify", "3"]
        if launcher == "launch":
            outs = netns.launch_across(hosts, shape, ["-m", "ringpipe.cli", *args], port, _env())
            text = outs[0].stdout
            if any(o.returncode for o in outs):
                raise RuntimeError("".join(o.stdout[-1500:] + o.stderr[-2500:] for o in outs))
        else:
            cmd, extra = netns.mpirun_across(hosts, [sys.executable, "-m", "ringpipe.cli", *args],
                                             work / "hostfile", shape)
            out = subprocess.run(cmd, capture_output=True, text=True, env=_env(RINGPIPE_BACKEND="mpi", **extra),
                                 timeout=300)
            if out.returncode:
                raise RuntimeError(out.stdout[-2000:] + out.stderr[-3000:])
            text = out.stdout
        return report_of(text)


def score(report: dict[str, Any], expected: list[str]) -> tuple[bool, list[str]]:
    """(every expected problem named, the problems that were not expected)."""
    problems = [f["what"] for f in report["findings"] if f["severity"] == "problem"]
    named = all(any(p.startswith(e) for p in problems) for e in expected)
    false = [p for p in problems if not any(p.startswith(e) for e in expected)]
    return named, false


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--launchers", default="launch,mpirun")
    ap.add_argument("--size", default="256K", help="probe message size (doctor --size)")
    ap.add_argument("--only", default=None, help="run the scenarios whose name contains this text")
    args = ap.parse_args()
    reason = netns.can_create()
    if reason:
        print(f"doctor_trials: {reason}", file=sys.stderr)
        return 2
    launchers = [x for x in args.launchers.split(",") if x]
    if "mpirun" in launchers and shutil.which("mpirun") is None:
        launchers.remove("mpirun")
    rows = []
    port = 29700
    with tempfile.TemporaryDirectory(prefix="rp-doctor-trials-") as tmp:
        for name, (shape, rate, late, expected) in SCENARIOS.items():
            if args.only and args.only not in name:
                continue
            for launcher in launchers:
                named, falses, gains, secs = 0, [], [], []
                for _ in range(args.trials):
                    port += 1
                    t0 = time.time()
                    try:
                        report = run_trial(shape, rate, late, launcher, args.size, port, Path(tmp))
                    except Exception as exc:  # noqa: BLE001 - a failed trial is scored as missed
                        print(f"  {name} / {launcher}: trial failed: {str(exc)[-600:]}", file=sys.stderr)
                        falses.append("(trial failed)")
                        continue
                    secs.append(time.time() - t0)
                    ok, false = score(report, expected)
                    named += ok
                    falses += false
                    ms = report.get("allreduce_ms", {})
                    if f"without {C}" in ms:
                        gains.append(ms["ring"] / ms[f"without {C}"])
                    elif expected and "placement" in expected[0] and ms:
                        best = min(v for k, v in ms.items() if not k.startswith("without"))
                        gains.append(ms["ring"] / best)
                    print(f"  {name} / {launcher}: named={ok} false={false} ({time.time() - t0:.0f} s)",
                          file=sys.stderr, flush=True)
                rows.append((name, launcher, args.trials, named if expected else "-", len(falses),
                             sorted(set(falses)), statistics.median(gains) if gains else None,
                             statistics.median(secs) if secs else 0.0))
    print("\n| scenario | launcher | trials | named correctly | false accusations | fix measured (ring / fix) "
          "| s per trial |\n|---|---|---|---|---|---|---|")
    for name, launcher, n, named, nfalse, falses, gain, secs in rows:
        what = f"{nfalse}" + (f" ({'; '.join(falses)[:160]})" if falses else "")
        print(f"| {name} | {launcher} | {n} | {named if named == '-' else f'{named}/{n}'} | {what} | "
              f"{'-' if gain is None else f'{gain:.1f}x'} | {secs:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
