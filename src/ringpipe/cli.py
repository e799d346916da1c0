"""`ringpipe train | data | launch | bench | doctor | trace`: argument parsing only."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]

# Subcommands live next to what they drive; each module offers add_parser(subparsers). Only the
# module of the command given is imported (several import torch, which takes seconds): the others
# are listed from this table, whose names and lines match their parsers (checked by the tests).
_SUBCOMMANDS = {
    "ringpipe.train.command": {"train": "train a model from a typed config (every mode: single, ddp, dp, pipelines)"},
    "ringpipe.train.command_plan": {"plan": "predict each pipeline mode's peak memory per stage for a training "
                                            "config, before running it"},
    "ringpipe.train.fetch": {"data": "get the datasets of the bundled configs (mnist, fashion-mnist, cifar10)"},
    "ringpipe.launch": {"launch": "start N processes of a script on this machine, or on several hosts "
                                  "(-H / --hostfile)"},
    "ringpipe.observe.bench": {"bench": "time collectives (ringpipe's algorithms and the native ones) over a "
                                        "size sweep"},
    "ringpipe.observe.commands": {
        "doctor": "explain where collectives lose time: late ranks, placement, slow links, slow CPUs",
        "trace": "turn an events file into a Chrome timeline and print the communication profile",
    },
}


def _version() -> str:
    """The installed distribution's version (read without importing ringpipe's torch-based modules)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ringpipe")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown (not installed)"


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; given ``argv``, only the module of its subcommand is imported
    (the other subcommands are listed, with their help line, for usage and errors)."""
    parser = argparse.ArgumentParser(
        prog="ringpipe",
        description="Distributed training on PyTorch: data parallel, pipelines, collectives, and where the time goes.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    command = _command(argv) if argv is not None else None
    for name, commands in _SUBCOMMANDS.items():
        if argv is not None and command not in commands:
            for word, line in commands.items():
                sub.add_parser(word, help=line, add_help=False)  # listed only: not the command run
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("ringpipe"):
                continue  # that part of ringpipe is not in this build
            raise
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "command", None) == "launch":
            # `ringpipe launch -m module --opt ...`: options after the module belong to it.
            args.args = [*extra, *args.args] if args.script is None else [*args.args, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.command == "doctor":
        with contextlib.suppress(ModuleNotFoundError):  # the pipeline doctors join the doctor's analyses
            importlib.import_module("ringpipe.pipeline.diagnosis")
            importlib.import_module("ringpipe.pipeline.stream_diagnosis")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
