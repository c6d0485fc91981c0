"""Opening listening sockets, for the traffic listeners and the admin endpoint."""

from __future__ import annotations

import socket

import trio

__all__ = ["open_datagram_sockets", "open_listening_sockets"]


async def open_listening_sockets(
    host: str, port: int, *, reuse_port: bool, backlog: int
) -> list[trio.socket.SocketType]:
    """Bind and listen on every address *host* resolves to (once for port 0).

    ``SO_REUSEPORT`` lets ``edge.workers`` processes share the port; IPv6
    sockets are v6-only so ``0.0.0.0`` and ``::`` can be bound side by side.

    Raises:
        OSError: the host does not resolve or an address cannot be bound; no
            socket is left open then.  Its ``strerror`` says which, with the
            host or the address (``cannot bind 127.0.0.1:8443: Address already
            in use``).
    """
    sockets = await _bind_all(host, port, socket.SOCK_STREAM, reuse_port=reuse_port)
    try:
        for sock in sockets:
            sock.listen(backlog)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def open_datagram_sockets(
    host: str, port: int, *, reuse_port: bool
) -> list[trio.socket.SocketType]:
    """Bind a UDP socket on every address *host* resolves to (once for port 0).

    As `open_listening_sockets`, but without ``SO_REUSEADDR``: on a UDP socket
    it would let a second process bind the same port and silently take part of
    its datagrams. With ``SO_REUSEPORT`` (several workers) the kernel keeps the
    datagrams of one client address on one worker (it hashes the addresses).

    Raises:
        OSError: as `open_listening_sockets`.
    """
    return await _bind_all(host, port, socket.SOCK_DGRAM, reuse_port=reuse_port)


async def _bind_all(
    host: str, port: int, kind: socket.SocketKind, *, reuse_port: bool
) -> list[trio.socket.SocketType]:
    try:
        infos = await trio.socket.getaddrinfo(
            host, port, type=kind, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise OSError(
            exc.errno, f"host {host!r} does not resolve: {exc.strerror}"
        ) from exc
    sockets: list[trio.socket.SocketType] = []
    seen: set[tuple[object, ...]] = set()
    try:
        for family, type_, proto, _, sockaddr in infos:
            if sockaddr in seen or (port == 0 and sockets):
                continue
            seen.add(sockaddr)
            sock = trio.socket.socket(family, type_, proto)
            sockets.append(sock)
            if kind == socket.SOCK_STREAM:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                await sock.bind(sockaddr)
            except OSError as exc:
                ip = str(sockaddr[0])
                shown = f"[{ip}]" if family == socket.AF_INET6 else ip
                raise OSError(
                    exc.errno, f"cannot bind {shown}:{port}: {exc.strerror}"
                ) from exc
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets
