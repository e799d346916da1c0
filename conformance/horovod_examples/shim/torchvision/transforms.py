"""TEST DOUBLE: torchvision.transforms as callables on H x W x C uint8 images / C x H x W float tensors."""
import random

import torch
import torch.nn.functional as F


def _pair(size):
    return (size, size) if isinstance(size, int) else tuple(size)


def _is_image(x):
    return x.dtype == torch.uint8


def _hw(x):
    return (x.shape[0], x.shape[1]) if _is_image(x) else (x.shape[-2], x.shape[-1])


def _crop(x, top, left, h, w):
    return x[top:top + h, left:left + w] if _is_image(x) else x[..., top:top + h, left:left + w]


def _resize(x, hw):
    if _is_image(x):
        y = F.interpolate(x.permute(2, 0, 1)[None].float(), size=hw, mode="bilinear", align_corners=False)
        return y[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8)
    return F.interpolate(x[None], size=hw, mode="bilinear", align_corners=False)[0]


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    def __call__(self, x):
        return x.permute(2, 0, 1).float().div(255.0)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean), torch.tensor(std)

    def __call__(self, x):
        return (x - self.mean.view(-1, 1, 1)) / self.std.view(-1, 1, 1)


class Resize:
    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        h, w = _hw(x)
        if isinstance(self.size, int):  # shorter side to size, aspect kept
            hw = (self.size, max(1, round(w * self.size / h))) if h <= w else (max(1, round(h * self.size / w)), self.size)
        else:
            hw = tuple(self.size)
        return _resize(x, hw)


class CenterCrop:
    def __init__(self, size):
        self.size = _pair(size)

    def __call__(self, x):
        h, w = _hw(x)
        th, tw = self.size
        return _crop(x, (h - th) // 2, (w - tw) // 2, th, tw)


class RandomResizedCrop:
    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale = _pair(size), scale

    def __call__(self, x):
        h, w = _hw(x)
        frac = random.uniform(*self.scale) ** 0.5
        ch, cw = max(1, int(h * frac)), max(1, int(w * frac))
        return _resize(_crop(x, random.randint(0, h - ch), random.randint(0, w - cw), ch, cw), self.size)


class RandomHorizontalFlip:
    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, x):
        if random.random() < self.p:
            return x.flip(1) if _is_image(x) else x.flip(-1)
        return x
