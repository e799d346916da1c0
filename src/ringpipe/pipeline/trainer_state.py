"""PipelineTrainer's state: a stage's checkpoint (state_dict / load_state_dict) and the whole model's weights."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TrainerState"]


class TrainerState:
    """The state methods of :class:`~ringpipe.pipeline.trainer.PipelineTrainer` (which sets the attributes)."""

    stage: int
    balance: list[int]
    schedule: str
    chunks: int
    part_offsets: list[int]
    module: Any
    optimizer: Any
    scheduler: Any
    executor: Any
    grid: Any
    comm: Any

    @property
    def streaming(self) -> bool:  # the trainer's: whether an asynchronous stream is open
        raise NotImplementedError

    @property
    def in_flight(self) -> int:  # the trainer's: micro-batches forwarded and not yet backwarded
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """This stage's state: its layers (local names), optimizer, scheduler and place.

        Refused while a stream is open: the micro-batches in flight (their activations and
        stashed weights) are not part of the state; :meth:`drain` first.
        """
        if self.streaming:
            raise ValueError(
                f"stage {self.stage}: state_dict while {self.in_flight} micro-batches of an open stream are in "
                "flight would lose them; call drain() on every rank first"
            )
        return {
            "stage": self.stage,
            "balance": list(self.balance),
            "schedule": self.schedule,
            "steps": self.executor.steps_taken,
            "microbatches": self.executor.microbatches_seen,
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["stage"] != self.stage or list(state["balance"]) != list(self.balance):
            raise ValueError(
                f"state of stage {state['stage']} with balance {state['balance']} cannot be loaded into "
                f"stage {self.stage} with balance {self.balance}"
            )
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.executor.steps_taken = int(state.get("steps", 0))
        self.executor.microbatches_seen = int(state.get("microbatches", 0))

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict (keys of ``nn.Sequential(*layers)``) on every rank. Collective."""
        local = {}
        if self.grid.replica == 0:
            modules = [self.module] if self.chunks == 1 else list(self.module.children())
            for module, offset in zip(modules, self.part_offsets, strict=True):
                for key, value in module.state_dict().items():
                    idx, _, rest = key.partition(".")
                    local[f"{int(idx) + offset}.{rest}"] = value.detach().cpu()
        merged: dict[str, torch.Tensor] = {}
        for part in self.comm.allgather_object(local):
            merged.update(part)
        return dict(sorted(merged.items(), key=lambda kv: (int(kv[0].partition(".")[0]), kv[0])))
