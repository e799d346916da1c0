"""`ringpipe train | data | launch | bench | doctor | trace`: argument parsing only."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]

# Subcommands live next to what they drive; each module offers add_parser(subparsers).
_SUBCOMMANDS = (
    "ringpipe.train.cli",
    "ringpipe.train.fetch",
    "ringpipe.launch",
    "ringpipe.observe.bench",
    "ringpipe.observe.cli",
)


def _version() -> str:
    """The installed distribution's version (read without importing ringpipe's torch-based modules)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ringpipe")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringpipe",
        description="Distributed training on PyTorch: data parallel, pipelines, collectives, and where the time goes.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("ringpipe"):
                continue  # that part of ringpipe is not in this build
            raise
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
