"""``ringpipe doctor`` and ``ringpipe trace``: argument parsing and the live probe job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ringpipe.comm.base import Communicator

#: Where ``ringpipe train`` writes a run's events (observe.timeline) and how to ask for them.
_EVENTS_HOWTO = "`ringpipe train --set observe.timeline=true` writes events.json into the run directory"

__all__ = ["add_parser", "doctor_main", "trace_main", "doctor_job"]


def doctor_job(comm: Communicator, nbytes: int, reps: int, all_pairs: bool | None) -> dict[str, Any] | None:
    """The probe every rank runs: compute, links, ring and native allreduce; rank 0 gets the result."""
    from ringpipe import collectives
    from ringpipe.observe.collect import collect_events
    from ringpipe.observe.doctor import compute_probe, diagnose, run_probe

    comm.log.clear()
    comm.barrier()
    compute_ms = compute_probe()
    comm.barrier()
    links = run_probe(comm, nbytes, all_pairs) if comm.size > 1 else []
    x = torch.ones(max(1, nbytes // 4))
    # The ring, the hierarchical cure for several hosts, and the backend's own allreduce.
    algorithms = ["ring", "hierarchical", "native"] if comm.topology.num_nodes > 1 else ["ring", "native"]
    timings: dict[str, list[float]] = {name: [] for name in algorithms}
    for _ in range(reps):
        for name in timings:
            comm.barrier()
            t0 = time.perf_counter()
            if name == "native":
                comm.allreduce(x, "sum")
            else:
                collectives.allreduce(comm, x, "sum", algorithm=name)
            timings[name].append(time.perf_counter() - t0)
    slowest = comm.allgather_object({k: min(v) for k, v in timings.items()})
    job = collect_events(comm, info={"compute_ms": compute_ms, "threads": torch.get_num_threads()})
    if job is None:
        return None
    findings = diagnose(job, links)
    allreduce_ms = {k: 1e3 * max(s[k] for s in slowest) for k in timings}
    return {"job": job, "links": links, "findings": findings, "allreduce_ms": allreduce_ms}


def _print_report(result: dict[str, Any], nbytes: int, as_json: bool) -> None:
    from ringpipe.observe.doctor import format_report

    job, findings = result["job"], result["findings"]
    if as_json:
        print(json.dumps({
            "ranks": job.size,
            "hosts": job.hosts(),
            "links": result.get("links", []),
            "allreduce_ms": result.get("allreduce_ms", {}),
            "compute_ms": [r.info.get("compute_ms") for r in job.ranks],
            "findings": [asdict(f) for f in findings],
        }), flush=True)
        return
    extra = []
    if result.get("links"):
        probed = all(x.get("latency_us") is not None for x in result["links"])
        extra.append(f"{'link':>12} {'latency us' if probed else 'ring steps':>11} {'GB/s':>8}  hosts")
        hosts = job.hosts()
        for x in result["links"]:
            how = f"{x['latency_us']:>11.1f}" if probed else f"{x.get('samples', 0):>11d}"
            arrow = "<->" if probed else " ->"
            extra.append(f"{x['src']:>5} {arrow} {x['dst']:<3} {how} {x['gbps']:>8.3f}  "
                         f"{hosts[x['src']]} / {hosts[x['dst']]}")
    if result.get("allreduce_ms"):
        ms = result["allreduce_ms"]
        extra.append(f"allreduce of {nbytes} bytes (slowest rank, best of the runs): "
                     + ", ".join(f"{name} {t:.2f} ms" for name, t in ms.items()))
    print(format_report(job, findings, extra), flush=True)


def _load_events(path: str) -> Any:
    """The events of ``path``: an events file, or a run directory holding events.json."""
    from ringpipe.observe.collect import load_events

    given = Path(path)
    if given.is_dir():
        if not (given / "events.json").is_file():
            raise IsADirectoryError(f"{path} is a directory without events.json; give the events file ({_EVENTS_HOWTO})")
        given = given / "events.json"
    try:
        return load_events(given)
    except KeyError as exc:
        raise ValueError(f"{given}: not a complete ringpipe events file (no {exc} entry)") from None
    except (TypeError, IndexError) as exc:
        raise ValueError(f"{given}: not a well-formed ringpipe events file ({exc})") from None


def _usage_error(command: str, exc: BaseException | str) -> int:
    print(f"ringpipe {command}: {exc}", file=sys.stderr)
    return 2


def _doctor_events(args: Any) -> int:
    """``ringpipe doctor EVENTS``: the profile and the findings of a recorded run."""
    from ringpipe.observe.doctor import diagnose, ring_links
    from ringpipe.observe.table import format_profile

    try:
        job = _load_events(args.events)
    except (ValueError, OSError) as exc:
        return _usage_error("doctor", exc)
    links = ring_links(job)  # the run's own ring steps stand in for the probe
    findings = diagnose(job, links)
    if not args.json:
        print(format_profile(job) + "\n", flush=True)
    _print_report({"job": job, "findings": findings, "links": links}, 0, args.json)
    return 1 if any(f.severity == "problem" for f in findings) and args.strict else 0


def _doctor_mpirun(args: Any) -> int:
    """Start ``-n`` ranks of this same probe under mpirun (the mpi backend needs it)."""
    from ringpipe.launch import mpirun_command

    argv = ["doctor", "--backend", "mpi", "--size", str(args.size), "--reps", str(args.reps), "--pairs", args.pairs]
    for flag, value in (("--save-events", args.save_events), ("--plot", args.plot)):
        if value is not None:
            argv += [flag, str(value)]
    argv += [f for f, on in (("--json", args.json), ("--strict", args.strict)) if on]
    verbose = ["-v"] if getattr(args, "verbose", False) else []
    cmd = mpirun_command(args.nprocs, [sys.executable, "-m", "ringpipe.cli", *verbose, *argv])
    env = dict(os.environ, RINGPIPE_BACKEND="mpi", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(cmd, env=env).returncode


def doctor_main(args: Any) -> int:
    from ringpipe.comm.base import CommError
    from ringpipe.comm.world import BACKENDS
    from ringpipe.env import EnvironmentError_
    from ringpipe.observe.bench import parse_size

    if args.events:
        return _doctor_events(args)
    try:
        nbytes = parse_size(args.size)
    except ValueError as exc:
        return _usage_error("doctor", exc)
    if args.reps < 1:
        return _usage_error("doctor", f"--reps must be >= 1, got {args.reps}")
    if args.nprocs is not None and args.nprocs < 1:
        return _usage_error("doctor", f"-n must be >= 1, got {args.nprocs}")
    backend = (args.backend or os.environ.get("RINGPIPE_BACKEND") or "gloo").lower()
    if backend not in BACKENDS:
        return _usage_error("doctor", f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    pairs = {"all": True, "ring": False, "auto": None}[args.pairs]
    launched = "WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ
    if args.nprocs and args.nprocs > 1 and backend == "mpi" and not launched:
        import importlib.util

        if importlib.util.find_spec("mpi4py") is None:
            return _usage_error("doctor", "the mpi backend needs mpi4py: pip install mpi4py (or use --backend gloo)")
        try:
            return _doctor_mpirun(args)
        except FileNotFoundError as exc:  # no mpirun: say so, and what else would work
            return _usage_error("doctor", f"--backend mpi with -n {args.nprocs} starts the ranks under mpirun: "
                                f"{exc}; or use --backend gloo")
    if args.nprocs and not launched:
        from ringpipe.launch import WorkerFailed, spawn

        try:
            results = spawn(doctor_job, args.nprocs, backend, args=(nbytes, args.reps, pairs))
        except WorkerFailed as exc:  # names the rank that failed
            print(f"ringpipe doctor: {exc}; the other ranks were stopped", file=sys.stderr)
            return 1
        result = results[0]
    else:
        from ringpipe.comm import init_world, shutdown_world

        try:
            comm = init_world(backend)
        except (CommError, EnvironmentError_) as exc:
            return _usage_error("doctor", exc)
        try:
            result = doctor_job(comm, nbytes, args.reps, pairs)
        finally:
            shutdown_world()
    if result is None:
        return 0
    if args.save_events:
        from ringpipe.observe.collect import save_events

        save_events(args.save_events, result["job"])
    if args.plot and result["links"]:
        from ringpipe.observe.doctor import plot_links

        plot_links(result["job"], result["links"], args.plot)
    _print_report(result, nbytes, args.json)
    return 1 if any(f.severity == "problem" for f in result["findings"]) and args.strict else 0


def trace_main(args: Any) -> int:
    from ringpipe.observe.table import format_profile
    from ringpipe.observe.timeline import write_timeline

    try:
        job = _load_events(args.events)
        out = write_timeline(args.output, job)
    except (ValueError, OSError) as exc:
        return _usage_error("trace", exc)
    print(format_profile(job), flush=True)
    print(f"\ntimeline: {out} (open in chrome://tracing or https://ui.perfetto.dev)", file=sys.stderr)
    return 0


def add_parser(sub: Any) -> None:
    d = sub.add_parser(
        "doctor",
        help="explain where collectives lose time: late ranks, placement, slow links, slow CPUs",
        description=(
            "Without EVENTS: probe the job it runs in (under any launcher, or -n N local processes): "
            "a compute probe per rank, latency and bandwidth of every pair of ranks (ring neighbours "
            "above 8 ranks), ring and native allreduce; then name the rank, host or link at fault. "
            "With EVENTS (the events.json of a run, or its run directory: `ringpipe train --set "
            "observe.timeline=true` writes it; or a file of ringpipe.observe.save_events): the "
            "communication profile and the late ranks of that run."
        ),
    )
    d.add_argument("events", nargs="?", default=None,
                   help="events file (or a run directory holding events.json) to analyse instead of probing")
    d.add_argument("-n", "--nprocs", type=int, default=None, help="start N local processes (when not under a launcher)")
    d.add_argument("--backend", default=None, help="gloo, nccl or mpi (default: $RINGPIPE_BACKEND or gloo)")
    d.add_argument("--size", default="4M", help="message size of the bandwidth and allreduce probes (default 4M)")
    d.add_argument("--reps", type=int, default=3, help="allreduce probe repetitions (default 3)")
    d.add_argument("--pairs", choices=("auto", "all", "ring"), default="auto",
                   help="links to probe: every pair, ring neighbours, or all pairs up to 8 ranks (auto)")
    d.add_argument("--save-events", default=None, metavar="FILE", help="also save the probe's events here")
    d.add_argument("--plot", default=None, metavar="FILE.png", help="draw the probed links as a rank x rank heat map")
    d.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    d.add_argument("--strict", action="store_true", help="exit 1 when a problem is found")
    d.set_defaults(func=doctor_main)

    t = sub.add_parser(
        "trace",
        help="turn an events file into a Chrome timeline and print the communication profile",
        description="Write EVENTS as a Chrome trace (chrome://tracing, ui.perfetto.dev) and print the MPI-style profile.",
    )
    t.add_argument("events", help="events file or a run directory holding events.json (ringpipe.observe.save_events "
                   "or `ringpipe train --set observe.timeline=true`)")
    t.add_argument("-o", "--output", default="timeline.json", help="timeline file to write (default timeline.json)")
    t.set_defaults(func=trace_main)
