"""Hugging Face models as ``ringpipe train`` model factories: GPT-2, Llama and BERT from a config, random weights.

Nothing is downloaded: each factory builds the model from a ``transformers`` config sized by the
data (vocabulary, sequence length, classes). One factory serves every mode, ``single`` and the
data-parallel ones as well as every pipeline schedule::

    ringpipe train --set model.name=hf_models:gpt2 --set data.name=synthetic_lm --set mode=single
    ringpipe train --set model.name=hf_models:gpt2 --set data.name=synthetic_lm --set mode=1f1b \\
        --set nprocs=2 --set 'pipeline.split_points=[transformer.h.2]'

(run from this folder, or put it on ``PYTHONPATH``). The model returns a ``ModelOutput``; the
trainer takes its ``logits``. GPT-2's LM head is tied to its token embedding: split across
stages, both copies step with the sum of their gradients.
"""

from __future__ import annotations

from typing import Any

__all__ = ["gpt2", "llama", "bert"]


def gpt2(data: Any, layers: int = 4, width: int = 64, heads: int = 4, dropout: float = 0.1) -> Any:
    """A ``GPT2LMHeadModel`` for a language-model dataset (``data.num_classes`` tokens, ``data.input_shape[0]`` long)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=data.num_classes,
                     n_positions=data.input_shape[0], use_cache=False, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def llama(data: Any, layers: int = 4, width: int = 64, heads: int = 4, kv_heads: int = 2) -> Any:
    """A ``LlamaForCausalLM`` (rotary positions, grouped-query attention, embedding tied to the LM head)
    for a language-model dataset, as :func:`gpt2`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=4 * width,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=data.num_classes,
                      max_position_embeddings=data.input_shape[0], use_cache=False, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def bert(data: Any, vocab: int = 1000, layers: int = 4, width: int = 64, heads: int = 4,
         dropout: float = 0.1) -> Any:
    """A ``BertForSequenceClassification`` over ``data.num_classes`` classes; batches are
    ``{"input_ids", "attention_mask"}`` mappings of ``data.input_shape[0]`` tokens."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                     intermediate_size=4 * width, vocab_size=vocab, max_position_embeddings=data.input_shape[0],
                     num_labels=data.num_classes, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout, pad_token_id=0)
    return BertForSequenceClassification(cfg)
