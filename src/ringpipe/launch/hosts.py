"""The hosts of a job and where its ranks go: ``-H host:slots,...`` and hostfiles, read as horovodrun and Open MPI read them.

``-H a:4,b:2`` is horovodrun's and mpirun's host list (a host without ``:slots`` has one slot).
A hostfile has one host a line, in either spelling users already keep:

* Open MPI's: ``host slots=N [max_slots=M]`` (``#`` starts a comment; a bare ``host`` is one slot),
* horovodrun's ``-H`` form, ``host:N``.

Ranks are placed by slot, host after host, as horovodrun and ``mpirun --map-by slot`` place
them: ``-np 8 -H a:4,b:2,c:2`` puts ranks 0-3 on a, 4-5 on b and 6-7 on c. A host that receives
no rank is left out. This module uses the standard library only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
from dataclasses import dataclass

__all__ = ["HostSlots", "HostsError", "parse_host_list", "read_hostfile", "place", "is_local", "Placement"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$|^\[?[0-9A-Fa-f:]+\]?$")


class HostsError(ValueError):
    """A host list or hostfile that cannot be used; the message names the entry and the fix."""


@dataclass(frozen=True)
class HostSlots:
    host: str
    slots: int
    max_slots: int | None = None


def _check_name(host: str, where: str) -> str:
    if not host:
        raise HostsError(f"{where}: an empty host name; write HOST:SLOTS (e.g. node1:4)")
    if not _NAME.match(host):
        raise HostsError(f"{where}: {host!r} is not a host name or address")
    return host


def _count(text: str, what: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise HostsError(f"{where}: {what} must be a whole number, got {text!r}") from None
    if value < 1:
        raise HostsError(f"{where}: {what} is {value}; give at least 1")
    return value


def parse_host_list(text: str) -> list[HostSlots]:
    """``host1:4,host2:2`` -> hosts with their slots (one slot where none is given)."""
    out: list[HostSlots] = []
    for item in text.split(","):
        item = item.strip()
        where = f"-H {text!r}"
        if item.count(":") > 1 and not item.startswith("["):  # a bare IPv6 address: no slots
            host, slots = item, ""
        else:
            host, _, slots = item.rpartition(":") if ":" in item else (item, "", "")
        host = _check_name(host.strip("[]"), where)
        out.append(HostSlots(host, _count(slots, f"slots of {host!r}", where) if slots else 1))
    return _merge(out, f"-H {text!r}")


def read_hostfile(path: str) -> list[HostSlots]:
    """Read a hostfile (Open MPI's ``host slots=N max_slots=M`` lines, or ``host:N`` lines)."""
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise HostsError(f"--hostfile {path}: cannot read it ({exc.strerror or exc})") from None
    out: list[HostSlots] = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--hostfile {path}, line {number} ({raw.strip()!r})"
        words = line.split()
        first = words[0]
        slots: int | None = None
        max_slots: int | None = None
        if ":" in first and first.count(":") == 1 and "=" not in first:
            first, _, count = first.partition(":")
            slots = _count(count, "the slot count", where)
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if not eq:
                raise HostsError(f"{where}: expected KEY=VALUE after the host, got {word!r} "
                                 "(write `host slots=4` or `host:4`)")
            key = key.strip().lower()
            if key in ("slots", "count", "cpu"):
                slots = _count(value, "slots", where)
            elif key == "max_slots" or key == "max-slots":
                max_slots = _count(value, "max_slots", where)
            else:
                raise HostsError(f"{where}: unknown key {key!r}; a hostfile line reads `host slots=N [max_slots=M]`")
        host = _check_name(first, where)
        if slots is None:
            slots = 1
        if max_slots is not None and max_slots < slots:
            raise HostsError(f"{where}: max_slots={max_slots} is less than slots={slots}")
        out.append(HostSlots(host, slots, max_slots))
    if not out:
        raise HostsError(f"--hostfile {path}: no hosts in it; write one `host slots=N` line per host")
    return _merge(out, f"--hostfile {path}")


def _merge(hosts: list[HostSlots], where: str) -> list[HostSlots]:
    """Open MPI adds the slots of a host named twice; so does ringpipe (keeping the first position)."""
    order: dict[str, HostSlots] = {}
    for h in hosts:
        if h.host in order:
            old = order[h.host]
            limit = None if old.max_slots is None or h.max_slots is None else old.max_slots + h.max_slots
            order[h.host] = HostSlots(h.host, old.slots + h.slots, limit)
        else:
            order[h.host] = h
    return list(order.values())


@dataclass(frozen=True)
class Placement:
    """Where the ranks go: ``(host, count)`` in rank order; ranks ``first[i] .. first[i] + count - 1`` on host i."""

    hosts: tuple[tuple[str, int], ...]

    @property
    def size(self) -> int:
        return sum(n for _, n in self.hosts)

    def first_rank(self, index: int) -> int:
        return sum(n for _, n in self.hosts[:index])

    def describe(self) -> str:
        return ", ".join(f"{h}: {n}" for h, n in self.hosts)


def place(hosts: list[HostSlots], nprocs: int | None, source: str) -> Placement:
    """Fill the slots host after host with ``nprocs`` ranks (all the slots when None).

    ``max_slots`` lets a host take more ranks than its slots, as in Open MPI: only when every
    host's slots are full, and never more than its ``max_slots``.
    """
    total = sum(h.slots for h in hosts)
    want = total if nprocs is None else nprocs
    if want < 1:
        raise HostsError(f"-n must be >= 1, got {want}")
    counts = [min(h.slots, max(0, want - sum(x.slots for x in hosts[:i]))) for i, h in enumerate(hosts)]
    left = want - sum(counts)
    if left > 0:  # oversubscribe up to max_slots, host after host
        for i, h in enumerate(hosts):
            if h.max_slots is not None:
                extra = min(left, h.max_slots - counts[i])
                counts[i] += extra
                left -= extra
    if left > 0:
        limit = sum(h.max_slots if h.max_slots is not None else h.slots for h in hosts)
        room = f" ({limit} with max_slots)" if limit != total else ""
        raise HostsError(f"-n {want} is more than the {total} slots{room} of {source}; lower -n or give the "
                         "hosts more slots (host:N, or slots=N in a hostfile)")
    return Placement(tuple((h.host, n) for h, n in zip(hosts, counts, strict=True) if n))


def _local_names() -> set[str]:
    names = {"localhost", "localhost.localdomain", "ip6-localhost", "::1"}
    for fn in (socket.gethostname, socket.getfqdn):
        with contextlib.suppress(OSError):
            names.add(fn())
    return names


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine: a loopback or own name, or an address of one of its interfaces."""
    if host in _local_names():
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if addr.is_loopback:
        return True
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))  # succeeds only for an address this machine holds
        return True
    except OSError:
        return False
