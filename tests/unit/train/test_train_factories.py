"""The user's factories named in a config: ``package.module:function`` imported and called, registered names accepted.

A bad path, an import that fails, a missing function, a call that raises or returns the wrong
kind of object is an error naming the section, the path and the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ringpipe.train.config import ConfigError, dump_config, load_config
from ringpipe.train.datasets import DATASETS, load_dataset
from ringpipe.train.factories import FactoryError
from ringpipe.train.models import MODELS, build_model
from ringpipe.train.userdata import DataError, as_dataset

USER_MODULE = textwrap.dedent('''
    import torch
    from torch import nn

    def net(width=8, data=None):
        return nn.Sequential(nn.Flatten(), nn.Linear(data.input_shape[0], width), nn.ReLU(),
                             nn.Linear(width, data.num_classes))

    def blobs(n=64, dim=4):
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 2, (n,), generator=g)
        x = torch.randn(n, dim, generator=g) + 3 * y[:, None].float()
        ds = torch.utils.data.TensorDataset(x, y)
        return ds, ds

    def broken():
        raise RuntimeError("no weights here")

    def not_a_model():
        return 42
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_nets.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_nets"
    sys.modules.pop("my_nets", None)


def test_factories_from_config_build_the_users_model_and_data(user_module):
    cfg = load_config(overrides=["mode=single", "model.name=my_nets:net", "model.width=5", "data.name=my_nets:blobs",
                                 "data.n=40"])
    assert cfg.model.model_extra == {"width": 5} and cfg.data.model_extra == {"n": 40}
    data = load_dataset(cfg.data)
    assert len(data.train) == 40 and data.input_shape == (4,) and data.num_classes == 2
    model = build_model(cfg.model, data)
    assert model[1].out_features == 5 and model(torch.zeros(3, 4)).shape == (3, 2)
    assert load_config(base=dump_config(cfg)) == cfg  # the run's config.yaml reads back


@pytest.mark.parametrize("name,error", [
    ("no_such_pkg.nets:net", "cannot import module 'no_such_pkg.nets'"),
    ("my_nets:nett", "'my_nets' has no attribute 'nett'; its callables: blobs, broken, net, not_a_model"),
    ("my_nets:broken", "model.name='my_nets:broken' raised RuntimeError: no weights here"),
    ("my_nets:not_a_model", "returned a int; a model factory returns a torch.nn.Module"),
])
def test_bad_model_factories_say_what_failed(user_module, name, error):
    cfg = load_config(overrides=["mode=single", f"model.name={name}"])
    data = as_dataset((torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)), None),
                      "t", "t")
    with pytest.raises(FactoryError) as info:
        build_model(cfg.model, data)
    assert error in str(info.value)


def test_a_factory_called_with_keys_it_does_not_take_names_them(user_module):
    cfg = load_config(overrides=["mode=single", "data.name=my_nets:blobs", "data.classes=3"])
    with pytest.raises(FactoryError, match=r"calling it with data.classes failed: .*unexpected keyword"):
        load_dataset(cfg.data)


def test_names_that_are_neither_built_in_registered_nor_a_path_are_refused():
    with pytest.raises(ConfigError, match=r"model.name='vgg': unknown name; valid names: 'mlp'.*package.module:function"):
        load_config(overrides=["model.name=vgg"])
    with pytest.raises(ConfigError, match=r"data.name='pkg:a:b': not an import path"):
        load_config(overrides=["data.name=pkg:a:b"])


def test_registered_names_are_accepted_by_the_schema():
    @MODELS.register("tiny_test_net")
    def tiny(cfg, data):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, cfg.width))

    @DATASETS.register("tiny_test_data")
    def tiny_data(cfg):
        x = torch.randn(cfg.n, 64)
        return torch.utils.data.TensorDataset(x, torch.zeros(cfg.n, dtype=torch.long)), None

    try:
        cfg = load_config(overrides=["mode=single", "model.name=tiny_test_net", "model.width=7",
                                     "data.name=tiny_test_data", "data.n=10"])
        data = load_dataset(cfg.data)
        assert len(data.train) == 10 and len(data.test) == 0
        assert build_model(cfg.model, data)[1].out_features == 7
    finally:
        MODELS._items.pop("tiny_test_net")
        DATASETS._items.pop("tiny_test_data")
    with pytest.raises(ConfigError, match="unknown name"):
        load_config(overrides=["model.name=tiny_test_net"])


def test_user_data_must_be_map_style_pairs():
    class Triples(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.zeros(2), 0, "extra"

    with pytest.raises(DataError, match=r"fit\(\) train set\[0\] is a 3-item tuple; each item must be a pair"):
        as_dataset(Triples(), "t", "fit()")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(2), 0

    with pytest.raises(DataError, match="needs a map-style dataset"):
        as_dataset(Stream(), "t", "fit()")


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_ringpipe_train_runs_a_factory_named_in_the_config(user_module, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ringpipe.cli", "train", "--no-progress", "--run-dir", str(run), "--mode", "single",
           "--set", "model.name=my_nets:net", "--set", "data.name=my_nets:blobs", "--set", "epochs=2",
           "--set", "batch_size=16"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "my_nets:net" and summary["test_accuracy"] > 0.9
    bad_cmd = [str(tmp_path / "run2") if part == str(run) else part for part in cmd]
    bad_cmd[bad_cmd.index("model.name=my_nets:net")] = "model.name=my_nets:broken"
    bad = subprocess.run(bad_cmd,
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert bad.returncode == 1 and "model.name='my_nets:broken' raised RuntimeError: no weights here" in bad.stderr
