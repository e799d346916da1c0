"""The command line starts without torch where it does not need it: ``ringpipe --help``, the
data fetcher's help, ``import ringpipe`` itself, the launcher's entry modules and its mpirun
path; the lazy listing of the subcommands says what their own parsers say. (``ringpipe train --help`` lists the modes and dp algorithms from their
registries, which import torch, when it prints.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ringpipe.cli import build_parser


def _torch_imported_by(code: str) -> tuple[bool, str]:
    """Run ``code`` in a fresh interpreter; whether torch was imported by then, and its output."""
    probe = f"import sys, contextlib, io\nout = io.StringIO()\n" \
            f"with contextlib.redirect_stdout(out):\n    try:\n        {code}\n    except SystemExit:\n        pass\n" \
            f"print('torch' in sys.modules)\nprint(out.getvalue())"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, _, rest = proc.stdout.partition("\n")
    return first == "True", rest


@pytest.mark.timeout(150)
@pytest.mark.parametrize("argv", [["--help"], ["data", "--help"], ["data", "fetch", "--help"], ["--version"]])
def test_help_does_not_import_torch(argv):
    imported, out = _torch_imported_by(f"from ringpipe.cli import main; main({argv!r})")
    assert not imported, f"ringpipe {' '.join(argv)} imported torch"
    assert "usage: ringpipe" in out or out.startswith("ringpipe ")


@pytest.mark.timeout(150)
def test_top_level_help_lists_every_subcommand_and_train_help_every_key():
    _, top = _torch_imported_by("from ringpipe.cli import main; main(['--help'])")
    for name in ("train", "data", "launch", "bench", "doctor", "trace"):
        assert f"    {name} " in top
    _, train = _torch_imported_by("from ringpipe.cli import main; main(['train', '--help'])")
    for key in ("scale_lr", "warmup_epochs", "keep", "batch_size", "precision", "accumulate", "every_epochs"):
        assert key in train


@pytest.mark.timeout(150)
def test_import_ringpipe_is_lazy_and_still_the_horovod_api():
    imported, _ = _torch_imported_by("import ringpipe")
    assert not imported
    imported, out = _torch_imported_by(
        "import ringpipe as hvd; ns = {}; exec('from ringpipe import *', ns); "
        "print(callable(hvd.init), hvd.Communicator.__name__, hvd.collectives.__name__, "
        "'DistributedOptimizer' in ns, 'spawn' in ns)")
    assert imported and out.split() == ["True", "Communicator", "ringpipe.collectives", "True", "True"]


#: the modules a launcher process imports before it knows its mode: none may import torch
LAUNCHER_ENTRIES = ("ringpipe.cli", "ringpipe.launch", "ringpipe.launch.runners", "ringpipe.launch.horovodrun",
                    "ringpipe.launch.remote", "ringpipe.launch.mpi_hosts", "ringpipe.launch.options",
                    "ringpipe.launch.run_api")


@pytest.mark.timeout(150)
def test_the_launchers_entry_modules_and_usage_errors_do_not_import_torch():
    imported, out = _torch_imported_by(
        f"import importlib; [importlib.import_module(m) for m in {LAUNCHER_ENTRIES!r}]; "
        "from ringpipe.launch import launch_main, mpirun_command; from types import SimpleNamespace; "
        "print(launch_main(SimpleNamespace(argv=['-n', '2', '--mode', 'bogus', 'x.py'])))")
    assert not imported, "a launcher entry module imported torch"
    assert out.split() == ["2"]  # the usage error was reported, without torch


@pytest.mark.timeout(150)
def test_the_torch_side_names_of_the_launcher_load_on_first_use():
    imported, out = _torch_imported_by(
        "import ringpipe.launch.spawning, ringpipe.launch as L; from ringpipe.launch import spawn, WorkerFailed; "
        "print(callable(spawn), L.spawn is spawn, WorkerFailed.__name__, L.local_rank_zero_first.__name__)")
    assert imported and out.split() == ["True", "True", "WorkerFailed", "local_rank_zero_first"]


@pytest.mark.timeout(150)
@pytest.mark.skipif(shutil.which("mpirun") is None or __import__("importlib").util.find_spec("mpi4py") is None,
                    reason="needs mpirun and mpi4py")
def test_an_mpirun_launch_runs_its_ranks_without_importing_torch_in_the_launcher(tmp_path: Path):
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    # The ranks write to the launcher's descriptors themselves: read the whole output, not a redirect.
    probe = ("import sys; from ringpipe.launch.horovodrun import main; "
             f"code = main(['--mpi', '-np', '2', 'python', {str(script)!r}]); "
             "print('launcher torch', 'torch' in sys.modules, 'code', code)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert "launcher torch False code 0" in out, out
    assert "rank 0 of 2" in out and "rank 1 of 2" in out, out


def _listing(parser) -> dict[str, str]:
    action = next(a for a in parser._actions if a.dest == "command")
    return {choice.dest: choice.help for choice in action._choices_actions}


def test_the_lazy_listing_matches_the_subcommands_own_parsers():
    full = _listing(build_parser())  # every subcommand module imported
    lazy = _listing(build_parser(["--help"]))  # none imported
    assert lazy == full
    assert _listing(build_parser(["train", "--help"])) == full


@pytest.mark.timeout(60)
def test_an_unknown_command_still_lists_the_valid_ones():
    proc = subprocess.run([sys.executable, "-m", "ringpipe.cli", "tran"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'tran'" in proc.stderr and "'train'" in proc.stderr
