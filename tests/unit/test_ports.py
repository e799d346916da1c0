"""A rendezvous port is chosen free and outside the range outgoing connections take their local ports from."""

import socket

from ringpipe import ports


def test_the_port_is_free_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port("127.0.0.1")
        assert ports.LOWEST <= port < low
        with socket.socket() as s:  # free: it can be listened on
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_port_in_use_is_never_chosen(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        used = taken.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST", used)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (used + 1001, 60999))
        # every candidate but one is free; the taken one must never come back
        assert all(ports.free_port("127.0.0.1") != used for _ in range(200))


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST + 10, 60999))
    port = ports.free_port("127.0.0.1")
    assert 0 < port < 65536
