"""``pipeline.split_points``: a traced model's settings are checked before any rank builds a stage."""

import pytest
from torch import nn

from ringpipe.train.config import ConfigError, PipelineConfig
from ringpipe.train.pipeline_modes import _check_traced


class Net(nn.Module):
    def forward(self, x):
        return x


def test_split_points_must_give_one_part_per_stage_and_chunk():
    _check_traced(PipelineConfig(stages=2, split_points=["h.2"]), Net(), 2)
    _check_traced(PipelineConfig(stages=2), Net(), 2)  # no points: balanced by parameters
    with pytest.raises(ConfigError, match=r"cut the model into 2 parts, but pipeline.stages=4 parts are needed; give 3"):
        _check_traced(PipelineConfig(stages=4, split_points=["h.2"]), Net(), 4)
    with pytest.raises(ConfigError, match=r"x pipeline.chunks = 4 parts are needed"):
        _check_traced(PipelineConfig(stages=2, split_points=["h.2"]), Net(), 4)


def test_layer_counts_and_other_partitions_do_not_apply_to_a_traced_model():
    with pytest.raises(ConfigError, match="pipeline.balance=.* counts layers of an nn.Sequential; the model is a Net"):
        _check_traced(PipelineConfig(stages=2, balance=[1, 1]), Net(), 2)
    with pytest.raises(ConfigError, match="pipeline.partition=time applies to an nn.Sequential"):
        _check_traced(PipelineConfig(stages=2, partition="time"), Net(), 2)
