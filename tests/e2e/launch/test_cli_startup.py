"""The command line starts without torch where it does not need it: ``ringpipe --help``, the
data fetcher's help, ``import ringpipe`` itself; the lazy listing of the subcommands says what
their own parsers say. (``ringpipe train --help`` lists the modes and dp algorithms from their
registries, which import torch, when it prints.)"""

from __future__ import annotations

import subprocess
import sys

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
