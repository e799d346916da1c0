"""The models the data-parallel benchmarks train, one batch each, the same on every rank and variant.

``small`` (the trainer's MLP 64-128-64-10, batch 32), ``mlp`` (1024-2048-2048-2048-10: 10.5M
parameters, batch 64), ``resnet`` (ResNet-18: 11.2M parameters, basic blocks 2-2-2-2, ImageNet
stem, 32x32 inputs, batch 16), ``transformer`` (the trainer's: d_model 64, 4 heads, 2 layers, ff
128, vocab 32, sequences of 16, batch 32), ``cnn`` (the network of Horovod's
``examples/pytorch/pytorch_mnist.py``: two 5x5 convolutions of 10 and 20 channels, 320-50-10,
dropout; 21.8k parameters, 1x28x28 inputs, batch 64) and ``tiny`` (an MLP 16-32-10, batch 8: the
``--quick`` runs' model). Every call seeds torch, so the model and batch are identical wherever built.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MODELS", "BasicBlock", "MnistNet", "loss", "make_model", "resnet18", "sync"]

#: The model names :func:`make_model` knows.
MODELS = ("small", "mlp", "resnet", "transformer", "cnn", "tiny")


class BasicBlock(nn.Module):
    """ResNet's basic block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet18(classes: int = 10) -> nn.Module:
    """ResNet-18 (basic blocks 2-2-2-2, ImageNet stem): 11.2M parameters with 10 classes."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class MnistNet(nn.Module):
    """The CNN of Horovod's ``pytorch_mnist.py`` example (logits; its ``log_softmax`` is in the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(nn.functional.max_pool2d(self.conv1(x), 2))
        x = torch.relu(nn.functional.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(nn.functional.dropout(x, training=self.training))


def make_model(kind: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model, one batch of inputs and targets (the same on every rank and for every variant)."""
    torch.manual_seed(0)
    if kind == "small":
        model: nn.Module = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                         nn.Linear(64, 10))
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    elif kind == "mlp":
        model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                              nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
        x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))
    elif kind == "tiny":
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
        x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    elif kind == "cnn":
        model = MnistNet()
        x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    elif kind == "resnet":
        model = resnet18()
        x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    elif kind == "transformer":
        from ringpipe.train.models import Embedding, TokenHead, TransformerBlock

        model = nn.Sequential(Embedding(32, 16, 64), TransformerBlock(64, 4, 128, 0.0),
                              TransformerBlock(64, 4, 128, 0.0), TokenHead(64, 32))
        x, y = torch.randint(0, 32, (32, 16)), torch.randint(0, 32, (32, 16))
    else:
        raise ValueError(f"unknown model {kind!r}; valid: {', '.join(MODELS)}")
    return model, x, y


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (token models flattened)."""
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def sync(device: torch.device) -> None:
    """Wait for the device (a no-op on the CPU), so that a phase's time includes its kernels."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
