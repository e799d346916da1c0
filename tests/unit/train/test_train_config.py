"""Trainer configuration: validation errors, overrides, files, registries."""

from __future__ import annotations

import argparse
import json
import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from ringpipe.train.command import add_train_parser
from ringpipe.train.config import (
    MITIGATION_DOCS,
    MODE_NAMES,
    ConfigError,
    DPConfig,
    PipelineConfig,
    TrainConfig,
    apply_overrides,
    dp_algorithms,
    dump_config,
    load_config,
    parse_override,
)
from ringpipe.train.datasets import DATASETS
from ringpipe.train.lr_schedules import LR_SCHEDULES
from ringpipe.train.models import MODELS
from ringpipe.train.modes import MODES, build_runner  # noqa: F401  (registers the modes)
from ringpipe.train.optimizers import OPTIMIZERS
from ringpipe.train.registry import RegistryError


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    return str(info.value)


def test_defaults_are_the_default_run():
    cfg = load_config()
    assert (cfg.mode, cfg.nprocs, cfg.model.name, cfg.data.name) == ("dp", 2, "mlp", "digits")
    assert cfg.dp is not None and cfg.pipeline is None


def test_unknown_key_names_it_and_lists_valid_keys():
    msg = _error("model.depth=3")
    assert "model.depth" in msg and "unknown key" in msg
    assert "hidden" in msg and "dropout" in msg
    msg = _error("learning_rate=0.1")
    assert "learning_rate" in msg and "optimizer" in msg


def test_bad_value_names_field_value_and_choices():
    msg = _error("mode=warp")
    assert "'warp'" in msg and "single" in msg and "gpipe" in msg
    msg = _error("model.name=vgg")
    assert "model.name='vgg'" in msg and "'resnet'" in msg and "'transformer'" in msg
    msg = _error("optimizer.lr=-1")
    assert "optimizer.lr=-1" in msg and "greater than 0" in msg
    msg = _error("backend=tcp")
    assert "'tcp'" in msg and "'gloo'" in msg and "'mpi'" in msg
    msg = _error("model.hidden=[8,x]")
    assert "model.hidden.1='x'" in msg


def test_sections_are_read_only_by_their_modes():
    assert "pipeline section is read only by modes" in _error("mode=ddp", "pipeline.stages=2")
    assert "dp section is read only by mode 'dp'" in _error("mode=gpipe", "dp.bucket_mb=1")
    cfg = load_config(overrides=["mode=gpipe"])
    assert cfg.pipeline is not None and cfg.dp is None
    assert "nprocs=3" in _error("mode=single", "nprocs=3")
    assert load_config(overrides=["mode=single"]).nprocs == 1


def test_dp_algorithm_is_one_of_the_collectives():
    from ringpipe.collectives import SUPPORTED

    msg = _error("dp.algorithm=rnig")
    assert "dp.algorithm" in msg and "'rnig'" in msg
    for name in SUPPORTED["allreduce"]:
        assert name in msg
        assert load_config(overrides=[f"dp.algorithm={name}"]).dp.algorithm == name


def test_model_and_data_must_fit():
    assert "synthetic_lm" in _error("model.name=transformer")
    assert "transformer" in _error("data.name=synthetic_lm")
    assert "[channels, height, width]" in _error("model.name=cnn", "data.name=synthetic", "data.shape=[64]")
    assert "data.root" in _error("data.name=mnist")
    assert "divisible" in _error("batch_size=30", "dp.backward_passes_per_step=4")


def test_override_coercion_and_variant_switch():
    assert parse_override("a.b=0.5") == (["a", "b"], 0.5)
    assert parse_override("x=[1, 2]") == (["x"], [1, 2])
    assert parse_override("x=null") == (["x"], None)
    assert parse_override("x=true") == (["x"], True)
    assert parse_override("x=hello") == (["x"], "hello")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("novalue")
    cfg = load_config(overrides=["epochs=3", "model.name=cnn", "model.channels=[4]", "optimizer.name=sgd",
                                 "optimizer.nesterov=true", "schedule.name=step", "schedule.step_epochs=1"])
    assert cfg.epochs == 3.0 and cfg.model.name == "cnn" and cfg.model.channels == [4]
    assert cfg.optimizer.name == "sgd" and cfg.optimizer.nesterov and cfg.schedule.name == "step"
    raw = apply_overrides({"model": {"name": "mlp", "hidden": [3]}}, ["model.name=resnet"])
    assert raw["model"] == {"name": "resnet"}


def test_files_yaml_and_json(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("mode: ddp\nepochs: 2\nmodel: {hidden: [16]}\n")
    cfg = load_config(y, ["batch_size=8"])
    assert (cfg.mode, cfg.epochs, cfg.model.hidden, cfg.batch_size) == ("ddp", 2.0, [16], 8)
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"mode": "single", "optimizer": {"name": "sgd", "lr": 0.1}}))
    cfg = load_config(j)
    assert cfg.optimizer.name == "sgd" and cfg.optimizer.lr == 0.1 and cfg.optimizer.momentum == 0.9
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips():
    for mode in ("single", "ddp", "dp", "gpipe"):
        cfg = load_config(overrides=[f"mode={mode}"])
        again = load_config(base=yaml.safe_load(yaml.safe_dump(dump_config(cfg))))
        assert again == cfg


def test_every_key_is_read():
    """Every field of every section names something a registry or the loop consumes."""
    for section, registry in (("model", MODELS), ("data", DATASETS), ("optimizer", OPTIMIZERS),
                              ("schedule", LR_SCHEDULES)):
        variants = typing.get_args(TrainConfig.model_fields[section].annotation)
        names = {n for c in variants for n in typing.get_args(c.model_fields["name"].annotation)}
        assert names == set(registry.names()), section
    assert set(MODES.names()) >= {"single", "ddp", "dp"}


def test_registry_errors_list_valid_names():
    with pytest.raises(RegistryError, match="valid models: mlp, cnn, resnet, transformer"):
        MODELS.get("vgg")


def _schema_keys(model: type[BaseModel]) -> set[str]:
    """Every field name of ``model`` and of the sections (all variants) below it."""
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(name)
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                keys |= _schema_keys(arg)
    return keys


def test_help_names_every_key_mode_and_choice():
    parser = argparse.ArgumentParser()
    train = add_train_parser(parser.add_subparsers())
    text = train.format_help()
    missing = sorted(k for k in _schema_keys(TrainConfig) if not re.search(rf"\b{k}\b", text))
    assert not missing, f"ringpipe train --help does not mention {missing}"
    values = [*MODE_NAMES, *MITIGATION_DOCS,
              *typing.get_args(DPConfig.model_fields["compression"].annotation),
              *typing.get_args(PipelineConfig.model_fields["partition"].annotation), *dp_algorithms()]
    assert not [v for v in values if not re.search(rf"\b{v}\b", text)]
    for mode in MODE_NAMES:  # one line per mode, with its description
        assert re.search(rf"^  {mode} +\S", text, re.MULTILINE), mode


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.mode in MODE_NAMES
    assert load_config(base=dump_config(cfg)) == cfg  # and its resolved form loads back the same


def test_bundled_examples_by_name():
    from ringpipe.train.config import bundled_configs, load_config

    names = bundled_configs()
    assert {"single", "ddp", "dp", "seq", "gpipe", "1f1b", "async"} <= set(names)
    assert load_config("gpipe").mode == "gpipe" and load_config("async.yaml").mode == "async"
    with pytest.raises(ConfigError, match="name of a bundled example: 1f1b, async"):
        load_config("no_such_example")


def test_a_variants_name_set_after_its_keys_keeps_them():
    """``--set optimizer.lr=0.01 --set optimizer.name=sgd`` once ran with SGD's default rate 0.05 and the
    default rate scaling: the name started the section afresh and dropped the keys set before it."""
    orders = [["optimizer.lr=0.01", "optimizer.scale_lr=false", "optimizer.name=sgd"],
              ["optimizer.name=sgd", "optimizer.lr=0.01", "optimizer.scale_lr=false"],
              ["optimizer.scale_lr=false", "optimizer.name=sgd", "optimizer.lr=0.01"]]
    for sets in orders:
        cfg = load_config(overrides=sets)
        assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.scale_lr, cfg.optimizer.momentum) == \
            ("sgd", 0.01, False, 0.9), sets
    # the keys of the variant replaced still go: an MLP's hidden sizes do not reach a ResNet
    raw = apply_overrides({"model": {"name": "mlp", "hidden": [3]}}, ["model.name=resnet"])
    assert raw["model"] == {"name": "resnet"}
    # a key given for the new variant that it does not read is an error naming it, in either order
    for sets in (["model.hidden=[8]", "model.name=cnn"], ["model.name=cnn", "model.hidden=[8]"]):
        with pytest.raises(ConfigError, match="hidden"):
            load_config(overrides=sets)
    # a name set twice: the second variant keeps the keys given for the section too
    cfg = load_config(overrides=["schedule.name=step", "schedule.gamma=0.5", "schedule.name=multistep"])
    assert (cfg.schedule.name, cfg.schedule.gamma) == ("multistep", 0.5)


def test_a_files_keys_that_the_new_variant_reads_stay_when_set_switches_the_variant(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optimizer: {lr: 0.01, scale_lr: false}\nmodel: {hidden: [8], dropout: 0.1}\n")
    cfg = load_config(f, ["optimizer.name=sgd", "model.name=resnet"])
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.scale_lr, cfg.optimizer.momentum) == \
        ("sgd", 0.01, False, 0.9)
    assert cfg.model.name == "resnet"  # the MLP's hidden sizes and dropout, which a ResNet does not read, are gone
    g = tmp_path / "adam.yaml"
    g.write_text("optimizer: {name: adam, lr: 0.002, betas: [0.8, 0.9]}\n")
    cfg = load_config(g, ["optimizer.name=sgd"])
    assert (cfg.optimizer.name, cfg.optimizer.lr) == ("sgd", 0.002)  # Adam's betas are not SGD's: dropped
    # defaults are not the user's: the default Adam rate does not become SGD's
    assert load_config(overrides=["optimizer.name=sgd"]).optimizer.lr == 0.05


def test_a_sections_key_given_at_the_top_level_is_pointed_to_its_section():
    assert "(did you mean 'pipeline.microbatches'?)" in _error("microbatches=4")
    assert "(did you mean 'optimizer.lr'?)" in _error("lr=0.1")
    assert "(did you mean 'checkpoint.keep'?)" in _error("keep=2")
    assert "(did you mean 'epochs'?)" in _error("epoch=2")  # a close top-level key still comes first
    assert "did you mean" not in _error("zzz=1")
