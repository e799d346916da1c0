"""Horovod's elastic machinery every face shares: ``run``, ``State``, ``ObjectState``, reset callbacks.

Semantics follow ``horovod.common.elastic``; the faces add their states (``TorchState`` in
:mod:`ringpipe.api.elastic`, ``TensorFlowState`` in :mod:`ringpipe.tensorflow.elastic`):

* ``state.commit()`` saves the tracked state (a copy of every model's and optimizer's
  ``state_dict``, and every other keyword attribute) — call it every few batches;
  ``state.restore()`` goes back to the last commit; ``state.sync()`` makes every rank hold rank
  0's state (broadcast of parameters, optimizer state and attributes).
* ``@hvd.elastic.run`` wraps ``train(state, ...)``: it syncs the state, calls the function, and
  when a collective fails with :class:`~ringpipe.core.errors.HorovodInternalError` (a peer
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

from ringpipe.comm import elastic_rendezvous
from ringpipe.comm.departures import PeerDeparted
from ringpipe.core import basics, movement
from ringpipe.core.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["State", "ObjectState", "run", "HostsUpdatedInterrupt", "committed_path"]

log = logging.getLogger(__name__)

STATE_FILE = "elastic-state.pt"


def committed_path() -> Path | None:
    """Where commits persist across worker restarts (``$RINGPIPE_ELASTIC_DIR``), or None."""
    directory = os.environ.get("RINGPIPE_ELASTIC_DIR", "").strip()
    return Path(directory) / STATE_FILE if directory else None


def _restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


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
        """Raise :class:`HostsUpdatedInterrupt` on every rank at once when the elastic driver published a new world.

        Rank 0 asks the driver's store and tells the others (Horovod's broadcast of the update), so
        that every rank leaves at the same commit. ``skip_sync`` is set when the new world only
        lost workers: every survivor already holds the committed state. Outside an elastic job
        (no driver) nothing is asked.
        """
        if not elastic_rendezvous.active() or not basics.is_initialized():
            return
        update: tuple[bool, bool] | None = elastic_rendezvous.hosts_updated() if basics.rank() == 0 else None
        if basics.size() > 1:
            update = movement.broadcast_object(update, root_rank=0)
        assert update is not None  # rank 0 asked (a world of one is rank 0 alone); the others got its answer
        updated, added = update
        if updated:
            raise HostsUpdatedInterrupt(skip_sync=not added)

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
        if path is None or basics.rank() != 0:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self._snapshot(), tmp)
        os.replace(tmp, path)

    def _resume_committed(self) -> bool:
        """After a worker restart: load the last persisted commit (rank 0; ``sync`` shares it)."""
        path = committed_path()
        if path is None or not _restarted() or basics.rank() != 0 or not path.is_file():
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
            self._saved_state = movement.broadcast_object(self._saved_state, root_rank=0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    def _snapshot(self) -> dict[str, Any]:
        return {"objects": copy.deepcopy(self._saved_state)}

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        self._saved_state = dict(snapshot.get("objects", {}))
        self._set_attrs()


def _reset() -> None:
    """Leave this world and join the next; a world that cannot be made is left for the one after."""
    while True:
        basics.shutdown()
        try:
            basics.init()
            return
        except (HorovodInternalError, RuntimeError) as exc:
            if not elastic_rendezvous.active():
                raise
            log.warning("elastic: the new world could not be made (%s); waiting for the next", exc)


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
