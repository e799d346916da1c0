"""Many ``python -m ringpipe.cli ARGS`` runs from one interpreter: a fresh fork per command line.

One Python process imports torch and ``ringpipe.cli`` once, then forks a child per command line
that runs ``ringpipe.cli`` as ``__main__`` with its own stdout and stderr files, exiting as the
interpreter would (``SystemExit``'s code, 1 and the traceback on stderr for an uncaught
exception). The tests that check many command lines' exit codes and messages (one parameter
each) pay one interpreter start instead of one per parameter. What depends on a fresh
interpreter's imports (``--help`` does not import torch) is tested with its own interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["run_cli_batch"]

DRIVER = r'''
import json, os, runpy, sys, traceback
import torch  # noqa: F401 - imported once, before the forks
import ringpipe.cli  # noqa: F401
from ringpipe.launch.bootstrap import exit_status

plan = json.loads(open(sys.argv[1]).read())
results = []
for i, argv in enumerate(plan["argv"]):
    out, err = os.path.join(plan["dir"], f"{i}.out"), os.path.join(plan["dir"], f"{i}.err")
    pid = os.fork()
    if pid == 0:
        fo, fe = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fo, 1)
        os.dup2(fe, 2)
        sys.argv = [ringpipe.cli.__file__, *argv]
        del sys.modules["ringpipe.cli"]  # run as __main__, as python -m does, not a second copy beside it
        code = 0
        try:
            runpy.run_module("ringpipe.cli", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exit_status(exc)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    results.append([code, open(out).read(), open(err).read()])
print(json.dumps(results))
'''


def run_cli_batch(argvs: Sequence[Sequence[str]], env: dict[str, str], timeout: float,
                  cwd: object = None) -> list[subprocess.CompletedProcess[str]]:
    """Each ``ringpipe ARGV`` of ``argvs`` in a fork of one interpreter; their results in order."""
    with tempfile.TemporaryDirectory(prefix="clibatch") as tmp:
        plan = Path(tmp) / "plan.json"
        plan.write_text(json.dumps({"argv": [list(a) for a in argvs], "dir": tmp}))
        proc = subprocess.run([sys.executable, "-c", DRIVER, str(plan)], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=cwd)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return [subprocess.CompletedProcess([sys.executable, "-m", "ringpipe.cli", *argv], code, out, err)
            for argv, (code, out, err) in zip(argvs, rows, strict=True)]
