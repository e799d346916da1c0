"""Step time of one Horovod program under real Horovod 0.28.1 and under ringpipe (``import ringpipe as hvd``).

    bash benchmarks/horovod_peer/build.sh                     # once: Horovod 0.28.1 into its own venv (~8 min)
    python benchmarks/dp_vs_horovod.py --build-peer           # the same, then the run
    python benchmarks/dp_vs_horovod.py                        # mlp and cnn, 2 ranks, 5 runs of each
    python benchmarks/dp_vs_horovod.py --models mlp --runs 3 --steps 40
    python benchmarks/dp_vs_horovod.py --quick                # seconds: tiny model, one run each

The program is ``lib/horovod_program.py``: Horovod's documented usage (init, scaled learning rate,
broadcasts from rank 0, ``hvd.DistributedOptimizer``, SGD with momentum) on a model of
``lib.models`` (``mlp``: the 10.5M-parameter MLP; ``cnn``: the network of Horovod's
``pytorch_mnist.py``), differing only in its import. Horovod's side runs under Horovod's own
launcher from the environment ``horovod_peer/build.sh`` made (``HOROVOD_VENV``, default
``~/.cache/ringpipe-bench/horovod-0.28.1``: ``horovodrun -np N --gloo``); ringpipe's under
``ringpipe launch -n N`` (gloo). Both over gloo on the CPU, one torch thread a rank.

The two alternate run by run (fresh processes each run; the first of each pair swapped every
pair), so drift of a shared machine falls on both. A run's figure is the median over its timed
steps of the slowest rank's step time; reported per model: each side's median over runs with
min-max, and the median of the per-pair ratios ringpipe / Horovod with their min-max (below 1:
ringpipe's step is faster). The final loss and a parameter checksum of each side are printed too:
the same program on the same data should end in the same place.

Without a built Horovod the script times ringpipe's side alone and says how to build the peer
(``--quick`` then still runs the whole path of ringpipe's side; ``--require-horovod`` makes a
missing peer an error).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lib import procs, report, stats  # noqa: E402

__all__ = ["main"]

PROGRAM = Path(__file__).resolve().parent / "lib" / "horovod_program.py"
BUILD = Path(__file__).resolve().parent / "horovod_peer" / "build.sh"
DEFAULT_VENV = Path.home() / ".cache" / "ringpipe-bench" / "horovod-0.28.1"


def horovod_venv() -> Path | None:
    """The environment holding the Horovod peer (``HOROVOD_VENV``), or None when it is not built."""
    venv = Path(os.environ.get("HOROVOD_VENV", DEFAULT_VENV))
    return venv if (venv / "bin" / "horovodrun").exists() else None


def one_run(impl: str, model: str, ranks: int, warmup: int, steps: int, venv: Path | None,
            timeout: float) -> dict:
    """One run of the program under ``impl``; its row (the median step and the rest)."""
    prog = [str(PROGRAM), "--impl", impl, "--model", model, "--warmup", str(warmup), "--steps", str(steps)]
    env = {"OMP_NUM_THREADS": "1"}
    if impl == "horovod":
        assert venv is not None
        cmd = [str(venv / "bin" / "horovodrun"), "-np", str(ranks), "--gloo", str(venv / "bin" / "python"), *prog]
        env["PYTHONPATH"] = ""  # Horovod's environment, not this tree's ringpipe
    else:
        cmd = procs.ringpipe_cli("launch", "-n", str(ranks), "--backend", "gloo", *prog)
    (row,) = procs.rows(procs.run(cmd, timeout, env))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,cnn", help="comma-separated models of lib.models")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--runs", type=int, default=5, help="runs of each side (alternated)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--require-horovod", action="store_true", help="fail when the Horovod peer is not built")
    p.add_argument("--build-peer", action="store_true",
                   help="first build Horovod 0.28.1 into HOROVOD_VENV with horovod_peer/build.sh (about 8 minutes)")
    p.add_argument("--quick", action="store_true", help="seconds: the tiny model, 2 ranks, one run of each side")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.ranks, args.runs, args.warmup, args.steps = "tiny", 2, 1, 2, 3
    if args.build_peer:
        subprocess.run(["bash", str(BUILD), str(Path(os.environ.get("HOROVOD_VENV", DEFAULT_VENV)))], check=True)
    venv = horovod_venv()
    report.header("dp_vs_horovod", argv, {"horovod peer": str(venv) if venv else "not built"})
    if venv is None:
        if args.require_horovod:
            print("the Horovod peer is not built: bash benchmarks/horovod_peer/build.sh", file=sys.stderr)
            return 2
        print("Horovod peer not built (bash benchmarks/horovod_peer/build.sh, or HOROVOD_VENV): "
              "ringpipe's side alone, no ratio.")
    sides = ("horovod", "ringpipe") if venv else ("ringpipe",)
    rows, headline = [], []
    for model in args.models.split(","):
        got: dict[str, list[dict]] = {s: [] for s in sides}
        for run in range(args.runs):
            for impl in (sides if run % 2 == 0 else sides[::-1]):
                got[impl].append(one_run(impl, model, args.ranks, args.warmup, args.steps, venv, args.timeout))
                print(f"{model} run {run}: {impl} {got[impl][-1]['median_s'] * 1e3:.2f} ms", flush=True)
        for impl in sides:
            s = stats.spread([r["median_s"] for r in got[impl]])
            last = got[impl][-1]
            rows.append((model, impl, last["version"], s.fmt(2, 1e3), f"{last['loss']:.4f}", f"{last['checksum']:.4f}"))
        if venv:
            ratio = stats.ratios([r["median_s"] for r in got["ringpipe"]], [r["median_s"] for r in got["horovod"]])
            headline.append((f"Horovod program's step time, {model}, {args.ranks} ranks (same program, "
                             f"`import ringpipe as hvd`)", "Horovod 0.28.1 (gloo)", ratio))
    print(f"\n{args.ranks} ranks over gloo; median over runs of each run's median step (slowest rank), min-max:\n")
    print(report.table(("model", "side", "version", "step (ms)", "final loss", "parameter checksum"), rows,
                       (False, False, False, True, True, True)))
    if headline:
        report.headline(headline)
    report.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
