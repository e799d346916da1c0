"""Inconsistent collective calls, one per case, on every path: run in each rank.

Rank 0 makes a good call, the last rank a different (or invalid) one. Each case returns, per
rank, the error's class, its text and the result of a correct allreduce made right after it
(the world must still work). Imported by the tests under ``ringpipe.launch.spawn`` and run as a
script under ``mpirun`` (one JSON file per rank in ``$CASES_DIR``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

import ringpipe as rp
import ringpipe.collectives as C
from ringpipe.check.call import InvalidCallError, MismatchError
from ringpipe.comm import Communicator

#: case -> (the call of rank 0 and the middle ranks, the call of the last rank); ``c`` is the
#: communicator, ``ar``/``ag``/``bc`` the path's allreduce, allgather and broadcast.
CASES: dict[str, tuple[str, str]] = {
    "shape": ("ar(torch.ones(1024))", "ar(torch.ones(1000))"),
    "dtype": ("ar(torch.ones(64))", "ar(torch.ones(64, dtype=torch.float64))"),
    "op": ("ar(torch.ones(64), 'sum')", "ar(torch.ones(64), 'max')"),
    "collective": ("ar(torch.ones(64))", "ag(torch.ones(64))"),
    "same_count": ("ar(torch.ones(32, 32))", "ar(torch.ones(1024))"),
    "root": ("bc(torch.ones(16), 0)", "bc(torch.ones(16), 1)"),
    "bad_root": ("bc(torch.ones(16), 0)", "bc(torch.ones(16), 99)"),
    "ag_trailing": ("ag(torch.ones(3, 4))", "ag(torch.ones(3, 5))"),
}

#: Paths: the communicator's own methods, ringpipe.collectives natively and with its own
#: algorithms, and the Horovod-style top-level API.
PATHS = ("comm", "native", "auto", "ring", "hvd")


def _calls(comm: Communicator, path: str) -> dict[str, Callable[..., Any]]:
    if path == "comm":
        return {"ar": comm.allreduce, "ag": comm.allgather, "bc": comm.broadcast}
    if path == "hvd":
        return {
            "ar": lambda t, op="average": rp.allreduce(t, op=op),
            "ag": rp.allgather,
            "bc": lambda t, root: rp.broadcast(t, root),
        }
    algo = "native" if path == "native" else path

    def gather_algo(kind: str) -> str:
        return algo if algo in C.SUPPORTED[kind] else "auto"

    return {
        "ar": lambda t, op="sum": C.allreduce(comm, t, op, algorithm=gather_algo("allreduce")),
        "ag": lambda t: C.allgather(comm, t, algorithm=gather_algo("allgather")),
        "bc": lambda t, root: C.broadcast(comm, t, root, algorithm=gather_algo("broadcast")),
    }


def run_case(comm: Communicator, path: str, case: str) -> tuple[str, str, float]:
    """Make this rank's call of ``case`` on ``path``; return (error class, text, next allreduce's sum)."""
    good, bad = CASES[case]
    calls = _calls(comm, path)
    code = bad if comm.rank == comm.size - 1 else good
    error: Exception | None = None
    try:
        eval(code, {"torch": torch}, calls)  # noqa: S307 - the case table above
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = exc
    name, text = "", ""
    if isinstance(error, InvalidCallError):  # the most specific kind, whatever class carries it
        name = "InvalidCallError"
    elif isinstance(error, MismatchError):
        name = "MismatchError"
    elif error is not None:
        name = type(error).__name__
    if error is not None:
        text = str(error)
        if path == "hvd" and not isinstance(error, rp.HorovodInternalError):
            name += " (not a HorovodInternalError, as Horovod raises)"
    after = torch.ones(4)
    comm.allreduce(after)
    return name, text, float(after[0])


def run_all(comm: Communicator, paths: tuple[str, ...] = PATHS) -> dict[str, tuple[str, str, float]]:
    rp.init(comm)
    out = {}
    for path in paths:
        for case in CASES:
            out[f"{path}/{case}"] = run_case(comm, path, case)
    return out


if __name__ == "__main__":
    from ringpipe.comm import init_world

    world = init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
    result = run_all(world)
    # a file per rank: mpirun's tagged output may split long lines
    with open(os.path.join(os.environ["CASES_DIR"], f"rank{world.rank}.json"), "w") as f:
        json.dump(result, f)
    rp.shutdown()
    sys.exit(0)
