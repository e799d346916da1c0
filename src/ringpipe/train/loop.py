"""The training loop: one function that runs any mode on any world, with evaluation, metrics and resume.

Every rank runs :func:`train`. Epochs are counted from the global step as
``step * global_batch / records`` (fractional); the test set is evaluated whenever an epoch
boundary is crossed, and a checkpoint follows every ``checkpoint.every_epochs`` epochs. The
state that makes a resumed run equal to an uninterrupted one is saved: engine (model and
optimizer), LR schedule, each rank's RNG state, batch-stream position and partial metric sums.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from ringpipe.comm import Communicator
from ringpipe.comm.events import blocked_ns
from ringpipe.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from ringpipe.train.config import TrainConfig, dump_config
from ringpipe.train.datasets import Dataset, load_dataset
from ringpipe.train.metrics import MetricsWriter, plot_curves, write_json_atomic
from ringpipe.train.models import build_model
from ringpipe.train.modes import Engine, ModeContext, build_engine
from ringpipe.train.sampling import ShardStream, eval_indices
from ringpipe.train.schedules import build_schedule

__all__ = ["train", "seed_everything", "node_first", "write_observations"]

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1


def seed_everything(seed: int) -> None:
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def node_first(comm: Communicator) -> AbstractContextManager[None]:
    """Local rank 0 of each node prepares data first, then the others (preparation once per node)."""
    if comm.size == 1:
        return nullcontext()
    from ringpipe.launch import local_rank_zero_first

    return local_rank_zero_first(comm)


def _rng_state() -> dict[str, Any]:
    """The RNG state that training consumes after initialisation (dropout and other torch sampling)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class _Tally:
    """Running ``[loss_sum, correct, count]`` sums, reduced across ranks when read."""

    def __init__(self) -> None:
        self.value = torch.zeros(3, dtype=torch.float64)

    def add(self, t: torch.Tensor) -> None:
        self.value += t

    def reduce(self, comm: Communicator) -> tuple[float, float, int]:
        total = self.value.clone()
        if comm.size > 1:
            comm.allreduce(total)
        loss_sum, correct, count = (float(v) for v in total)
        self.value.zero_()
        if count == 0:
            return math.nan, math.nan, 0
        return loss_sum / count, correct / count, int(count)


class _Run:
    """The state of one run on one rank."""

    def __init__(self, comm: Communicator, cfg: TrainConfig, run_dir: Path, progress: bool) -> None:
        self.comm, self.cfg, self.run_dir, self.progress = comm, cfg, run_dir, progress
        self.is_root = comm.rank == 0
        seed_everything(cfg.seed)
        with node_first(comm):
            self.data: Dataset = load_dataset(cfg.data)

        def make_model() -> torch.nn.Sequential:
            torch.manual_seed(cfg.seed)  # identical initial weights on every rank
            return build_model(cfg.model, self.data)

        self.engine: Engine = build_engine(ModeContext(cfg, comm, self.data, make_model))
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
        self.window = _Tally()
        self.epoch_tally = _Tally()
        self.metrics = MetricsWriter(run_dir, self.is_root)
        self.train_time = 0.0
        self.step_windows: list[tuple[int, int, int]] = []  # (start ns, end ns, blocked ns)
        self.last_eval: dict[str, Any] = {}
        self.last_train: dict[str, Any] = {}

    # ------------------------------------------------------------------ epochs

    def epoch_at(self, step: int) -> float:
        return step * self.global_batch / self.records

    def crossed_epoch(self, step: int) -> int | None:
        """The whole epoch reached by ``step`` if step-1 was still before it."""
        before, after = math.floor(self.epoch_at(step - 1) + 1e-9), math.floor(self.epoch_at(step) + 1e-9)
        return after if after > before else None

    # ------------------------------------------------------------------ checkpoints

    def _payload(self) -> dict[str, Any] | None:
        mine = {
            "rng": _rng_state(),
            "stream": self.stream.state_dict(),
            "window": self.window.value.clone(),
            "epoch_tally": self.epoch_tally.value.clone(),
            "schedule": self.schedule.state_dict(),
        }
        if not self.engine.shared_state:
            mine["engine"] = self.engine.state_dict()
        ranks = self.comm.allgather_object(mine) if self.comm.size > 1 else [mine]
        if not self.is_root:
            return None
        return {
            "version": CHECKPOINT_VERSION,
            "step": self.step,
            "epoch": self.epoch_at(self.step),
            "mode": self.cfg.mode,
            "world_size": self.comm.size,
            "config": dump_config(self.cfg),
            "engine": self.engine.state_dict() if self.engine.shared_state else None,
            "ranks": ranks,
            "train_time": self.train_time,
            "last_eval": self.last_eval,
            "last_train": self.last_train,
        }

    def save(self) -> None:
        payload = self._payload()
        if payload is not None:
            path = save_checkpoint(self.run_dir / "checkpoints", self.step, payload, self.cfg.checkpoint.keep)
            log.debug("checkpoint %s", path)
        if self.comm.size > 1:
            self.comm.barrier()

    def resume(self) -> None:
        ckpt: dict[str, Any] | None = None
        error = ""
        if self.is_root:
            path = latest_checkpoint(self.run_dir / "checkpoints")
            if path is None:
                error = f"--resume: no checkpoint in {self.run_dir / 'checkpoints'}"
            else:
                try:
                    ckpt = load_checkpoint(path)
                except CheckpointError as exc:
                    error = str(exc)
                if ckpt is not None and (ckpt["world_size"] != self.comm.size or ckpt["mode"] != self.cfg.mode):
                    error = (
                        f"--resume: {path} was written by mode {ckpt['mode']!r} on {ckpt['world_size']} ranks; "
                        f"this run is mode {self.cfg.mode!r} on {self.comm.size}: resume with the same mode "
                        "and number of processes"
                    )
                log.info("resuming from %s (step %d)", path, ckpt["step"] if ckpt else -1)
        if self.comm.size > 1:
            error, ckpt = self.comm.broadcast_object((error, ckpt if not error else None))
        if error:
            raise CheckpointError(error)
        assert ckpt is not None
        mine = ckpt["ranks"][self.comm.rank]
        self.engine.load_state_dict(ckpt["engine"] if self.engine.shared_state else mine["engine"])
        self.schedule.load_state_dict(mine["schedule"])
        self.stream.load_state_dict(mine["stream"])
        self.window.value = mine["window"].clone()
        self.epoch_tally.value = mine["epoch_tally"].clone()
        _set_rng_state(mine["rng"])
        self.step = int(ckpt["step"])
        self.train_time = float(ckpt["train_time"])
        self.last_eval, self.last_train = dict(ckpt["last_eval"]), dict(ckpt["last_train"])
        self.metrics.truncate_after(self.step)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> tuple[float, float]:
        t = _Tally()
        test = self.data.test
        for idx in eval_indices(len(test), self.engine.replicas, self.engine.replica_rank, self.cfg.batch_size):
            t.add(self.engine.eval_step(test.x[idx], test.y[idx]))
        loss, acc, _ = t.reduce(self.comm)
        return loss, acc

    def comm_share(self, since: int = 0) -> float:
        """Share of the steps' time this rank spent blocked waiting for communication.

        Communication that overlaps computation (gradient buckets reduced during backward,
        pipeline receives posted ahead) costs nothing here; only the waits that remain do.
        """
        windows = self.step_windows[since:]
        busy = sum(w1 - w0 for w0, w1, _ in windows)
        return sum(b for _, _, b in windows) / busy if busy > 0 else 0.0

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        cfg, e = self.cfg, self.engine
        start_step = self.step
        wall0 = time.perf_counter()
        bar = self._bar()
        window_start_time = time.perf_counter()
        window_steps = 0
        epoch_window_start = len(self.step_windows)
        train_x, train_y = self.data.train.x, self.data.train.y
        try:
            while self.step < self.stop_step:
                t0, b0 = time.perf_counter_ns(), blocked_ns()
                idx = self.stream.next_batch()
                self.window.add(e.train_step(train_x[idx], train_y[idx]))
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
                if self.step % cfg.log_every == 0 or at_eval:
                    self.epoch_tally.value += self.window.value
                    self._log_train(bar, window_steps, time.perf_counter() - window_start_time)
                    window_start_time, window_steps = time.perf_counter(), 0
                if at_eval:
                    self._log_eval(epoch_window_start)
                    epoch_window_start = len(self.step_windows)
                    every = cfg.checkpoint.every_epochs
                    if self.step == self.total_steps or (every and epoch is not None and epoch % every == 0):
                        self.save()
            if self.step < self.total_steps and self.step > start_step:
                self.save()  # stopped by max_steps: resumable from here
            if window_steps:
                # Stopped inside a log window: record it (marked partial, dropped on resume) for the
                # curves and the summary; the checkpoint above keeps the window open.
                self._log_train(bar, window_steps, time.perf_counter() - window_start_time, partial=True)
        finally:
            bar.close()
        interrupted = self.step < self.total_steps
        if interrupted or not self.last_eval or self.last_eval.get("step") != self.step:
            loss, acc = self.evaluate()
            final_eval = {"test_loss": loss, "test_accuracy": acc}
        else:
            final_eval = self.last_eval
        wall = time.perf_counter() - wall0
        return self._summary(final_eval, interrupted, wall)

    def _bar(self) -> Any:
        from tqdm.auto import tqdm

        return tqdm(
            total=self.stop_step,
            initial=self.step,
            disable=not (self.is_root and self.progress),
            desc=f"{self.cfg.mode} x{self.comm.size}",
            unit="step",
            dynamic_ncols=True,
            leave=False,
        )

    def _log_train(self, bar: Any, steps: int, seconds: float, partial: bool = False) -> None:
        loss, acc, count = self.window.reduce(self.comm)
        rec: dict[str, Any] = {
            "kind": "train",
            "step": self.step,
            "epoch": round(self.epoch_at(self.step), 6),
            "loss": loss,
            "accuracy": acc,
            "lr": self.schedule.get_last_lr()[0],
            "samples_per_second": steps * self.global_batch / seconds if seconds > 0 else 0.0,
        }
        if partial:
            rec["partial"] = True
        self.last_train = rec
        self.metrics.write(rec)
        bar.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.3f}", lr=f"{rec['lr']:.2e}", refresh=False)

    def _log_eval(self, since: int) -> None:
        train_loss, train_acc, _ = self.epoch_tally.reduce(self.comm)
        test_loss, test_acc = self.evaluate()
        windows = self.step_windows[since:]
        secs = sum(w1 - w0 for w0, w1, _ in windows) / 1e9
        rec: dict[str, Any] = {
            "kind": "eval",
            "step": self.step,
            "epoch": round(self.epoch_at(self.step), 6),
            "train_loss": train_loss,
            "train_accuracy": train_acc,
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "lr": self.schedule.get_last_lr()[0],
            "samples_per_second": len(windows) * self.global_batch / secs if secs > 0 else 0.0,
            "comm_share": self.comm_share(since),
        }
        self.last_eval = rec
        self.metrics.write(rec)
        if self.is_root:
            log.info(
                "epoch %.2f | train loss %.4f acc %.4f | test loss %.4f acc %.4f | lr %.2e | %.0f samples/s | comm %.0f%%",
                rec["epoch"], train_loss, train_acc, test_loss, test_acc, rec["lr"],
                rec["samples_per_second"], 100 * rec["comm_share"],
            )

    def _summary(self, final_eval: dict[str, Any], interrupted: bool, wall: float) -> dict[str, Any]:
        e = self.engine
        samples = self.step * self.global_batch
        return {
            "mode": self.cfg.mode,
            "world_size": self.comm.size,
            "replicas": e.replicas,
            "model": self.cfg.model.name,
            "dataset": self.cfg.data.name,
            "epochs": round(self.epoch_at(self.step), 6),
            "steps": self.step,
            "global_batch": self.global_batch,
            "test_accuracy": final_eval["test_accuracy"],
            "test_loss": final_eval["test_loss"],
            "final_loss": self.last_train.get("loss", math.nan),
            "final_lr": self.schedule.get_last_lr()[0],
            "samples_per_second": samples / self.train_time if self.train_time > 0 else 0.0,
            "comm_share": self.comm_share(),
            "train_time_s": self.train_time,
            "wall_time_s": wall,
            "interrupted": interrupted,
        }


def write_observations(comm: Communicator, run: Path, timeline: bool) -> None:
    """Gather every rank's communication events; rank 0 writes the profile, the doctor's findings
    and, with ``timeline``, the events and the Chrome timeline into the run directory."""
    from ringpipe.observe import (
        collect_events,
        diagnose,
        format_profile,
        format_report,
        save_events,
        write_timeline,
    )

    job = collect_events(comm)
    if job is None:
        return
    (run / "comm_profile.txt").write_text(format_profile(job) + "\n")
    (run / "doctor.txt").write_text(format_report(job, diagnose(job)) + "\n")
    if timeline:
        save_events(run / "events.json", job)
        write_timeline(run / "timeline.json", job)


def train(
    comm: Communicator,
    cfg: TrainConfig,
    run_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``cfg`` on this rank of ``comm``; rank 0 writes the run directory. Returns the summary."""
    run = Path(run_dir)
    if comm.rank == 0 and not resume:
        run.mkdir(parents=True, exist_ok=True)
    if comm.size > 1:
        comm.barrier()
    state = _Run(comm, cfg, run, progress)
    try:
        if resume:
            state.resume()  # refuses a mismatched checkpoint before anything is written
        if comm.rank == 0:
            (run / "config.yaml").write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
            if not resume:
                (run / "metrics.jsonl").write_text("")
        summary = state.run()
        if comm.size > 1 and (cfg.observe.profile or cfg.observe.timeline):
            write_observations(comm, run, cfg.observe.timeline)
    finally:
        state.engine.close()
    if comm.rank == 0:
        write_json_atomic(run / "summary.json", summary)
        plot_curves(run, state.metrics.records)
    return summary
