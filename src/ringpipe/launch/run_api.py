"""Horovod's run API, ``horovod.run``: start a function on every rank of a new job and return each rank's value.

``ringpipe.run(main, np=2, hosts="localhost:2", use_gloo=True)`` does what Horovod's
``horovod.runner.run`` documents: it starts ``num_proc`` processes, calls ``func(*args,
**kwargs)`` in each (the function typically calls ``init()`` and trains), and returns the list of
their return values, indexed by rank. The job is started by the same launcher as
``ringpipe-horovodrun``, from the same settings (``hosts``/``hostfile``, ``ssh_port``,
``ssh_identity_file``, ``start_timeout``, ``network_interfaces``, ``use_gloo``/``use_mpi``; without
either, MPI when ``mpirun`` and mpi4py are both here, as Horovod's default); ``executable`` is the
Python that runs the launcher and the ranks. The function and its arguments travel pickled by
value (cloudpickle, as Horovod's), so a function defined in the calling script runs without that
script being imported again. What the ranks print reaches this process's standard output as
``ringpipe launch`` prints it (each line prefixed with its rank).

A rank that raises or exits non-zero makes ``run`` raise ``RuntimeError`` after the job has
stopped, as Horovod's does. Horovod's deprecated ``np``, ``min_np``, ``max_np`` and
``network_interface`` are accepted with its ``DeprecationWarning``. With ``host_discovery_script``
the job is elastic (:mod:`ringpipe.launch.elastic_driver`; ``min_num_proc``, ``max_num_proc``,
``slots``, ``reset_limit``, ``cooldown_range``, ``elastic_timeout`` as horovodrun's options) and
the values of the last world's ranks come back; ``mpi_args`` is refused by name before anything starts;
``min_num_proc`` / ``max_num_proc`` without a discovery script start a fixed job of ``num_proc``
ranks, with a warning (no rank can join, a lost rank ends the job), and return the first
``min_num_proc`` values, as Horovod's elastic run does;
``output_filename`` also writes each rank's output to ``<output_filename>/rank.<R>/stdout`` and
``stderr``; ``verbose`` and ``disable_cache`` change nothing (ringpipe caches no checks).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ringpipe.launch.run_task import NONCE, PAYLOAD, PAYLOAD_FILE, decode, encode

__all__ = ["run", "horovodrun_args"]

_ENV_LIMIT = 96 * 1024  # one environment variable holds at most 128 KiB on Linux (MAX_ARG_STRLEN)


def horovodrun_args(
    num_proc: int, hosts: str | None = None, hostfile: str | None = None, start_timeout: int | None = None,
    ssh_port: int | None = None, ssh_identity_file: str | None = None,
    network_interfaces: Sequence[str] | None = None, use_gloo: bool | None = None, use_mpi: bool | None = None,
    output_filename: str | None = None, host_discovery_script: str | None = None,
    min_num_proc: int | None = None, max_num_proc: int | None = None, slots: int | None = None,
    reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None,
    elastic_timeout: int | None = None,
) -> list[str]:
    """The ``horovodrun`` command line (before the program) that ``run`` starts its job with."""
    args = ["-np", str(num_proc)]
    if host_discovery_script is not None:  # an elastic job
        args += ["--host-discovery-script", host_discovery_script]
        for flag, value in (("--min-np", min_num_proc), ("--max-np", max_num_proc), ("--slots-per-host", slots),
                            ("--reset-limit", reset_limit), ("--elastic-timeout", elastic_timeout)):
            if value is not None:
                args += [flag, str(value)]
        if cooldown_range is not None:
            args += ["--blacklist-cooldown-range", str(cooldown_range[0]), str(cooldown_range[1])]
    if hosts is not None:
        args += ["-H", hosts]
    if hostfile is not None:
        args += ["--hostfile", hostfile]
    if start_timeout is not None:
        args += ["--start-timeout", str(start_timeout)]
    if ssh_port is not None:
        args += ["-p", str(ssh_port)]
    if ssh_identity_file is not None:
        args += ["-i", ssh_identity_file]
    if network_interfaces:
        args += ["--network-interfaces", ",".join(sorted(network_interfaces))]
    if output_filename is not None:
        args += ["--output-filename", output_filename]
    if use_gloo:
        args.append("--gloo")
    if use_mpi:
        args.append("--mpi")
    return args


def _deprecated(new: Any, old: Any, old_name: str, new_name: str) -> Any:
    if old is None:
        return new
    warnings.warn(f"{old_name} is deprecated, use {new_name} instead", DeprecationWarning, stacklevel=3)
    return old


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    num_proc: int = 1,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    host_discovery_script: str | None = None,
    start_timeout: int | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    network_interfaces: Sequence[str] | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    elastic_timeout: int | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` new ranks; the list of their return values, by rank."""
    if network_interface:
        warnings.warn("network_interface is deprecated, use network_interfaces instead", DeprecationWarning,
                      stacklevel=2)
        network_interfaces = network_interface.split(",")
    num_proc = _deprecated(num_proc, np, "np", "num_proc")
    min_num_proc = _deprecated(min_num_proc, min_np, "min_np", "min_num_proc")
    max_num_proc = _deprecated(max_num_proc, max_np, "max_np", "max_num_proc")
    if hosts is not None and hostfile is not None:
        raise ValueError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    if not callable(func):
        raise TypeError(f"ringpipe.run needs a function to run on every rank, got {type(func).__name__}")
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"ringpipe.run: num_proc must be a positive number of processes, got {num_proc!r}")
    elastic = host_discovery_script is not None
    if elastic and (hosts is not None or hostfile is not None):
        raise ValueError("ringpipe.run: give the hosts once: host_discovery_script, or hosts / hostfile")
    if elastic and use_mpi:
        raise ValueError("ringpipe.run: elastic jobs (host_discovery_script) run on Gloo only, as Horovod's do: "
                         "drop use_mpi")
    if (min_num_proc is not None or max_num_proc is not None) and not elastic:
        low, high = min_num_proc or num_proc, max_num_proc or num_proc
        if not low <= num_proc <= high:
            raise ValueError(f"ringpipe.run: num_proc={num_proc} must lie between min_num_proc={min_num_proc} and "
                             f"max_num_proc={max_num_proc}")
        warnings.warn(f"ringpipe.run starts a fixed job of num_proc={num_proc} ranks: without a host discovery "
                      "script no rank joins later, and a lost rank ends the job (min_num_proc / max_num_proc, "
                      "reset_limit and cooldown_range have nothing to act on)", UserWarning, stacklevel=2)
    if mpi_args is not None:
        raise ValueError("ringpipe.run does not take mpi_args: set Open MPI's options as OMPI_MCA_* variables "
                         "in the environment instead (every rank's mpirun reads them)")
    del verbose, disable_cache  # accepted, as Horovod's; nothing to do

    payload = encode((func, tuple(args), dict(kwargs or {})))
    nonce = "ringpipe-run-" + secrets.token_hex(8)
    env = dict(os.environ)
    env[NONCE] = nonce
    env.pop(PAYLOAD, None)
    env.pop(PAYLOAD_FILE, None)
    remote = hosts is not None or hostfile is not None
    path = None
    if len(payload) <= _ENV_LIMIT:
        env[PAYLOAD] = payload
    elif remote:
        raise ValueError(f"ringpipe.run: the function and its arguments pickle to {len(payload)} base64 characters, "
                         f"more than the {_ENV_LIMIT} that travel to other hosts; pass large data as a file path "
                         "the ranks read instead")
    else:
        fd, path = tempfile.mkstemp(prefix="ringpipe-run-", suffix=".b64")
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(payload)
        env[PAYLOAD_FILE] = path
    hargs = horovodrun_args(num_proc, hosts, hostfile, start_timeout, ssh_port, ssh_identity_file,
                            network_interfaces, use_gloo, use_mpi, output_filename, host_discovery_script,
                            min_num_proc, max_num_proc, slots, reset_limit, cooldown_range, elastic_timeout)
    python = executable or sys.executable
    command = [python, "-m", "ringpipe.launch.horovodrun", *hargs, "python", "-m", "ringpipe.launch.run_task"]
    try:
        code, parts = _run_job(command, env, nonce)
    finally:
        if path is not None:
            os.unlink(path)
    if code != 0:
        raise RuntimeError(f"ringpipe.run: the job exited with status {code}; one or more ranks failed "
                           "(the launcher's report and the ranks' errors are above)")
    # an elastic job ends with as many ranks as its last world had
    ranks = range(max(parts) + 1 if elastic and parts else num_proc)
    missing = [r for r in ranks if r not in parts or len(parts[r][1]) != parts[r][0]]
    if missing:
        raise RuntimeError(f"ringpipe.run: rank(s) {missing} ended without handing back the function's value")
    values = [decode("".join(parts[r][1][i] for i in range(parts[r][0]))) for r in ranks]
    return values[:min_num_proc] if min_num_proc is not None else values  # Horovod: the first min_num_proc


def _run_job(command: list[str], env: dict[str, str], nonce: str) -> tuple[int, dict[int, tuple[int, dict[int, str]]]]:
    """Run the launcher; pass its output through, keeping the marked lines: {rank: (count, {index: text})}."""
    parts: dict[int, tuple[int, dict[int, str]]] = {}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            at = line.find(nonce + ":")
            if at < 0:
                sys.stdout.write(line)
                continue
            before = line[:at]
            if before.strip() and not before.rstrip().endswith("]:"):
                sys.stdout.write(before + "\n")
            rank, index, count, text = line[at + len(nonce) + 1 :].rstrip("\n").split(":", 3)
            parts.setdefault(int(rank), (int(count), {}))[1][int(index)] = text
        sys.stdout.flush()
        return proc.wait(), parts
    except BaseException:
        proc.kill()
        proc.wait()
        raise
