"""A worker's side of an elastic job's rendezvous: which world to join next, and whether hosts changed.

Under ``ringpipe-horovodrun --host-discovery-script`` (or ``--min-np``) the driver on the launching
host serves a key-value store (``RINGPIPE_ELASTIC_DRIVER`` = ``addr:port``) and publishes world
versions in it:

* ``elastic/version``: the newest version;
* ``elastic/v<V>/<worker>``: the worker's place in world V as JSON (rank, size, local and cross
  ranks), or ``"leave"`` when the worker has no place in it (its host was removed);
* ``elastic/v<V>/added``: ``"1"`` when world V adds workers (those need the state synced);
* ``elastic/v<V>/ready``: a counter every member adds 1 to once its process group is made;
* ``elastic/v<V>/joined/<worker>``: set by a worker when it takes its place in world V (the driver
  replaces a survivor that never comes: one still blocked in a collective of the old world);
* ``elastic/waiting/<worker>``: set by a worker when it first waits to join (the driver publishes a
  version that adds workers only once all of them wait);
* ``elastic/v<V>/lost``: a counter a worker adds 1 to when it comes back to wait for a newer world
  after joining V (a collective of V failed, or V's process group could not be made). When no
  worker ended, the driver learns from it alone that V is gone: once every live member of V has
  come back it makes V+1 of the same workers (a collective that timed out, a replacement that came
  after the process group's timeout).

:func:`join` waits for a version newer than the one this process last joined, sets the rank
variables of its place (``RANK`` ... ``HOROVOD_CROSS_SIZE``) and returns the version, whose
process group meets under keys of its own in the same store. :func:`hosts_updated` says whether a
newer version waits (``state.commit()`` asks it).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any

__all__ = ["DRIVER", "WORKER", "FIRST_VERSION", "active", "driver_store", "join", "hosts_updated", "joined_version",
           "mark_ready", "prefix"]

#: ``addr:port`` of the elastic driver's store (set by the driver for each worker).
DRIVER = "RINGPIPE_ELASTIC_DRIVER"
#: This worker's name in the driver's records (``host[slot]``).
WORKER = "RINGPIPE_ELASTIC_WORKER"
#: Set by the driver: the world a new worker was started for.
FIRST_VERSION = "RINGPIPE_ELASTIC_FIRST_VERSION"

_STORE: list[Any] = []
_JOINED = [0]


def active() -> bool:
    """Whether this process is a worker of an elastic job."""
    return bool(os.environ.get(DRIVER, "").strip()) and bool(os.environ.get(WORKER, "").strip())


def driver_store() -> Any:
    """The driver's store (a client, opened once per process)."""
    if not _STORE:
        import torch.distributed as dist

        addr, _, port = os.environ[DRIVER].rpartition(":")
        _STORE.append(dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=60)))
    return _STORE[0]


def joined_version() -> int:
    """The world version this process joined last (0 before the first)."""
    return _JOINED[0]


def prefix(version: int) -> str:
    """The store prefix of world ``version``'s process group."""
    return f"/ringpipe/elastic/v{version}"


def _version(store: Any) -> int:
    return int(store.get("elastic/version").decode()) if store.check(["elastic/version"]) else 0


def join(poll_s: float = 0.05) -> int:
    """Wait for a world newer than the last joined, take this worker's place in it; its version.

    A worker without a place in the newest world (its host was removed) ends here, with status 0.
    A new worker joins no world older than the one it was started for (``FIRST_VERSION``): an
    older world may say ``leave`` for its slot, meant for the worker it replaces.
    """
    store = driver_store()
    me = os.environ[WORKER]
    if _JOINED[0]:  # back from a world that was lost or never made: the driver makes the next one
        store.add(f"elastic/v{_JOINED[0]}/lost", 1)
    store.set(f"elastic/waiting/{me}", "1")  # the driver tells the running workers once the new ones wait
    oldest = max(_JOINED[0] + 1, int(os.environ.get(FIRST_VERSION, "1") or 1))
    while True:
        version = _version(store)
        if version >= oldest:
            key = f"elastic/v{version}/{me}"
            if store.check([key]):
                place = store.get(key).decode()
                if place == "leave":
                    raise SystemExit(0)
                os.environ.update(json.loads(place))
                _JOINED[0] = version
                store.set(f"elastic/v{version}/joined/{me}", "1")
                return version
        time.sleep(poll_s)


def mark_ready(version: int) -> None:
    """Tell the driver this worker's process group of world ``version`` is made."""
    driver_store().add(f"elastic/v{version}/ready", 1)


def hosts_updated() -> tuple[bool, bool]:
    """(a newer world waits, it adds workers); (False, False) outside an elastic job."""
    if not active() or not _JOINED[0]:
        return False, False
    store = driver_store()
    version = _version(store)
    if version <= _JOINED[0]:
        return False, False
    added = any(store.check([f"elastic/v{v}/added"]) and store.get(f"elastic/v{v}/added") == b"1"
                for v in range(_JOINED[0] + 1, version + 1))
    return True, added
