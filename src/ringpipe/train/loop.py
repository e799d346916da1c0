"""The training loop: one function that runs any mode on any world, with evaluation, metrics and resume.

Every rank runs :func:`train`. Epochs are counted from the global step as
``step * global_batch / records`` (fractional); the test set is evaluated whenever an epoch
boundary is crossed, and a checkpoint follows every ``checkpoint.every_epochs`` epochs. The
state that makes a resumed run equal to an uninterrupted one is saved: engine (model and
optimizer), LR schedule, each rank's RNG state, batch-stream position and partial metric sums.

Ctrl-C (SIGINT) stops a run as ``max_steps`` does: the ranks agree to stop at the next step
that closes a log window (every step on one process), save a checkpoint there, evaluate and
write the summary, with ``stop_reason`` "interrupt". A second Ctrl-C, a second or more after
the first, stops at once (``KeyboardInterrupt``), keeping the newest checkpoint.
"""

from __future__ import annotations

import logging
import math
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
from ringpipe.train.best import BestCheckpoint
from ringpipe.train.config import TrainConfig, dump_config
from ringpipe.train.datasets import Dataset, load_dataset
from ringpipe.train.metrics import MetricsWriter, plot_curves, write_json_atomic
from ringpipe.train.models import build_model
from ringpipe.train.modes import Engine, ModeContext, build_engine
from ringpipe.train.reporting import Reporting
from ringpipe.train.rundir import clear_run_dir
from ringpipe.train.runstate import Checkpointing, NothingToResume, nothing_to_resume
from ringpipe.train.sampling import ShardStream, eval_indices
from ringpipe.train.schedules import build_schedule
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


class _Run(Checkpointing, Reporting):
    """The state of one run on one rank."""

    def __init__(self, comm: Communicator, cfg: TrainConfig, run_dir: Path, progress: bool,
                 stop: StopRequest | None = None, given: Given | None = None, writes: bool = True) -> None:
        self.comm, self.cfg, self.run_dir, self.progress = comm, cfg, run_dir, progress
        self.stop = stop or StopRequest()
        self.is_root = comm.rank == 0
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
        self.engine: Engine = build_engine(ctx)
        # Per-rank seed for everything random after initialisation (dropout, ...).
        seed_everything(cfg.seed + 1 + comm.rank)
        e = self.engine
        self.records = len(self.data.train)
        self.global_batch = cfg.batch_size * e.replicas
        self.steps_per_epoch = self.records / self.global_batch
        self.total_steps = cfg.total_steps(self.records, e.replicas)
        self.stop_step = min(self.total_steps, cfg.max_steps or self.total_steps)
        self.schedule = build_schedule(e.optimizer, cfg.schedule, cfg.epochs, self.steps_per_epoch, e.lr_scale)
        self.stream = ShardStream(self.records, e.replicas, e.replica_rank, cfg.batch_size, cfg.seed)
        self.step = 0
        self.base_step = self.base_samples = 0  # samples read by step base_step (a resumed run's checkpoint)
        self.resizes: list[dict[str, Any]] = []  # changes of mode or replicas at resumes (runstate.py)
        self.window = Tally()
        self.epoch_tally = Tally()
        self.metrics = MetricsWriter(run_dir, self.is_root and writes, cfg.logger)
        self.train_time = 0.0
        self.wall_before = 0.0  # wall time of the run's earlier parts (resumed runs)
        self.wall_start: float | None = None  # when this part's loop started
        self.saved_step = -1
        self.drained: tuple[int, dict[str, Any] | None] | None = None  # streaming engines: (step, payload)
        self.stop_reason = ""
        self.step_windows: list[tuple[int, int, int]] = []  # (start ns, end ns, blocked ns)
        self.last_eval: dict[str, Any] = {}
        self.last_train: dict[str, Any] = {}
        self.best = BestCheckpoint(cfg.checkpoint.best, run_dir, comm) if cfg.checkpoint.best else None

    # ------------------------------------------------------------------ epochs

    def samples_at(self, step: int) -> int:
        return self.base_samples + (step - self.base_step) * self.global_batch

    def epoch_at(self, step: int) -> float:
        return self.samples_at(step) / self.records

    def crossed_epoch(self, step: int) -> int | None:
        """The whole epoch reached by ``step`` if step-1 was still before it."""
        before, after = math.floor(self.epoch_at(step - 1) + 1e-9), math.floor(self.epoch_at(step) + 1e-9)
        return after if after > before else None

    def wall_time(self) -> float:
        """Wall time of the loop over the run's parts so far (resumed runs count every part)."""
        now = time.perf_counter() - self.wall_start if self.wall_start is not None else 0.0
        return self.wall_before + now

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, split: Any = None) -> tuple[float, float]:
        t = Tally()
        test = self.data.test if split is None else split
        with expected_work("evaluation"):  # ranks may hold unequal shares of the test set, by design
            for idx in eval_indices(len(test), self.engine.replicas, self.engine.replica_rank, self.cfg.batch_size):
                t.add(self.engine.eval_step(*test.batch(idx)))
        loss, acc, _ = t.reduce(self.comm)
        return loss, acc

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        cfg, e = self.cfg, self.engine
        start_step = self.step
        self.wall_start = time.perf_counter()
        bar = self._bar()
        window_start_time = time.perf_counter()
        window_steps = 0
        epoch_window_start = len(self.step_windows)
        train = self.data.train
        if e.streams:
            self.note_drained()  # a fresh stream: the state is whole here
        try:
            while self.step < self.stop_step:
                t0, b0 = time.perf_counter_ns(), blocked_ns()
                idx = self.stream.next_batch()
                self.window.add(e.train_step(*train.batch(idx)))
                self.schedule.step()
                t1 = time.perf_counter_ns()
                self.step_windows.append((t0, t1, blocked_ns() - b0))
                self.train_time += (t1 - t0) / 1e9
                self.step += 1
                window_steps += 1
                bar.update(1)
                epoch = self.crossed_epoch(self.step)
                at_eval = epoch is not None or self.step == self.total_steps
                # A train record every log_every steps and at each evaluation (so that epoch sums
                # are complete); an interruption by max_steps keeps the window open in the checkpoint.
                # Ctrl-C: the ranks agree at the end of a log window (in its allreduce).
                stop = self.comm.size == 1 and self.stop.requested
                if self.step % cfg.log_every == 0 or at_eval:
                    self.epoch_tally.value += self.window.value
                    stop = self._log_train(bar, window_steps, time.perf_counter() - window_start_time)
                    window_start_time, window_steps = time.perf_counter(), 0
                if at_eval:
                    self._log_eval(epoch_window_start)
                    epoch_window_start = len(self.step_windows)
                    gathered = (self.note_drained(),) if e.streams else None  # the engine drains at epoch ends
                    every = cfg.checkpoint.every_epochs
                    if self.step == self.total_steps or (every and epoch is not None and epoch % every == 0):
                        self.save(gathered)
                    if self.best is not None:
                        self.best.consider(self.step, float(self.last_eval[self.best.metric]), self.metrics.records,
                                           gathered, self._payload)
                if stop and self.step < self.stop_step:
                    self.stop_reason = "interrupt"
                    if self.is_root:
                        log.warning("interrupted: stopping at step %d (checkpoint, evaluation, summary)", self.step)
                    break
            if self.step < self.total_steps and self.step > start_step and self.saved_step != self.step:
                # stopped by max_steps or Ctrl-C: resumable from here (or from the last drain)
                if e.streams and self.drained is not None and self.drained[0] != self.step:
                    self.save_drained()
                else:
                    self.save()
            if window_steps:
                # Stopped inside a log window: record it (marked partial, dropped on resume) for the
                # curves and the summary; the checkpoint above keeps the window open.
                self._log_train(bar, window_steps, time.perf_counter() - window_start_time, partial=True)
        finally:
            bar.close()
        interrupted = self.step < self.total_steps
        if not self.stop_reason:
            self.stop_reason = "max_steps" if interrupted else "complete"
        if interrupted or not self.last_eval or self.last_eval.get("step") != self.step:
            loss, acc = self.evaluate()
            final_eval = {"test_loss": loss, "test_accuracy": acc}
        else:
            final_eval = self.last_eval
        return self._summary(final_eval, interrupted, self.wall_time())


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
            state.resume()  # refuses a mismatched checkpoint before anything is written
        if comm.rank == 0:
            (run / "config.yaml").write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
            if not resume:
                (run / "metrics.jsonl").write_text("")
                for logger in state.metrics.loggers:
                    logger.rewrite([])
        summary = state.run()
        if comm.size > 1 and (cfg.observe.profile or cfg.observe.timeline):
            write_observations(comm, run, cfg.observe.timeline, state.step_windows)
    finally:
        state.engine.close()
        state.metrics.close()
    if comm.rank == 0:
        write_json_atomic(run / "summary.json", summary)
        plot_curves(run, state.metrics.records, title=f"{run.name}: mode {cfg.mode}, {comm.size} "
                    f"process{'es' if comm.size > 1 else ''}")
    return summary
