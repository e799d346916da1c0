"""Horovod's elastic API for torch programs: ``hvd.elastic.run``, ``TorchState``, reset callbacks.

Semantics follow ``horovod.common.elastic`` and ``horovod.torch.elastic``:

* ``state.commit()`` saves the tracked state (a copy of every model's and optimizer's
  ``state_dict``, and every other keyword attribute) — call it every few batches;
  ``state.restore()`` goes back to the last commit; ``state.sync()`` makes every rank hold rank
  0's state (broadcast of parameters, optimizer state and attributes).
* ``@hvd.elastic.run`` wraps ``train(state, ...)``: it syncs the state, calls the function, and
  when a collective fails with :class:`~ringpipe.dp.engine.HorovodInternalError` (a peer
  departed, ranks disagreed) or :class:`~ringpipe.comm.departures.PeerDeparted`, restores the
  last commit, re-initialises the world (``shutdown()`` then ``init()``), runs the reset
  callbacks and tries again.

Why more than Horovod: under ``ringpipe launch --max-restarts N`` torch's elastic agent replaces
*every* worker when one is lost, so no memory survives. ``commit()`` therefore also writes the
committed state to ``$RINGPIPE_ELASTIC_DIR/elastic-state.pt`` (rank 0, atomically) when that
variable names a directory, and a restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0) starts
from it: the program goes on from its last commit. The file holds tensors and plain Python
values only and is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ringpipe.api.elastic_sampler import ElasticSampler
from ringpipe.comm.departures import PeerDeparted
from ringpipe.dp.engine import HorovodInternalError

__all__ = ["State", "ObjectState", "TorchState", "ElasticSampler", "SamplerStateHandler", "run",
           "HostsUpdatedInterrupt", "committed_path"]

log = logging.getLogger(__name__)

STATE_FILE = "elastic-state.pt"


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 - Horovod's name
    """Horovod raises it when hosts were added or removed; ringpipe's workers are replaced instead."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


def committed_path() -> Path | None:
    """Where commits persist across worker restarts (``$RINGPIPE_ELASTIC_DIR``), or None."""
    directory = os.environ.get("RINGPIPE_ELASTIC_DIR", "").strip()
    return Path(directory) / STATE_FILE if directory else None


def _restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _api() -> Any:
    import ringpipe.api as api  # the package's faces (init, rank, broadcasts), imported when used

    return api


class State:
    """Tracked state of a worker: ``commit``/``restore``/``sync`` and reset callbacks (Horovod's ``State``)."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Functions to call after a reset (the world was re-initialised), e.g. to rescale the LR."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (in memory; also to ``$RINGPIPE_ELASTIC_DIR`` on rank 0), then check for host updates."""
        self.save()
        self._persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod's hook for added or removed hosts; workers are replaced whole here, so nothing to do."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset, before the callbacks and the next sync."""

    # persistence across worker restarts
    def _snapshot(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        raise NotImplementedError

    def _persist(self) -> None:
        path = committed_path()
        if path is None or _api().rank() != 0:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self._snapshot(), tmp)
        os.replace(tmp, path)

    def _resume_committed(self) -> bool:
        """After a worker restart: load the last persisted commit (rank 0; ``sync`` shares it)."""
        path = committed_path()
        if path is None or not _restarted() or _api().rank() != 0 or not path.is_file():
            return False
        self._load_snapshot(torch.load(path, map_location="cpu", weights_only=True))
        self.save()
        log.info("elastic: restarted worker resumes from the commit in %s", path)
        return True


class ObjectState(State):
    """State of plain Python objects, each given as a keyword and exposed as an attribute."""

    def __init__(self, **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__()

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = _api().broadcast_object(self._saved_state, root_rank=0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def _snapshot(self) -> dict[str, Any]:
        return {"objects": copy.deepcopy(self._saved_state)}

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        self._saved_state = dict(snapshot.get("objects", {}))
        self._set_attrs()


class _Handler:
    """Save, restore and sync of one model or optimizer (Horovod's state handlers)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _ModelHandler(_Handler):
    def sync(self) -> None:
        _api().broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        _api().broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_Handler):
    """An :class:`ElasticSampler` in a ``TorchState``: its epoch and processed count, synced from rank 0.

    Loading the state re-splits the sampler among the ranks of the moment, so after a reset the
    rest of the epoch is divided among the new set of ranks.
    """

    def sync(self) -> None:
        self.value.load_state_dict(_api().broadcast_object(self.value.state_dict(), root_rank=0))


def _handler(value: Any) -> _Handler | None:
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

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
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


def _reset() -> None:
    api = _api()
    api.shutdown()
    api.init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` elastically: sync, call, and after a lost peer restore, reset and retry.

    Collectives must not be made by the caller of the wrapped function: every rank enters it
    together (Horovod's rule).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        state._resume_committed()
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except (HorovodInternalError, PeerDeparted) as exc:
                log.warning("elastic: %s; restoring the last commit and re-initialising", exc)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            _reset()
            state.on_reset()

    return wrapper
