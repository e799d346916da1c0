"""Train a model and a dataset defined in this file with ringpipe's trainer, in any mode.

The same script runs every mode; the launcher decides the world::

    python examples/train_your_model.py --mode single
    ringpipe launch -n 2 python examples/train_your_model.py --mode dp
    ringpipe launch -n 2 python examples/train_your_model.py --mode ddp
    ringpipe launch -n 2 python examples/train_your_model.py --mode gpipe --precision bf16
    ringpipe launch -n 2 python examples/train_your_model.py --mode 1f1b --clip 1.0
    ringpipe launch -n 2 python examples/train_your_model.py --mode seq
    ringpipe launch -n 2 python examples/train_your_model.py --mode async
    torchrun --nproc-per-node 2 examples/train_your_model.py --mode dp
    mpirun -n 2 python examples/train_your_model.py --mode gpipe --backend mpi

The pipeline modes cut the model between the entries of its ``nn.Sequential`` (two stages on two
processes here). Rank 0 prints the summary; the run directory holds metrics.jsonl, metrics.csv,
summary.json, curves.png and the checkpoints.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import Dataset

import ringpipe.train as rt


class Rings(Dataset):
    """Points in the plane labelled by which of ``classes`` rings around the origin they lie on."""

    def __init__(self, n: int, classes: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, classes, (n,), generator=g)
        angle = torch.rand(n, generator=g) * 2 * torch.pi
        radius = 1.0 + self.y.float() + 0.15 * torch.randn(n, generator=g)
        self.x = torch.stack((radius * angle.cos(), radius * angle.sin()), dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


def make_model(classes: int = 3, width: int = 64) -> nn.Sequential:
    """A small MLP; each entry is a place where a pipeline may cut it."""
    return nn.Sequential(
        nn.Linear(2, width), nn.Tanh(),
        nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, classes),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="single", help="single, dp, ddp, seq, gpipe, 1f1b or async")
    parser.add_argument("--epochs", type=float, default=5)
    parser.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16")
    parser.add_argument("--clip", type=float, default=None, help="clip the whole model's gradient norm")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = {
        "mode": args.mode,
        "backend": args.backend,
        "epochs": args.epochs,
        "batch_size": 32,
        "precision": args.precision,
        "schedule": {"name": "cosine", "warmup_epochs": 0.5},
        "optimizer": {"name": "adam", "lr": 0.01, "clip_grad_norm": args.clip},
    }
    if args.mode in ("seq", "gpipe", "1f1b", "async"):
        config["pipeline"] = {"stages": 2, "microbatches": 4, "partition": "uniform"}
    summary = rt.fit(
        make_model(),
        Rings(2000, seed=0),
        Rings(500, seed=1),
        loss=nn.functional.cross_entropy,
        config=config,
        run_dir=args.run_dir,
        overwrite=args.run_dir is not None,
    )
    if summary["world_size"] == 1 or _rank() == 0:
        print(f"mode {summary['mode']} on {summary['world_size']} process(es): test accuracy "
              f"{summary['test_accuracy']:.3f}, test loss {summary['test_loss']:.4f}")


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))))


if __name__ == "__main__":
    main()
