"""Quiet failures: a failed rank shows its message once and the user's own frame (everything with
-v / --verbose); ``ringpipe-horovodrun`` names itself on the launcher's lines; progress bars are
drawn on a terminal only.

The references: Python's own full traceback (which holds the library frames the short report
leaves out), the line of the user's file that raised, and the name of the command that was run.
"""

from __future__ import annotations

import linecache
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest

import ringpipe
from ringpipe.launch.bootstrap import failure_report

RINGPIPE_DIR = Path(ringpipe.__file__).parent
_LAUNCH_VARS = ("RINGPIPE_BACKEND", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "RINGPIPE_LAUNCH_VERBOSE")

# Code that stands for ringpipe's engine: compiled as a file of the ringpipe package, it is library code.
ENGINE = textwrap.dedent('''
    class MismatchError(RuntimeError):
        pass

    class EngineMismatchError(RuntimeError):
        pass

    def _thread_task():
        raise MismatchError("rank 0 passed shape=[3], but rank 1 passed shape=[4]")

    def run(user_callback=None):
        try:
            _thread_task()
        except MismatchError as error:
            raise EngineMismatchError(str(error)) from error

    def divide(n):
        return 1 / n

    class PeerDeparted(RuntimeError):
        pass

    def wait():
        try:
            raise RuntimeError("[pair.cc:553] Connection closed by peer")
        except RuntimeError as error:
            raise PeerDeparted("rank 0 left the job while rank 1 waited in barrier") from error
''')


def _engine():
    path = str(RINGPIPE_DIR / "fake_engine.py")  # never written: its lines are given to linecache
    linecache.cache[path] = (len(ENGINE), None, ENGINE.splitlines(True), path)
    namespace: dict = {"__name__": "ringpipe.fake_engine"}
    exec(compile(ENGINE, path, "exec"), namespace)
    return namespace


def test_a_wrapped_collective_error_shows_its_message_once_and_the_users_frame():
    engine = _engine()
    try:
        engine["run"]()  # the user's line
    except RuntimeError as exc:
        caught = exc
    full = "".join(traceback.format_exception(caught))
    assert full.count("passed shape=[3]") >= 2 and "fake_engine.py" in full  # Python's own: twice or more, and the engine
    short = failure_report(caught, hint="-v shows them")
    assert short.count("passed shape=[3]") == 1, short
    assert 'engine["run"]()  # the user\'s line' in short and __file__ in short
    assert "fake_engine.py" not in short and short.rstrip().endswith("(-v shows them)")
    assert failure_report(caught, verbose=True).count("fake_engine.py") >= 2  # -v: everything


def test_an_error_with_no_frame_of_the_users_shows_where_it_was_raised():
    engine = _engine()
    try:
        engine["divide"](0)
    except ZeroDivisionError as exc:
        caught = exc.with_traceback(exc.__traceback__.tb_next)  # as if the user's code were not on the stack
    short = failure_report(caught)
    assert "fake_engine.py" in short and "return 1 / n" in short and "ZeroDivisionError" in short, short


def test_a_library_error_that_ringpipe_explains_is_not_shown_twice():
    engine = _engine()
    try:
        engine["wait"]()
    except RuntimeError as exc:
        caught = exc.with_traceback(exc.__traceback__.tb_next)  # no frame of the user's
    short = failure_report(caught)
    assert short.strip() == "ringpipe.fake_engine.PeerDeparted: rank 0 left the job while rank 1 waited in barrier", short
    assert "Connection closed by peer" in failure_report(caught, verbose=True)


SHAPES = textwrap.dedent('''
    import torch
    import ringpipe as hvd
    hvd.init()
    t = torch.ones(3 + hvd.rank())
    print(hvd.allreduce(t, name="grad"))
''')

HOROVODRUN = "import sys\nfrom ringpipe.launch.horovodrun import main\nsys.exit(main())\n"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_shape_mismatch_under_horovodrun_is_short_and_named(tmp_path):
    (tmp_path / "shapes.py").write_text(SHAPES)
    (tmp_path / "ringpipe-horovodrun").write_text(HOROVODRUN)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"

    def horovodrun(*flags):
        return subprocess.run([sys.executable, str(tmp_path / "ringpipe-horovodrun"), *flags, "-np", "2", "--gloo",
                               "python", "shapes.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=280)

    out = horovodrun()
    assert out.returncode != 0
    err = out.stderr
    message = "Mismatched tensor shapes in allreduce"
    for rank in (0, 1):
        mine = [line for line in err.splitlines() if line.startswith(f"[{rank}]:")]
        assert sum(message in line for line in mine) == 1, err  # once per rank
        assert any('File "shapes.py", line 6' in line for line in mine), err  # the user's own frame
        assert len(mine) <= 8, err
    assert "engine.py" not in err and "announcement" not in err, err
    own = [line for line in err.splitlines() if not line.startswith("[")]
    assert own and all(line.startswith("horovodrun (ringpipe): ") for line in own), own  # it names itself
    assert sum(message in line for line in own) == 1, own  # the summary says it once
    verbose = horovodrun("--verbose")
    assert "core/engine.py" in verbose.stderr, verbose.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_redirected_training_log_has_no_progress_bar(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-m", "ringpipe.cli", "train", "--run-dir", str(tmp_path / "run"),
                          "--set", "nprocs=2", "--set", "max_steps=12", "--set", "log_every=4"],
                         env=env, capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "\r" not in out.stderr and "step/s" not in out.stderr, out.stderr[-2000:]
