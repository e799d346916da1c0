"""``ringpipe train``: argument parsing, world detection or process start, and the closing summary."""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from ringpipe.train.command_help import epilog_when_shown
from ringpipe.train.command_stop import forward_stop as _forward_stop
from ringpipe.train.command_stop import interrupted as _interrupted
from ringpipe.train.command_stop import stop_children as _stop_children
from ringpipe.train.config import (
    MODE_NAMES,
    PIPELINE_MODES,
    ConfigError,
    TrainConfig,
    dump_config,
    read_file,
    resolve_raw,
    validate,
)

__all__ = ["add_parser", "add_train_parser", "run_train", "resolve_run_dir"]

log = logging.getLogger(__name__)

def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``train`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "train",
        help="train a model from a typed config (every mode: single, ddp, dp, pipelines)",
        description=(
            "Train a model from a validated configuration, on one process, on N local processes "
            "(--nprocs), or on the world of a launcher (torchrun, mpirun, srun, ringpipe launch), "
            "which is detected. Writes everything into the run directory and nowhere else."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", "-c", metavar="FILE", default=None,
                   help="YAML or JSON config file; its keys refine the defaults (default: the built-in default run)")
    p.add_argument("--set", "-s", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one key, dotted, value read as YAML (repeatable), e.g. --set optimizer.lr=0.01")
    p.add_argument("--mode", "-m", choices=MODE_NAMES, default=None, help="shortcut for --set mode=MODE")
    p.add_argument("--nprocs", "-n", type=int, default=None,
                   help="local processes to start when not under a launcher (shortcut for --set nprocs=N)")
    p.add_argument("--backend", choices=("gloo", "nccl", "mpi"), default=None,
                   help="communication backend (shortcut for --set backend=...); mpi re-starts under mpirun")
    p.add_argument("--run-dir", "-o", metavar="DIR", default=None,
                   help="where outputs go (default: runs/<timestamp>-<mode>; with --resume: the newest run in runs/)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint of --run-dir with its saved config (--set still applies)")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate the newest good checkpoint of --run-dir (or --checkpoint) on the test and training "
                        "sets, without training; writes eval-step-N.json there (the training outputs stay as they are)")
    p.add_argument("--checkpoint", metavar="FILE|best", default=None,
                   help="with --eval-only: the checkpoint to evaluate (a file, or best: the kept best one)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run in a non-empty --run-dir (a new run is otherwise refused there)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging on every rank")
    p.set_defaults(func=run_train)
    epilog_when_shown(p)
    return p


#: ``ringpipe.cli`` registers subcommands through ``add_parser``.
add_parser = add_train_parser


def resolve_run_dir(run_dir: str | None, mode: str, resume: bool, root: Path = Path("runs")) -> Path:
    """The run directory: as given; for --resume the newest under ``root``; else a new, unique one (created)."""
    from ringpipe.train.rundir import new_run_dir, newest_run

    if run_dir:
        return Path(run_dir)
    if resume:
        newest = newest_run(root)
        if newest is None:
            raise ConfigError(f"--resume without --run-dir: no run with checkpoints under {root}/; give --run-dir")
        return newest
    return new_run_dir(root, mode)


def _build_config(args: argparse.Namespace, run_dir: Path | None, header: dict[str, Any] | None = None) -> TrainConfig:
    """The run's config; with ``header`` (the checkpoint to resume), a mode or world that differs from
    the checkpoint's is refused first, before the config's sections are checked against its mode."""
    overrides = list(args.overrides)
    for flag, key in ((args.mode, "mode"), (args.nprocs, "nprocs"), (args.backend, "backend")):
        if flag is not None:
            overrides.insert(0, f"{key}={flag}")
    base = None
    if args.resume and args.config is None and run_dir is not None and (run_dir / "config.yaml").is_file():
        base = read_file(run_dir / "config.yaml")
    raw = resolve_raw(args.config, overrides, base=base)
    if base is not None and raw.get("mode") != base.get("mode"):
        # Resumed in another mode: the saved config's mode-specific keys are not carried over.
        base = {k: v for k, v in base.items() if k not in ("dp", "pipeline", "nprocs")}
        raw = resolve_raw(args.config, overrides, base=base)
    env_backend = os.environ.get("RINGPIPE_BACKEND")
    if env_backend and args.backend is None and "backend" not in raw:
        raw = {**raw, "backend": env_backend}
    if header is not None:
        from ringpipe.train.checkpoints.resume_checks import check_resume_world

        check_resume_world(header, raw)
    return validate(raw)


def _world_fits(cfg: TrainConfig) -> str:
    """Why ``cfg.nprocs`` local processes cannot run ``cfg`` ("" if they can)."""
    if cfg.mode in PIPELINE_MODES and cfg.pipeline is not None and cfg.nprocs % cfg.pipeline.stages:
        stages = cfg.pipeline.stages
        return (
            f"mode {cfg.mode!r} runs pipelines of pipeline.stages={stages} processes, but nprocs={cfg.nprocs} "
            f"is not a multiple of {stages}: set --nprocs to a multiple of {stages} or change pipeline.stages"
        )
    return ""


def _worker(comm: Any, raw: dict[str, Any], run_dir: str, resume: bool, progress: bool, verbose: bool,
            overwrite: bool = False, evaluate: tuple[bool, str | None] = (False, None)) -> Any:
    """Entry point on every rank (spawned, or under a launcher): rank 0's summary, the others' stop reason."""
    import torch

    from ringpipe.train.loop import NothingToResume, train
    from ringpipe.train.rank_logging import configure_rank_logging

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    configure_rank_logging(comm.rank, comm.size, verbose)
    try:
        summary = train(comm, validate(raw), Path(run_dir), resume=resume, progress=progress, overwrite=overwrite,
                        eval_only=evaluate[0], checkpoint=evaluate[1])
    except NothingToResume as exc:  # raised alike on every rank, before any of them trains
        return {"nothing_to_resume": str(exc)}
    return summary if comm.rank == 0 else {"stop_reason": summary.get("stop_reason", "")}



# A rank's failure that every rank meets alike (a config or checkpoint problem) needs no rank number.
_SAME_ON_EVERY_RANK = re.compile(
    r"^rank \d+ failed: (?:ringpipe\.[\w.]+\.)?"
    r"(?:ConfigError|CheckpointError|NothingToResume|ModeUnavailable|RegistryError|BalanceError|FactoryError|"
    r"DataError|DatasetError|SplitTooSmall): "
)


def _error_text(exc: BaseException) -> str:
    return _SAME_ON_EVERY_RANK.sub("", str(exc), count=1)


def _in_launched_world() -> bool:
    from ringpipe.env import detect

    return detect().launcher != "single"


def run_train(args: argparse.Namespace) -> int:
    """Run ``ringpipe train``: returns the process exit code."""
    try:
        return _run_train(args)
    except KeyboardInterrupt:  # Ctrl-C before the run started (a run in progress stops by itself)
        print("ringpipe train: interrupted", file=sys.stderr)
        return 130


def _run_train(args: argparse.Namespace) -> int:
    verbose = bool(getattr(args, "verbose", False))
    from ringpipe.env import EnvironmentError_
    from ringpipe.train.checkpoints.files import CheckpointError, find_resumable, load_checkpoint

    header: dict[str, Any] | None = None
    from ringpipe.train.checkpoints.checkpointer import after_restart

    evaluate = (bool(getattr(args, "eval_only", False)), getattr(args, "checkpoint", None))
    if evaluate[1] is not None and not evaluate[0]:
        print("ringpipe train: --checkpoint names the checkpoint of --eval-only; add --eval-only "
              "(--resume continues from the newest good checkpoint)", file=sys.stderr)
        return 2
    if evaluate[0] and args.overwrite:
        print("ringpipe train: --eval-only changes nothing in the run directory; drop --overwrite", file=sys.stderr)
        return 2
    args.resume = args.resume or evaluate[0]  # the run's own config and checkpoint, as for --resume
    args.resume, args.overwrite = after_restart(args.run_dir, args.resume, args.overwrite)
    try:
        pre_dir = resolve_run_dir(args.run_dir, "x", args.resume) if (args.run_dir or args.resume) else None
        if args.resume and pre_dir is not None and not args.print_config:
            from ringpipe.train.evaluate import resolve_checkpoint

            chosen = resolve_checkpoint(pre_dir, evaluate[1]) if evaluate[0] else None
            if chosen is not None:
                evaluate = (True, str(chosen))
                found_path, checkpoint = chosen, load_checkpoint(chosen)
            else:
                found = find_resumable(pre_dir)  # the ranks move newer unusable ones aside, and say so
                found_path, checkpoint = found.path, found.checkpoint
            header = {k: v for k, v in checkpoint.items() if k not in ("engine", "ranks")}
            header["path"] = found_path
        cfg = _build_config(args, pre_dir, header)
    except (ConfigError, EnvironmentError_) as exc:
        print(f"ringpipe train: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"ringpipe train: {str(exc).replace('--resume: ', '--eval-only: ' if evaluate[0] else '--resume: ')}",
              file=sys.stderr)
        return 1
    if args.print_config:
        import yaml

        print(yaml.safe_dump(dump_config(cfg), sort_keys=False), end="")
        return 0
    from ringpipe.train.datasets import data_problem
    from ringpipe.train.rundir import run_dir_problem

    # Everything that can be checked is, before any process starts or the run directory is made.
    problem = data_problem(cfg.data) or (run_dir_problem(pre_dir, args.resume, args.overwrite) if pre_dir else "")
    if problem:
        print(f"ringpipe train: {problem}", file=sys.stderr)
        return 2
    if header is not None and not evaluate[0]:
        assert pre_dir is not None
        from ringpipe.train.checkpoints.resume_checks import nothing_left

        done = nothing_left(header, cfg, pre_dir)
        if done:
            print(f"ringpipe train: {done}", file=sys.stderr)
            return 0
    raw = dump_config(cfg)
    progress = not args.no_progress

    try:
        launched = _in_launched_world()
    except EnvironmentError_ as exc:
        print(f"ringpipe train: {exc}", file=sys.stderr)
        return 2
    if launched:
        return _run_in_world(cfg, raw, args, progress, verbose, evaluate)  # rank 0 names the run directory
    error = _world_fits(cfg)
    if error:
        print(f"ringpipe train: {error}", file=sys.stderr)
        return 2
    run_dir = pre_dir or resolve_run_dir(None, cfg.mode, False)
    if cfg.backend == "mpi" and cfg.nprocs > 1:
        try:
            return _reexec_mpirun(cfg, run_dir, args)
        except FileNotFoundError as exc:  # no mpirun: say so, and what else would work
            print(f"ringpipe train: backend mpi with nprocs={cfg.nprocs} starts the ranks under mpirun: {exc}; "
                  "or use --backend gloo", file=sys.stderr)
            return 1

    from ringpipe.launch.bootstrap import VERBOSE, failure_report
    from ringpipe.train.registry import RegistryError

    try:
        if cfg.nprocs == 1:
            from ringpipe.comm import init_world, shutdown_world

            comm = init_world(cfg.backend)
            try:
                summary = _worker(comm, raw, str(run_dir), args.resume, progress, verbose, args.overwrite, evaluate)
            finally:
                shutdown_world()
        else:
            from ringpipe.launch import spawn

            log.info("starting %d local processes (%s, mode %s) -> %s", cfg.nprocs, cfg.backend, cfg.mode, run_dir)
            with _forward_stop().installed():
                summary = spawn(_worker, cfg.nprocs, backend=cfg.backend,
                                args=(raw, str(run_dir), args.resume, progress, verbose, args.overwrite, evaluate),
                                env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                                     **({VERBOSE: "1"} if verbose else {})})[0]
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once, keep the newest checkpoint
        _stop_children()
        return _interrupted(run_dir)
    except (ConfigError, RegistryError, ValueError, RuntimeError, FileNotFoundError) as exc:
        from ringpipe.launch import WorkerFailed

        report = exc.report if isinstance(exc, WorkerFailed) else failure_report(
            exc, verbose, hint=f"frames of ringpipe and the libraries left out; -v or {VERBOSE}=1 shows them")
        if "Traceback (most recent call last)" in report:  # where it was raised: the user's frames, or all with -v
            sys.stderr.write(report if report.endswith("\n") else report + "\n")
        print(f"ringpipe train: {_error_text(exc)}", file=sys.stderr)
        return 1
    return _finish(summary, run_dir)


def _finish(summary: dict[str, Any] | None, run_dir: Path) -> int:
    """Report rank 0's result; the exit code."""
    if summary is None:  # the ranks were stopped by Ctrl-C before they could report
        return _interrupted(run_dir)
    if "nothing_to_resume" in summary:
        print(f"ringpipe train: {summary['nothing_to_resume']}", file=sys.stderr)
        return 0
    _report(summary, run_dir)
    return _interrupted(run_dir) if summary.get("stop_reason") == "interrupt" else 0


def _run_in_world(cfg: TrainConfig, raw: dict[str, Any], args: argparse.Namespace, progress: bool,
                  verbose: bool, evaluate: tuple[bool, str | None] = (False, None)) -> int:
    from ringpipe.comm import init_world, shutdown_world

    comm = init_world(cfg.backend)
    run_dir: str | None = None
    try:
        if cfg.nprocs != comm.size and "nprocs" in cfg.model_fields_set and comm.rank == 0:
            log.warning("nprocs=%d is ignored: the launcher started %d ranks", cfg.nprocs, comm.size)
        # Rank 0 names the run directory, so that every rank writes to the same place.
        name = str(resolve_run_dir(args.run_dir, cfg.mode, args.resume)) if comm.rank == 0 else None
        run_dir = comm.broadcast_object(name) if comm.size > 1 else name
        summary = _worker(comm, raw, str(run_dir), args.resume, progress, verbose, args.overwrite, evaluate)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once, keep the newest checkpoint
        if comm.rank == 0 and run_dir is not None:
            return _interrupted(Path(run_dir))
        return 130
    finally:
        shutdown_world()
    if comm.rank == 0:
        return _finish(summary, Path(str(run_dir)))
    return 130 if summary.get("stop_reason") == "interrupt" else 0


def _reexec_mpirun(cfg: TrainConfig, run_dir: Path, args: argparse.Namespace) -> int:
    """Start ``cfg.nprocs`` ranks of this same command under mpirun (the mpi backend needs it)."""
    from ringpipe.launch import mpirun_command

    argv = ["train", "--run-dir", str(run_dir)]
    if args.config:
        argv += ["--config", str(args.config)]
    for flag, value in (("--mode", args.mode), ("--nprocs", args.nprocs), ("--backend", args.backend)):
        if value is not None:
            argv += [flag, str(value)]
    for item in args.overrides:
        argv += ["--set", item]
    argv += [f for f, on in (("--resume", args.resume), ("--overwrite", args.overwrite),
                             ("--no-progress", args.no_progress), ("--eval-only", getattr(args, "eval_only", False)))
             if on]
    if getattr(args, "checkpoint", None):
        argv += ["--checkpoint", str(args.checkpoint)]
    cmd = mpirun_command(cfg.nprocs, [sys.executable, "-m", "ringpipe.cli", *argv])
    log.info("starting %d ranks under mpirun: %s", cfg.nprocs, " ".join(cmd))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(cmd, env=env).returncode


def _report(summary: dict[str, Any], run_dir: Path) -> None:
    from ringpipe.train.metrics import format_summary

    print(format_summary(summary))
    if summary.get("eval_only"):
        from ringpipe.train.evaluate import eval_path

        print(f"evaluation written to {eval_path(run_dir, summary['step'])}")
    else:
        print(f"run directory: {run_dir}")
