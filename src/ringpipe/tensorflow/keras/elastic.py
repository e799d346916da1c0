"""Horovod's elastic Keras API (Keras 3, or tf-keras with ``TF_USE_LEGACY_KERAS=1``): ``KerasState`` and the commit / batch / epoch callbacks.

``hvd.elastic.run`` and the states are :mod:`ringpipe.tensorflow.elastic`'s (which reuses the
machinery every face shares); the callbacks follow ``horovod/_keras/elastic.py``: commit every
``batches_per_commit`` batches and at each epoch's end, and keep ``state.batch`` /
``state.epoch`` current so that a restored state knows where training was.
"""

from __future__ import annotations

from typing import Any

from ..elastic import ObjectState, State, TensorFlowKerasState, TensorFlowState, run
from ._which import keras

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]


class KerasState(TensorFlowKerasState):
    """State of a Keras model and optimizer (the compiled one by default), plus keyword attributes."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of each epoch."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit  # the same count on every rank after a sync

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the last finished batch of the epoch (0 again at the epoch's end).

    As in Horovod, ``params["steps"]`` of the first epoch after a reset is shortened by the
    batches already done; Keras 3's ``fit`` sizes its epochs from the data, not from
    ``params``, so skip those batches in the data you pass (e.g. ``dataset.skip(state.batch)``).
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of finished epochs, counted across resets."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
