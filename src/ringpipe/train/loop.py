"""The training loop: one function that runs any mode on any world, with evaluation, metrics and resume.

The loop owns a :class:`~ringpipe.train.reporting.Reporter` (records, log lines, progress bar,
summary) and a :class:`~ringpipe.train.checkpoints.checkpointer.Checkpointer` (save, resume, the
best checkpoint), both over the run's :class:`~ringpipe.train.progress.RunProgress`.

Every rank runs :func:`train`. Epochs are counted from the global step as
``step * global_batch / records`` (fractional); the test set is evaluated whenever an epoch
boundary is crossed, and a checkpoint follows every ``checkpoint.every_epochs`` epochs. The
state that makes a resumed run equal to an uninterrupted one is saved: runner (model and
optimizer), LR schedule, each rank's RNG state, batch-stream position and partial metric sums.

Ctrl-C (SIGINT) stops a run as ``max_steps`` does: the ranks agree to stop at the next step
that closes a log window (every step on one process), save a checkpoint there, evaluate and
write the summary, with ``stop_reason`` "interrupt". A second Ctrl-C, a second or more after
the first, stops at once (``KeyboardInterrupt``), keeping the newest checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from ringpipe.comm import Communicator
from ringpipe.comm.events import blocked_ns
from ringpipe.observe.regions import expected_work
from ringpipe.train.checkpoints.checkpointer import Checkpointer, NothingToResume, nothing_to_resume
from ringpipe.train.config import TrainConfig, dump_config
from ringpipe.train.datasets import Dataset, load_dataset
from ringpipe.train.lr_schedules import build_schedule
from ringpipe.train.metrics import MetricsWriter, plot_curves, write_json_atomic
from ringpipe.train.models import build_model
from ringpipe.train.modes import ModeContext, ModeRunner, build_runner
from ringpipe.train.progress import RunProgress
from ringpipe.train.reporting import Reporter
from ringpipe.train.rundir import clear_run_dir
from ringpipe.train.sampling import ShardStream, check_split_sizes, eval_indices
from ringpipe.train.stop import REPEAT_S, StopRequest
from ringpipe.train.tally import Tally

__all__ = ["train", "Given", "REPEAT_S", "seed_everything", "node_first", "write_observations", "NothingToResume", "StopRequest",
           "nothing_to_resume"]

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def node_first(comm: Communicator) -> AbstractContextManager[None]:
    """Local rank 0 of each node prepares data first, then the others (preparation once per node)."""
    if comm.size == 1:
        return nullcontext()
    from ringpipe.launch import local_rank_zero_first

    return local_rank_zero_first(comm)


@dataclass
class Given:
    """What :func:`ringpipe.train.fit` hands the loop instead of the config's names (None: from the config)."""

    model: Callable[[], torch.nn.Module] | None = None
    data: Dataset | None = None
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    device: torch.device | None = None


class _Run:
    """One run on one rank: its data, runner, schedule and batch stream, where it stands, and the
    reporter and checkpointer that word and save it."""

    def __init__(self, comm: Communicator, cfg: TrainConfig, run_dir: Path, progress: bool,
                 stop: StopRequest | None = None, given: Given | None = None, writes: bool = True) -> None:
        self.comm, self.cfg, self.run_dir = comm, cfg, run_dir
        self.stop = stop or StopRequest()
        given = given or Given()
        seed_everything(cfg.seed)
        if given.data is not None:
            self.data: Dataset = given.data
        else:
            with node_first(comm):
                self.data = load_dataset(cfg.data)

        def make_model() -> torch.nn.Module:
            torch.manual_seed(cfg.seed)  # identical initial weights on every rank
            return given.model() if given.model is not None else build_model(cfg.model, self.data)

        ctx = ModeContext(cfg, comm, self.data, make_model, given.loss, given.optimizer, given.device)
        self.runner: ModeRunner = build_runner(ctx)
        # Per-rank seed for everything random after initialisation (dropout, ...).
        seed_everything(cfg.seed + 1 + comm.rank)
        e = self.runner
        records = len(self.data.train)
        check_split_sizes(records, e.replicas, f"data {self.data.name!r}")
        if len(self.data.test) == 0 and comm.rank == 0 and writes:
            log.warning("data %r has no test set: test loss and accuracy are not measured (reported as NaN); a "
                        "factory returns (train, test) or {'train': ..., 'test': ...}, or takes a train parameter "
                        "(called with train=True and train=False)", self.data.name)
        global_batch = cfg.batch_size * e.replicas
        total_steps = cfg.total_steps(records, e.replicas)
        self.progress = RunProgress(records, global_batch, total_steps, min(total_steps, cfg.max_steps or total_steps))
        self.schedule = build_schedule(e.optimizer, cfg.schedule, cfg.epochs, records / global_batch, e.lr_scale)
        self.stream = ShardStream(records, e.replicas, e.replica_rank, cfg.batch_size, cfg.seed)
        self.metrics = MetricsWriter(run_dir, comm.rank == 0 and writes, cfg.logger)
        self.reporter = Reporter(comm, cfg, self.progress, e, self.schedule, self.metrics, self.stop, self.evaluate,
                                 log, progress)
        self.checkpointer = Checkpointer(comm, cfg, run_dir, self.progress, e, self.schedule, self.stream,
                                         self.metrics, log)

    def evaluate(self, split: Any = None) -> tuple[float, float]:
        """Loss and accuracy over the test set (or ``split``), each sample once across the replicas. Collective."""
        t = Tally()
        test = self.data.test if split is None else split
        with expected_work("evaluation"):  # ranks may hold unequal shares of the test set, by design
            for idx in eval_indices(len(test), self.runner.replicas, self.runner.replica_rank, self.cfg.batch_size):
                t.add(self.runner.eval_step(*test.batch(idx)))
        loss, acc, _ = t.reduce(self.comm)
        return loss, acc

    def run(self) -> dict[str, Any]:
        cfg, e, p = self.cfg, self.runner, self.progress
        reporter, checkpointer = self.reporter, self.checkpointer
        start_step = p.step
        p.wall_start = time.perf_counter()
        bar = reporter.bar()
        window_start_time = time.perf_counter()
        window_steps = 0
        epoch_window_start = len(p.step_windows)
        train = self.data.train
        if e.streams:
            checkpointer.note_drained()  # a fresh stream: the state is whole here
        try:
            while p.step < p.stop_step:
                t0, b0 = time.perf_counter_ns(), blocked_ns()
                idx = self.stream.next_batch()
                p.window.add(e.train_step(*train.batch(idx)))
                self.schedule.step()
                t1 = time.perf_counter_ns()
                p.step_windows.append((t0, t1, blocked_ns() - b0))
                p.train_time += (t1 - t0) / 1e9
                p.step += 1
                window_steps += 1
                bar.update(1)
                epoch = p.crossed_epoch(p.step)
                at_eval = epoch is not None or p.step == p.total_steps
                # A train record every log_every steps and at each evaluation (so that epoch sums
                # are complete); an interruption by max_steps keeps the window open in the checkpoint.
                # Ctrl-C: the ranks agree at the end of a log window (in its allreduce).
                stop = self.comm.size == 1 and self.stop.requested
                if p.step % cfg.log_every == 0 or at_eval:
                    p.epoch_tally.value += p.window.value
                    stop = reporter.log_train(bar, window_steps, time.perf_counter() - window_start_time)
                    window_start_time, window_steps = time.perf_counter(), 0
                if at_eval:
                    reporter.log_eval(epoch_window_start)
                    epoch_window_start = len(p.step_windows)
                    # the runner drains at epoch ends
                    gathered = (checkpointer.note_drained(),) if e.streams else None
                    every = cfg.checkpoint.every_epochs
                    if p.step == p.total_steps or (every and epoch is not None and epoch % every == 0):
                        checkpointer.save(gathered)
                    checkpointer.consider_best(gathered)
                if stop and p.step < p.stop_step:
                    p.stop_reason = "interrupt"
                    if self.comm.rank == 0:
                        log.warning("interrupted: stopping at step %d (checkpoint, evaluation, summary)", p.step)
                    break
            if p.step < p.total_steps and p.step > start_step and p.saved_step != p.step:
                # stopped by max_steps or Ctrl-C: resumable from here (or from the last drain)
                if e.streams and checkpointer.drained is not None and checkpointer.drained[0] != p.step:
                    checkpointer.save_drained()
                else:
                    checkpointer.save()
            if window_steps:
                # Stopped inside a log window: record it (marked partial, dropped on resume) for the
                # curves and the summary; the checkpoint above keeps the window open.
                reporter.log_train(bar, window_steps, time.perf_counter() - window_start_time, partial=True)
        finally:
            bar.close()
        interrupted = p.step < p.total_steps
        if not p.stop_reason:
            p.stop_reason = "max_steps" if interrupted else "complete"
        if interrupted or not p.last_eval or p.last_eval.get("step") != p.step:
            loss, acc = self.evaluate()
            final_eval = {"test_loss": loss, "test_accuracy": acc}
        else:
            final_eval = p.last_eval
        return reporter.summary(final_eval, interrupted, p.wall_time(), checkpointer.best)


def write_observations(comm: Communicator, run: Path, timeline: bool,
                       steps: list[tuple[int, int, int]] | None = None) -> None:
    """Rank 0 writes the profile and the doctor's findings of the training steps (and, with
    ``timeline``, the events and the Chrome timeline); see :mod:`ringpipe.observe.runreport`."""
    from ringpipe.observe.runreport import write_run_observations

    write_run_observations(comm, run, timeline, steps or [])


def train(
    comm: Communicator,
    cfg: TrainConfig,
    run_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    given: Given | None = None,
    eval_only: bool = False,
    checkpoint: str | Path | None = None,
) -> dict[str, Any]:
    """Train ``cfg`` on this rank of ``comm``; rank 0 writes the run directory. Returns the summary.

    ``eval_only``: evaluate ``checkpoint`` (default: the newest good one) instead, see
    :mod:`ringpipe.train.evaluate`; returns the evaluation.

    ``given``: the model, data, loss or optimizer factory handed to :func:`ringpipe.train.fit`.

    In the main thread, Ctrl-C (SIGINT) stops the run gracefully (see the module's description);
    ``--resume`` of a run with no step left raises :class:`NothingToResume` before writing anything;
    ``overwrite`` removes an earlier run's outputs from ``run_dir`` first.
    """
    if eval_only:
        from ringpipe.train.evaluate import evaluate_checkpoint

        return evaluate_checkpoint(comm, cfg, Path(run_dir), checkpoint, lambda **kw: _Run(comm, cfg, Path(run_dir),
                                   False, given=given, writes=False, **kw))
    with StopRequest().installed() as stop:
        return _train(comm, cfg, Path(run_dir), resume, progress, stop, overwrite, given)


def _train(comm: Communicator, cfg: TrainConfig, run: Path, resume: bool, progress: bool,
           stop: StopRequest, overwrite: bool, given: Given | None = None) -> dict[str, Any]:
    if comm.rank == 0 and not resume:
        if overwrite:
            clear_run_dir(run)
        run.mkdir(parents=True, exist_ok=True)
    if comm.size > 1:
        comm.barrier()
    state = _Run(comm, cfg, run, progress, stop, given)
    try:
        if resume:
            state.checkpointer.resume()  # refuses a mismatched checkpoint before anything is written
        if comm.rank == 0:
            (run / "config.yaml").write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
            if not resume:
                (run / "metrics.jsonl").write_text("")
                for logger in state.metrics.loggers:
                    logger.rewrite([])
        summary = state.run()
        if comm.size > 1 and (cfg.observe.profile or cfg.observe.timeline):
            write_observations(comm, run, cfg.observe.timeline, state.progress.step_windows)
    finally:
        state.runner.close()
        state.metrics.close()
    if comm.rank == 0:
        write_json_atomic(run / "summary.json", summary)
        plot_curves(run, state.metrics.records, title=f"{run.name}: mode {cfg.mode}, {comm.size} "
                    f"process{'es' if comm.size > 1 else ''}")
    return summary
