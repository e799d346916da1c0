"""The elastic driver's pure parts: the discovery script's answer, the blacklist and the rank assignment.

Semantics follow Horovod's elastic runner (horovod/runner/elastic/discovery.py, driver.py):

* a discovery script prints one host a line, ``host`` or ``host:slots``; a line without slots gets
  ``--slots-per-host`` (1 when not given); blank lines are skipped, a later line for the same host
  replaces an earlier one;
* a host whose worker failed is blacklisted; without ``--blacklist-cooldown-range`` for ever, with
  ``A B`` until a cooldown ends: ``A * 2**n + uniform(0, 1) * A`` seconds after its n-th
  blacklisting, clamped to ``[A, B]`` (Horovod's formula);
* a new world keeps the workers that survive in their rank order (so rank 0 stays on a survivor),
  then adds the new slots host after host, hosts in the order they were first discovered, up to
  ``--max-np``. A worker is named by its host and slot: ``host[slot]``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["DiscoveryError", "parse_discovery", "Blacklist", "SlotInfo", "assign", "WorkerKey"]

#: A worker's identity: (host as discovery printed it, slot on that host).
WorkerKey = tuple[str, int]


class DiscoveryError(ValueError):
    """The discovery script's output cannot be read; the message names the line."""


def parse_discovery(text: str, default_slots: int | None = None) -> list[tuple[str, int]]:
    """``host`` / ``host:slots`` lines -> [(host, slots)] in order of first appearance."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        host, colon, count = line.rpartition(":") if ":" in line else (line, "", "")
        if not colon:
            host = line
        if not host or any(c.isspace() for c in host):
            raise DiscoveryError(f"line {number} {raw!r}: give `host` or `host:slots`")
        if colon:
            if not count.isdigit() or int(count) < 0:
                raise DiscoveryError(f"line {number} {raw!r}: slots must be a whole number >= 0")
            slots = int(count)
        else:
            slots = 1 if default_slots is None else default_slots
        hosts[host] = slots
    return list(hosts.items())


class Blacklist:
    """Hosts whose workers failed, each until its cooldown ends (for ever without a cooldown range)."""

    def __init__(self, cooldown_range: tuple[int, int] | None = None,
                 uniform: Callable[[], float] = random.random) -> None:
        if cooldown_range is not None:
            low, high = cooldown_range
            if low < 1 or high < low:
                raise ValueError(f"--blacklist-cooldown-range {low} {high}: give 1 <= A <= B seconds")
        self.cooldown_range = cooldown_range
        self._uniform = uniform
        self._until: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def add(self, host: str, now: float) -> float:
        """Blacklist ``host`` from ``now``; the time its cooldown ends (inf without a range)."""
        if self.cooldown_range is None:
            self._until[host] = float("inf")
            return self._until[host]
        low, high = self.cooldown_range
        self._count[host] = self._count.get(host, 0) + 1
        delay = low * (1 << self._count[host]) + self._uniform() * low
        self._until[host] = now + max(low, min(high, delay))
        return self._until[host]

    def blocked(self, host: str, now: float) -> bool:
        """Whether ``host`` is blacklisted at ``now``."""
        return self._until.get(host, 0.0) > now

    def count(self, host: str) -> int:
        """How many times ``host`` was blacklisted."""
        return self._count.get(host, 1 if host in self._until else 0)


@dataclass(frozen=True)
class SlotInfo:
    """One worker's place in a world: Horovod's rank, size, local and cross ranks."""

    host: str
    slot: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    node: int = 0  # the host's index among the world's hosts, by first rank

    @property
    def key(self) -> WorkerKey:
        return (self.host, self.slot)

    def env(self) -> dict[str, str]:
        """The rank variables of this place (torchrun's and Horovod's names)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_size), "GROUP_RANK": str(self.node),
                "HOROVOD_RANK": str(self.rank), "HOROVOD_SIZE": str(self.size),
                "HOROVOD_LOCAL_RANK": str(self.local_rank), "HOROVOD_LOCAL_SIZE": str(self.local_size),
                "HOROVOD_CROSS_RANK": str(self.cross_rank), "HOROVOD_CROSS_SIZE": str(self.cross_size),
                "HOROVOD_HOSTNAME": self.host}


def assign(previous: Sequence[WorkerKey], hosts: Sequence[tuple[str, int]], max_np: int | None = None,
           host_order: Sequence[str] = ()) -> list[SlotInfo]:
    """The next world: surviving workers of ``previous`` (in rank order) first, then new slots.

    ``hosts`` are the usable hosts now with their slots; a previous worker survives when its host
    is still there with its slot. New slots follow host after host, in ``host_order`` (the order
    hosts were first discovered) and then ``hosts``' own order, up to ``max_np`` workers in all.
    """
    slots = dict(hosts)
    order = [h for h in dict.fromkeys([*host_order, *slots]) if h in slots]
    keys = [k for k in previous if k[0] in slots and k[1] < slots[k[0]]]
    taken = set(keys)
    for host in order:
        for slot in range(slots[host]):
            if (host, slot) not in taken:
                keys.append((host, slot))
                taken.add((host, slot))
    if max_np is not None:
        keys = keys[:max_np]
    size = len(keys)
    local: dict[str, list[int]] = {}
    for rank, (host, _) in enumerate(keys):
        local.setdefault(host, []).append(rank)
    host_index = {h: i for i, h in enumerate(local)}  # hosts by their first rank
    out = []
    for rank, (host, slot) in enumerate(keys):
        local_rank = local[host].index(rank)
        # cross rank: this host's index among the hosts holding this local rank (Horovod's rule)
        holders = [h for h in local if len(local[h]) > local_rank]
        out.append(SlotInfo(host, slot, rank, size, local_rank, len(local[host]),
                            holders.index(host), len(holders), host_index[host]))
    return out
