"""Start a job's ranks: ``ringpipe launch`` on this machine (or one node of many), and :func:`spawn` inside Python.

``ringpipe launch`` is a thin layer over existing process managers — torch's elastic agent for
gloo/NCCL, ``mpirun`` for MPI, ``torch.multiprocessing`` for ``--mode mp`` — that gives every
mode the same command line (:mod:`~ringpipe.launch.options`), the same rank environment, ranks
that end with their launcher (:mod:`~ringpipe.launch.bootstrap`), whole lines prefixed with the
rank and one report naming the rank that failed first (:mod:`~ringpipe.launch.relay`). With
``-H``/``--hostfile`` naming other hosts, one command starts every host's ranks over ssh
(:mod:`~ringpipe.launch.remote`; :mod:`~ringpipe.launch.hosts` reads the host lists).

The launcher process imports torch only on the paths that run torch's code in it: the elastic
agent (the default mode) and ``--mode mp``'s ``torch.multiprocessing``. ``mpirun`` launches,
several-host launches, usage errors and help start without it, and :func:`spawn`,
:func:`local_rank_zero_first` and :class:`WorkerFailed` (torch's side) are imported on first use.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from ringpipe.launch.bootstrap import VERBOSE
from ringpipe.launch.options import (
    LaunchOptions,
    LaunchUsageError,
    launch_help,
    parse_launch_args,
    validate,
)
from ringpipe.launch.runners import mpirun_command
from ringpipe.launch.speaker import label

if TYPE_CHECKING:  # at run time __getattr__ imports them (ringpipe.launch.spawning imports torch)
    from ringpipe.launch.spawning import WorkerFailed, local_rank_zero_first, spawn

__all__ = ["spawn", "launch_main", "local_rank_zero_first", "WorkerFailed", "mpirun_command", "add_parser",
           "parse_launch_args", "LaunchOptions", "LaunchUsageError"]

#: names imported on first use, and their module (named apart from the function ``spawn``, so
#: that importing the module never rebinds this package's ``spawn``)
_LAZY = {"spawn": "ringpipe.launch.spawning", "local_rank_zero_first": "ringpipe.launch.spawning",
         "WorkerFailed": "ringpipe.launch.spawning"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ringpipe.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def add_parser(sub: Any) -> None:
    """Register ``launch``; its arguments are read by :func:`parse_launch_args`, untouched by argparse.

    The subcommand's parser treats every word as a positional (no prefix characters), so the
    launcher's options and the program's arguments reach :func:`launch_main` exactly as typed.
    """
    import argparse

    p = sub.add_parser(
        "launch",
        help="start N processes of a script on this machine, or on several hosts (-H / --hostfile)",
        description=launch_help(),
        prefix_chars="\0",
        add_help=False,
    )
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=launch_main)


def launch_main(args: Any) -> int:
    """Run ``ringpipe launch`` with ``args.argv`` (the words after ``launch``) or a parsed LaunchOptions."""
    from ringpipe.launch import mpi_hosts, remote, runners

    if getattr(args, "verbose", False):  # `ringpipe -v launch`: a failed rank's whole traceback
        os.environ[VERBOSE] = "1"
    try:
        opts = args if isinstance(args, LaunchOptions) else parse_launch_args(list(args.argv))
        validate(opts)
    except LaunchUsageError as exc:
        print(f"{label()}: {exc}", file=sys.stderr)
        return 2
    if os.environ.pop(remote.STDIN_EOF, None):  # one host of a several-host launch: end with the launcher
        opts.host_of_many = True
        remote.end_on_stdin_eof()
    if opts.elastic:
        from ringpipe.launch.elastic_driver import run_elastic

        return run_elastic(opts)
    if opts.placement is not None and opts.backend != "mpi":
        return remote.run_hosts(opts)
    if opts.backend == "mpi":
        try:
            return mpi_hosts.run_mpi_hosts(opts) if opts.placement is not None else runners.run_mpi(opts)
        except FileNotFoundError as exc:
            print(f"{label()}: {exc}", file=sys.stderr)
            return 1
    if opts.mode == "mp":
        return runners.run_mp(opts)
    return runners.run_agent(opts)
