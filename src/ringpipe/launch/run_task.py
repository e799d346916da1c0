"""One rank of a :func:`ringpipe.run` job: call the function it was handed and hand back what it returned.

Started by ``ringpipe launch`` as ``python -m ringpipe.launch.run_task`` on every rank. The
function, its arguments and keyword arguments arrive pickled (cloudpickle) and base64-encoded in
the environment (:data:`PAYLOAD`), or, when that would be too long for one variable, in a file
named by :data:`PAYLOAD_FILE`. The value it returns is pickled the same way and written to the
rank's standard output as marked lines (:data:`NONCE`, the rank, the line's index and count, a
slice of the base64 text): the launcher relays every rank's output from every host, and the
caller takes the marked lines out and puts the value back together. An exception leaves the rank
like any program's, with its traceback, and the launcher reports the job failed.
"""

from __future__ import annotations

import base64
import os
import sys
from typing import Any

__all__ = ["PAYLOAD", "PAYLOAD_FILE", "NONCE", "CHUNK", "encode", "decode", "result_lines", "main"]

PAYLOAD = "RINGPIPE_RUN_PAYLOAD"
PAYLOAD_FILE = "RINGPIPE_RUN_PAYLOAD_FILE"
NONCE = "RINGPIPE_RUN_NONCE"
CHUNK = 4000  # base64 characters per marked line: well under what any relay or mpirun tag handles


def encode(value: Any) -> str:
    """``value`` pickled by value (cloudpickle: functions of ``__main__`` and closures too), base64."""
    import cloudpickle

    return base64.b64encode(cloudpickle.dumps(value)).decode("ascii")


def decode(text: str) -> Any:
    import pickle

    return pickle.loads(base64.b64decode(text.encode("ascii")))


def result_lines(nonce: str, rank: int, value: Any) -> list[str]:
    """The marked lines that carry ``value`` from ``rank`` (at least one, even for ``None``)."""
    text = encode(value)
    parts = [text[i : i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]
    return [f"{nonce}:{rank}:{i}:{len(parts)}:{p}" for i, p in enumerate(parts)]


def _payload() -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    text = os.environ.get(PAYLOAD)
    if text is None:
        path = os.environ.get(PAYLOAD_FILE)
        if not path:
            raise RuntimeError(f"ringpipe.launch.run_task runs the ranks of ringpipe.run(): neither {PAYLOAD} nor "
                               f"{PAYLOAD_FILE} is set (start it through ringpipe.run)")
        with open(path, encoding="ascii") as f:
            text = f.read()
    func, args, kwargs = decode(text)
    return func, tuple(args), dict(kwargs)


def main() -> int:
    func, args, kwargs = _payload()
    value = func(*args, **kwargs)
    nonce = os.environ[NONCE]
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    sys.stdout.flush()
    sys.stdout.write("\n".join(result_lines(nonce, rank, value)) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
