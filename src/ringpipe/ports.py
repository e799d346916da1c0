"""Choosing a free TCP port for a job's rendezvous, so that nothing else takes it before rank 0 listens.

A port found free by binding port 0 comes from the kernel's ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default), which is also where every outgoing
connection on the machine gets its local port. Between the choice and the moment rank 0 (or the
launcher's agent) listens on it, any connection may take it, and rank 0 then fails with
``EADDRINUSE`` — seen on a busy machine running several jobs. :func:`free_port` therefore picks,
at random, a port below that range that is free now; only another job choosing the same port in
the same instant could take it. Where no such range exists, it falls back to the kernel's choice.

Imports nothing heavy: the launcher uses it before torch is loaded.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "ephemeral_range"]

#: The lowest port chosen (above the registered ports services commonly listen on).
LOWEST = 20000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "") -> int:
    """A TCP port free right now on ``host``, outside the range outgoing connections take theirs from."""
    low, _ = ephemeral_range()
    if low - LOWEST >= 1000:
        rng = random.Random()  # not the program's random state: seeded programs must not collide
        for _ in range(64):
            port = rng.randrange(LOWEST, low)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
