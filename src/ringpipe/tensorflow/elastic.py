"""Horovod's elastic API for TensorFlow 2: ``hvd.elastic.run``, ``TensorFlowState``, ``TensorFlowKerasState``.

The machinery is every face's (:mod:`ringpipe.core.elastic`): ``run`` syncs the state, calls
the training function, and when a collective fails (a peer departed, ranks disagreed) restores
the last commit, re-initialises the world and tries again; commits persist across worker
restarts under ``ringpipe launch --max-restarts`` when ``$RINGPIPE_ELASTIC_DIR`` is set. Only the
states are TensorFlow's: they save copies of variable values, restore them by ``assign``, and
sync by broadcasting rank 0's values.

Where it differs from Horovod on TensorFlow 2: Horovod's ``TensorFlowState`` broadcasts the
variables once, when it is built; here ``sync()`` broadcasts them (``run`` calls it before the
training function), so a state built on every rank makes no collective of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
import torch

from ringpipe.core import elastic as _elastic
from ringpipe.core.elastic import ObjectState, State
from ringpipe.core.errors import HorovodInternalError

from .bridge import to_tf, to_torch
from .functions import broadcast_variables

__all__ = ["ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` elastically (see :func:`ringpipe.core.elastic.run`).

    A collective that failed inside a ``tf.function`` reaches Python as a TensorFlow error; it
    is turned back into the :class:`HorovodInternalError` it was, so that ``run`` recovers.
    """

    @functools.wraps(func)
    def unwrap(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            text = str(exc)
            if "HorovodInternalError" in text or "PeerDeparted" in text or "Mismatched" in text:
                raise HorovodInternalError(text) from exc
            raise

    return _elastic.run(unwrap)


def _values(variables: Sequence[Any]) -> list[tf.Tensor]:
    """Copies of the variables' current values (not views: the variables will be assigned)."""
    return [tf.identity(tf.convert_to_tensor(v)) for v in variables]


class _VariablesState(ObjectState):
    """Saved copies of some TF variables (plus keyword objects): save, restore, sync, persist."""

    _saved_values: list[tf.Tensor]

    def _tracked(self) -> list[Any]:
        raise NotImplementedError

    def _save_variables(self) -> None:
        object.__setattr__(self, "_saved_values", _values(self._tracked()))

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for var, value in zip(self._tracked(), self._saved_values, strict=True):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        variables = self._tracked()
        if variables:
            broadcast_variables(variables, root_rank=0)
        self._save_variables()
        super().sync()

    def _snapshot(self) -> dict[str, Any]:
        return {"variables": [to_torch(v).clone() for v in self._saved_values], **super()._snapshot()}

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        saved = snapshot.get("variables", [])
        variables = self._tracked()
        if len(saved) != len(variables):
            raise ValueError(f"elastic: the persisted commit holds {len(saved)} variables, this state tracks "
                             f"{len(variables)}; remove $RINGPIPE_ELASTIC_DIR's state file to start afresh")
        for var, value in zip(variables, saved, strict=True):
            var.assign(to_tf(value if isinstance(value, torch.Tensor) else torch.as_tensor(value)))
        super()._load_snapshot(snapshot)


class TensorFlowState(_VariablesState):
    """State of a list of ``tf.Variable`` objects, plus any keyword attributes (Horovod's ``TensorFlowState``).

    TensorFlow 2 has no global variable collection: pass ``variables`` (e.g. ``model.variables +
    optimizer.variables``). ``session`` is accepted for Horovod's signature and must be None.
    """

    variables: list[Any]
    session: Any

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None, **kwargs: Any) -> None:
        if variables is None:
            raise ValueError("TensorFlowState(variables=...): TensorFlow 2 has no global variables; pass the "
                             "variables to track, e.g. model.variables + optimizer.variables")
        if session is not None:
            raise ValueError("TensorFlowState: a TF1 session is not supported; run eagerly (TensorFlow 2)")
        object.__setattr__(self, "variables", list(variables))
        object.__setattr__(self, "session", None)
        self._save_variables()
        super().__init__(**kwargs)

    def _tracked(self) -> list[Any]:
        return self.variables


def _optimizer_variables(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)  # Keras 2: a method; Keras 3: a list


class TensorFlowKerasState(_VariablesState):
    """State of a Keras model and its optimizer, plus any keyword attributes (Horovod's ``TensorFlowKerasState``).

    ``TensorFlowKerasState(model, optimizer=None, epoch=0, batch=0)``: the model must be built;
    the optimizer defaults to the model's compiled one. Its variables (the iteration count and
    slots) are tracked as they exist at each save. ``sync()`` first builds an optimizer that has
    no slots yet (``optimizer.build(model.trainable_variables)``, which Keras would do at the first
    step): a worker that joins a running job (a new host, a replaced worker) starts with an
    unbuilt optimizer while rank 0's has its momentum, and the broadcast must carry the same
    variables on every rank. Horovod leaves this to the program (its elastic Keras example runs a
    first ``fit`` step before making the state); here it needs nothing.
    """

    model: Any
    optimizer: Any

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer or getattr(model, "optimizer", None))
        object.__setattr__(self, "backend", backend)
        self._save_variables()
        super().__init__(**kwargs)

    def _tracked(self) -> list[Any]:
        return list(self.model.variables) + _optimizer_variables(self.optimizer)

    def sync(self) -> None:
        optimizer = self.optimizer
        if optimizer is not None and getattr(optimizer, "built", None) is False and hasattr(optimizer, "build"):
            optimizer.build(self.model.trainable_variables)
        super().sync()

    def restore(self) -> None:
        if len(self._tracked()) != len(self._saved_values):  # the optimizer was built after the last save
            raise ValueError(f"elastic: the model and optimizer now hold {len(self._tracked())} variables, the "
                             f"last commit {len(self._saved_values)}; build the optimizer before the state "
                             f"(optimizer.build(model.trainable_variables)) or commit after its first step")
        super().restore()
