"""The first code of every rank that ``ringpipe launch`` starts: tie the rank to its launcher, then run the program.

The launcher runs ``python [options] bootstrap.py PROGRAM...`` by path, so this module uses the
standard library only and starts before torch or ringpipe is imported. In order, it

1. makes the rank die with its parent (Linux's parent-death signal, and a watchdog thread that
   polls the parent's pid where that signal does not exist). torch's elastic agent starts every
   rank in a session of its own, so without this a launcher killed with SIGKILL, or its whole
   process group, leaves the ranks running; under MPI the parent is ``mpirun``, which itself dies
   with the launcher;
2. completes the environment every launch mode promises (:func:`rank_environment`): ``RANK``,
   ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
   ``MASTER_PORT`` and horovodrun's ``HOROVOD_*`` rank variables;
3. sends its output to the launcher's per-rank pipes, where the launcher prefixes whole lines;
4. runs the script (or ``-m module``) as ``__main__``, as ``python`` would; an uncaught exception
   or a non-zero exit prints the traceback, leaves a failure record for the launcher's report
   and, when the program started MPI, aborts the MPI job as ``python -m mpi4py`` does (MPI's
   finalisation would otherwise wait forever for ranks blocked in a collective).

The traceback a rank prints (:func:`failure_report`) is the user's: the frames of the user's own
files, and each message once (an exception that only wraps another with the same text, as the
engine's errors wrap those of its thread, is not repeated); ringpipe's, the libraries' and the
standard library's frames are left out, and where no frame is the user's the innermost one is
shown (none for ringpipe's own errors, whose message says what to fix). ``RINGPIPE_LAUNCH_VERBOSE=1`` (``ringpipe -v``, horovodrun's ``--verbose``) prints
Python's whole traceback instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence

__all__ = ["die_with_parent", "rank_environment", "redirect_output", "run_program", "main", "failure_report",
           "verbose_tracebacks", "exit_status", "VERBOSE"]

#: Directory of the launcher's output pipes and failure records (set by the launcher).
LAUNCH_DIR = "RINGPIPE_LAUNCH_DIR"
#: Ranks per host of a several-host launch, in host order ("4,2,2"; set by the launcher).
PLACEMENT = "RINGPIPE_LAUNCH_PLACEMENT"
#: Set (to anything but "" or "0") for Python's whole traceback of a failed rank, every frame of every library.
VERBOSE = "RINGPIPE_LAUNCH_VERBOSE"


def die_with_parent(parent: int | None = None, poll_s: float = 0.5) -> None:
    """End this process when its parent process ends, however the parent ends.

    Linux delivers SIGKILL through ``prctl(PR_SET_PDEATHSIG)``; if the parent is already gone by
    the time that is set (it died while this process started), the process ends at once. A
    daemon thread polling the parent's pid covers the systems without the signal.
    """
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watchdog below still works
            pass
    if os.getppid() != parent:
        os._exit(128 + int(signal.SIGKILL))

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ringpipe-parent-watchdog", daemon=True).start()


def _end_on_stdin_eof() -> None:
    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ringpipe-stdin-watch", daemon=True).start()


def _first(env: Mapping[str, str], names: Sequence[str]) -> str | None:
    for name in names:
        if env.get(name, "").strip():
            return env[name].strip()
    return None


def rank_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The launch variables missing from ``env``, derived from those a launcher did set.

    torch's agent sets the torch variables, ``mpirun`` its own ``OMPI_COMM_WORLD_*`` (or Hydra's
    ``PMI_*``); from either, every mode ends with the same contract: ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node's index) and, as horovodrun
    exports them, ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
    ``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK`` (the node's index among the nodes that hold
    this local rank) and ``HOROVOD_CROSS_SIZE`` (the number of those nodes; every node when each
    holds the same number of ranks). Variables already set are kept.
    """
    rank = _first(env, ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"])
    size = _first(env, ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
    if rank is None or size is None:
        return {}
    local_rank = _first(env, ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"])
    local_size = _first(env, ["LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                              "PMI_LOCAL_SIZE"])
    local_rank = local_rank or rank
    local_size = local_size or size
    # Open MPI's OMPI_COMM_WORLD_NODE_RANK is a rank within the node, not the node's index; with
    # ranks placed by slot (as ringpipe launch and horovodrun place them) the node is rank // local size.
    node = _first(env, ["GROUP_RANK"]) or str(int(rank) // max(1, int(local_size)))
    nodes = str(max(int(node) + 1, -(-int(size) // max(1, int(local_size)))))
    cross_rank, cross_size = node, nodes
    counts = [int(c) for c in env.get(PLACEMENT, "").split(",") if c.strip().isdigit()]
    if counts and sum(counts) == int(size):  # a several-host launch: the exact placement is known
        starts = [sum(counts[:i]) for i in range(len(counts))]
        host = max(i for i, start in enumerate(starts) if start <= int(rank))
        count, local = counts[host], int(rank) - starts[host]
        node, nodes, local_rank, local_size = str(host), str(len(counts)), str(local), str(count)
        # Horovod's cross rank and size: among the hosts that hold this local rank (hosts.py's rule).
        cross_rank = str(sum(1 for c in counts[:host] if c > local))
        cross_size = str(sum(1 for c in counts if c > local))
    values = {
        "RANK": rank,
        "WORLD_SIZE": size,
        "LOCAL_RANK": local_rank,
        "LOCAL_WORLD_SIZE": local_size,
        "GROUP_RANK": node,
        "HOROVOD_RANK": rank,
        "HOROVOD_SIZE": size,
        "HOROVOD_LOCAL_RANK": local_rank,
        "HOROVOD_LOCAL_SIZE": local_size,
        "HOROVOD_CROSS_RANK": cross_rank,
        "HOROVOD_CROSS_SIZE": cross_size,
    }
    return {k: v for k, v in values.items() if not env.get(k, "").strip()}


def redirect_output(launch_dir: str, slot: int) -> None:
    """Point file descriptors 1 and 2 at the launcher's pipes for this rank's slot.

    Everything the rank writes, C libraries and child processes included, reaches the launcher,
    which prefixes whole lines with the rank: no line of two ranks is ever mixed.
    """
    for fd, stream in ((1, "out"), (2, "err")):
        path = os.path.join(launch_dir, f"{stream}-{slot}")
        pipe = os.open(path, os.O_WRONLY)
        os.dup2(pipe, fd)
        os.close(pipe)


def _write_record(launch_dir: str | None, code: int, error: str) -> None:
    if not launch_dir:
        return
    rank = os.environ.get("RANK", "?")
    record = {"rank": rank, "time": time.time(), "code": code, "error": error,
              "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}
    path = os.path.join(launch_dir, f"failed-{rank}-{os.getpid()}.json")
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh)
        os.replace(path + ".tmp", path)
    except OSError:  # the launcher is gone or its directory too: nothing to report to
        pass


def _abort_mpi(code: int) -> None:
    """Abort the MPI job if this program started MPI (its finalisation would wait for every rank)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
            mpi.COMM_WORLD.Abort(code)
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _user_traceback(exc: BaseException) -> str:
    """The exception's traceback without this module's and runpy's frames."""
    tb = exc.__traceback__
    here = os.path.abspath(__file__)
    while tb is not None and (os.path.abspath(tb.tb_frame.f_code.co_filename) == here
                              or tb.tb_frame.f_code.co_filename.endswith("runpy.py")
                              or "<frozen runpy>" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def verbose_tracebacks(env: Mapping[str, str] | None = None) -> bool:
    """Whether a failed rank prints Python's whole traceback (``RINGPIPE_LAUNCH_VERBOSE``)."""
    return (os.environ if env is None else env).get(VERBOSE, "").strip() not in ("", "0")


def _library_folders() -> tuple[str, ...]:
    """Folders whose files are not the user's: ringpipe's package, the standard library, installed packages."""
    import site
    import sysconfig

    folders = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # the ringpipe package
    paths = sysconfig.get_paths()
    folders.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib", "scripts") if paths.get(k))
    with contextlib.suppress(Exception):  # a virtualenv without site.getsitepackages
        folders.update(site.getsitepackages())
    with contextlib.suppress(Exception):
        folders.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(f), "") for f in folders if f)


def _users(filename: str, libraries: tuple[str, ...]) -> bool:
    if filename.startswith("<"):  # <frozen runpy>, <string>, ...
        return False
    return not os.path.realpath(filename).startswith(libraries)


def _ringpipes(exc: BaseException) -> bool:
    """Whether ``exc`` is one of ringpipe's own errors (written to say what happened and what to fix)."""
    return type(exc).__module__.split(".")[0] == "ringpipe"


def failure_report(exc: BaseException, verbose: bool = False, hint: str = "") -> str:
    """What a failed rank prints about ``exc``: its message once and the user's own frames.

    ``verbose``: Python's whole traceback (less the launch's own frames). Otherwise each exception of the chain (oldest first,
    as Python prints them) with the frames of the user's files only; an exception whose text the
    next one repeats, or that one of ringpipe's own errors was raised from, and which has no frame
    of the user's is left out; where no frame of the chain is the user's, the innermost frame of
    the first exception shown stands in, unless the last is one of ringpipe's own errors (whose
    message says what to fix). ``hint``
    (how to see everything) ends the report when frames were left out.
    """
    if verbose:
        return _user_traceback(exc)
    chain: list[BaseException] = []  # newest first
    current: BaseException | None = exc
    while current is not None and all(current is not c for c in chain):
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    chain.reverse()
    libraries = _library_folders()
    blocks: list[tuple[BaseException, list[traceback.FrameSummary], bool]] = []
    hidden = False
    for i, e in enumerate(chain):
        frames = traceback.extract_tb(e.__traceback__)
        mine = [f for f in frames if _users(f.filename, libraries)]
        hidden = hidden or len(mine) < len(frames)
        wrapper = chain[i + 1] if i + 1 < len(chain) else None
        if not mine and wrapper is not None and (
                (str(e) and str(e) in str(wrapper))  # the next exception says the same
                or (wrapper.__cause__ is e and _ringpipes(wrapper))):  # ringpipe's error tells what it means
            continue
        blocks.append((e, mine, e.__cause__ is not None))
    if blocks and not any(mine for _, mine, _ in blocks) and not _ringpipes(blocks[-1][0]):
        e, _, cause = blocks[0]  # ringpipe's own errors say what to fix; another exception shows where it was raised
        blocks[0] = (e, traceback.extract_tb(e.__traceback__)[-1:], cause)
    out: list[str] = []
    for j, (e, shown, caused) in enumerate(blocks):
        if j:
            out.append("\nThe above exception was the direct cause of the following exception:\n\n" if caused
                       else "\nDuring handling of the above exception, another exception occurred:\n\n")
        if shown:
            out.append("Traceback (most recent call last):\n")
            out.extend(traceback.format_list(shown))
        out.extend(traceback.format_exception_only(type(e), e))
    if hidden and hint:
        out.append(f"({hint})\n")
    return "".join(out)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream
            stream.flush()


def _departed(how: str) -> None:
    """Tell the other ranks how this one left (they name it in their errors): see ringpipe.comm.departures."""
    with contextlib.suppress(Exception):
        from ringpipe.comm import departures

        departures.leave(how)


def exit_status(exc: SystemExit) -> int:
    """The status Python's own interpreter exits with for ``exc``: ``None`` is 0, an int is itself,
    anything else is printed to stderr and gives 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_program(program: Sequence[str]) -> int:
    """Run ``[script, *args]`` or ``["-m", module, *args]`` as ``__main__``; return its exit status.

    A failure prints the traceback on this rank's standard error, leaves a record for the
    launcher and aborts an MPI job the program started.
    """
    import runpy

    launch_dir = os.environ.get(LAUNCH_DIR)
    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]
        sys.path[0] = os.getcwd()
    else:
        sys.argv = list(program)
        sys.path[0] = os.path.dirname(os.path.abspath(program[0]))
    code = 0
    try:
        if program[0] == "-m":
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(program[0], run_name="__main__")
    except SystemExit as exc:
        code = exit_status(exc)
        if code:
            _write_record(launch_dir, code, f"exited with status {code}")
            _departed(f"exited with status {code}")
    except KeyboardInterrupt:
        code = 128 + int(signal.SIGINT)
        _write_record(launch_dir, code, "interrupted")
    except BaseException as exc:  # noqa: BLE001 - the program's uncaught exception: report it
        sys.stderr.write(failure_report(exc, verbose_tracebacks(), hint=(
            f"frames of ringpipe and the libraries left out; {VERBOSE}=1 or the launcher's -v shows them")))
        last = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
        _write_record(launch_dir, 1, last[-1] if last else type(exc).__name__)
        _departed("exception: " + (last[-1] if last else type(exc).__name__))
        code = 1
    if code:
        _flush()
        _abort_mpi(code)
    return code


def _pick_gloo_interface(driver_addr: str) -> None:
    """An elastic worker on another host: Gloo binds to the interface of the route to the driver.

    Gloo otherwise binds to the address its hostname resolves to, which on many hosts is none or
    the loopback, and the other hosts' workers could not reach it (the fixed-size launch picks the
    route to node 0 the same way). ``GLOO_SOCKET_IFNAME`` (``--network-interface``) wins.
    """
    import subprocess

    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        out = subprocess.run(["ip", "-o", "route", "get", driver_addr], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return
    words = out.stdout.split()
    if "dev" in words and words.index("dev") + 1 < len(words) and words[words.index("dev") + 1] != "lo":
        os.environ["GLOO_SOCKET_IFNAME"] = words[words.index("dev") + 1]


def main(argv: Sequence[str] | None = None) -> int:
    """``bootstrap.py PROGRAM...``: the rank's whole life (see the module's docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    die_with_parent()
    if os.environ.get("RINGPIPE_ELASTIC_DRIVER") and os.environ.pop("RINGPIPE_LAUNCH_END_ON_EOF", None):
        _end_on_stdin_eof()  # an elastic worker started over ssh: it ends when the driver's ssh ends
        _pick_gloo_interface(os.environ["RINGPIPE_ELASTIC_DRIVER"].rpartition(":")[0])
    os.environ.update(rank_environment(os.environ))
    launch_dir = os.environ.get(LAUNCH_DIR)
    if launch_dir and os.environ.get("RINGPIPE_LAUNCH_SLOTS") == "local":
        redirect_output(launch_dir, int(os.environ["LOCAL_RANK"]))
    elif launch_dir:
        redirect_output(launch_dir, int(os.environ["RANK"]))
    if not argv:
        print("ringpipe launch: no program to run", file=sys.stderr)
        return 2
    return run_program(argv)


if __name__ == "__main__":
    code = main()
    _flush()
    sys.exit(code)
