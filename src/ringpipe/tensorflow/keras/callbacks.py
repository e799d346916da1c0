"""Horovod's Keras callbacks: broadcast at the start, metric averages, learning-rate warmup and schedule.

They are callbacks of the Keras ``tf.keras`` is (Keras 3, or tf-keras with
``TF_USE_LEGACY_KERAS=1``; :mod:`._which`), and read and set the learning rate and momentum
buffers of either kind of optimizer (Keras 3's, tf-keras's and ``tf.keras.optimizers.legacy``).

The schedule callbacks follow Horovod's formulas per batch: the learning rate is
``initial_lr * multiplier(epoch)`` with ``epoch`` fractional (``epoch + batch / steps_per_epoch``)
unless ``staircase``; the warmup multiplier is ``1/size * (e * (size - 1) / warmup_epochs + 1)``
with ``e = epoch + 1/steps_per_epoch``. Momentum correction (Goyal et al.) keeps the momentum
buffer in the units of the new rate for the batch where the rate changes: Horovod multiplies the
momentum coefficient by ``new_lr / old_lr`` for that batch; Keras 3 reads the coefficient as a
constant of the compiled step, so the buffers are multiplied instead (the same update for plain
momentum, which is ``m = momentum * m - lr * g``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from ringpipe.core.basics import size
from ringpipe.core.process_sets import global_process_set

from ..functions import broadcast_variables
from ..mpi_ops import allreduce
from ._which import KERAS2, keras

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Give every rank ``root_rank``'s model and optimizer variables before the first step (Horovod step 5).

    Keras 3 builds the model before training starts; the callback builds the optimizer on the
    model's trainable variables (as its first step would) and broadcasts both in
    ``on_train_begin``, so the first step already starts equal everywhere (Horovod, on Keras 2,
    broadcast after the first batch). A model still unbuilt then is broadcast after the first batch.
    ``local_variables`` (a variable or a list of them) keep each rank's own value, as
    :meth:`register_local_var` does.
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None,
                 process_set: Any = global_process_set) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False
        self._local_vars: set[int] = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        bad = [type(v).__name__ for v in local_variables if not _is_variable(v)]
        if bad:
            raise ValueError(f"local_variables must be variables (tf.Variable or keras.Variable), got {bad}: "
                             f"pass e.g. model.layers[0].variables")
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """A variable not to broadcast (model-parallel variables)."""
        self._local_vars.add(id(var))

    def _broadcast(self) -> None:
        model_vars = [v for v in self.model.variables if id(v) not in self._local_vars]
        broadcast_variables(model_vars, self.root_rank, process_set=self.process_set)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            broadcast_variables(optimizer_variables(optimizer), self.root_rank, process_set=self.process_set)
        self.broadcast_done = True

    def on_train_begin(self, logs: Any = None) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        if not self.model.built:
            return
        if optimizer is not None:
            build_optimizer(optimizer, self.model.trainable_variables)
        self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


def _is_variable(x: Any) -> bool:
    return isinstance(x, (tf.Variable, getattr(keras, "Variable", tf.Variable)))


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics (``logs``) over ranks at the end of each epoch, in sorted name order.

    Place it before callbacks that read the metrics (checkpoints, early stopping, schedules).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs:
            return
        for metric in sorted(logs):
            value = np.asarray(logs[metric], dtype=np.float64)
            logs[metric] = float(allreduce(tf.constant(value)).numpy())


def optimizer_variables(optimizer: Any) -> list[Any]:
    """An optimizer's variables: a list in Keras 3 and tf-keras, a method of legacy optimizers."""
    found = optimizer.variables
    return list(found() if callable(found) else found)


def build_optimizer(optimizer: Any, variables: list[Any]) -> None:
    """Make the optimizer's variables for ``variables`` now, as its first step would."""
    if hasattr(optimizer, "_create_all_weights"):  # tf.keras.optimizers.legacy
        optimizer._create_all_weights(variables)
    elif not getattr(optimizer, "built", getattr(optimizer, "_built", False)):
        optimizer.build(variables)


def _value(x: Any) -> float:
    return float(np.asarray(tf.convert_to_tensor(x)))


def _lr(optimizer: Any) -> float:
    # read as a tensor, not through a Keras backend: Keras 3's cannot read a tf-keras variable
    return _value(optimizer.learning_rate)


def _momentum_buffers(optimizer: Any, variables: list[Any]) -> list[Any]:
    """The SGD momentum buffers: ``momentums`` (Keras 3, tf-keras), or the legacy optimizers' ``momentum`` slots."""
    buffers = getattr(optimizer, "momentums", None)
    if buffers is not None:
        return list(buffers)
    if hasattr(optimizer, "get_slot_names") and "momentum" in optimizer.get_slot_names():
        return [optimizer.get_slot(v, "momentum") for v in variables]
    return []


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's learning-rate schedule: ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``.

    ``multiplier``: a number (``multiplier ** (epoch - start_epoch)``) or a function of the
    epoch; with ``staircase=False`` the epoch is fractional and the rate changes every batch.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, *args: Any) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self) -> int:
        if self.params.get("steps"):
            return int(self.params["steps"])
        if self.params.get("samples") and self.params.get("batch_size"):
            return int(self.params["samples"] // self.params["batch_size"])
        raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
                         f"parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if not (self.momentum_correction and momentum is not None and _value(momentum) and old_lr
                and new_lr != old_lr):
            return
        ratio = new_lr / old_lr
        for m in _momentum_buffers(optimizer, self.model.trainable_variables):
            m.assign(m * ratio)

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self.current_epoch
        assert epoch is not None
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(epoch)
        elif not self.staircase:
            assert self.steps_per_epoch
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = _lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warmup from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` (Goyal et al.)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0, *args: Any) -> None:
        def multiplier(epoch: float) -> float:
            assert self.steps_per_epoch
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if self.end_epoch is not None and epoch == self.end_epoch - 1 and self.verbose > 0:
            from ringpipe.core.basics import rank

            if rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's ``ModelCheckpoint`` that keeps only the best model (``save_best_only=True``).

    Horovod passes no path (its Spark estimator sets ``filepath`` later); Keras 3 checks the
    path's extension when the callback is made, so here the path is checked when it is known:
    give ``filepath=`` (``.keras``, or ``.weights.h5`` with ``save_weights_only``) or set
    ``callback.filepath`` before ``fit``.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: str | int = "epoch", filepath: Any = None) -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = None if filepath is None else str(filepath)
        if self.filepath is not None:
            self._check_path()

    def _check_path(self) -> None:
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint has no path: pass filepath='best.keras' or set callback.filepath "
                             "before fit()")
        ends = (".weights.h5",) if self.save_weights_only else (".keras", ".h5")
        if not KERAS2 and not self.filepath.endswith(ends):  # Keras 2 also saves SavedModel folders
            raise ValueError(f"BestModelCheckpoint: the filepath must end in {' or '.join(ends)} (Keras 3's model "
                             f"format{', save_weights_only=True' if self.save_weights_only else ''}); got "
                             f"{self.filepath!r}")

    def on_train_begin(self, logs: Any = None) -> None:
        self._check_path()
        super().on_train_begin(logs)
