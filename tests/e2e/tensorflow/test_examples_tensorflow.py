"""Seed 002's two Horovod TensorFlow programs, as shipped in examples/, run on 2 ranks and train.

Each is started as a user starts it (``ringpipe launch -n 2``); what is checked is what the
program prints: a falling loss, every rank ending with the same weights, and the accuracy of
the trained model on all the digits.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _launch(program: str, *args: str) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "ringpipe.cli", "launch", "-n", "2", str(EXAMPLES / program), *args],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def test_the_gradient_tape_program_trains_the_same_weights_on_every_rank(tmp_path: Path) -> None:
    out = _launch("tensorflow_mnist_style.py", "--epochs", "3", "--checkpoint_dir", str(tmp_path))
    losses = [float(v) for v in re.findall(r"epoch \d+: loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "weights equal on every rank: True" in out
    accuracy = float(re.search(r"accuracy on all digits: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.8
    assert (tmp_path / "checkpoint").exists()  # written by rank 0


def test_the_keras_fit_program_trains_and_reports_its_time() -> None:
    out = _launch("tensorflow_keras_mnist_style.py", "--epochs", "2", "--warmup_epochs", "1")
    assert re.search(r"Hvd Procs 2 Total time: [0-9.]+ second", out)
    accuracy = float(re.search(r"accuracy on all digits: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.5
