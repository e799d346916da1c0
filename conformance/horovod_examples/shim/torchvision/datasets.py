"""TEST DOUBLE: datasets.MNIST and datasets.ImageFolder returning random data of the real shapes."""
import os

import torch


def _size(train):
    n = int(os.environ.get("FAKE_DATA_N", "256"))
    return n if train else max(1, n // 4)


class _Random(torch.utils.data.Dataset):
    shape = (28, 28, 1)
    num_classes = 10

    def __init__(self, train, transform, target_transform, seed):
        self.n, self.transform, self.target_transform, self.seed = _size(train), transform, target_transform, seed
        self.classes = [str(c) for c in range(self.num_classes)]

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if not 0 <= index < self.n:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randint(0, 256, self.shape, dtype=torch.uint8, generator=g)
        target = int(torch.randint(0, self.num_classes, (1,), generator=g))
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class MNIST(_Random):
    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        super().__init__(train, transform, target_transform, seed=1 if train else 2)
        self.root = root


class ImageFolder(_Random):
    shape = (256, 320, 3)
    num_classes = 1000

    def __init__(self, root, transform=None, target_transform=None, **kwargs):
        train = "val" not in os.path.basename(os.path.normpath(str(root)))
        super().__init__(train, transform, target_transform, seed=3 if train else 4)
        self.root = root
        self.samples = [(os.path.join(str(root), f"{i}.jpg"), i % self.num_classes) for i in range(self.n)]
        self.targets = [t for _, t in self.samples]
