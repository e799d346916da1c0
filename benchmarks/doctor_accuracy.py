"""How often `ringpipe doctor` names the right culprit on three hosts, and how often it accuses the innocent.

Seed 000's setup on one machine: three network-namespace hosts joined by a bridge (needs root),
8 ranks placed 4-2-2, 3-3-2 or 4-3-1. Scenarios: nothing wrong; a single-rank host (4-3-1);
host c's link shaped with ``tc tbf``; a rank that arrives late at every allreduce, and a rank
that computes four times as much before each (a script's events, then ``ringpipe doctor
EVENTS``); host c oversubscribed (its two ranks confined to one CPU that another job keeps
busy). Each trial runs under ``ringpipe launch --nnodes 3`` (gloo) or Open MPI's ``mpirun`` (mpi
backend) and scores the doctor's JSON report: the expected problem named, and every other
problem counted as a false accusation. Trials go round the scenarios and launchers in turn (a
trial of each, then the next round), each appended to ``--log`` as a JSON line as it ends;
prints a markdown table; for the shaped link, also the allreduce time with and without host c
that the doctor measured (the fix it recommends, proven in the same run).

    python benchmarks/doctor_accuracy.py --trials 10 [--launchers launch,mpirun] [--size 256K] [--log FILE]
    python benchmarks/doctor_accuracy.py --trials 10 --log FILE --resume   # go on: skip the trials FILE holds
    python benchmarks/doctor_accuracy.py --table FILE [--each]   # the table of a log (--each: every trial)
    python benchmarks/doctor_accuracy.py --clock 3        # clock_offsets under each launcher
    python benchmarks/doctor_accuracy.py --quick          # seconds: one probe on 2 local ranks, scored (no namespaces)

Where a trial's time goes (8 ranks on a 2-core machine): setting up the namespaces takes 0.4 s and
the probe itself 3-4 s (``phases_s`` in the log); the rest is starting the launchers and 8 Python
processes that import torch on 2 cores, and for an events scenario one more process for
``ringpipe doctor EVENTS``.
The probe already runs small (``--size 256K``, 3 repeats, ``--verify 3``).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import procs, report, testhelpers  # noqa: E402

netns = testhelpers.module("netns")
LATE = str(testhelpers.path("scripts/doctor_late_rank.py"))
CLOCK = str(testhelpers.path("scripts/doctor_clock.py"))


B, C = "rp-host-b", "rp-host-c"


class Scenario:
    """Ranks per host, what is wrong, and which problems name it (``expected``: all required;
    ``allowed``: also right, not false accusations)."""

    def __init__(self, shape: tuple[int, int, int], expected: list[str], rate: str | None = None,
                 late: int | None = None, script: str = "sleep", busy_c: bool = False,
                 allowed: list[str] | None = None) -> None:
        self.shape, self.expected, self.rate, self.late = shape, expected, rate, late
        self.script, self.busy_c, self.allowed = script, busy_c, allowed or []


SCENARIOS: dict[str, Scenario] = {
    "4-2-2, nothing wrong": Scenario((4, 2, 2), []),
    "3-3-2, nothing wrong": Scenario((3, 3, 2), []),
    "4-3-1": Scenario((4, 3, 1), [f"placement 4-3-1: host {C} runs a single rank"]),
    "4-2-2, host c's link at 50 Mbit/s": Scenario((4, 2, 2), [f"host {C}'s network link is slow"], rate="50mbit"),
    "4-3-1, host c's link at 50 Mbit/s": Scenario((4, 3, 1), [f"host {C}'s network link is slow",
                                                              "placement 4-3-1: host"], rate="50mbit"),
    "4-2-2, rank 5 late (events)": Scenario((4, 2, 2), [f"rank 5 (host {B}) arrives late"], late=5),
    "4-2-2, rank 5 computes 4x (events)": Scenario((4, 2, 2), [f"rank 5 (host {B}) arrives late"], late=5,
                                                   script="compute"),
    "4-2-2, host c oversubscribed": Scenario((4, 2, 2), [f"ranks [6, 7] on host {C} are bound to the same CPUs"],
                                             busy_c=True, allowed=[f"the ranks of host {C} compute slowly"]),
}



def report_of(text: str) -> dict[str, Any]:
    """The doctor's JSON report in a launcher's output (prefixes such as ``[0]:`` allowed)."""
    # Open MPI's --tag-output may cut a long line and tag each piece: glue the pieces back.
    text = re.sub(r"\n?\[\d+,\d+\]<std(out|err)>:", "", text)
    start = text.index('{"ranks"')
    report = json.JSONDecoder().raw_decode(text, start)[0]
    if not all("severity" in f for f in report.get("findings", [])):
        raise ValueError(f"a report that does not parse whole: {text[start:start + 3000]}")
    return report


def compute_worker(out: str, slow: int, reps: int = 10, nbytes: int = 256 << 10) -> None:
    """Every rank computes the same matrix products before each ring allreduce; rank ``slow`` four times as many."""
    import torch

    from ringpipe import collectives
    from ringpipe.comm import init_world, shutdown_world
    from ringpipe.observe import collect_events, save_events

    comm = init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(comm.rank))
    x = torch.ones(nbytes // 4)
    for _ in range(reps):
        for _ in range(80 if comm.rank == slow else 20):
            a = torch.tanh(a @ a / 256)
        collectives.allreduce(comm, x, "sum", algorithm="ring")
    job = collect_events(comm)
    if job is not None:
        save_events(out, job)
    shutdown_world()


def clock_table(launchers: list[str], blocks: int, port: int, work: Path) -> str:
    """``clock_offsets`` under each launcher (4-2-2, no fault), alternated in blocks; ms per call."""
    got: dict[str, list[float]] = {x: [] for x in launchers}
    with netns.bridged_hosts(3) as hosts:
        for b in range(blocks):
            for launcher in (launchers if b % 2 == 0 else launchers[::-1]):
                port += 1
                argv = [CLOCK, "5"]
                out = (_launch(hosts, argv, port, (4, 2, 2)) if launcher == "launch" else
                       _mpirun(hosts, [sys.executable, *argv], work, (4, 2, 2)))
                line = next(x for x in out.splitlines() if "CLOCK " in x)
                got[launcher] += json.JSONDecoder().raw_decode(line.split("CLOCK ", 1)[1])[0]["ms"]  # a tag may follow
                print(f"  clock block {b} / {launcher}: {got[launcher][-5:]} (load {os.getloadavg()[0]:.1f})",
                      file=sys.stderr, flush=True)
    rows = ["| launcher | calls | ms per clock_offsets (median) | min-max |", "|---|---|---|---|"]
    rows += [f"| {k} | {len(v)} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} |" for k, v in got.items() if v]
    return "\n".join(rows)


def _mpirun(hosts: tuple[Any, ...], argv: list[str], work: Path, shape: tuple[int, ...]) -> str:
    cmd, extra = netns.mpirun_across(hosts, argv, work / "hostfile", shape)
    out = subprocess.run(cmd, capture_output=True, text=True, env=netns.job_env(RINGPIPE_BACKEND="mpi", **extra), timeout=300)
    if out.returncode:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-3000:])
    return out.stdout


def _launch(hosts: tuple[Any, ...], argv: list[str], port: int, shape: tuple[int, ...]) -> str:
    outs = netns.launch_across(hosts, shape, argv, port, netns.job_env())
    if any(o.returncode for o in outs):
        raise RuntimeError("".join(o.stdout[-1500:] + o.stderr[-2500:] for o in outs))
    return outs[0].stdout


def run_trial(sc: Scenario, launcher: str, size: str, port: int, work: Path) -> dict[str, Any]:
    """One trial: build the hosts, run the doctor (or a script and then the doctor on its events), return its report."""
    rates = {2: sc.rate} if sc.rate else None
    with netns.bridged_hosts(3, rates, cpus={2: "1"} if sc.busy_c else None) as hosts:
        # Another job on host c keeps its CPU busy for the whole trial.
        hog = (subprocess.Popen([*hosts[2].prefix(), sys.executable, "-c", "while True: pass"],
                                start_new_session=True) if sc.busy_c else None)
        try:
            if sc.late is not None:
                events = work / f"events-{port}.json"
                argv = ([LATE, str(events), str(sc.late)] if sc.script == "sleep" else
                        [__file__, "--worker", str(events), str(sc.late)])
                if launcher == "launch":
                    _launch(hosts, argv, port, sc.shape)
                else:
                    _mpirun(hosts, [sys.executable, *argv], work, sc.shape)
                done = subprocess.run([sys.executable, "-m", "ringpipe.cli", "doctor", "--json", str(events)],
                                      capture_output=True, text=True, env=netns.job_env(), timeout=120)
                return {**report_of(done.stdout), "events_file": str(events)}
            args = ["-m", "ringpipe.cli", "doctor", "--json", "--size", size, "--verify", "3"]
            if launcher == "launch":
                return report_of(_launch(hosts, args, port, sc.shape))
            return report_of(_mpirun(hosts, [sys.executable, *args], work, sc.shape))
        finally:
            if hog is not None:
                os.killpg(hog.pid, 9)
                hog.wait()


def score(report: dict[str, Any], sc: Scenario) -> tuple[bool, list[str]]:
    """(every expected problem named, the problems that were neither expected nor allowed)."""
    problems = [f["what"] for f in report["findings"] if f["severity"] == "problem"]
    named = all(any(p.startswith(e) for p in problems) for e in sc.expected)
    false = [p for p in problems if not any(p.startswith(e) for e in sc.expected + sc.allowed)]
    return named, false


def _gain(report: dict[str, Any], sc: Scenario) -> float | None:
    ms = report.get("allreduce_ms", {})
    if f"without {C}" in ms:
        return ms["ring"] / ms[f"without {C}"]
    if sc.expected and "placement" in sc.expected[0] and ms:
        return ms["ring"] / min(v for k, v in ms.items() if not k.startswith("without"))
    return None


def _keep(where: Path, tag: str, report: dict[str, Any]) -> None:
    """Save a missed trial's report (and its events, for an events scenario) to read later."""
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{tag}.report.json").write_text(json.dumps(report, indent=1))
    if report.get("events_file"):
        shutil.copy(report["events_file"], where / f"{tag}.events.json")
    print(f"  kept in {where / tag}.*", file=sys.stderr)


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of logged trials (one row per scenario and launcher)."""
    out = ["| scenario | launcher | trials | named correctly | false accusations | fix measured (ring / fix) "
           "| s per trial (median) | load (min-max) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    names = list(SCENARIOS) + sorted({r["scenario"] for r in rows} - set(SCENARIOS))
    for name in names:
        sc = SCENARIOS.get(name, Scenario((0, 0, 0), []))
        for launcher in ("launch", "mpirun"):
            mine = [r for r in rows if r["scenario"] == name and r["launcher"] == launcher]
            if not mine:
                continue
            falses = [p for r in mine for p in r["false"]]
            named = sum(r["named"] for r in mine)
            gains = [r["gain"] for r in mine if r.get("gain")]
            what = f"{len(falses)}" + (f" ({'; '.join(sorted(set(falses)))[:200]})" if falses else "")
            out.append(f"| {name} | {launcher} | {len(mine)} | {f'{named}/{len(mine)}' if sc.expected else '-'} | "
                       f"{what} | {f'{statistics.median(gains):.1f}x' if gains else '-'} | "
                       f"{statistics.median(r['secs'] for r in mine):.0f} | "
                       f"{min(r['load'] for r in mine):.0f}-{max(r['load'] for r in mine):.0f} |")
    return "\n".join(out)


def each_trial(rows: list[dict[str, Any]]) -> str:
    """Every logged trial: a row per scenario and launcher, a column per round; the verdict and the load at its end.

    ``ok``: named (or nothing wrong and nobody accused); ``MISS``: an expected problem not named;
    ``FALSE n``: n innocent accused (``failed``: the trial did not run the doctor).
    """
    rounds = sorted({r["trial"] for r in rows})
    out = ["| scenario | launcher | " + " | ".join(f"round {k}" for k in rounds) + " |",
           "|---|---|" + "---|" * len(rounds)]
    for name in SCENARIOS:
        for launcher in ("launch", "mpirun"):
            mine = {r["trial"]: r for r in rows if r["scenario"] == name and r["launcher"] == launcher}
            if not mine:
                continue
            cells = []
            for k in rounds:
                r = mine.get(k)
                if r is None:
                    cells.append("")
                    continue
                if r["false"] == ["(trial failed)"]:
                    verdict = "failed"
                else:
                    verdict = " ".join(x for x in ("" if r["named"] else "MISS",
                                                   f"FALSE {len(r['false'])}" if r["false"] else "") if x) or "ok"
                cells.append(f"{verdict}, load {r['load']:.0f}")
            out.append(f"| {name} | {launcher} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _done(log: str | None) -> set[tuple[int, str, str]]:
    """The (round, scenario, launcher) trials a log already holds."""
    if not log or not Path(log).is_file():
        return set()
    rows = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    return {(r["trial"], r["scenario"], r["launcher"]) for r in rows}


def quick_trial(size: str) -> list[dict[str, Any]]:
    """One probe on 2 ranks of this machine (no namespaces, no root), scored as "nothing wrong"."""
    sc = Scenario((2, 0, 0), [])
    t0 = time.time()
    out = procs.run(procs.ringpipe_cli("launch", "-n", "2", "-m", "ringpipe.cli", "doctor", "--json", "--size", size,
                                       "--verify", "1"), 300, {"OMP_NUM_THREADS": "1"})
    ok, false = score(report_of(out), sc)
    return [{"scenario": "2 local ranks, nothing wrong", "launcher": "launch", "trial": 0, "named": ok,
             "false": false, "gain": None, "secs": time.time() - t0, "load": os.getloadavg()[0], "phases": {},
             "code": "quick"}]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        compute_worker(sys.argv[2], int(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--launchers", default="launch,mpirun")
    ap.add_argument("--size", default="256K", help="probe message size (doctor --size)")
    ap.add_argument("--only", default=None, help="run the scenarios whose name contains this text")
    ap.add_argument("--log", default=None, help="append each trial to this file as a JSON line")
    ap.add_argument("--keep", default=None, metavar="DIR", help="save the report (and events) of every missed trial here")
    ap.add_argument("--clock", type=int, default=0, metavar="BLOCKS",
                    help="only time the clock-offset estimation under each launcher, BLOCKS alternated blocks")
    ap.add_argument("--table", default=None, metavar="LOG", help="print the table of a log and exit")
    ap.add_argument("--each", action="store_true", help="with --table: also list every trial (round, load)")
    ap.add_argument("--resume", action="store_true",
                    help="with --log: skip the trials (round, scenario, launcher) that the log already holds")
    ap.add_argument("--until", default=None, metavar="HH:MM",
                    help="start no trial after this time of day (UTC); the log keeps what ran")
    ap.add_argument("--code", default="", help="a label of the code under trial (a commit), logged with each trial")
    ap.add_argument("--quick", action="store_true",
                    help="seconds: one doctor probe on 2 ranks of this machine, scored and tabled (no namespaces)")
    args = ap.parse_args()
    report.header("doctor_accuracy", sys.argv[1:])
    if args.quick:
        print(table(quick_trial("4K")))
        report.footer()
        return 0
    if args.table:
        rows = [json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()]
        print(table(rows))
        if args.each:
            print("\n" + each_trial(rows))
        return 0
    reason = netns.can_create()
    if reason:
        print(f"doctor_accuracy: {reason}", file=sys.stderr)
        return 2
    launchers = [x for x in args.launchers.split(",") if x]
    if "mpirun" in launchers and shutil.which("mpirun") is None:
        launchers.remove("mpirun")
    if args.clock:
        with tempfile.TemporaryDirectory(prefix="rp-doctor-clock-") as tmp:
            print(clock_table(launchers, args.clock, 29650, Path(tmp)))
        return 0
    rows: list[dict[str, Any]] = []
    port = 29700
    done = _done(args.log) if args.resume else set()
    until = None
    if args.until:
        hh, mm = (int(x) for x in args.until.split(":"))
        now = time.gmtime()
        until = time.time() + ((hh - now.tm_hour) * 60 + mm - now.tm_min) * 60 - now.tm_sec
    with tempfile.TemporaryDirectory(prefix="rp-doctor-accuracy-") as tmp:
        names = [n for n in SCENARIOS if not args.only or args.only in n]
        total = args.trials * len(names) * len(launchers) - len(done)
        for trial in range(args.trials):
            for name, sc in SCENARIOS.items():
                if args.only and args.only not in name:
                    continue
                for launcher in launchers:
                    port += 1
                    if (trial, name, launcher) in done:
                        continue
                    if until is not None and time.time() >= until:
                        print(f"  stopped at {args.until} UTC: {len(rows)} trials run", file=sys.stderr)
                        print("\n" + table(rows))
                        return 0
                    t0 = time.time()
                    try:
                        found = run_trial(sc, launcher, args.size, port, Path(tmp))
                        ok, false = score(found, sc)
                        gain = _gain(found, sc)
                        phases = found.get("phases_s", {})
                        if args.keep and (not ok or false):
                            _keep(Path(args.keep), f"{trial}-{launcher}-{port}", found)
                    except Exception as exc:  # noqa: BLE001 - a failed trial is scored as missed
                        print(f"  {name} / {launcher}: trial failed: {str(exc)[-600:]}", file=sys.stderr)
                        ok, false, gain, phases = False, ["(trial failed)"], None, {}
                    row = {"scenario": name, "launcher": launcher, "trial": trial, "named": ok, "false": false,
                           "gain": gain, "secs": time.time() - t0, "load": os.getloadavg()[0], "phases": phases,
                           "code": args.code}
                    rows.append(row)
                    if args.log:
                        with open(args.log, "a") as f:
                            f.write(json.dumps(row) + "\n")
                    left = total - len(rows)
                    eta = left * statistics.mean(r["secs"] for r in rows) / 60
                    print(f"  [{trial}] {name} / {launcher}: named={ok} false={false} ({row['secs']:.0f} s, "
                          f"load {row['load']:.1f}); {len(rows)} of {total} done, about {eta:.0f} min left",
                          file=sys.stderr, flush=True)
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
