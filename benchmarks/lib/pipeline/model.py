"""The model, data and split that every pipeline benchmark gives both systems, and their options.

One list of layers (an MLP of ``--blocks`` Linear+ReLU blocks and a Linear head, built with the
same seed), one batch of data, and one :class:`Split` of the layers into chunks and ranks, from
which ringpipe's and torch.distributed.pipelining's stages are both built. Where the cut between
the two ranks falls is chosen here (:func:`choose_split`): from each block's measured cost
(``--balance measured``) or as given (``--balance A,B``). A layout that cuts each rank's blocks
into two chunks needs two blocks a rank; :func:`layout_misfit` says when a split cannot give that
and which option fixes it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LAYOUTS", "Loss", "Split", "add_model_args", "add_run_args", "choose_split", "data",
           "layout_misfit", "make_layers", "split_line"]

LAYOUTS = {  # chunk layout -> what it is, for messages
    "flat": "one chunk a rank",
    "loop": "two chunks a rank, ranks 0, 1, 0, 1",
    "v": "two chunks a rank, ranks 0, 1, 1, 0",
}


def make_layers(width: int, blocks: int) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for _ in range(blocks):
        out += [nn.Linear(width, width), nn.ReLU()]
    out.append(nn.Linear(width, 10))
    return out


def data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)


def blocks_needed(layout: str) -> int:
    """Blocks each rank must hold for ``layout``: one a chunk."""
    return 1 if layout == "flat" else 2


@dataclass(frozen=True)
class Split:
    """Which layers form each chunk and which rank holds it; one object for both systems."""

    chunks: tuple[tuple[int, ...], ...]
    ranks: tuple[int, ...]

    @classmethod
    def make(cls, num_layers: int, blocks: int, layout: str, first: int | None = None) -> Split:
        """``first`` blocks on one rank, the other blocks and the head on the other (half each by default).

        ``flat``: one chunk a rank, rank 0 the first ``first`` blocks. ``loop`` (ranks 0, 1, 0, 1)
        and ``v`` (0, 1, 1, 0): each rank's blocks cut into two chunks, so every rank holds the
        same work as in ``flat`` (in ``v`` rank 0 holds the head, hence the other share).
        """
        first = blocks // 2 if first is None else first
        rest = blocks - first
        low = blocks_needed(layout)
        if not (first >= low and rest >= low):
            raise SystemExit(f"--blocks {blocks} split {first} | {rest}: every rank needs at least {low} "
                             f"block(s) for layout {layout!r}; use more blocks or another --balance")
        per = [list(range(2 * b, 2 * b + 2)) for b in range(blocks)]
        per[-1].append(num_layers - 1)
        if layout == "flat":
            sizes, order = [first, rest], (0, 1)
        else:
            order = {"loop": (0, 1, 0, 1), "v": (0, 1, 1, 0)}[layout]
            share = {0: first, 1: rest} if layout == "loop" else {0: rest, 1: first}  # head's rank: rest
            halves = {r: [(n + 1) // 2, n // 2] for r, n in share.items()}
            sizes = [halves[r].pop(0) for r in order]
        chunks, start = [], 0
        for n in sizes:
            chunks.append(tuple(sum(per[start:start + n], [])))
            start += n
        return cls(tuple(chunks), order)

    def chunks_of(self, rank: int) -> list[int]:
        return [c for c, r in enumerate(self.ranks) if r == rank]

    def balance(self) -> list[int]:
        return [len(c) for c in self.chunks]


def layout_misfit(args: argparse.Namespace, layout: str) -> str | None:
    """Why the chosen split (``args.first_blocks`` of ``args.blocks``) cannot be cut into ``layout``, and
    the option that fixes it; None when it can."""
    first, rest, low = args.first_blocks, args.blocks - args.first_blocks, blocks_needed(layout)
    if first >= low and rest >= low:
        return None
    if args.blocks >= 2 * low:
        a = min(max(first, low), args.blocks - low)
        fix = f"--balance {2 * a},{2 * (args.blocks - a) + 1} ({a} | {args.blocks - a} blocks + head)"
        fix += " or more --blocks" if args.balance_how == "measured" else ""
    else:
        fix = (f"--blocks {2 * low} or more" if args.balance_how == "measured"
               else f"--blocks {2 * low} --balance {2 * low},{2 * low + 1} ({low} | {low} blocks + head)")
    rank, few = (0, first) if first < low else (1, rest)
    rank = 1 - rank if layout == "v" else rank  # in a V, rank 0 holds the head's side
    return (f"the split {first} | {rest} blocks ({args.balance_how}) gives rank {rank} only {few} "
            f"block{'' if few == 1 else 's'}, and layout {layout!r} ({LAYOUTS[layout]}) needs at least {low} on each "
            f"rank; use {fix}")


class Loss(nn.Module):
    """The loss as a layer, so that the split's timing counts it with the last block."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(x, self.target)


def choose_split(args: argparse.Namespace) -> tuple[int, list[float], str]:
    """Blocks on the first rank, the two stages' measured ms per micro-batch, and how it was chosen.

    ``--balance measured``: each block's forward + backward of one micro-batch is timed once
    (thread CPU, one thread as in the run, ringpipe's :func:`layer_times`: the first block
    without the input gradient the first stage never computes, the head and the loss counted
    with the last block) and ringpipe's exact splitter picks the cut that minimises the slower
    stage. ``--balance A,B``: layers per rank (a cut between blocks), timed the same way.
    """
    from ringpipe.pipeline.partition import balance_by_size, layer_times

    if args.blocks < 2:
        raise SystemExit(f"--blocks {args.blocks}: two ranks need at least 2 blocks (one a rank); use --blocks 2 or more")
    layers = make_layers(args.width, args.blocks)
    n = len(layers)
    x, y = data(args)
    rows = args.batch // args.microbatches
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer_times(layers[:2], x[:rows], repeats=3, clock=time.thread_time)  # warm the allocator
        t = layer_times(layers + [Loss(y[:rows])], x[:rows], repeats=args.balance_repeats, clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)
    block = [t[2 * b] + t[2 * b + 1] for b in range(args.blocks)]
    block[-1] += t[n - 1] + t[n]  # head and loss
    if args.balance == "measured":
        first, how = balance_by_size(block, 2)[0], "measured"
    else:
        try:
            bal = [int(v) for v in args.balance.split(",")]
        except ValueError:
            raise SystemExit(f"--balance {args.balance!r}: give 'measured' or two layer counts like 4,5") from None
        if len(bal) != 2 or sum(bal) != n or bal[0] % 2 or bal[0] < 2:
            raise SystemExit(f"--balance {args.balance}: give two layer counts adding up to {n} (the model's "
                             f"layers) whose first is an even number >= 2 (a cut between Linear+ReLU blocks), "
                             f"e.g. {args.blocks},{args.blocks + 1}")
        first, how = bal[0] // 2, "given"
    stage = [1e3 * sum(block[:first]), 1e3 * sum(block[first:])]
    return first, stage, how


def split_line(args: argparse.Namespace) -> str:
    a, b = args.stage_ms
    return (f"# split ({args.balance_how}): rank 0 blocks 0-{args.first_blocks - 1} | rank 1 blocks "
            f"{args.first_blocks}-{args.blocks - 1} + head + loss (layers per rank {2 * args.first_blocks},"
            f"{2 * (args.blocks - args.first_blocks) + 1}); timed before the run, forward+backward of one "
            f"micro-batch, thread CPU: stage 0 {a:.2f} ms, stage 1 {b:.2f} ms (slower / faster {max(a, b) / min(a, b):.3f})")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model, batch and split options, alike in every pipeline benchmark."""
    ap.add_argument("--width", type=int, default=362)
    ap.add_argument("--blocks", type=int, default=32,
                    help="Linear+ReLU blocks in all (32 of width 362: the multiply-adds of 4 blocks of 1024)")
    ap.add_argument("--balance", default="measured",
                    help="'measured' (time each block, cut where the two stages cost most nearly the same) "
                         "or layers per rank, e.g. 4,5 for 2 blocks | 2 blocks + head")
    ap.add_argument("--balance-repeats", type=int, default=31, help="passes over the layers to time the split (median)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)


def quick(args: argparse.Namespace) -> None:
    """Shrink a run to seconds (``--quick``): 4 blocks of width 16, 2 micro-batches, 2 steps, 1 block."""
    args.width, args.blocks, args.balance, args.balance_repeats = 16, 4, "measured", 2
    args.batch, args.microbatches, args.steps, args.warmup, args.repeats = 16, 2, 2, 1, 1


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """Steps, warm-up and blocks of a timed run, alike in every pipeline benchmark."""
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="blocks: every variant runs once per block")
