"""Calling a model with a batch as users have it, and taking the logits from what it returns."""

from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from ringpipe.pipeline.microbatches import _run_lengths, split_microbatches
from ringpipe.pipeline.model_io import (
    ModelIOError,
    batch_chunk,
    batch_index,
    batch_size,
    batch_to,
    call_model,
    logits_of,
)


class TwoInputs(nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids * 10 + (0 if attention_mask is None else attention_mask)


def test_a_tensor_is_one_argument_a_tuple_positional_a_mapping_keywords():
    ids, mask = torch.tensor([[1, 2]]), torch.tensor([[1, 0]])
    m = TwoInputs()
    assert torch.equal(call_model(m, ids), torch.tensor([[10, 20]]))
    assert torch.equal(call_model(m, (ids, mask)), torch.tensor([[11, 20]]))
    assert torch.equal(call_model(m, [ids, mask]), torch.tensor([[11, 20]]))
    assert torch.equal(call_model(m, {"attention_mask": mask, "input_ids": ids}), torch.tensor([[11, 20]]))
    with pytest.raises(ModelIOError, match="keys must be strings"):
        call_model(m, {1: ids})


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def test_logits_of_tensor_tuple_mapping_and_dataclass():
    t = torch.ones(2, 3)
    assert logits_of(t) is t
    assert logits_of((t, torch.zeros(1))) is t
    assert logits_of(OrderedDict(loss=torch.zeros(()), logits=t)) is t  # a ModelOutput is an OrderedDict
    assert logits_of(Output(t)) is t
    transformers = pytest.importorskip("transformers")
    out = transformers.modeling_outputs.CausalLMOutputWithCrossAttentions(logits=t)
    assert logits_of(out) is t
    with pytest.raises(ModelIOError, match="no 'logits'"):
        logits_of({"hidden": t})
    with pytest.raises(ModelIOError, match="return a tensor"):
        logits_of(3)


def test_batch_helpers_cut_every_tensor_along_the_samples():
    x = {"input_ids": torch.arange(10).reshape(5, 2), "attention_mask": torch.ones(5, 2)}
    assert batch_size(x) == 5 and batch_size((x["input_ids"], x["attention_mask"])) == 5
    parts = batch_chunk(x, 2)
    assert [batch_size(p) for p in parts] == [3, 2]
    assert torch.equal(parts[1]["input_ids"], torch.tensor([[6, 7], [8, 9]]))
    picked = batch_index(x, torch.tensor([4, 0]))
    assert torch.equal(picked["input_ids"], torch.tensor([[8, 9], [0, 1]]))
    assert batch_to(x, "cpu").keys() == x.keys()
    with pytest.raises(ModelIOError, match="first dimensions"):
        batch_size((torch.ones(2), torch.ones(3)))


def test_microbatches_of_a_mapping_batch():
    x = {"input_ids": torch.arange(10).reshape(5, 2), "attention_mask": torch.ones(5, 2)}
    mbs = split_microbatches(x, 3)  # sizes as tensor_split: 2, 2, 1
    assert [m["input_ids"].shape[0] for m in mbs] == [2, 2, 1]
    assert torch.equal(torch.cat([m["input_ids"] for m in mbs]), x["input_ids"])
    assert _run_lengths(mbs) == [2, 1, 1]
    with pytest.raises(TypeError, match="mapping of tensors"):
        split_microbatches({"a": [1, 2]}, 2)
