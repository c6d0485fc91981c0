"""``proxyproto send HOST:PORT``: one connection behind a PROXY header.

curl sends v1 only (``--haproxy-protocol``); this sends a v1 or v2 header
built from the ``encode`` options (by default naming the connection's own
endpoints, as curl does), optionally starts TLS after it (as behind a load
balancer passing TLS through), sends the request bytes, and copies the answer
to *out* until the server closes or stays silent for ``wait`` seconds.
Blocking sockets, a timeout on every step; stdlib only.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from typing import BinaryIO, Literal

from proxyproto._client import HeaderPlan
from proxyproto._exchange import GONE
from proxyproto._tls_client import TLSClient

__all__ = ["SendConfig", "SendError", "SendResult", "send"]

_CHUNK = 65536
Ending = Literal["closed", "reset", "silent"]


@dataclass(frozen=True, slots=True)
class SendConfig:
    """Where to connect and what to send.

    Attributes:
        tls: a client context to start TLS with after the header (None:
            plain).
        server_name: SNI and the name checked against the certificate.
        wait: the answer is over after this many seconds without a byte.
    """

    host: str
    port: int
    plan: HeaderPlan
    request: bytes
    tls: ssl.SSLContext | None = None
    server_name: str | None = None
    connect_timeout: float = 5.0
    wait: float = 2.0


@dataclass(frozen=True, slots=True)
class SendResult:
    """What happened: the header sent, how many bytes came back, and how
    the answer ended (the server closed or reset the connection, or went
    silent for ``wait`` seconds)."""

    header: bytes
    received: int
    ending: Ending
    tls_version: str | None = None


class SendError(Exception):
    """No connection, a failed send or TLS handshake: one line for stderr."""


def _copy_answer(
    sock: socket.socket, stream: socket.socket | TLSClient, out: BinaryIO, wait: float
) -> tuple[int, Ending]:
    received = 0
    sock.settimeout(wait)
    while True:
        try:
            chunk = stream.recv(_CHUNK)
        except TimeoutError:
            return received, "silent"
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            return received, "closed"
        except OSError as exc:
            if exc.errno in GONE:
                return received, "reset"
            raise SendError(f"receive: {exc}") from exc
        if not chunk:
            return received, "closed"
        out.write(chunk)
        out.flush()
        received += len(chunk)


def send(config: SendConfig, out: BinaryIO) -> SendResult:
    """Connect, send the header, [TLS,] the request; copy the answer to *out*.

    Raises:
        SendError: the connection, a send, or the TLS handshake failed.
        proxyproto.LocalProtocolError: the header cannot be built for this
            connection.
    """
    try:
        sock = socket.create_connection(
            (config.host, config.port), timeout=config.connect_timeout
        )
    except OSError as exc:
        raise SendError(f"connect to {config.host}:{config.port}: {exc}") from exc
    with sock:
        header = config.plan.wire(sock.getsockname(), sock.getpeername())
        try:
            sock.sendall(header)
        except OSError as exc:
            raise SendError(f"send the header: {exc}") from exc
        stream: socket.socket | TLSClient = sock
        version = None
        if config.tls is not None:
            stream = TLSClient(sock, config.tls, config.server_name)
            try:
                version = stream.handshake()
            except OSError as exc:
                raise SendError(f"TLS handshake after the header: {exc}") from exc
        try:
            stream.sendall(config.request)
        except OSError as exc:
            if exc.errno not in GONE:
                raise SendError(f"send the request: {exc}") from exc
        received, ending = _copy_answer(sock, stream, out, config.wait)
    return SendResult(header, received, ending, version)
