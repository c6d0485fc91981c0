"""Connections and edges ended at every stage of their life, over real
loopback sockets.

Theory of operation
-------------------
`test_a_connection_ended_at_each_stage` is a table: each `Stage` drives one
client connection to a point of its life (a PROXY header half read, a TLS
handshake half done, an upstream connect in progress, a relay half closed,
an HTTP body or response half sent, an upgraded relay, an idle keep-alive,
...), then an *ending* ends it: the edge cancelled from outside, stopped,
or drained until its deadline (all three cut the connection: the `Stage`'s
``cut`` lines), a backend that closes or a client that resets at the moment
the edge is cancelled (either cause may win the race), a graceful drain or a
reload that removes the listener and its backend while the connection
completes what it was doing (its ``completed`` lines, and what its client
receives last). Every case checks that nothing was logged at ERROR, that
nothing hangs (each wait is bounded), that the edge's metrics agree with its
access log (`assert_metrics_agree`: each line moved its counters by exactly
one, its bytes by its byte fields, and every gauge is back to 0) and, through
the suite's leak check (tests/conftest.py), that no descriptor was left open.
`test_the_metrics_agree_after_each_plain_path` is the same check after
traffic that ends by itself (served, refused, timed out), while the edge
runs on and after its drain; tests/tlsedge/control/test_worker_metrics.py
makes it with ``workers = 2``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trustme

from proxyproto import ProxyHeader, encode_v1
from tests.test_faults import blackhole, closed_port
from tests.tlsedge.helpers import (
    access_records,
    address_of,
    close_clients,
    connect,
    make_config,
    wait_until,
)
from tests.tlsedge.pipeline.http.test_h2 import RawH2
from tests.tlsedge.pipeline.test_udp import (
    Client as UdpClient,
    servers as udp_servers,
    udp_config,
)
from tlsedge._backends.upstream import BackendPool
from tlsedge._control.edge import Edge
from tlsedge._core.metrics import REFUSED_TERMINATIONS
from tlsedge._reactor.relay import set_abortive_close
from tlsedge._tls.stream import TLSStream


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


@dataclass(frozen=True)
class Certificate:
    """The edge's certificate files and a client context trusting them."""

    cert: str
    key: str
    client: ssl.SSLContext


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    ca = trustme.CA()
    leaf = ca.issue_cert("edge.test")
    folder = tmp_path_factory.mktemp("lifecycle")
    leaf.private_key_and_cert_chain_pem.write_to_path(str(folder / "site.pem"))
    leaf.private_key_pem.write_to_path(str(folder / "site.key"))
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return Certificate(str(folder / "site.pem"), str(folder / "site.key"), client)


# -- the metrics agree with the access log --------------------------------------------

#: The counters checked against the access log, and the labels compared.
COUNTERS = {
    "tlsedge_connections_total": ("listener",),
    "tlsedge_connections_closed_total": ("listener", "termination"),
    "tlsedge_connections_refused_total": ("listener", "reason"),
    "tlsedge_connection_duration_seconds_count": ("listener",),
    "tlsedge_client_bytes_received_total": ("listener",),
    "tlsedge_client_bytes_sent_total": ("listener",),
    "tlsedge_server_bytes_sent_total": ("backend", "server"),
    "tlsedge_server_bytes_received_total": ("backend", "server"),
    "tlsedge_http_requests_total": ("listener", "code"),
    "tlsedge_http_request_duration_seconds_count": ("listener",),
    "tlsedge_server_http_requests_total": ("server", "code"),
    "tlsedge_tls_handshakes_total": ("listener", "version"),
    "tlsedge_tls_handshake_failures_total": ("listener",),
    "tlsedge_backend_connect_failures_total": ("backend",),
    "tlsedge_backend_no_server_total": ("backend",),
}
#: The terminations of a failed TLS handshake with the client.
TLS_FAILURES = frozenset({"tls_error", "tls_handshake_timeout"})
#: The gauges that are back to 0 once every connection ended.
GAUGES = frozenset({"tlsedge_connections_active", "tlsedge_server_active_connections"})

Sample = tuple[str, dict[str, str], float]
Series = tuple[str, tuple[str, ...]]


def expected_counts(records: Iterable[dict[str, Any]]) -> dict[Series, int]:
    """What `COUNTERS` say after the access-log *records*: a connection line
    counts one accepted and one closed connection with its termination (one
    refused with it as the reason, if it refuses) and its duration, its
    bytes, its TLS
    handshake (done, or failed), and a connect failure or no server (with
    no server to name); a request line with a status counts one request of
    its status class and its duration."""
    counts: collections.Counter[Series] = collections.Counter()
    for record in records:
        if record.get("type") == "http":
            status = record["status"]
            if status is not None:
                code = f"{status // 100}xx"
                listener = record["listener"]
                counts["tlsedge_http_requests_total", (listener, code)] += 1
                counts["tlsedge_http_request_duration_seconds_count", (listener,)] += 1
                if record["server"] is not None:
                    server = (record["server"], code)
                    counts["tlsedge_server_http_requests_total", server] += 1
            continue
        listener, termination = record["listener"], record["termination"]
        counts["tlsedge_connections_total", (listener,)] += 1
        counts["tlsedge_connections_closed_total", (listener, termination)] += 1
        counts["tlsedge_connection_duration_seconds_count", (listener,)] += 1
        if termination in REFUSED_TERMINATIONS:
            counts["tlsedge_connections_refused_total", (listener, termination)] += 1
        received, sent = record["bytes_from_client"], record["bytes_from_server"]
        counts["tlsedge_client_bytes_received_total", (listener,)] += received
        counts["tlsedge_client_bytes_sent_total", (listener,)] += sent
        if record["tls"] is not None:
            version = record["tls"].split(" ", 1)[0]
            counts["tlsedge_tls_handshakes_total", (listener, version)] += 1
        elif termination in TLS_FAILURES:
            counts["tlsedge_tls_handshake_failures_total", (listener,)] += 1
        if record["server"] is not None:
            server = (record["backend"], record["server"])
            counts["tlsedge_server_bytes_sent_total", server] += received
            counts["tlsedge_server_bytes_received_total", server] += sent
        elif termination == "connect_failed":
            counts["tlsedge_backend_connect_failures_total", (record["backend"],)] += 1
        elif termination == "no_server":
            counts["tlsedge_backend_no_server_total", (record["backend"],)] += 1
    return {series: count for series, count in counts.items() if count}


def assert_metrics_agree(
    samples: Iterable[Sample], records: Iterable[dict[str, Any]]
) -> None:
    """The counters of *samples* (``EdgeMetrics.samples()``, or a parsed
    ``/metrics``) are what the access-log *records* say, and every gauge of
    `GAUGES` is 0."""
    counts: collections.Counter[Series] = collections.Counter()
    gauges: dict[Series, float] = {}
    for name, labels, value in samples:
        if name in COUNTERS:
            counts[name, tuple(labels[label] for label in COUNTERS[name])] += int(value)
        elif name in GAUGES and value:
            gauges[name, tuple(labels.values())] = value
    assert {series: count for series, count in counts.items() if count} == (
        expected_counts(records)
    )
    assert gauges == {}


# -- the backend -----------------------------------------------------------------------


class ScriptedBackend:
    """A TCP server whose connections do what the stage needs.

    ``echo``: every byte back; after the client's EOF its side stays open
    until `release`, then it sends ``bye`` and closes. ``http``: requests one
    at a time; ``/hold`` is answered ``held`` after `release`, ``/half``
    gets half its body, the rest after `release`; ``/upgrade`` becomes an
    echo after a 101; ``/upload`` is answered once its body is in; anything
    else ``ok``. ``silent``: reads, never answers (a TLS server that never
    finishes its handshake).

    ``reached`` counts the connections (or requests) that got to the point
    the stage waits for; `end` closes (or resets) every connection at once.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.port = 0
        self.streams: set[trio.SocketStream] = set()
        self.reached = 0
        self.released = trio.Event()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, nursery: trio.Nursery) -> None:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, self._handle, 0, host="127.0.0.1")
        )
        self.port = int(listeners[0].socket.getsockname()[1])

    def release(self) -> None:
        self.released.set()

    def end(self, *, reset: bool) -> None:
        """Close every connection now (with an RST if *reset*)."""
        for stream in list(self.streams):
            if reset:
                set_abortive_close(stream)
            stream.socket.close()
        self.streams.clear()

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.streams.add(stream)
        try:
            if self.mode == "echo":
                await self._echo(stream)
            elif self.mode == "silent":
                self.reached += 1
                await trio.sleep_forever()
            else:
                await self._http(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.streams.discard(stream)
            await trio.aclose_forcefully(stream)

    async def _echo(self, stream: trio.SocketStream) -> None:
        self.reached += 1
        while data := await stream.receive_some(65536):
            await stream.send_all(data)
        await self.released.wait()
        await stream.send_all(b"bye")

    async def _http(self, stream: trio.SocketStream) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                buffer += chunk
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            target = head.split(b" ", 2)[1]
            if target == b"/upgrade":
                await stream.send_all(
                    b"HTTP/1.1 101 Switching Protocols\r\n"
                    b"Connection: upgrade\r\nUpgrade: test\r\n\r\n" + buffer
                )
                await self._echo(stream)
                return
            if target == b"/upload":
                self.reached += 1
                while len(buffer) < UPLOAD_SIZE:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                buffer = buffer[UPLOAD_SIZE:]
                answer = b"uploaded"
            elif target == b"/half":
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n0123456789"
                )
                self.reached += 1
                await self.released.wait()
                await stream.send_all(b"abcdefghij")
                continue
            elif target == b"/hold":
                self.reached += 1
                await self.released.wait()
                answer = b"held"
            else:
                answer = b"ok"
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(answer) + answer
            )


UPLOAD_SIZE = 20


# -- the client and the edge -----------------------------------------------------------


@dataclass
class Client:
    """A client connection: ``stream`` is what it speaks over (its TCP
    stream, or TLS over it), ``tcp`` the TCP stream; ``received`` is
    everything it read."""

    tcp: trio.SocketStream
    stream: trio.abc.HalfCloseableStream
    received: bytes = b""
    eof_sent: bool = False

    async def send_eof(self) -> None:
        if not self.eof_sent:
            self.eof_sent = True
            await self.stream.send_eof()

    async def receive_until(self, end: bytes) -> None:
        """Read until what was received ends with *end*."""
        while not self.received.endswith(end):
            chunk = await self.stream.receive_some(65536)
            assert chunk, f"EOF after {self.received!r}"
            self.received += chunk

    async def read_to_end(self) -> None:
        """Read until EOF (a reset or a closed stream count as the end)."""
        with contextlib.suppress(
            trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError
        ):
            while chunk := await self.stream.receive_some(65536):
                self.received += chunk

    def reset(self) -> None:
        """Close with an RST, now."""
        set_abortive_close(self.tcp)
        self.tcp.socket.close()


@dataclass
class World:
    """An edge (listener ``in`` to backend ``b``), its backend, and the
    cancel scope of its ``run()``."""

    edge: Edge
    backend: ScriptedBackend
    certificate: Certificate
    scope: trio.CancelScope
    stage: Stage | None

    @property
    def listener(self) -> Any:
        return self.edge.config.listeners[0]

    async def open(self, *, tls: bool | None = None) -> Client:
        """A client connection, over TLS when the listener has it (or *tls*
        says so), after a PROXY header when the listener wants one."""
        tcp = await connect(address_of(self.edge, "in"))
        if self.listener.proxy_protocol is not None:
            await tcp.send_all(HEADER)
        if not (self.listener.tls is not None if tls is None else tls):
            return Client(tcp, tcp)
        stream = TLSStream(
            tcp, self.certificate.client, server_side=False, server_hostname="edge.test"
        )
        await stream.do_handshake()
        return Client(tcp, stream)

    def connecting(self) -> bool:
        """An upstream connect runs (in a task of the connections nursery)."""
        nursery = self.edge._connections
        return nursery is not None and bool(nursery.child_tasks)

    def bytes_from_clients(self) -> int:
        """What the edge's HTTP connections read from their clients so far."""
        return sum(
            running.result.bytes_from_client
            for running in self.edge._pipeline.in_flight
            if hasattr(running, "result")
        )


HEADER = encode_v1(
    ProxyHeader.from_addresses(("192.0.2.1", 1234), ("192.0.2.2", 80), version=1)
)
REQUEST = b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


# -- the stages: getting there (drive) and completing (finish) -------------------------


async def _header_half_read(world: World) -> Client:
    client = await connect(address_of(world.edge, "in"))
    await client.send_all(HEADER[:10])
    await wait_until(lambda: len(world.edge._pipeline.in_flight) == 1)
    return Client(client, client)


async def _finish_header(world: World, client: Client) -> bytes:
    await client.stream.send_all(HEADER[10:] + b"ping")
    await client.send_eof()
    world.backend.release()
    return b"pingbye"


async def _handshake_half_done(world: World) -> Client:
    client = await world.open(tls=False)
    await client.stream.send_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
    await wait_until(lambda: len(world.edge._pipeline.in_flight) == 1)
    return client


async def _connecting(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(REQUEST if world.listener.mode == "http" else b"x")
    await wait_until(world.connecting)
    return client


async def _upstream_handshake(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(REQUEST if world.listener.mode == "http" else b"x")
    await wait_until(lambda: world.backend.reached == 1)
    return client


async def _relay_half_closed(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(b"ping")
    await client.receive_until(b"ping")
    await client.send_eof()
    return client


async def _finish_relay(world: World, client: Client) -> bytes:
    await client.send_eof()
    world.backend.release()
    return b"bye"


async def _http_idle(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(REQUEST)
    await client.receive_until(OK)
    return client


async def _finish_nothing(world: World, client: Client) -> bytes:
    return b""


async def _http_head_half_sent(world: World) -> Client:
    client = await _http_idle(world)
    await client.stream.send_all(REQUEST[:20])
    await wait_until(lambda: world.bytes_from_clients() == len(REQUEST) + 20)
    return client


async def _finish_head(world: World, client: Client) -> bytes:
    await client.stream.send_all(REQUEST[20:])
    return b"ok"


async def _http_waiting(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(b"GET /hold HTTP/1.1\r\nHost: h\r\n\r\n")
    await wait_until(lambda: world.backend.reached == 1)
    return client


async def _finish_held(world: World, client: Client) -> bytes:
    world.backend.release()
    return b"held"


async def _http_body_half_sent(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(
        b"POST /upload HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % UPLOAD_SIZE
        + b"0123456789"
    )
    await wait_until(lambda: world.backend.reached == 1)
    return client


async def _finish_body(world: World, client: Client) -> bytes:
    await client.stream.send_all(b"abcdefghij")
    return b"uploaded"


async def _http_response_half_sent(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(b"GET /half HTTP/1.1\r\nHost: h\r\n\r\n")
    await client.receive_until(b"0123456789")
    return client


async def _finish_half(world: World, client: Client) -> bytes:
    world.backend.release()
    return b"abcdefghij"


async def _http_upgraded(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(
        b"GET /upgrade HTTP/1.1\r\nHost: h\r\nConnection: upgrade\r\n"
        b"Upgrade: test\r\n\r\nping"
    )
    await client.receive_until(b"ping")
    return client


async def _h2c_preface_half_read(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(b"PRI * HTTP/2.0\r\n")
    await wait_until(world.connecting)  # the sniff's task
    return client


async def _denied_lingering(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(REQUEST)
    await client.receive_until(b"Forbidden\n")
    return client


async def _bad_request_lingering(world: World) -> Client:
    client = await world.open()
    await client.stream.send_all(
        b"GET / HTTP/1.1\r\nHost: h\r\nContent-Length: x\r\n\r\n"
    )
    await client.receive_until(b"\n")
    return client


async def _finish_eof(world: World, client: Client) -> bytes:
    await client.send_eof()
    return b""


# What an access-log record says: the connection's termination, then each
# request's, in order.
Lines = tuple[str, tuple[str, ...]]

DRAINED: Lines = ("drained", ())


@dataclass(frozen=True)
class Stage:
    name: str
    drive: Callable[[World], Awaitable[Client]]
    #: The lines when the edge cuts the connection (cancelled, stopped, the
    #: drain deadline).
    cut: Lines
    #: Completes what the connection was doing and says what its client
    #: then receives last (None: it cannot complete, e.g. a connect that
    #: never ends), and the lines then.
    finish: Callable[[World, Client], Awaitable[bytes]] | None = None
    completed: Lines = DRAINED
    listener: dict[str, Any] = field(default_factory=dict)
    backend: str = "echo"
    #: The backend's server never answers the SYN.
    blackhole: bool = False

    def __str__(self) -> str:
        return self.name


TRUSTED = {"proxy_protocol": {"trusted": ["127.0.0.1/32"]}}
TLS = {"tls": True}
HTTP = {"mode": "http"}
UPSTREAM_TLS = {"protocol": "tls"}

STAGES = [
    Stage(
        "proxy-header-half-read",
        _header_half_read,
        DRAINED,
        _finish_header,
        ("client_closed", ()),
        TRUSTED,
    ),
    Stage("tls-handshake-half-done", _handshake_half_done, DRAINED, listener=TLS),
    Stage("tcp-connecting", _connecting, DRAINED, listener=TRUSTED, blackhole=True),
    Stage(
        "tcp-relay-half-closed",
        _relay_half_closed,
        DRAINED,
        _finish_relay,
        ("client_closed", ()),
    ),
    Stage(
        "tls-relay-half-closed",
        _relay_half_closed,
        DRAINED,
        _finish_relay,
        ("client_closed", ()),
        TLS,
    ),
    Stage(
        "http-keepalive-idle",
        _http_idle,
        ("drained", ("ok",)),
        _finish_nothing,
        ("drained", ("ok",)),
        HTTP,
        "http",
    ),
    Stage(
        "http-head-half-sent",
        _http_head_half_sent,
        ("drained", ("ok",)),
        _finish_head,
        ("drained", ("ok", "ok")),
        HTTP,
        "http",
    ),
    Stage(
        "http-connecting",
        _connecting,
        ("drained", ("drained",)),
        listener=HTTP,
        backend="http",
        blackhole=True,
    ),
    Stage(
        "https-waiting",
        _http_waiting,
        ("drained", ("drained",)),
        _finish_held,
        ("drained", ("ok",)),
        {**HTTP, **TLS},
        "http",
    ),
    Stage(
        "http-body-half-sent",
        _http_body_half_sent,
        ("drained", ("drained",)),
        _finish_body,
        ("drained", ("ok",)),
        HTTP,
        "http",
    ),
    Stage(
        "http-response-half-sent",
        _http_response_half_sent,
        ("drained", ("drained",)),
        _finish_half,
        ("drained", ("ok",)),
        {**HTTP, **TRUSTED},
        "http",
    ),
    Stage(
        "http-upgraded",
        _http_upgraded,
        ("upgraded:drained", ("upgraded:drained",)),
        _finish_relay,
        ("upgraded:client_closed", ("upgraded:client_closed",)),
        HTTP,
        "http",
    ),
    Stage(
        "h2c-preface-half-read",
        _h2c_preface_half_read,
        DRAINED,
        listener={**HTTP, "http2": {"cleartext": "prior-knowledge"}},
        backend="http",
    ),
    Stage(
        "http-denied-403-lingering",
        _denied_lingering,
        ("denied", ()),
        _finish_eof,
        ("denied", ()),
        {**HTTP, "allow": ["192.0.2.0/24"], "denied": "403"},
        "http",
    ),
    Stage(
        "http-400-lingering",
        _bad_request_lingering,
        ("bad_request", ("bad_request",)),
        _finish_eof,
        ("bad_request", ("bad_request",)),
        HTTP,
        "http",
    ),
    Stage(
        "upstream-tls-handshake",
        _upstream_handshake,
        ("drained", ("drained",)),
        listener=HTTP,
        backend="silent",
    ),
]


# -- the endings -----------------------------------------------------------------------


async def _cancel(world: World, client: Client) -> None:
    world.scope.cancel()


async def _stop(world: World, client: Client) -> None:
    world.edge.stop()


async def _drain_deadline(world: World, client: Client) -> None:
    world.edge.drain()


async def _cancel_as_the_backend_closes(world: World, client: Client) -> None:
    world.backend.end(reset=False)
    world.scope.cancel()


async def _cancel_as_the_client_resets(world: World, client: Client) -> None:
    client.reset()
    world.scope.cancel()


async def _drain_while_it_completes(world: World, client: Client) -> None:
    world.edge.drain()
    await _complete(world, client)


async def _reload_without_it_while_it_completes(world: World, client: Client) -> None:
    """A reload removes the connection's listener and backend (their
    replacements go to the same server); the connection carries on."""
    server = str(world.edge.config.backends[0].servers[0].address)
    await world.edge.reload(
        make_config(
            [{"name": "other", "backend": "other", "mode": world.listener.mode}],
            [{"name": "other", "servers": [server]}],
            {"drain_timeout": DRAIN_TIMEOUT},
        )
    )
    await _complete(world, client)
    world.edge.drain()


async def _complete(world: World, client: Client) -> None:
    assert world.stage is not None
    finish = world.stage.finish
    assert finish is not None
    await client.receive_until(await finish(world, client))


Ending = Callable[[World, Client], Awaitable[None]]

#: The endings that cut the connection: its lines are the stage's ``cut``.
CUTS: dict[str, Ending] = {
    "cancelled": _cancel,
    "stopped": _stop,
    "drain-deadline": _drain_deadline,
}
#: The endings racing another cause: either may be logged.
RACES: dict[str, tuple[Ending, frozenset[str]]] = {
    "cancelled-as-the-backend-closes": (
        _cancel_as_the_backend_closes,
        frozenset({"client_closed", "server_closed", "server_error", "server_aborted"}),
    ),
    "cancelled-as-the-client-resets": (
        _cancel_as_the_client_resets,
        # (A reset in the TLS handshake is a tls_error, test_tls_edge.)
        frozenset({"client_error", "client_closed", "tls_error"}),
    ),
}
#: The endings that let the connection complete: the stage's ``completed``.
COMPLETIONS: dict[str, Ending] = {
    "drain": _drain_while_it_completes,
    "reload-without-it": _reload_without_it_while_it_completes,
}
ENDINGS = [*CUTS, *RACES, *COMPLETIONS]
DRAIN_TIMEOUT = 0.3


@contextlib.contextmanager
def _server(blackholed: bool, backend: ScriptedBackend) -> Iterator[str]:
    """The address of the backend's server (one that never answers)."""
    if blackholed:
        with blackhole() as address:
            yield address
    else:
        yield backend.address


def _listener(settings: dict[str, Any], certificate: Certificate) -> dict[str, Any]:
    listener = dict(settings)
    if tls := listener.pop("tls", False):
        listener["tls"] = {
            "certificates": [{"cert": certificate.cert, "key": certificate.key}],
            **(tls if isinstance(tls, dict) else {}),
        }
    return listener


@contextlib.asynccontextmanager
async def _running(
    listener: dict[str, Any],
    backend_mode: str,
    certificate: Certificate,
    *,
    stage: Stage | None = None,
    blackholed: bool = False,
    server: str | None = None,
) -> AsyncIterator[tuple[World, trio.Event]]:
    """An edge serving *listener* with a `ScriptedBackend` in
    *backend_mode* (or the blackholed server, or *server*), and the event
    set once its ``run()`` returned."""
    backend = ScriptedBackend(backend_mode)
    async with trio.open_nursery() as nursery:
        await backend.start(nursery)
        with _server(blackholed, backend) as address:
            config = make_config(
                [{"name": "in", "backend": "b", **_listener(listener, certificate)}],
                [
                    {
                        "name": "b",
                        "servers": [server or address],
                        "connect_timeout": 30.0,
                        **(UPSTREAM_TLS if backend_mode == "silent" else {}),
                    }
                ],
                {"drain_timeout": DRAIN_TIMEOUT},
            )
            edge = Edge(config)
            returned = trio.Event()

            async def run(*, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    await edge.run()
                returned.set()

            scope = await nursery.start(run)
            await wait_until(lambda: edge.ready)
            yield World(edge, backend, certificate, scope, stage), returned
        nursery.cancel_scope.cancel()


async def _end_at(
    stage: Stage,
    ending: Ending,
    certificate: Certificate,
    caplog: pytest.LogCaptureFixture,
) -> Lines:
    """Drive a connection to *stage*, end it with *ending*; its access-log
    lines (once ``run()`` returned)."""
    async with _running(
        stage.listener,
        stage.backend,
        certificate,
        stage=stage,
        blackholed=stage.blackhole,
    ) as (world, returned):
        client = await stage.drive(world)
        world.edge.metrics.flush()  # a scrape: counts the bytes so far
        with trio.fail_after(10):
            await ending(world, client)
            await returned.wait()
            await client.read_to_end()
        await trio.aclose_forcefully(client.stream)
    records = access_records(caplog)
    assert_metrics_agree(world.edge.metrics.samples(), records)
    (connection,) = [r for r in records if "type" not in r]
    requests = tuple(r["termination"] for r in records if r.get("type") == "http")
    return connection["termination"], requests


def _cases() -> Iterator[Any]:
    for stage in STAGES:
        for ending in ENDINGS:
            if ending not in COMPLETIONS or stage.finish is not None:
                yield pytest.param(stage, ending, id=f"{stage}-{ending}")


@pytest.mark.parametrize(("stage", "ending"), list(_cases()))
async def test_a_connection_ended_at_each_stage(
    stage: Stage,
    ending: str,
    certificate: Certificate,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if ending in CUTS:
        lines = await _end_at(stage, CUTS[ending], certificate, caplog)
        assert lines == stage.cut
    elif ending in RACES:
        race, causes = RACES[ending]
        lines = await _end_at(stage, race, certificate, caplog)
        # The edge's cut, or the peer's cause if the reactor saw it first.
        (connection, requests), (cut, cut_requests) = lines, stage.cut
        assert len(requests) == len(cut_requests)
        for seen, expected in zip(
            (connection, *requests), (cut, *cut_requests), strict=True
        ):
            assert seen == expected or seen.removeprefix("upgraded:") in causes
    else:
        lines = await _end_at(stage, COMPLETIONS[ending], certificate, caplog)
        assert lines == stage.completed
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# -- the plain paths, refusals included -----------------------------------------------


async def _echo_through(world: World) -> None:
    world.backend.release()
    client = await world.open()
    await client.stream.send_all(b"ping")
    await client.send_eof()
    await client.receive_until(b"pingbye")
    await client.read_to_end()
    await trio.aclose_forcefully(client.stream)


async def _refused_after(world: World, data: bytes) -> None:
    client = await connect(address_of(world.edge, "in"))
    with contextlib.suppress(trio.BrokenResourceError):
        await client.send_all(data)
    await Client(client, client).read_to_end()
    await client.aclose()


async def _refused(world: World) -> None:
    await _refused_after(world, b"ping")


async def _bad_header(world: World) -> None:
    await _refused_after(world, b"PROXY garbage\r\n")


async def _bad_handshake(world: World) -> None:
    await _refused_after(world, b"GET / HTTP/1.1\r\n\r\n")


async def _two_requests_then_close(world: World) -> None:
    client = await world.open()
    for answered in (1, 2):
        await client.stream.send_all(REQUEST)
        await client.receive_until(OK * answered)
    await client.send_eof()  # over TLS, a close_notify alone
    await client.read_to_end()
    await trio.aclose_forcefully(client.stream)


async def _one_request_then_close(world: World) -> None:
    client = await world.open()
    await client.stream.send_all(REQUEST)
    await client.send_eof()
    await client.read_to_end()
    await trio.aclose_forcefully(client.stream)


async def _upgrade_through(world: World) -> None:
    client = await _http_upgraded(world)
    await _finish_relay(world, client)
    await client.receive_until(b"bye")
    await client.read_to_end()
    await trio.aclose_forcefully(client.stream)


async def _h2c_two_streams(world: World) -> None:
    client = await RawH2.open(address_of(world.edge, "in")[1])
    streams = [client.request("/"), client.request("/")]
    await client.send()
    await client.until(lambda c: all(c.ended(s) for s in streams))
    assert [client.body(s) for s in streams] == [b"ok", b"ok"]
    await client.aclose()


async def _silent(world: World) -> None:
    """Connect, send nothing, read until the edge ends it."""
    await _refused_after(world, b"")


async def _echo_then_idle(world: World) -> None:
    client = await world.open()
    await client.stream.send_all(b"ping")
    await client.receive_until(b"ping")
    await client.read_to_end()
    await trio.aclose_forcefully(client.stream)


async def _request_then_idle(world: World) -> None:
    client = await world.open()
    await client.stream.send_all(REQUEST)
    await client.receive_until(OK)
    await client.read_to_end()
    await trio.aclose_forcefully(client.stream)


async def _held_past_the_response_timeout(world: World) -> None:
    client = await world.open()
    await client.stream.send_all(b"GET /hold HTTP/1.1\r\nHost: h\r\n\r\n")
    await client.read_to_end()
    assert client.received.startswith(b"HTTP/1.1 504 ")
    await trio.aclose_forcefully(client.stream)


async def _untrusted_header(world: World) -> None:
    await _refused_after(world, HEADER + b"ping")


@dataclass(frozen=True)
class PlainPath:
    """Traffic that ends by itself, then a graceful drain."""

    name: str
    traffic: Callable[[World], Awaitable[None]]
    #: The terminations of the access log's lines: the connections', then
    #: the requests' (each sorted).
    lines: tuple[tuple[str, ...], tuple[str, ...]]
    listener: dict[str, Any] = field(default_factory=dict)
    backend: str = "echo"
    #: The backend's server refuses connections.
    refusing: bool = False

    def __str__(self) -> str:
        return self.name


PATHS = [
    PlainPath("tcp", _echo_through, (("client_closed",), ())),
    PlainPath("tls", _echo_through, (("client_closed",), ()), TLS),
    PlainPath("proxy", _echo_through, (("client_closed",), ()), TRUSTED),
    PlainPath("proxy-header-error", _bad_header, (("header_error",), ()), TRUSTED),
    PlainPath("tls-error", _bad_handshake, (("tls_error",), ()), TLS),
    PlainPath("tcp-connect-failed", _refused, (("connect_failed",), ()), refusing=True),
    PlainPath(
        "tls-handshake-timeout",
        _silent,
        (("tls_handshake_timeout",), ()),
        {"tls": {"handshake_timeout": 0.2}},
    ),
    PlainPath(
        "tcp-idle-timeout",
        _echo_then_idle,
        (("idle_timeout",), ()),
        {"idle_timeout": 0.2},
    ),
    PlainPath(
        "http-keepalive-timeout",
        _request_then_idle,
        (("keepalive_timeout",), ("ok",)),
        {**HTTP, "http": {"keepalive_timeout": 0.2}},
        "http",
    ),
    PlainPath(
        "http-504",
        _held_past_the_response_timeout,
        (("response_timeout",), ("response_timeout",)),
        {**HTTP, "http": {"response_timeout": 0.2}},
        "http",
    ),
    PlainPath(
        "tcp-denied",
        _refused,
        (("denied",), ()),
        {"allow": ["192.0.2.0/24"]},
    ),
    PlainPath(
        "proxy-from-an-untrusted-peer",
        _untrusted_header,
        (("rejected",), ()),
        {"proxy_protocol": {"trusted": ["192.0.2.0/24"]}},
    ),
    PlainPath(
        "http-keepalive",
        _two_requests_then_close,
        (("client_closed",), ("ok", "ok")),
        HTTP,
        "http",
    ),
    PlainPath(
        "https",
        _two_requests_then_close,
        (("client_closed",), ("ok", "ok")),
        {**HTTP, **TLS},
        "http",
    ),
    PlainPath(
        "http-upgrade",
        _upgrade_through,
        (("upgraded:client_closed",), ("upgraded:client_closed",)),
        HTTP,
        "http",
    ),
    PlainPath(
        "h2c",
        _h2c_two_streams,
        (("client_closed",), ("ok", "ok")),
        {**HTTP, "http2": {"cleartext": "prior-knowledge"}},
        "http",
    ),
    PlainPath(
        "http-502",
        _one_request_then_close,
        (("connect_failed",), ("connect_failed",)),
        HTTP,
        "http",
        refusing=True,
    ),
]


@pytest.mark.parametrize("path", PATHS, ids=str)
async def test_the_metrics_agree_after_each_plain_path(
    path: PlainPath, certificate: Certificate, caplog: pytest.LogCaptureFixture
) -> None:
    refusing = closed_port()
    async with _running(
        path.listener,
        path.backend,
        certificate,
        server=refusing if path.refusing else None,
    ) as (world, returned):
        with trio.fail_after(10):
            await path.traffic(world)
            # Every connection ended: the gauges are back to 0 while the
            # edge runs on (its idle upstream connections pooled).
            await wait_until(lambda: world.edge._pipeline.active == 0)
            assert_metrics_agree(world.edge.metrics.samples(), access_records(caplog))
            world.edge.drain()
            await returned.wait()
    records = access_records(caplog)
    assert_metrics_agree(world.edge.metrics.samples(), records)
    connections = sorted(r["termination"] for r in records if "type" not in r)
    requests = sorted(r["termination"] for r in records if r.get("type") == "http")
    assert (tuple(connections), tuple(requests)) == path.lines
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# -- udp flows -------------------------------------------------------------------------


@pytest.mark.parametrize("ending", [*CUTS, "reload-without-it"])
async def test_a_udp_flow_ended_each_way(
    ending: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        udp_servers("a") as (server,),
        UdpClient() as client,
        trio.open_nursery() as nursery,
    ):
        config = udp_config(
            [server], {"idle_timeout": 60.0}, edge={"drain_timeout": DRAIN_TIMEOUT}
        )
        edge = Edge(config)
        scope = trio.CancelScope()
        returned = trio.Event()

        async def run() -> None:
            with scope:
                await edge.run()
            returned.set()

        nursery.start_soon(run)
        await wait_until(lambda: edge.ready)
        address = address_of(edge, "dns")
        assert await client.ask(address, b"1") == b"a|1"
        edge.metrics.flush()  # a scrape: counts the flow's bytes so far
        if ending == "cancelled":
            scope.cancel()
        elif ending == "stopped":
            edge.stop()
        elif ending == "drain-deadline":
            edge.drain()
        else:
            other = make_config(
                [{"name": "other", "mode": "udp", "backend": "other"}],
                [{"name": "other", "servers": [server.address]}],
                {"drain_timeout": DRAIN_TIMEOUT},
            )
            await edge.reload(other)
            assert await client.ask(address, b"2") == b"a|2"  # the flow goes on
            edge.drain()
        with trio.fail_after(10):
            await returned.wait()
    (record,) = access_records(caplog)
    assert record["termination"] == "drained"
    assert record["requests"] == (2 if ending == "reload-without-it" else 1)
    samples = list(edge.metrics.samples())
    assert_metrics_agree(samples, [record])
    datagrams = {
        labels["direction"]: value
        for name, labels, value in samples
        if name == "tlsedge_udp_datagrams_total"
    }
    answered = record["requests"]  # each datagram was answered once
    assert datagrams == {"from_client": answered, "from_server": answered}
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# -- http/2 streams --------------------------------------------------------------------


@pytest.mark.parametrize(
    "ending",
    [
        *CUTS,
        "reload-without-it",
        "cancelled-as-the-backend-closes",
        "cancelled-as-the-client-resets",
    ],
)
async def test_http2_streams_ended_each_way(
    ending: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Four streams on one h2c connection: two wait upstream, two connect
    to a server that never answers the SYN (round-robin over both). (test_h2
    has more of their drain, drain deadline and cancel.)"""
    backend = ScriptedBackend("http")
    async with trio.open_nursery() as nursery:
        await backend.start(nursery)
        with blackhole() as hole:
            config = make_config(
                [
                    {
                        "name": "in",
                        "backend": "b",
                        **HTTP,
                        "http2": {"cleartext": "prior-knowledge"},
                    }
                ],
                [
                    {
                        "name": "b",
                        "servers": [backend.address, hole],
                        "connect_timeout": 30.0,
                    }
                ],
                {"drain_timeout": DRAIN_TIMEOUT},
            )
            edge = Edge(config)
            scope = trio.CancelScope()
            returned = trio.Event()

            async def run() -> None:
                with scope:
                    await edge.run()
                returned.set()

            nursery.start_soon(run)
            await wait_until(lambda: edge.ready)
            client = await RawH2.open(address_of(edge, "in")[1])
            streams = [client.request("/hold") for _ in range(4)]
            await client.send()
            await wait_until(lambda: backend.reached == 2)
            edge.metrics.flush()  # a scrape: counts the bytes so far
            with trio.fail_after(10):
                if ending == "cancelled":
                    scope.cancel()
                elif ending == "stopped":
                    edge.stop()
                elif ending == "drain-deadline":
                    edge.drain()
                elif ending == "reload-without-it":
                    await edge.reload(
                        make_config(
                            [{"name": "other", "backend": "other", **HTTP}],
                            [{"name": "other", "servers": [backend.address]}],
                            {"drain_timeout": DRAIN_TIMEOUT},
                        )
                    )
                    backend.release()
                    await client.until(lambda c: sum(c.ended(s) for s in streams) == 2)
                    assert sorted(client.body(s) for s in streams) == [
                        b"",
                        b"",
                        b"held",
                        b"held",
                    ]
                    edge.drain()  # the connecting ones are cut at its deadline
                elif ending == "cancelled-as-the-backend-closes":
                    backend.end(reset=False)
                    scope.cancel()
                else:
                    set_abortive_close(client.stream)
                    await client.aclose()
                    scope.cancel()
                await returned.wait()
            await client.aclose()
        nursery.cancel_scope.cancel()
    records = access_records(caplog)
    assert_metrics_agree(edge.metrics.samples(), records)
    (connection,) = [r["termination"] for r in records if "type" not in r]
    requests = sorted(r["termination"] for r in records if r.get("type") == "http")
    if ending == "reload-without-it":
        assert (connection, requests) == ("drained", ["drained", "drained", "ok", "ok"])
    elif ending in CUTS or ending == "cancelled-as-the-backend-closes":
        assert (connection, requests) == ("drained", ["drained"] * 4)
    else:
        assert connection in {"drained", "client_error"}
        assert requests == [connection] * 4
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# -- a drain while the edge starts -----------------------------------------------------


@pytest.mark.parametrize("end", ["drain", "stop"])
@pytest.mark.parametrize("mode", ["tcp", "udp"])
async def test_a_drain_while_the_edge_starts_serves_nothing_and_returns(
    mode: str,
    end: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A SIGTERM (or SIGINT) can come while the edge resolves its backends
    (the signal handlers are up first: `tlsedge._control.run`). The listeners
    bound after it are closed, not served, and ``run()`` returns. (A udp
    listener was served on after a drain: ``run()`` never returned. A tcp
    one was served, ``ready``, until ``run()`` returned.)"""
    resolving, resolved = trio.Event(), trio.Event()
    create = BackendPool.create

    async def slow_create(*args: Any, **kwargs: Any) -> BackendPool:
        resolving.set()
        await resolved.wait()  # a slow DNS answer
        return await create(*args, **kwargs)

    monkeypatch.setattr(BackendPool, "create", slow_create)
    config = make_config(
        [{"name": "in", "backend": "b", "mode": mode}],
        [{"name": "b", "servers": ["127.0.0.1:9"]}],
    )
    edge = Edge(config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(edge.run)
        await resolving.wait()
        getattr(edge, end)()
        resolved.set()
        with trio.fail_after(5):
            while nursery.child_tasks:
                assert not edge.ready
                await trio.sleep(0.01)
    assert not edge.ready
    assert [s.fileno() for s in edge._listeners["in"].sockets] == [-1]
    assert "listener in on" not in caplog.text
    assert_metrics_agree(edge.metrics.samples(), access_records(caplog))
