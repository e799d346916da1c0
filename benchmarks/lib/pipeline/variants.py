"""The variants the pipeline benchmark compares, which of them fit the split, and the two-rank worker.

A variant is a named run (``"ringpipe 1f1b"``, ``"torch zbv"``, ...) on one chunk layout of the
shared split. A variant whose layout the split cannot give (two chunks a rank need two blocks a
rank) is skipped before anything runs, with the reason and the option that fixes it
(:func:`misfits`). The worker runs the variants in blocks, the order rotated from block to block.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lib.pipeline.model import layout_misfit
from lib.pipeline.ringpipe_run import RINGPIPE_NEW, RINGPIPE_SYNC, ringpipe_run
from lib.pipeline.torch_run import TORCH_SCHEDULES, torch_run
from ringpipe.launch import spawn
from ringpipe.pipeline.schedules import SCHEDULES

__all__ = ["layout_of", "misfits", "probe_torch", "variant_names", "variants", "worker"]


def variant_names(torch_ok: Iterable[str]) -> list[str]:
    """Every variant's name, in the order they are run and reported."""
    names = [f"ringpipe {s}" for s in RINGPIPE_SYNC + [n for n in RINGPIPE_NEW if n in SCHEDULES]]
    names.append("ringpipe async_1f1b")
    names += [f"ringpipe {s}+recompute" for s in ("gpipe", "1f1b")]
    return names + [f"torch {s}" for s in torch_ok]


def layout_of(name: str) -> str:
    """The chunk layout a variant runs on: ``flat``, ``loop`` or ``v``."""
    system, sched = name.split(maxsplit=1)
    sched = sched.split("+")[0]
    return TORCH_SCHEDULES[sched][1] if system == "torch" else RINGPIPE_NEW.get(sched, "flat")


def misfits(args: argparse.Namespace, names: Iterable[str]) -> dict[str, str]:
    """The variants among ``names`` whose layout the chosen split cannot give, each with why and the fix."""
    out = {}
    for n in names:
        why = layout_misfit(args, layout_of(n))
        if why:
            out[n] = why
    return out


def variants(args: argparse.Namespace, torch_ok: Sequence[str]) -> dict[str, Callable[[Any], dict[str, Any]]]:
    out: dict[str, Callable[[Any], dict[str, Any]]] = {}
    for s in RINGPIPE_SYNC + [n for n in RINGPIPE_NEW if n in SCHEDULES]:
        out[f"ringpipe {s}"] = lambda c, s=s: ringpipe_run(c, args, s)
    out["ringpipe async_1f1b"] = lambda c: ringpipe_run(c, args, "async")
    for s in ("gpipe", "1f1b"):
        out[f"ringpipe {s}+recompute"] = lambda c, s=s: ringpipe_run(c, args, s, True)
    for s in torch_ok:
        out[f"torch {s}"] = lambda c, s=s: torch_run(c, args, s)
    return out


def worker(comm: Any, args: argparse.Namespace, torch_ok: Sequence[str], only: Sequence[str] | None,
           skip: Iterable[str] = ()) -> dict[str, list[dict]]:
    """Run the variants (``only`` if given, else all but ``skip``) ``--repeats`` times on this rank."""
    torch.set_num_threads(1)
    table = variants(args, torch_ok)
    names = list(only) if only else [n for n in table if n not in set(skip)]
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; valid: {sorted(table)}")
    out: dict[str, list[dict]] = {n: [] for n in names}
    for block in range(args.repeats):
        k = block % len(names)
        for n in names[k:] + names[:k]:  # rotated so no variant always runs first or after the same one
            if args.profile:
                import cProfile

                prof = cProfile.Profile()
                out[n].append(prof.runcall(table[n], comm))
                prof.dump_stats(os.path.join(args.profile, f"{n.replace(' ', '_')}.rank{comm.rank}.prof"))
            else:
                out[n].append(table[n](comm))
    return out


def probe_torch(args: argparse.Namespace, names: Iterable[str] = TORCH_SCHEDULES) -> tuple[list[str], dict[str, str]]:
    """Which of torch's schedules ``names`` run here (a failing one would leave its peer waiting in the real run)."""
    small = argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 0, "repeats": 1, "profile": None})
    ok, failed = [], {}
    for name in names:
        try:
            spawn(worker, 2, args=(small, [name], [f"torch {name}"]), env={"OMP_NUM_THREADS": "1"})
            ok.append(name)
        except Exception as exc:  # noqa: BLE001 - report any failure of torch's schedule, then go on
            failed[name] = " ".join(str(exc).split())[:300]
    return ok, failed
