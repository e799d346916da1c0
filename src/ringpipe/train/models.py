"""Model registry: MLP, small CNN, small ResNet and a small transformer LM, each an ``nn.Sequential``.

Every model is a flat sequence of layers so that the pipeline modes can cut it into stages
anywhere between two entries; residual blocks and transformer blocks are single entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ringpipe.train.datasets import Dataset
from ringpipe.train.registry import Registry

__all__ = ["MODELS", "build_model", "BasicBlock", "Embedding", "TransformerBlock", "TokenHead"]

MODELS: Registry[Callable[[Any, Dataset], nn.Sequential]] = Registry("model")


def build_model(cfg: Any, data: Dataset) -> nn.Module:
    """Build the model of a model config section for ``data``'s input shape and classes (a registered
    name, or the user's ``package.module:function``, see :mod:`ringpipe.train.factories`)."""
    if cfg.name not in MODELS and ":" in cfg.name:
        from ringpipe.train.factories import (
            FactoryError,
            call_factory,
            import_factory,
            section_kwargs,
        )

        model = call_factory(import_factory(cfg.name, "model"), section_kwargs(cfg), cfg.name, "model", data)
        if isinstance(model, list | tuple) and model and all(isinstance(m, nn.Module) for m in model):
            return nn.Sequential(*model)
        if not isinstance(model, nn.Module):
            raise FactoryError(
                f"model.name={cfg.name!r} returned a {type(model).__name__}; a model factory returns a "
                f"torch.nn.Module (an nn.Sequential, or a list of stages, for the pipeline modes)"
            )
        return model
    if cfg.name == "python":
        raise ValueError(
            "model.name='python' stands for a model handed to ringpipe.train.fit; from a config, name a factory "
            "'package.module:function' or a registered model"
        )
    if data.num_classes < 1:
        raise ValueError(
            f"model {cfg.name!r} sizes its output by the dataset's classes, which {data.name!r} does not give: "
            f"use a model of your own, or give the data as tensors (a TensorDataset of integer labels)"
        )
    return MODELS.get(cfg.name)(cfg, data)


def _need_image(name: str, data: Dataset) -> tuple[int, int, int]:
    if len(data.input_shape) != 3:
        raise ValueError(
            f"model {name!r} needs image inputs (channels, height, width); dataset {data.name!r} has "
            f"inputs of shape {data.input_shape}: use model.name=mlp or an image dataset"
        )
    c, h, w = data.input_shape
    return c, h, w


@MODELS.register("mlp")
def mlp(cfg: Any, data: Dataset) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(data.input_shape)
    for h in cfg.hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if cfg.dropout:
            layers.append(nn.Dropout(cfg.dropout))
        width = h
    layers.append(nn.Linear(width, data.num_classes))
    return nn.Sequential(*layers)


@MODELS.register("cnn")
def cnn(cfg: Any, data: Dataset) -> nn.Sequential:
    c, h, w = _need_image("cnn", data)
    layers: list[nn.Module] = []
    for out in cfg.channels:
        layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU()]
        if min(h, w) >= 2:
            layers.append(nn.MaxPool2d(2))
            h, w = h // 2, w // 2
        c = out
    layers += [nn.Flatten(), nn.Linear(c * h * w, cfg.hidden), nn.ReLU()]
    if cfg.dropout:
        layers.append(nn.Dropout(cfg.dropout))
    layers.append(nn.Linear(cfg.hidden, data.num_classes))
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


@MODELS.register("resnet")
def resnet(cfg: Any, data: Dataset) -> nn.Sequential:
    c, h, w = _need_image("resnet", data)
    width = cfg.width
    layers: list[nn.Module] = [nn.Conv2d(c, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for i, n in enumerate(cfg.blocks):
        cout = width * 2**i
        for j in range(n):
            stride = 2 if (i > 0 and j == 0 and min(h, w) >= 2) else 1
            if stride == 2:
                h, w = (h + 1) // 2, (w + 1) // 2
            layers.append(BasicBlock(cin, cout, stride))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, data.num_classes)]
    return nn.Sequential(*layers)


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, seq_len: int, d_model: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Parameter(torch.zeros(seq_len, d_model))
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens(x) + self.positions[: x.shape[1]]


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention and a feed-forward layer, both residual."""

    def __init__(self, d_model: int, heads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, ff), nn.GELU(), nn.Linear(ff, d_model), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class TokenHead(nn.Module):
    """Final layer norm and the projection to vocabulary logits."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


@MODELS.register("transformer")
def transformer(cfg: Any, data: Dataset) -> nn.Sequential:
    if data.kind != "lm":
        raise ValueError(f"model 'transformer' needs a token dataset (synthetic_lm), got {data.name!r}")
    seq_len = data.input_shape[0]
    layers: list[nn.Module] = [Embedding(data.num_classes, seq_len, cfg.d_model)]
    layers += [TransformerBlock(cfg.d_model, cfg.heads, cfg.ff, cfg.dropout) for _ in range(cfg.layers)]
    layers.append(TokenHead(cfg.d_model, data.num_classes))
    return nn.Sequential(*layers)
