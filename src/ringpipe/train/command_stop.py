"""Ctrl-C in ``ringpipe train``'s parent of spawned ranks: the first is passed on, a repeat stops them.

The ranks stop gracefully on the first SIGINT (a checkpoint, an evaluation and the summary at
the next log window, :mod:`ringpipe.train.stop`); a second one stops them at once. Either way
the parent says where the run can continue from and exits with Ctrl-C's code, 130.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shlex
import signal
import sys
import typing
from pathlib import Path
from types import FrameType

if typing.TYPE_CHECKING:
    from ringpipe.train.loop import StopRequest

__all__ = ["forward_stop", "interrupted", "stop_children"]


def forward_stop() -> StopRequest:
    """SIGINT in the parent of spawned ranks: the first is passed on to the ranks, which stop
    gracefully and report (a terminal's Ctrl-C reaches them too: they take both as one); a
    repeat raises ``KeyboardInterrupt`` here, and the parent stops the ranks at once. A forked
    rank inherits the handler, and with it a request made before its training loop took over."""
    from ringpipe.train.loop import StopRequest

    parent = os.getpid()

    class ForwardStop(StopRequest):
        def __call__(self, signum: int, frame: FrameType | None) -> None:
            first = not self.requested
            super().__call__(signum, frame)
            if first and os.getpid() == parent:
                for child in multiprocessing.active_children():
                    if child.pid is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(child.pid, signal.SIGINT)

    return ForwardStop()


def stop_children(timeout: float = 5.0) -> None:
    """Terminate the spawned ranks (a second Ctrl-C), killing those that do not exit in ``timeout``."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout)
        if child.is_alive():
            child.kill()


def interrupted(run_dir: Path) -> int:
    """Say where an interrupted run can continue from; the exit code of Ctrl-C."""
    from ringpipe.train.checkpoints.files import checkpoint_step, latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        print(f"ringpipe train: interrupted before the first checkpoint; nothing to resume in {run_dir}",
              file=sys.stderr)
    else:
        print(f"ringpipe train: interrupted at step {checkpoint_step(ckpt)}; continue with: "
              f"ringpipe train --resume --run-dir {shlex.quote(str(run_dir))}", file=sys.stderr)
    return 130
