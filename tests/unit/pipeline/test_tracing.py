"""Splitting any nn.Module by split points: the stages composed give the whole model's output and gradients.

References are the whole model run in one process; the split shares the model's parameters, so
the same tensors are compared. Outputs and gradients are compared exactly (the stages run the
same operations in the same order); dropout runs under the same seed.
"""

import pytest
import torch
from torch import nn

from ringpipe.pipeline.model_io import call_model, logits_of
from ringpipe.pipeline.stage import StageRuntime
from ringpipe.pipeline.tracing import SplitError, split_model
from ringpipe.pipeline.values import BoundaryError, pack, unpack

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=50, n_positions=16, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


GPT2_POINTS = ["transformer.h.1", "transformer.h.2", "transformer.h.3"]


@pytest.fixture(scope="module")
def gpt2_auto_split(gpt2):
    """GPT-2 split in 4 without split points (traced once for the module: each trace exports the model twice)."""
    return split_model(gpt2, torch.randint(0, 50, (2, 8)), num_stages=4)


@pytest.fixture(scope="module")
def gpt2_split(gpt2, gpt2_auto_split):
    """GPT-2 split at its blocks 1, 2 and 3: the automatic split, once it chose exactly those points
    (``test_without_split_points_...`` checks that it does; the same points give the same stages)."""
    if gpt2_auto_split.split_points == GPT2_POINTS:
        return gpt2_auto_split
    return split_model(gpt2, torch.randint(0, 50, (4, 8)), GPT2_POINTS)


def run(stages, x):
    v = x
    for s in stages:
        v = s(v)
    return v


def test_gpt2_stages_compose_to_the_model_in_eval_and_train_mode(gpt2, gpt2_split):
    x = torch.randint(0, 50, (3, 8))  # another batch size than the sample: the batch dimension is dynamic
    gpt2.eval()
    for s in gpt2_split.stages:
        s.eval()
    with torch.no_grad():
        assert torch.equal(run(gpt2_split.stages, x).logits, gpt2(x).logits)
    gpt2.train()
    for s in gpt2_split.stages:
        s.train()
    torch.manual_seed(3)
    ref = gpt2(x).logits  # dropout 0.1 everywhere: the same masks from the same generator state
    ref.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in gpt2.named_parameters()}
    gpt2.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    out = run(gpt2_split.stages, x)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert torch.equal(out.logits, ref)
    out.logits.square().mean().backward()
    for n, p in gpt2.named_parameters():  # the stages hold the model's own parameters
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=0, atol=1e-7, msg=n)
    gpt2.zero_grad(set_to_none=True)


def test_gpt2_tied_weight_is_one_object_on_the_first_and_last_stage(gpt2, gpt2_split):
    assert gpt2_split.tied == {"transformer.wte.weight": [0, 3]}
    first = dict(gpt2_split.stages[0].named_parameters())
    last = dict(gpt2_split.stages[3].named_parameters())
    assert any(p is gpt2.transformer.wte.weight for p in first.values())
    assert any(p is gpt2.lm_head.weight for p in last.values())
    # boundaries carry hidden states, the causal mask and sizes; relayed through every stage
    assert all(s.boundary_names for s in gpt2_split.stages[:-1])


def test_without_split_points_the_blocks_are_balanced_by_parameters(gpt2_auto_split):
    assert gpt2_auto_split.split_points == GPT2_POINTS


class Encoder(nn.Module):
    """A wrapper with no parameters of its own around its blocks (as RoBERTa's ``encoder`` around ``layer``)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.encoder = Encoder()
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


def test_a_wrapper_around_the_blocks_is_opened_so_the_blocks_are_balanced():
    """embed 80, four blocks of 272, head 34 parameters: halves of about 601 meet at block 2 (the
    wrapper left whole would put every block on one stage)."""
    torch.manual_seed(0)
    model = Wrapped()
    split = split_model(model, torch.randn(3, 4), num_stages=2)
    assert split.split_points == ["encoder.layers.2"]
    sizes = [sum(p.numel() for p in s.parameters()) for s in split.stages]
    assert sizes == [80 + 2 * 272, 2 * 272 + 34]
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert torch.equal(run(split.stages, x), model(x))


def test_a_hugging_face_wrapper_is_opened_too():
    """RoBERTa's ``roberta.encoder`` wraps its ``layer`` list alone: 2 stages split between blocks
    (OPT's ``model`` around ``decoder`` is the same case)."""
    torch.manual_seed(0)
    roberta = transformers.RobertaForSequenceClassification(transformers.RobertaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=40, num_labels=3))
    ids = torch.randint(1, 50, (2, 8))
    assert split_model(roberta, {"input_ids": ids}, num_stages=2).split_points == ["roberta.encoder.layer.2"]


def test_bert_with_two_inputs_split_in_three():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=50, max_position_embeddings=16, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg).eval()
    ids = torch.randint(1, 50, (4, 8))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[0, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    split = split_model(model, batch, ["bert.encoder.layer.1", "classifier"])
    for s in split.stages:
        s.eval()
    with torch.no_grad():
        assert torch.equal(logits_of(run(split.stages, batch)), call_model(model, batch).logits)
    with pytest.raises(SplitError, match="the batch has keys"):
        split.stages[0]({"input_ids": ids})


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(4, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def test_an_inplace_operation_where_a_stage_begins_works_on_a_copy():
    torch.manual_seed(0)
    model = Plain()
    x = torch.randn(5, 4)
    split = split_model(model, x, ["act"])
    loss_fn = nn.functional.mse_loss
    y = torch.randn(5, 2)
    ref_in = model.a(x).detach().requires_grad_(True)
    loss_fn(model.b(torch.relu(ref_in)), y).backward()
    ref_b = model.b.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    for recompute in (False, True):
        first = StageRuntime(split.stages[0], 0, 2, recompute=recompute)
        last = StageRuntime(split.stages[1], 1, 2, loss_fn=loss_fn, recompute=recompute)
        sent, _, _ = first.forward(0, x)
        kept = sent.tensors[0].clone()
        last.forward(0, sent, target=y)
        (grad,) = last.backward(0)
        assert torch.equal(sent.tensors[0], kept)  # the received tensor was not overwritten by relu_
        torch.testing.assert_close(grad, ref_in.grad)
        torch.testing.assert_close(model.b.weight.grad, ref_b)
        model.zero_grad(set_to_none=True)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # control flow on a value: no graph holds both branches
            return h
        return -h


def test_bad_split_points_and_untraceable_models_are_named():
    model, x = Plain(), torch.randn(3, 4)
    with pytest.raises(SplitError, match=r"split point\(s\) \['c'\] name no submodule"):
        split_model(model, x, ["c"])
    # where no name is near, the model's top-level modules are listed (an nn.Sequential's are numbers)
    with pytest.raises(SplitError, match=r"\['foo'\] name no submodule of Sequential; its top-level modules: \['0', '1'\]"):
        split_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), x, ["foo"])
    with pytest.raises(SplitError, match="'unused' is a module that the traced forward never runs"):
        split_model(model, x, ["unused"])
    with pytest.raises(SplitError, match="not in the order the model runs them"):
        split_model(model, x, ["b", "act"])
    with pytest.raises(SplitError, match="begin at the same operation: the stage between them would be empty"):
        split_model(nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2)), x, ["0", "0.0"])
    with pytest.raises(SplitError, match="cannot trace DataDependent .*a list of stage modules"):
        split_model(DataDependent(), x, ["a"])


def test_boundary_values_pack_nested_structures_and_refuse_other_types():
    h = torch.randn(2, 3, requires_grad=True)
    value = {"hidden": h * 2, "mask": torch.ones(2, 3, dtype=torch.bool), "sizes": (2, 3), "scale": 0.5, "none": None,
             "more": [torch.zeros(1)]}
    packed = pack(value)
    assert packed.grads == (True, False, False)  # only the tensor that requires grad takes a gradient back
    back = unpack(packed.structure, packed.tensors)
    assert back["sizes"] == (2, 3) and back["scale"] == 0.5 and back["none"] is None
    assert torch.equal(back["hidden"], value["hidden"]) and isinstance(back["more"], list)
    with pytest.raises(BoundaryError, match=r"out\['bad'\] is a set"):
        pack({"bad": {1}}, "out")


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False, tie_word_embeddings=True))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=50, d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8,
        decoder_start_token_id=0, use_cache=False))


@pytest.mark.parametrize(("make", "points", "tied"), [
    (_llama, ["model.layers.2"], ["model.embed_tokens.weight"]),  # rotary positions, grouped-query attention
    (_t5, ["decoder.block.0"], ["shared.weight"]),  # encoder-decoder: the encoder's output crosses to the decoder
], ids=["llama", "t5"])
def test_decoder_families_split_automatically_into_stages_that_compose_to_the_model(make, points, tied):
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(1, 50, (3, 8))
    batch = {"input_ids": ids, "decoder_input_ids": torch.randint(1, 50, (3, 8))} if "decoder" in points[0] else \
        {"input_ids": ids, "attention_mask": torch.ones(3, 8, dtype=torch.long)}
    split = split_model(model, batch, num_stages=2)
    assert split.split_points == points
    assert sorted(split.tied) == tied
    for s in split.stages:
        s.eval()
    with torch.no_grad():
        assert torch.equal(logits_of(run(split.stages, batch)), call_model(model, batch).logits)
