"""A newcomer's first commands: --version, train -v, "did you mean", the summary's notes, curves.png, README."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from ringpipe.train.metrics import curves_figure, format_summary
from trainrun import sets, train

README = Path(__file__).resolve().parents[3] / "README.md"


def _cli(*argv, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "RINGPIPE_BACKEND"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "ringpipe.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(60)
def test_version():
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"ringpipe {version('ringpipe')}"


@pytest.mark.timeout(60)
def test_train_takes_verbose_after_the_subcommand():
    out = _cli("train", "-v", "--print-config")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("mode: dp") and "usage" not in out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,hint", [
    (["--set", "epoch=3"], "epoch: unknown key (value 3) (did you mean 'epochs'?)"),
    (["--set", "optimizer.lrr=0.1"], "optimizer.lrr: unknown key (value 0.1) (did you mean 'lr'?)"),
    (["--set", "model.name=mpl"], "model.name='mpl': unknown name (did you mean 'mlp'?)"),
    (["--set", "mode=asnyc"], "unknown mode 'asnyc' (did you mean 'async'?)"),
    (["--config", "dpp"], "config file 'dpp' does not exist (did you mean 'dp'?)"),
])
def test_did_you_mean(argv, hint):
    out = _cli("train", *argv, "--print-config")
    assert out.returncode == 2 and hint in out.stderr, out.stderr


def test_parser_and_help_leave_the_trainer_unimported():
    """``ringpipe --help`` builds every subcommand's parser: the trainer's loop and modes (torch) stay out."""
    code = ("import sys, contextlib, io; from ringpipe.cli import build_parser; p = build_parser(); "
            "f = io.StringIO(); r = contextlib.redirect_stdout(f); r.__enter__(); p.print_help(); r.__exit__(None, None, None); "
            "print([m for m in ('ringpipe.train.loop', 'ringpipe.train.modes', 'ringpipe.train.pipeline_modes') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_readme_torchrun_line_uses_the_bundled_name(tmp_path):
    lines = [line for line in README.read_text().splitlines() if line.startswith("torchrun") and " train " in line]
    assert lines and all("--config configs/" not in line for line in lines)
    config = re.search(r"--config (\S+)", lines[0]).group(1)
    out = _cli("train", "--config", config, "--print-config", cwd=tmp_path)  # from outside the repository
    assert out.returncode == 0 and "mode: ddp" in out.stdout, out.stderr


# ------------------------------------------------------------------------------ the summary


@pytest.mark.timeout(120)
def test_summary_says_what_its_numbers_mean(tmp_path, capsys):
    run = tmp_path / "run"
    cfg = ["mode=dp", "nprocs=2", "epochs=1", "batch_size=32", "dp.backward_passes_per_step=2",
           "model.hidden=[16]", "log_every=5"]
    rc, summary, _ = train(run, *sets(cfg))
    out = capsys.readouterr().out
    assert rc == 0
    assert summary["complete"] and summary["stop_reason"] == "complete" and "interrupted" not in summary
    # 1,438 records, global batch 64: 23 steps take 1,472 samples, 34 past the first epoch.
    assert summary["steps"] == 23 and summary["samples"] == 23 * 64 and summary["records"] == 1438
    assert summary["epochs"] == round(1472 / 1438, 6) and summary["epochs_configured"] == 1
    assert "the last one ran 34 samples past epoch 1" in out
    assert summary["micro_batch"] == 16 and summary["optimizer_steps"] == 23
    assert summary["lr"] == 0.001 and summary["lr_scale"] == 2.0
    assert "lr 0.001 is the single-process rate; optimizer.scale_lr (default true) multiplied it by 2" in out
    help_text = _cli("train", "--help").stdout
    assert "scale_lr (default true)" in " ".join(help_text.split())


@pytest.mark.timeout(60)
def test_max_steps_stop_is_not_called_an_interruption(tmp_path):
    rc, summary, _ = train(tmp_path / "run", *sets(["mode=single", "max_steps=3", "model.hidden=[16]"]))
    assert rc == 0 and summary["stop_reason"] == "max_steps" and not summary["complete"]
    assert "interrupted" not in summary
    assert "past epoch" not in format_summary(summary)


# ------------------------------------------------------------------------------ curves.png


def test_curves_have_a_title_and_a_learning_rate_panel():
    records = [{"kind": "train", "step": s, "epoch": s / 10, "loss": 1 / s, "accuracy": 0.5, "lr": 0.01 * s}
               for s in range(1, 6)]
    records.append({"kind": "eval", "step": 5, "epoch": 0.5, "test_loss": 0.3, "test_accuracy": 0.8})
    fig = curves_figure(records, "runs/x: mode dp, 2 processes")
    assert fig._suptitle.get_text() == "runs/x: mode dp, 2 processes"
    lr_axes = [ax for ax in fig.axes if ax.get_ylabel() == "learning rate"]
    assert len(lr_axes) == 1
    (line,) = lr_axes[0].get_lines()
    assert list(line.get_xdata()) == [r["epoch"] for r in records[:5]]
    assert list(line.get_ydata()) == [r["lr"] for r in records[:5]]


@pytest.mark.timeout(60)
def test_curves_png_names_the_run(tmp_path):
    from PIL import Image

    run = tmp_path / "myrun"
    rc, _, _ = train(run, *sets(["mode=single", "max_steps=3", "model.hidden=[16]"]))
    assert rc == 0
    assert Image.open(run / "curves.png").text["Title"] == "myrun: mode single, 1 process"
    assert json.loads((run / "summary.json").read_text())["mode"] == "single"
