"""``ringpipe doctor`` and ``ringpipe trace``: argument parsing and the live probe job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ringpipe.observe.probe import doctor_job

#: Where ``ringpipe train`` writes a run's events and how to ask for them.
_EVENTS_HOWTO = ("`ringpipe train` with several processes writes events.json into the run directory (observe.profile, "
                 "on by default); a run of one process has no communication to profile")

__all__ = ["add_parser", "doctor_main", "trace_main", "doctor_job", "load_events_arg"]


def _print_report(result: dict[str, Any], nbytes: int, as_json: bool) -> None:
    from ringpipe.observe.doctor import figures, format_report

    job, findings = result["job"], result["findings"]
    if as_json:
        report = {
            "ranks": job.size,
            "hosts": job.hosts(),
            "links": result.get("links", []),
            "allreduce_ms": result.get("allreduce_ms", {}),
            "compute_ms": [r.info.get("compute_ms") for r in job.ranks],
            "findings": [asdict(f) for f in findings],
            "verified": result.get("verified"),
            "phases_s": result.get("phases_s", {}),
            **({"comm": result["comm"]} if result.get("comm") else {}),
            **figures(job),  # the analyses' own figures: "pipeline" for a pipeline run
        }
        write_whole_lines(json_text(report, short_lines=under_mpi_launcher()))
        return
    extra = [result["comm"]] if result.get("comm") else []
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
    v = result.get("verified")
    if v:
        extra.append(f"verify: ring {v['before_ms']:.2f} ms before, {v['fix']} {v['after_ms']:.2f} ms after "
                     f"(median of {v['runs']} interleaved runs each)")
    write_whole_lines(format_report(job, findings, extra) + "\n")


def under_mpi_launcher() -> bool:
    """True in a rank started by an MPI launcher (Open MPI, MPICH / PMI), which may tag its output."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK"))


def json_text(report: dict[str, Any], short_lines: bool) -> str:
    """``report`` as JSON text ending in a newline: one line, or with ``short_lines`` one value per line.

    One line suits a reader that takes the last line of the output. Under an MPI launcher the
    line would be several KB, and ``mpirun --tag-output`` tags what each read of it returns, so
    it could come back cut with a tag in the middle; there the report is indented (every line
    short, each written whole by :func:`write_whole_lines`), so that taking the tag off the front
    of each line leaves valid JSON. Either way the text starts with ``{"ranks"`` on its first line.
    """
    if not short_lines:
        return json.dumps(report) + "\n"
    text = json.dumps(report, indent=1)
    return "{" + text[1:].lstrip() + "\n"  # '{"ranks": N,' on the first line, as the one-line form


def write_whole_lines(text: str, piece: int = 1024, pause_s: float = 0.02, wait_s: float = 2.0) -> None:
    """Write ``text`` to stdout so that whoever reads it (mpirun) never gets a line in two reads.

    ``mpirun --tag-output`` tags what each read of a rank's terminal (or pipe) returns, so a
    line that two reads share is cut in two with a tag in the middle: a 21 KB report written at
    once was cut every 2-4 KB. On a terminal or a pipe the text therefore goes in pieces of whole
    lines of at most ``piece`` bytes, each in one write (a terminal passes at most 2 KB a write
    on): on a pipe once the reader has taken the previous piece (``FIONREAD``: the bytes still
    in it, waiting at most ``wait_s``), on a terminal ``pause_s`` after it, which gives the reader
    time to take each piece alone. Elsewhere (a file) in one write.
    """
    import fcntl
    import stat
    import struct
    import termios
    import time

    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
        pipe, tty = stat.S_ISFIFO(os.fstat(fd).st_mode), os.isatty(fd)
    except (AttributeError, OSError, ValueError):  # a captured or replaced stdout
        pipe = tty = False
    if not (pipe or tty):
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    pieces, cur = [], ""
    for line in text.splitlines(keepends=True):
        if cur and len((cur + line).encode()) > piece:
            pieces.append(cur)
            cur = ""
        cur += line
    pieces.append(cur)
    for i, part in enumerate(pieces):
        if i and pipe:
            until = time.monotonic() + wait_s
            while time.monotonic() < until:
                if struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] == 0:
                    break
                time.sleep(0.005)
        elif i:
            time.sleep(pause_s)
        os.write(fd, part.encode())


def _sniff(path: Path) -> None:
    """ValueError naming what ``path`` is when it cannot be an events file (binary, image, empty)."""
    with path.open("rb") as f:
        head = f.read(4096)
    if not head.strip():
        raise ValueError(f"{path} is empty: the run wrote no events (did it end before collect_events, or "
                         f"was the disk full?); {_EVENTS_HOWTO}")
    kinds = {b"\x89PNG": "a PNG image", b"%PDF": "a PDF document", b"PK\x03\x04": "a zip archive (a torch "
             "checkpoint?)", b"\x80": "a pickle (a torch checkpoint?)", b"\x1f\x8b": "a gzip file"}
    for magic, kind in kinds.items():
        if head.startswith(magic):
            raise ValueError(f"{path} is {kind}, not an events file; give the events.json of a run ({_EVENTS_HOWTO})")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the end of the sample
            raise ValueError(f"{path} is a binary file, not an events file (JSON text); {_EVENTS_HOWTO}") from None


def _why_no_events(run: Path) -> str:
    """Why a run directory holds no events, where its summary or config says ("" if they do not)."""
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return ""
    if summary.get("world_size") == 1:
        return " (a run of one process: it made no communication to profile)"
    config = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else ""
    if "profile: false" in config:
        return " (the run had observe.profile=false)"
    return " (a run of an earlier ringpipe, which wrote it only with observe.timeline=true)"


def load_events_arg(path: str) -> Any:
    """The events of ``path``: an events file, a run directory holding events.json, or a timeline beside its events."""
    from ringpipe.observe.collect import load_events

    given = Path(path)
    if given.is_dir():
        if not (given / "events.json").is_file():
            raise IsADirectoryError(f"{path} is a directory without events.json{_why_no_events(given)}; give the "
                                    f"events file ({_EVENTS_HOWTO})")
        given = given / "events.json"
    if given.is_file():
        _sniff(given)
        timeline = given.with_name(given.stem + ".events.json")
        if given.suffix == ".json" and not given.name.endswith(".events.json") and _is_trace(given):
            if timeline.is_file():
                print(f"ringpipe: {given} is a Chrome timeline; reading its events from {timeline}", file=sys.stderr)
                given = timeline
            else:
                raise ValueError(f"{given} is a Chrome timeline, not an events file; give the events file written "
                                 f"beside it ({timeline.name}: RINGPIPE_TIMELINE=FILE.json writes "
                                 f"FILE.events.json; {_EVENTS_HOWTO})")
    try:
        job = load_events(given)
    except KeyError as exc:
        raise ValueError(f"{given}: not a complete ringpipe events file (no {exc} entry)") from None
    except (TypeError, IndexError) as exc:
        raise ValueError(f"{given}: not a well-formed ringpipe events file ({exc})") from None
    if job.size == 0 or not any(r.events for r in job.ranks):
        raise ValueError(f"{given} holds no events ({job.size} ranks, 0 events): nothing to analyse; record "
                         f"communication before saving ({_EVENTS_HOWTO})")
    return job


def _is_trace(path: Path) -> bool:
    with path.open("rb") as f:
        return b'"traceEvents"' in f.read(4096)


def _usage_error(command: str, exc: BaseException | str) -> int:
    print(f"ringpipe {command}: {exc}", file=sys.stderr)
    return 2


def _doctor_events(args: Any) -> int:
    """``ringpipe doctor EVENTS``: the profile and the findings of a recorded run."""
    from ringpipe.observe.doctor import diagnose, run_links
    from ringpipe.observe.runreport import window_job
    from ringpipe.observe.table import comm_line, format_profile

    try:
        job = window_job(load_events_arg(args.events))  # a training run's steps, as its doctor.txt
    except (ValueError, OSError) as exc:
        return _usage_error("doctor", exc)
    links = run_links(job)  # the run's own collective steps stand in for the probe
    findings = diagnose(job, links)
    if not args.json:
        print(format_profile(job) + "\n", flush=True)
    _print_report({"job": job, "findings": findings, "links": links, "comm": comm_line(job)}, 0, args.json)
    if args.verify:
        return _verify_change(args, findings) or _strict(args, findings)
    return _strict(args, findings)


def _verify_change(args: Any, findings: list[Any]) -> int:
    """``--verify N`` on a run directory: its recommended training change measured (2 on a usage error)."""
    from ringpipe.observe.verify_run import training_change, verify_training_change

    change = training_change([f.fix for f in findings])
    if change is None:
        print("verify: no finding recommends a change of the training run to measure", flush=True)
        return 0
    run = Path(args.events)
    run = run if run.is_dir() else run.parent
    print(f"verify: running {run}/config.yaml {args.verify} time(s) as it was and with "
          f"`ringpipe train {' '.join(change)}` ...", flush=True)
    try:
        v = verify_training_change(run, change, args.verify)
    except (OSError, RuntimeError) as exc:
        return _usage_error("doctor --verify", exc)
    print(f"verify: {v['change']}: {v['after_ms']:.1f} ms per step against {v['before_ms']:.1f} ms as it was "
          f"({v['before_ms'] / max(v['after_ms'], 1e-9):.2f}x; faster in {v['faster']} of {v['runs']} pairs of "
          f"{v['steps']}-step runs)", flush=True)
    return 0


def _strict(args: Any, findings: list[Any]) -> int:
    """Exit 1 under --strict when a problem was found, saying so (not a crash)."""
    problems = sum(f.severity == "problem" for f in findings)
    if not (problems and args.strict):
        return 0
    print(f"ringpipe doctor --strict: {problems} problem(s) found, exit status 1 (the doctor itself ran fine)",
          file=sys.stderr, flush=True)
    return 1


def _doctor_mpirun(args: Any) -> int:
    """Start ``-n`` ranks of this same probe under mpirun (the mpi backend needs it)."""
    from ringpipe.launch import mpirun_command

    argv = ["doctor", "--backend", "mpi", "--size", str(args.size), "--reps", str(args.reps), "--pairs", args.pairs,
            "--verify", str(args.verify)]
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
    from ringpipe.comm.rendezvous import BACKENDS
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
    if args.verify < 0:
        return _usage_error("doctor", f"--verify must be >= 0 runs, got {args.verify}")
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
            results = spawn(doctor_job, args.nprocs, backend, args=(nbytes, args.reps, pairs, args.verify))
        except WorkerFailed as exc:  # names the rank that failed
            print(f"ringpipe doctor: {exc}; the other ranks were stopped", file=sys.stderr)
            return 1
        result = results[0]
    else:
        from ringpipe.comm import init_world, shutdown_world

        if backend == "mpi":
            # Open MPI's waits spin on a core; with more ranks than cores (a small machine, several
            # hosts in containers) the spinning ranks then hold the cores that the ranks being
            # measured need. Yielding while idle costs nothing where every rank has its core.
            os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        try:
            comm = init_world(backend)
        except (CommError, EnvironmentError_) as exc:
            return _usage_error("doctor", exc)
        try:
            result = doctor_job(comm, nbytes, args.reps, pairs, args.verify)
        finally:
            shutdown_world()
    if result is None:
        return 0
    if args.save_events:
        from ringpipe.observe.collect import save_events

        save_events(args.save_events, result["job"])
    if args.plot and result["links"]:
        from ringpipe.observe.plots import plot_links

        plot_links(result["job"], result["links"], args.plot)
        print(f"ringpipe doctor: links drawn in {args.plot}", file=sys.stderr, flush=True)
    _print_report(result, nbytes, args.json)
    return _strict(args, result["findings"])


def _beside(events: str) -> Path:
    """Where a timeline goes by default: beside its events (in the run directory), never the current one."""
    given = Path(events)
    if given.is_dir():
        return given / "timeline.json"
    stem = given.name.removesuffix(".json").removesuffix(".events")
    return given.with_name(("timeline" if stem == "events" else stem + ".timeline") + ".json")


def trace_main(args: Any) -> int:
    from ringpipe.observe.runreport import window_job
    from ringpipe.observe.table import format_profile
    from ringpipe.observe.timeline import write_timeline

    try:
        job = load_events_arg(args.events)
        out = write_timeline(args.output or _beside(args.events), job)  # the whole run, start-up included
    except (ValueError, OSError) as exc:
        return _usage_error("trace", exc)
    print(format_profile(window_job(job)), flush=True)  # a training run's steps, as its comm_profile.txt
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
            "With EVENTS (the events.json of a run, or its run directory: every `ringpipe train` of "
            "several processes writes it: observe.profile, on by default; or a file of ringpipe.observe.save_events): the "
            "communication profile and the late ranks of that run's training steps."
        ),
    )
    d.add_argument("events", nargs="?", default=None,
                   help="events file (or a run directory holding events.json: observe.profile, on by default) to "
                   "analyse instead of probing")
    d.add_argument("-n", "--nprocs", type=int, default=None, help="start N local processes (when not under a launcher)")
    d.add_argument("--backend", default=None, help="gloo, nccl or mpi (default: $RINGPIPE_BACKEND or gloo)")
    d.add_argument("--size", default="4M", help="message size of the bandwidth and allreduce probes (default 4M)")
    d.add_argument("--reps", type=int, default=3, help="allreduce probe repetitions (default 3)")
    d.add_argument("--pairs", choices=("auto", "all", "ring"), default="auto",
                   help="links to probe: every pair, ring neighbours, or all pairs up to 8 ranks (auto)")
    d.add_argument("--save-events", default=None, metavar="FILE", help="also save the probe's events here")
    d.add_argument("--plot", default=None, metavar="FILE.png", help="draw the probed links as a rank x rank heat map")
    d.add_argument("--verify", type=int, nargs="?", const=5, default=0, metavar="RUNS",
                   help="time the recommended fix against the ring in RUNS more interleaved runs (default 5)")
    d.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    d.add_argument("--strict", action="store_true", help="exit 1 when a problem is found")
    d.set_defaults(func=doctor_main)

    t = sub.add_parser(
        "trace",
        help="turn an events file into a Chrome timeline and print the communication profile",
        description="Write EVENTS as a Chrome trace (chrome://tracing, ui.perfetto.dev) and print the MPI-style profile.",
    )
    t.add_argument("events", help="events file or a run directory holding events.json (ringpipe.observe.save_events "
                   "or any `ringpipe train` of several processes: observe.profile, on by default)")
    t.add_argument("-o", "--output", default=None,
                   help="timeline file to write (default: beside the events: timeline.json in a run directory, "
                   "NAME.timeline.json for NAME.json)")
    t.set_defaults(func=trace_main)
