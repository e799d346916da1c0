"""TEST DOUBLE for torchvision (data and models only) -- Horovod's examples against ringpipe.

The PyPI torchvision wheel does not load on this torch, and there is no network to fetch MNIST or
ImageNet, so this package stands in for the three things the examples take from torchvision:

  datasets.MNIST / datasets.ImageFolder -> random images of the real shapes (28x28x1 uint8,
                                           RGB uint8 larger than 224x224), random labels;
                                           FAKE_DATA_N items (default 256; a quarter for test sets)
  transforms.*                          -> callables with torchvision's meaning on those images
  models.resnet50                       -> a small CNN with ResNet-50's input and 1000 outputs

An "image" here is a uint8 tensor H x W x C (what ToTensor turns into C x H x W floats in [0, 1]).
Nothing in ringpipe is replaced: the examples import ringpipe itself.
"""
from . import datasets, models, transforms  # noqa: F401

__version__ = "0.0.0+testdouble"
