"""How long an elastic job takes to go on after a worker dies, and to use a host that appears.

Under ``ringpipe-horovodrun --host-discovery-script`` (the elastic driver), with N workers, one
per host, the hosts being loopback addresses of this machine (127.0.0.1, 127.0.0.2, ...; the
driver treats each as a host of its own), the program ``lib/elastic_program.py``:

- **death**: N workers; at step 5 the last host's worker is SIGKILLed. Measured: from the time it
  wrote just before dying to the first step the N-1 survivors complete in their new world (the
  latest of them): detection by the driver and the survivors, the blacklisting, the new world's
  rendezvous, the restore and the re-done step;
- **join**: N-1 workers; at step 5 rank 0 adds a host to the discovery script's answer. Measured:
  from that moment to the new worker's first completed step: up to 1 s until discovery runs, the
  worker's start (a Python interpreter importing torch and ringpipe), the notice at the next
  commit, the rendezvous and the state's sync from rank 0.

    python benchmarks/elastic_recovery.py                 # N = 2 and 4, 3 runs each
    python benchmarks/elastic_recovery.py --workers 2 --runs 5
    python benchmarks/elastic_recovery.py --quick         # N = 2, one run of each, 10 steps a job
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import report, stats  # noqa: E402

PROGRAM = Path(__file__).resolve().parent / "lib" / "elastic_program.py"


def _run(event: str, n: int, steps: int) -> float:
    """One job; seconds from the event to the first step that shows it handled."""
    with tempfile.TemporaryDirectory(prefix="ringpipe-elastic-bench-") as d:
        out = Path(d)
        start = n if event == "death" else n - 1
        hosts = [f"127.0.0.{i + 1}:1" for i in range(start)]
        (out / "hosts").write_text("\n".join(hosts) + "\n")
        (out / "new_host").write_text(f"127.0.0.{n}:1\n")
        discover = out / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {out / 'hosts'}\n")
        discover.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGPIPE_", "TORCHELASTIC_"))}
        env.update(OMP_NUM_THREADS="1", ELASTIC_WORKERS=str(n), ELASTIC_STEPS=str(steps))
        cmd = [sys.executable, "-m", "ringpipe.launch.horovodrun", "-np", str(start), "--min-np", "1",
               "--max-np", str(n), "--host-discovery-script", str(discover), "python", str(PROGRAM), str(out), event]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{event} with {n} workers failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        t_event = float((out / "event").read_text())
        rows = []
        for f in out.glob("steps.*"):
            for line in f.read_text().splitlines():
                t, step, rank, size, host = line.split()
                rows.append((float(t), int(step), int(rank), int(size), host))
        if event == "death":
            after = [r for r in rows if r[0] > t_event and r[3] == n - 1]
            first: dict[str, float] = {}
            for r in sorted(after):
                first.setdefault(r[4], r[0])
            found = list(first.values())
        else:
            found = [r[0] for r in rows if r[4] == f"127.0.0.{n}"]
        if not found:  # say what the job did rather than a bare error
            raise RuntimeError(f"{event} with {n} workers: no step after the event in the workers' logs:\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return (max(found) if event == "death" else min(found)) - t_event


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="steps of each job (the event is at step 5)")
    ap.add_argument("--quick", action="store_true", help="2 workers, one run of each event, 10 steps a job")
    args = ap.parse_args()
    if args.quick:
        args.workers, args.runs, args.steps = [2], 1, 10
    if args.steps < 7:
        ap.error(f"--steps {args.steps}: give 7 at least (the event is at step 5; a step after it is measured)")
    report.header("elastic_recovery")
    rows = []
    for n in args.workers:
        for event, what in (("death", f"a worker SIGKILLed -> the {n - 1} survivors' next step"),
                            ("join", f"a host appears -> its worker's first step ({n - 1} -> {n} workers)")):
            times = []
            for _ in range(args.runs):
                try:
                    times.append(_run(event, n, args.steps))
                except RuntimeError as exc:  # a failed run is reported and left out of the figures
                    print(f"a run failed: {exc}", file=sys.stderr)
            if not times:
                raise SystemExit(f"every run of {event} with {n} workers failed")
            s = stats.spread(times)
            rows.append([what, n, f"{stats.median(times):.2f}", f"{s.low:.2f}-{s.high:.2f}", len(times)])
    print(report.table(["event", "workers", "median s", "min-max s", "runs"], rows,
                       numeric=[False, True, True, False, True]))
    report.footer()


if __name__ == "__main__":
    main()
