"""free_port never hands one process the same port twice, though the kernel may offer it again."""

from __future__ import annotations

import socket

from tidegate import ports


def test_consecutive_ports_differ_even_when_the_kernel_offers_the_same_one(monkeypatch) -> None:
    offered = iter([41000, 41000, 41000, 41001])  # the kernel's picks, as it repeated one in CI

    class FixedPortSocket(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(ports.socket, "socket", FixedPortSocket)
    monkeypatch.setattr(ports, "_handed_out", set())
    assert [ports.free_port(), ports.free_port()] == [41000, 41001]


def test_a_port_handed_out_is_free_to_bind() -> None:
    port = ports.free_port()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
    assert port not in {ports.free_port() for _ in range(50)}
