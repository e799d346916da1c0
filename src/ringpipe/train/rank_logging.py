"""Rank-aware logging for training processes: a rank prefix, and only rank 0 talks at INFO."""

from __future__ import annotations

import logging
import sys

__all__ = ["configure_rank_logging"]


class _TqdmHandler(logging.StreamHandler):  # type: ignore[type-arg, unused-ignore]
    """Writes through ``tqdm.write`` so that log lines and a progress bar do not overwrite each other."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never raise into the training loop
            self.handleError(record)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}/{size}] " if size > 1 else ""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = self.prefix
        return True


def configure_rank_logging(rank: int, size: int, verbose: bool = False) -> None:
    """Route ringpipe's log records through one handler with a rank prefix.

    Rank 0 logs at INFO (DEBUG when ``verbose``); the other ranks only report warnings and
    errors unless ``verbose``, so a run prints one story rather than N copies of it. Lines go
    through tqdm so that they do not break rank 0's progress bar.
    """
    logger = logging.getLogger("ringpipe")
    for h in list(logger.handlers):
        if getattr(h, "_ringpipe_rank", False):
            logger.removeHandler(h)
    handler = _TqdmHandler()
    handler._ringpipe_rank = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter(rank, size))
    handler.setFormatter(logging.Formatter("%(asctime)s %(rank_prefix)s%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
    if verbose:
        logger.setLevel(logging.DEBUG)
    else:
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
