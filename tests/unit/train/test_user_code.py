"""The trainer and the user's own code: factories found beside the command, torchvision-style data
factories, splits too small for the replicas, and a failed rank's traceback.

The references are Python's own: ``python -m`` puts the current directory first on ``sys.path``,
torchvision's datasets take ``train=True``/``train=False``, and the evaluation indices of the
replicas together must be each test sample exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ringpipe.train.config import load_config
from ringpipe.train.datasets import load_dataset
from ringpipe.train.factories import import_factory
from ringpipe.train.sampling import SplitTooSmall, check_split_sizes, eval_indices

USER_CODE = textwrap.dedent('''
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    def factory(data=None):
        return nn.Sequential(nn.Flatten(), nn.Linear(8, 2))

    def dataset(train=True):
        """torchvision's convention: one split per call."""
        g = torch.Generator().manual_seed(0 if train else 1)
        n = 96 if train else 40
        y = torch.randint(0, 2, (n,), generator=g)
        x = torch.randn(n, 8, generator=g) + 3 * y[:, None].float()
        return TensorDataset(x, y)

    def one_sample():
        x = torch.randn(1, 8)
        return TensorDataset(x, torch.zeros(1, dtype=torch.long)), TensorDataset(x, torch.zeros(1, dtype=torch.long))

    def fails(train=True):
        rows = {"a": 1}
        return rows["missing"]
''')

# What a console script (``ringpipe``, installed by pip) runs: sys.path[0] is the script's own folder.
CONSOLE_SCRIPT = "import sys\nfrom ringpipe.cli import main\nsys.exit(main())\n"


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A folder holding the user's ``mymodels.py``, made the current directory, not on sys.path."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "mymodels.py").write_text(USER_CODE)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(folder))])
    yield folder
    sys.modules.pop("mymodels", None)


def test_a_factory_beside_the_command_is_imported_as_python_m_would(user_folder):
    assert import_factory("mymodels:factory", "model")().__class__.__name__ == "Sequential"
    assert sys.path[0] == str(user_folder)  # the current directory first, as `python -m` puts it


def test_a_torchvision_style_data_factory_gets_its_test_set(user_folder):
    data = load_dataset(load_config(overrides=["data.name=mymodels:dataset"]).data)
    assert len(data.train) == 96 and len(data.test) == 40
    # the test set is the factory's own train=False split, not a copy of the train split
    import mymodels

    expected = mymodels.dataset(train=False).tensors[0]
    assert torch.equal(data.test.x, expected)


def test_a_given_train_key_is_passed_as_given(user_folder):
    data = load_dataset(load_config(overrides=["data.name=mymodels:dataset", "data.train=false"]).data)
    assert len(data.train) == 40 and len(data.test) == 0  # the user chose the split: no second call


@pytest.mark.parametrize("records,replicas", [(0, 2), (1, 2), (1, 3), (2, 4), (3, 4), (5, 2), (7, 3)])
def test_evaluation_indices_cover_a_small_test_set_once(records, replicas):
    seen = [int(i) for rank in range(replicas) for batch in eval_indices(records, replicas, rank, 2) for i in batch]
    assert sorted(seen) == list(range(records))


def test_a_train_set_smaller_than_the_replicas_is_refused_with_the_figures():
    check_split_sizes(2, 2, "data 'x'")
    with pytest.raises(SplitTooSmall, match=r"data 'x': the train set has 1 sample, fewer than the run's 2"):
        check_split_sizes(1, 2, "data 'x'")


def _ringpipe(folder, tmp_path, *argv, env_extra=None):
    """``ringpipe ARGV`` as the installed console script runs it, from ``folder``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ringpipe").write_text(CONSOLE_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and "site-packages" not in p and os.path.isdir(p)
                                        and p != str(folder))
    return subprocess.run([sys.executable, str(bin_dir / "ringpipe"), *argv], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ringpipe_train_runs_the_users_code_beside_it_on_two_ranks(user_folder, tmp_path):
    common = ["train", "--no-progress", "--set", "nprocs=2", "--set", "mode=dp", "--set", "epochs=1",
              "--set", "batch_size=16", "--set", "model.name=mymodels:factory"]
    run = tmp_path / "run"
    out = _ringpipe(user_folder, tmp_path, *common, "--set", "data.name=mymodels:dataset", "--run-dir", str(run))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] is not None and summary["test_loss"] is not None
    tiny = _ringpipe(user_folder, tmp_path, *common, "--set", "data.name=mymodels:one_sample",
                     "--run-dir", str(tmp_path / "tiny"))
    assert tiny.returncode == 1
    assert "the train set has 1 sample, fewer than the run's 2 data-parallel replicas" in tiny.stderr, tiny.stderr
    assert "inconsistent with step sign" not in tiny.stderr
    # a factory that fails: its own line is shown, not only the exception's name
    failed = _ringpipe(user_folder, tmp_path, *common, "--set", "data.name=mymodels:fails",
                       "--run-dir", str(tmp_path / "fails"))
    assert failed.returncode == 1
    assert "KeyError" in failed.stderr and 'return rows["missing"]' in failed.stderr, failed.stderr
