"""TEST DOUBLE: models.resnet50 as a small CNN (3 x 224 x 224 in, 1000 logits out) -- not ResNet-50."""
import torch.nn as nn


def resnet50(pretrained=False, num_classes=1000, **kwargs):
    return nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=7, stride=4, padding=3), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 16, kernel_size=3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))
