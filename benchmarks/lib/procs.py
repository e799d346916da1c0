"""Starting the processes a benchmark compares: ringpipe's command line, a child's output, its JSON rows.

Drivers run their workers as separate programs (under ``ringpipe launch``, ``mpirun`` or a peer's
own launcher) and read back one JSON object per line that the workers print with a marker; a
child that fails or runs past its time stops the benchmark with the end of its output, so a
broken script never reports a figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["MARK", "emit", "ringpipe_cli", "rows", "run"]

#: What a worker puts before each JSON row it prints (:func:`emit`), so that logs around it are ignored.
MARK = "BENCH-ROW "


def ringpipe_cli(*args: str) -> list[str]:
    """The command line of ``ringpipe ARGS`` with this interpreter (no console script needed)."""
    return [sys.executable, "-m", "ringpipe.cli", *args]


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None, cwd: str | None = None) -> str:
    """Run ``cmd``; return its stdout and stderr together, or raise with their last lines when it fails."""
    full_env = {**os.environ, **(env or {})}
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        tail = ((exc.stdout or b"") if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace"))
        raise RuntimeError(f"{' '.join(cmd)} ran past {timeout:.0f} s:\n{tail[-3000:]}") from exc
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{text[-3000:]}")
    return text


def emit(row: dict[str, Any]) -> None:
    """Print one JSON row for the driver (:func:`rows` reads it back)."""
    print(MARK + json.dumps(row), flush=True)


def rows(text: str) -> list[dict[str, Any]]:
    """The JSON rows a worker printed with :func:`emit`, in order (each object decoded on its own:
    launchers may prefix a rank's lines or put another rank's output right after one)."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(chunk.lstrip())[0] for chunk in text.split(MARK)[1:]]
