"""Horovod's elastic API for torch programs: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``.

The machinery (``run``, ``State``, ``ObjectState``, persistence of commits across worker restarts)
is every face's (:mod:`ringpipe.core.elastic`); this face adds the state of a torch training
process: models and optimizers saved as copies of their ``state_dict`` and synced by broadcast
from rank 0, and the :class:`ElasticSampler`'s position in its epoch.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ringpipe.api.elastic_sampler import ElasticSampler
from ringpipe.core.elastic import ObjectState, State, committed_path, run
from ringpipe.core.errors import HostsUpdatedInterrupt

__all__ = ["State", "ObjectState", "TorchState", "ElasticSampler", "SamplerStateHandler", "run",
           "HostsUpdatedInterrupt", "committed_path"]


def _api() -> Any:
    import ringpipe.api as api  # this face's broadcasts, imported when used (the package imports this module)

    return api


class _Handler:
    """Save, restore and sync of one model or optimizer (Horovod's state handlers)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def reset(self) -> None:
        """After a reset (the world was made again); nothing for most values."""

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _ModelHandler(_Handler):
    def sync(self) -> None:
        _api().broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def reset(self) -> None:
        """After a reset: a ``DistributedOptimizer`` reduces over the new world."""
        follow = getattr(self.value, "follow_world", None)
        if follow is not None:
            follow()

    def sync(self) -> None:
        _api().broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_Handler):
    """An :class:`ElasticSampler` in a ``TorchState``: its epoch and processed count, synced from rank 0.

    Loading the state re-splits the sampler among the ranks of the moment, so after a reset the
    rest of the epoch is divided among the new set of ranks.
    """

    def sync(self) -> None:
        self.value.load_state_dict(_api().broadcast_object(self.value.state_dict(), root_rank=0))


#: the handler of each kind of value a TorchState saves by its ``state_dict``
_Handlers = _ModelHandler | _OptimizerHandler | SamplerStateHandler


def _handler(value: Any) -> _Handlers | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return SamplerStateHandler(value)
    return None


class TorchState(ObjectState):
    """State of a torch training process: models, optimizers and any other keyword attributes.

    ``TorchState(model=model, optimizer=opt, epoch=0, batch=0)``; ``state.epoch`` etc. read and
    assign the attributes. Models, optimizers and :class:`ElasticSampler` s are saved as copies of
    their ``state_dict`` and synced by broadcast from rank 0; the rest as Python objects.
    """

    #: the models', optimizers' and samplers' handlers by attribute name (set past ``__setattr__``, which reads it)
    _handlers: dict[str, _Handlers]

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handlers] = {}
        for name, value in list(kwargs.items()):
            handler = _handler(value)
            if handler is not None:
                handlers[name] = handler
                del kwargs[name]
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**kwargs)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
        super().reset()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def _snapshot(self) -> dict[str, Any]:
        return {"handlers": {n: h.saved for n, h in self._handlers.items()}, **super()._snapshot()}

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        for name, saved in snapshot.get("handlers", {}).items():
            if name in self._handlers:
                self._handlers[name].value.load_state_dict(saved)
        super()._load_snapshot(snapshot)
