"""``ringpipe.run``, Horovod's run API (``horovod.run``): a function on every rank of a new job, values back by rank.

What Horovod documents (``horovod/runner/__init__.py``): the return value is the list of the
function's values indexed by rank; ``args``/``kwargs`` are passed to it; ``np`` is a deprecated
alias of ``num_proc``; giving both ``hosts`` and ``hostfile``, or both ``use_gloo`` and
``use_mpi``, is a ``ValueError`` with Horovod's message; a failed rank fails the call. Jobs are
real: each call starts real ranks through the launcher, and the programs here are scripts whose
function lives in ``__main__``, as in Horovod's examples.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import ringpipe

HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None

SCRIPT = """
import sys

import torch

import ringpipe as horovod
import ringpipe as hvd


def main(scale, offset=0):
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    print("rank", hvd.rank(), "says hello")
    return {"rank": hvd.rank(), "size": hvd.size(), "value": float(total) * scale + offset}


if __name__ == "__main__":
    backend = sys.argv[1]
    n = int(sys.argv[2])
    factor = 3.0
    out = horovod.run(main, args=(2.0,), kwargs={"offset": 1.0}, num_proc=n, use_gloo=backend == "gloo",
                      use_mpi=backend == "mpi")
    closure = horovod.run(lambda: hvd.init() or hvd.rank() * factor, num_proc=n, use_gloo=backend == "gloo",
                          use_mpi=backend == "mpi")
    big = horovod.run(len, args=(b"x" * 300_000,),
                      num_proc=n, use_gloo=backend == "gloo", use_mpi=backend == "mpi")
    print("RESULT", out)
    print("CLOSURE", closure)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fixed = horovod.run(lambda: hvd.init() or hvd.rank(), num_proc=n, min_num_proc=n - 1, max_num_proc=n,
                            use_gloo=backend == "gloo", use_mpi=backend == "mpi")
    print("BIG", big)
    print("FIXED", fixed, any("fixed job" in str(w.message) for w in caught))
"""

FAILING = """
import ringpipe as horovod


def main():
    import os
    if os.environ["RANK"] == "1":
        raise ValueError("rank one cannot go on")
    return "fine"


if __name__ == "__main__":
    try:
        horovod.run(main, num_proc=2, use_gloo=True)
    except RuntimeError as exc:
        print("RAISED", type(exc).__name__, exc)
    else:
        print("NOT RAISED")
"""


def _script(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "program.py"
    path.write_text(textwrap.dedent(text))
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


def _line(out: str, tag: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith(tag + " ")]
    assert len(lines) == 1, out
    return lines[0][len(tag) + 1 :]


@pytest.mark.parametrize("backend,n", [("gloo", 3), pytest.param("mpi", 2, marks=pytest.mark.skipif(
    not HAVE_MPI, reason="needs mpirun and mpi4py"))])
def test_run_returns_every_ranks_value_in_rank_order(tmp_path, backend, n):
    proc = _script(tmp_path, SCRIPT, backend, str(n))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want = [{"rank": r, "size": n, "value": 2.0 * sum(range(1, n + 1)) + 1.0} for r in range(n)]
    assert _line(proc.stdout, "RESULT") == repr(want)
    assert _line(proc.stdout, "CLOSURE") == repr([r * 3.0 for r in range(n)])  # a lambda over a local
    assert _line(proc.stdout, "BIG") == repr([300_000] * n)  # arguments too long for the environment: a file
    # min/max_num_proc without host discovery: a fixed job, with a warning; Horovod returns the first min_num_proc
    assert _line(proc.stdout, "FIXED") == f"{list(range(n - 1))!r} True"
    for r in range(n):  # what the ranks print still reaches the caller's output
        assert f"rank {r} says hello" in proc.stdout


def test_a_failed_rank_fails_the_call_with_runtime_error(tmp_path):
    proc = _script(tmp_path, FAILING)
    assert "RAISED RuntimeError" in proc.stdout, proc.stdout + proc.stderr
    assert "rank one cannot go on" in proc.stdout + proc.stderr  # the rank's own error is shown


def test_arguments_horovod_refuses_are_refused_before_anything_starts():
    def f():
        return 1

    with pytest.raises(ValueError, match="Argument hosts and hostfile only allow one provided."):
        ringpipe.run(f, num_proc=2, hosts="localhost:2", hostfile="hosts.txt")
    with pytest.raises(ValueError, match="Argument use_gloo and use_mpi only allow one set True."):
        ringpipe.run(f, num_proc=2, use_gloo=True, use_mpi=True)
    with pytest.raises(ValueError, match="num_proc=2 must lie between min_num_proc=3"):
        ringpipe.run(f, num_proc=2, min_num_proc=3)
    with pytest.raises(ValueError, match="host_discovery_script, or hosts"):
        ringpipe.run(f, num_proc=2, host_discovery_script="discover.sh", hosts="localhost:2")
    with pytest.raises(ValueError, match="Gloo only"):
        ringpipe.run(f, num_proc=2, host_discovery_script="discover.sh", use_mpi=True)
    with pytest.raises(ValueError, match="num_proc must be a positive"):
        ringpipe.run(f, num_proc=0)
    with pytest.raises(TypeError, match="needs a function"):
        ringpipe.run(42, num_proc=1)  # type: ignore[arg-type]


def test_np_is_a_deprecated_alias_of_num_proc():
    def f():
        return 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="num_proc must be a positive"):  # np=0 reaches num_proc
            ringpipe.run(f, np=0)
    assert any(issubclass(w.category, DeprecationWarning) and "np is deprecated, use num_proc" in str(w.message)
               for w in caught)
