"""What a checkpoint holds of a run, and how a run is saved and restored: the :class:`Checkpointer` the training loop owns.

The state that makes a resumed run equal to an uninterrupted one: the runner (model and
optimizer, each rank's own for pipeline stages), the LR schedule, each rank's RNG state,
batch-stream position and partial metric sums, the run's clocks and last records
(:class:`~ringpipe.train.progress.RunProgress`). Rank 0 gathers it and writes it
(:mod:`ringpipe.train.checkpoints.files` adds the checksum and the atomic write); ``--resume``
reads the newest good checkpoint on rank 0 and broadcasts it. The runner's state is kept under
the key ``engine`` (the runner's earlier name), so that checkpoints of earlier runs still
resume. The checkpointer also keeps the best checkpoint (:mod:`ringpipe.train.checkpoints.best`)
when the config asks for one.

A streaming runner (mode ``async``) has micro-batches in flight between its drains, which a
checkpoint cannot hold; saving there would drain them, which an uninterrupted run does not
do. So its state is kept (a copy) at every drain, and a run stopped between drains is
checkpointed as it was at the last one: ``--resume`` repeats the steps since then exactly.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ringpipe.observe.regions import expected_work
from ringpipe.train.checkpoints.best import BestCheckpoint
from ringpipe.train.checkpoints.files import (
    CheckpointError,
    Resumable,
    find_resumable,
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
    set_aside,
)
from ringpipe.train.checkpoints.resize import (
    replicas_of,
    resharded_stream,
    resume_refusal,
    samples_seen,
    summed_tally,
    total_steps_from,
)
from ringpipe.train.config import dump_config

if TYPE_CHECKING:
    from ringpipe.comm import Communicator
    from ringpipe.train.config import TrainConfig
    from ringpipe.train.metrics import MetricsWriter
    from ringpipe.train.modes import ModeRunner
    from ringpipe.train.progress import RunProgress
    from ringpipe.train.sampling import ShardStream

__all__ = ["CHECKPOINT_VERSION", "Checkpointer", "NothingToResume", "after_restart", "nothing_to_resume"]

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1


def after_restart(run_dir: str | None, resume: bool, overwrite: bool) -> tuple[bool, bool]:
    """``(resume, overwrite)`` for workers an elastic agent restarted (``TORCHELASTIC_RESTART_COUNT`` > 0).

    A restarted run continues itself: from the newest good checkpoint of its ``--run-dir`` (of the
    newest run under ``runs/`` without one), or from the start in the same directory when the
    first attempt died before its first checkpoint. A first attempt is left as asked.
    """
    import os

    if resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
        return resume, overwrite
    if run_dir is None or any((Path(run_dir) / "checkpoints").glob("step-*.pt")):
        log.warning("restarted by the elastic agent: resuming from the newest good checkpoint")
        return True, overwrite
    return False, True


class NothingToResume(CheckpointError):
    """``--resume`` of a run whose checkpoint is already at its last step (or at ``max_steps``)."""


def nothing_to_resume(run_dir: str | Path, step: int, total: int, max_steps: int | None) -> str:
    """Why a run at ``step`` of ``total`` has nothing left to train ("" if it has)."""
    if step >= total:
        return f"the run in {run_dir} is already complete (step {step} of {total}); nothing to resume"
    if max_steps is not None and step >= max_steps:
        return (
            f"the run in {run_dir} already stopped at max_steps={max_steps} (step {step} of {total}); "
            "nothing to resume: resume with --set max_steps=null (or a larger max_steps) to continue"
        )
    return ""


def _rng_state() -> dict[str, Any]:
    """The RNG state that training consumes after initialisation (dropout and other torch sampling)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # a run that never touched CUDA has no CUDA state to keep
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _model_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """The first difference between the model weights of two runner states ("" if none is found)."""
    where = f"stage {saved['stage']}: " if "stage" in saved else ""
    if "balance" in saved and list(saved["balance"]) != list(current.get("balance", [])):
        return f"its pipeline stages hold {list(saved['balance'])} layers, this config's {list(current['balance'])}"
    for key in ("model", "module"):  # data-parallel runners, pipeline stages
        old, new = saved.get(key), current.get(key)
        if not (isinstance(old, dict) and isinstance(new, dict)):
            continue
        for name in [*old, *(k for k in new if k not in old)]:
            if name not in new:
                return f"{where}{name} is in the checkpoint but not in this model"
            if name not in old:
                return f"{where}{name} of this model is not in the checkpoint"
            if tuple(old[name].shape) != tuple(new[name].shape):
                return (f"{where}{name} has shape {list(old[name].shape)} in the checkpoint, "
                        f"{list(new[name].shape)} in this model")
    return ""


class Checkpointer:
    """Saves one run's state on one rank and restores it (``--resume``, ``--eval-only``).

    ``progress``: where the run stands (saved, and set back on resume); ``runner``, ``schedule``,
    ``stream``: the model and optimizer, the LR schedule and the batch stream (their states saved
    and loaded); ``metrics``: the records (truncated after the resumed step); ``log``: the logger
    of the loop's lines (the loop passes its own, so they carry its name).
    """

    def __init__(self, comm: Communicator, cfg: TrainConfig, run_dir: Path, progress: RunProgress, runner: ModeRunner,
                 schedule: Any, stream: ShardStream, metrics: MetricsWriter, log: logging.Logger) -> None:
        self.comm, self.cfg, self.run_dir, self.progress = comm, cfg, run_dir, progress
        self.runner, self.schedule, self.stream, self.metrics, self.log = runner, schedule, stream, metrics, log
        self.is_root = comm.rank == 0
        self.best = BestCheckpoint(cfg.checkpoint.best, run_dir, comm) if cfg.checkpoint.best else None
        self.drained: tuple[int, dict[str, Any] | None] | None = None  # streaming runners: (step, payload)
        self.evaluating = False
        self.resumed_from = ""

    def payload(self) -> dict[str, Any] | None:
        """The checkpoint of the current step, gathered on rank 0 (None on the others). Collective."""
        p = self.progress
        mine = {
            "rng": _rng_state(),
            "stream": self.stream.state_dict(),
            "window": p.window.value.clone(),
            "epoch_tally": p.epoch_tally.value.clone(),
            "schedule": self.schedule.state_dict(),
        }
        if not self.runner.shared_state:
            mine["engine"] = self.runner.state_dict()
        ranks = self.comm.allgather_object(mine) if self.comm.size > 1 else [mine]
        if not self.is_root:
            return None
        return {
            "version": CHECKPOINT_VERSION,
            "step": p.step,
            "epoch": p.epoch_at(p.step),
            "samples": p.samples_at(p.step),
            "mode": self.cfg.mode,
            "world_size": self.comm.size,
            "config": dump_config(self.cfg),
            "engine": self.runner.state_dict() if self.runner.shared_state else None,
            "ranks": ranks,
            "train_time": p.train_time,
            "wall_time": p.wall_time(),
            "records": p.records,
            "replicas": self.runner.replicas,
            "lr_scale": self.runner.lr_scale,
            "resizes": p.resizes,
            "last_eval": p.last_eval,
            "last_train": p.last_train,
        }

    def save(self, gathered: tuple[dict[str, Any] | None] | None = None) -> None:
        """Checkpoint the current step (collective); ``gathered``: its payload, already gathered."""
        payload = gathered[0] if gathered is not None else self.payload()
        if payload is not None:
            with expected_work("checkpoint"):  # rank 0 alone: the doctor does not call it lateness
                path = save_checkpoint(self.run_dir / "checkpoints", payload["step"], payload, self.cfg.checkpoint.keep)
            self.log.debug("checkpoint %s", path)
        self.progress.saved_step = self.progress.step
        if self.comm.size > 1:
            self.comm.barrier()

    def consider_best(self, gathered: tuple[dict[str, Any] | None] | None = None) -> None:
        """After an evaluation: keep this step as the best checkpoint if its metric improved (collective);
        ``gathered``: its payload, already gathered."""
        if self.best is not None:
            p = self.progress
            self.best.consider(p.step, float(p.last_eval[self.best.metric]), self.metrics.records, gathered,
                               self.payload)

    def note_drained(self) -> dict[str, Any] | None:
        """A streaming runner just drained: keep this step's state (a copy), for a stop before the next drain."""
        payload = self.payload()
        self.drained = (self.progress.step, copy.deepcopy(payload))
        return payload

    def save_drained(self) -> None:
        """Stopped between drains (streaming runner): checkpoint the state of the last drain.

        Saving here would first drain the micro-batches in flight, which an uninterrupted run
        does not do: resumed from such a checkpoint, the run would see other weight versions.
        From the last drain, ``--resume`` repeats the steps since then exactly.
        """
        assert self.drained is not None
        step, payload = self.drained
        if self.is_root:
            self.log.warning(
                "mode %s stopped at step %d with micro-batches in flight (the pipeline drains only at epoch "
                "ends): the checkpoint is its state at its last drain, step %d; --resume repeats steps %d-%d "
                "exactly", self.cfg.mode, self.progress.step, step, step + 1, self.progress.step)
            if payload is not None and not (self.run_dir / "checkpoints" / f"step-{step:08d}.pt").exists():
                with expected_work("checkpoint"):
                    save_checkpoint(self.run_dir / "checkpoints", step, payload, self.cfg.checkpoint.keep)
        self.progress.saved_step = self.progress.step
        if self.comm.size > 1:
            self.comm.barrier()

    def resume(self, checkpoint: str | Path | None = None, evaluating: bool = False) -> None:
        """Continue from the newest good checkpoint (or ``checkpoint``); ``evaluating``: only load
        it (``--eval-only``), changing nothing in the run directory."""
        p = self.progress
        ckpt: dict[str, Any] | None = None
        error, path = "", ""
        self.evaluating = evaluating
        if self.is_root:
            try:
                if checkpoint is not None:
                    path, ckpt = str(checkpoint), load_checkpoint(checkpoint)
                else:
                    found = find_resumable(self.run_dir) if evaluating else self._find_resumable()
                    path, ckpt = str(found.path), found.checkpoint
                    for bad, reason in found.skipped if evaluating else []:
                        self.log.warning("skipped %s: %s", bad, reason)
                error = resume_refusal(path, ckpt, self.cfg.mode, self.comm.size)
            except CheckpointError as exc:
                error = str(exc)
            if evaluating:
                error = error.replace("--resume: ", "--eval-only: ")
            if not error:
                assert ckpt is not None
                self.log.info("%s %s (step %d)", "evaluating" if evaluating else "resuming from", path, ckpt["step"])
        if self.comm.size > 1:
            error, path, ckpt = self.comm.broadcast_object((error, path, ckpt if not error else None))
        if error:
            raise CheckpointError(error)
        assert ckpt is not None
        self.resumed_from = path
        old_replicas = replicas_of(ckpt, self.runner.replicas)
        step, samples = int(ckpt["step"]), samples_seen(ckpt, old_replicas)
        p.base_step, p.base_samples = step, samples
        resized = old_replicas != self.runner.replicas
        if samples != step * p.global_batch:  # another global batch before (resized now or earlier)
            p.total_steps = total_steps_from(self.cfg.epochs, p.records, p.global_batch, step, samples)
            p.stop_step = min(p.total_steps, self.cfg.max_steps or p.total_steps)
        done = "" if evaluating else nothing_to_resume(self.run_dir, step, p.total_steps, self.cfg.max_steps)
        if done:
            raise NothingToResume(done)  # before anything in the run directory changes
        p.resizes = list(ckpt.get("resizes", []))
        if resized:
            self._resume_resized(ckpt, path, old_replicas)
        else:
            mine = ckpt["ranks"][self.comm.rank]
            self._load_runner(ckpt["engine"] if self.runner.shared_state else mine["engine"], path)
            self.schedule.load_state_dict(mine["schedule"])
            self.stream.load_state_dict(mine["stream"])
            p.window.value = mine["window"].clone()
            p.epoch_tally.value = mine["epoch_tally"].clone()
            _set_rng_state(mine["rng"])
            if ckpt["mode"] != self.cfg.mode:
                self._note_resize(ckpt, old_replicas, f"resuming mode {ckpt['mode']} as mode {self.cfg.mode} on the same "
                                        f"{self.runner.replicas} replicas at step {step}: nothing else changes")
        p.step = step
        p.saved_step = p.step
        p.train_time = float(ckpt["train_time"])
        p.wall_before = float(ckpt.get("wall_time", p.train_time))
        p.last_eval, p.last_train = dict(ckpt["last_eval"]), dict(ckpt["last_train"])
        if not evaluating:
            self.metrics.truncate_after(p.step)

    def _resume_resized(self, ckpt: dict[str, Any], path: str, old_replicas: int) -> None:
        """Continue a data-parallel checkpoint on another number of replicas (:mod:`ringpipe.train.checkpoints.resize`)."""
        p = self.progress
        ranks, rank = ckpt["ranks"], self.comm.rank
        old_lr = float(ranks[0]["schedule"]["_last_lr"][0])
        old_scale = float(ckpt.get("lr_scale", old_replicas if ckpt["config"]["optimizer"].get("scale_lr") else 1))
        self._load_runner(ckpt["engine"], path)
        stream = resharded_stream([r["stream"] for r in ranks], old_replicas, p.records)
        self.stream.load_state_dict(stream)
        p.window.value = summed_tally([r["window"] for r in ranks], rank)
        p.epoch_tally.value = summed_tally([r["epoch_tally"] for r in ranks], rank)
        if rank < len(ranks):
            _set_rng_state(ranks[rank]["rng"])
        # The rate of a run of this size at this epoch: the schedule counts steps of this global
        # batch, so its position is the samples seen in those steps (a fraction after a resize).
        schedule = self.schedule
        schedule.last_epoch = p.base_samples / p.global_batch
        lrs = schedule.get_lr()
        for group, lr in zip(schedule.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        schedule._last_lr = list(lrs)
        left = p.records - stream["start"] if stream["start"] else 0
        repeated = (-left) % self.runner.replicas if left else 0
        data = (f"the {left} samples not yet seen in the interrupted pass are dealt to the new replicas"
                f"{f' ({repeated} of them read twice to even out the shards)' if repeated else ''}"
                if left else "the next pass starts on the new replicas")
        self._note_resize(ckpt, old_replicas, (
            f"resuming mode {ckpt['mode']} on {old_replicas} replicas as mode {self.cfg.mode} on "
            f"{self.runner.replicas} at step {p.base_step} ({p.base_samples} samples, epoch "
            f"{p.base_samples / p.records:.4f}): global batch {self.cfg.batch_size * old_replicas} -> "
            f"{p.global_batch} ({self.cfg.batch_size} per replica), lr scale {old_scale:g} -> "
            f"{self.runner.lr_scale:g}, lr {old_lr:.4g} -> {lrs[0]:.4g}; {data}"))

    def _note_resize(self, ckpt: dict[str, Any], old_replicas: int, line: str) -> None:
        p = self.progress
        if self.evaluating:
            return
        p.resizes.append({"step": p.base_step, "samples": p.base_samples, "from_mode": ckpt["mode"],
                          "from_replicas": old_replicas, "mode": self.cfg.mode,
                          "replicas": self.runner.replicas})
        if self.is_root:
            self.log.warning("%s", line)

    def _find_resumable(self) -> Resumable:
        """Rank 0: the newest good checkpoint; newer unusable ones are reported and moved aside,
        temporary files of a save that never finished are removed."""
        directory = self.run_dir / "checkpoints"
        for tmp in remove_stale_temporaries(directory):
            self.log.warning("removed %s, left by a run stopped while it saved a checkpoint", tmp)
        found = find_resumable(self.run_dir)
        for bad, reason in found.skipped:
            set_aside(bad, reason.replace("--resume: ", ""))
        if found.skipped:
            self.log.warning("--resume: continuing from %s, the newest good checkpoint (step %d)",
                        found.path, found.checkpoint["step"])
        return found

    def _load_runner(self, state: dict[str, Any], path: str) -> None:
        """Load the runner's state; a checkpoint of another model is refused on every rank, saying how."""
        error = ""
        try:
            self.runner.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError) as exc:
            try:
                first = _model_mismatch(state, self.runner.state_dict())
            except Exception:  # the runner's own state is only read to name the difference
                first = ""
            first = first or str(exc).strip().splitlines()[-1].strip()
            error = (
                f"--resume: the model in {path} does not match this config's model ({first}): resume with the "
                f"run's own config ({self.run_dir / 'config.yaml'}; leave out the --config or --set that "
                f"changed the model), or start a new run in another --run-dir"
            )
        if self.comm.size > 1:
            error = next((e for e in self.comm.allgather_object(error) if e), "")
        if error:
            raise CheckpointError(error)
