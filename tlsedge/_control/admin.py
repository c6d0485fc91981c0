"""The admin endpoint (``edge.admin``): metrics, probes and the status page.

A small HTTP/1.1 server (h11 over trio) on its own address, never a traffic
port (the configuration refuses an ``edge.admin`` that collides with a
listener's ``bind``):

- ``GET /metrics``: Prometheus text format (OpenMetrics if the scraper asks);
- ``GET /healthz``: 200 while the process is alive;
- ``GET /readyz``: 200 while the listeners are up and the edge is not
  draining, else 503 (a Kubernetes readiness probe takes the pod out of the
  Service's endpoints while it drains);
- ``GET /status``: an HTML page in the spirit of HAProxy's stats page;
- ``GET /``: links to the above.

Only GET and HEAD are served (405 otherwise), unknown paths get 404, every
response closes the connection. The request head must arrive within
`REQUEST_TIMEOUT` and fit in `MAX_HEADER_SIZE` bytes; at most
`MAX_CONNECTIONS` admin connections are served at once.

The server never sees the `Edge`: it is given `Edge.snapshot` (called once per
``/readyz`` and ``/status`` request; `tlsedge._core.snapshot` has the records) and
the edge's `EdgeMetrics` (``/metrics`` and the status page's counts).

With ``edge.workers > 1`` every worker binds the admin address with
``SO_REUSEPORT`` (like the listeners), so whichever worker the kernel picks
answers; `tlsedge._core.metrics` explains why its numbers are still the totals.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import h11
import trio

from tlsedge._control.status_page import render_status_page
from tlsedge._core.accesslog import format_address
from tlsedge._core.config import Address
from tlsedge._core.metrics import EdgeMetrics
from tlsedge._core.snapshot import Snapshot
from tlsedge._reactor.listen import open_listening_sockets
from tlsedge._version import __version__

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_HEADER_SIZE",
    "REQUEST_TIMEOUT",
    "AdminServer",
    "RateTracker",
    "bind_admin",
]

LOGGER = logging.getLogger("tlsedge.admin")

#: Seconds a client has to send the complete request head.
REQUEST_TIMEOUT: Final = 10.0
#: Largest request head accepted (h11's ``max_incomplete_event_size``).
MAX_HEADER_SIZE: Final = 16 * 1024
#: Admin connections served at once; more wait in the kernel's backlog.
MAX_CONNECTIONS: Final = 32
#: Seconds to send a response before giving up on a slow reader.
SEND_TIMEOUT: Final = 30.0
#: How often the status page's rates are sampled, and over how long.
RATE_INTERVAL: Final = 5.0
RATE_WINDOW: Final = 60.0

_SERVER_HEADER: Final = f"tlsedge/{__version__}".encode()
_TEXT: Final = b"text/plain; charset=utf-8"
_HTML: Final = b"text/html; charset=utf-8"
_ALLOW: Final = b"GET, HEAD"


@dataclass(frozen=True, slots=True)
class Response:
    """What a route answers."""

    status: int
    body: bytes
    content_type: bytes = _TEXT
    headers: tuple[tuple[bytes, bytes], ...] = ()


class RateTracker:
    """Per-minute rates for the status page, from periodic samples of totals.

    Every `RATE_INTERVAL` seconds the admin server stores the current totals
    (connections, bytes and HTTP requests per listener, HTTP requests per
    server, summed over all workers); a rate is the growth since the oldest
    sample still in `RATE_WINDOW`.
    """

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, dict[str, float]]] = (
            collections.deque()
        )

    def add(self, now: float, totals: dict[str, float]) -> None:
        """Store a sample taken at *now* (monotonic seconds)."""
        self._samples.append((now, totals))
        while len(self._samples) > 1 and now - self._samples[0][0] > RATE_WINDOW:
            self._samples.popleft()

    def rates(self, now: float, totals: dict[str, float]) -> dict[str, float]:
        """Per-second growth of each total since the oldest sample."""
        if not self._samples:
            return {}
        then, old = self._samples[0]
        elapsed = now - then
        if elapsed <= 0:
            return {}
        return {
            key: max(0.0, value - old.get(key, 0.0)) / elapsed
            for key, value in totals.items()
        }


def rate_totals(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """The totals `RateTracker` follows, keyed ``"conn:<listener>"``,
    ``"bytes:<listener>"``, ``"req:<listener>"`` (HTTP requests) and
    ``"server-req:<backend>/<server>"``, from `EdgeMetrics.samples` output."""
    totals: dict[str, float] = collections.defaultdict(float)
    for name, labels, value in samples:
        listener = labels.get("listener", "")
        if name == "tlsedge_connections_total":
            totals["conn:" + listener] += value
        elif name == "tlsedge_http_requests_total":
            totals["req:" + listener] += value
        elif name == "tlsedge_server_http_requests_total":
            server = f"{labels.get('backend')}/{labels.get('server')}"
            totals["server-req:" + server] += value
        elif name in {
            "tlsedge_client_bytes_received_total",
            "tlsedge_client_bytes_sent_total",
        }:
            totals["bytes:" + listener] += value
    return dict(totals)


# Scrapes and probes are few; the kernel queue need not be long.
_ADMIN_BACKLOG = 128


async def bind_admin(
    address: Address, *, reuse_port: bool
) -> list[trio.socket.SocketType]:
    """Open the admin endpoint's listening sockets (like the listeners' ``_bind``).

    Raises:
        OSError: the address does not resolve or cannot be bound; the message
            names ``edge.admin``.
    """
    try:
        return await open_listening_sockets(
            address.host, address.port, reuse_port=reuse_port, backlog=_ADMIN_BACKLOG
        )
    except OSError as exc:
        raise OSError(
            exc.errno, f"edge.admin {address}: {exc.strerror or exc}"
        ) from exc


class AdminServer:
    """The admin endpoint of one edge, on sockets from `bind_admin`.

    Args:
        snapshot: Gives the edge's state, called once per ``/readyz`` and
            ``/status`` request (`Edge.snapshot`).
        metrics: The edge's metrics (``/metrics``, the status page's counts).
        sockets: Listening sockets (closed when `serve` ends).

    Attributes:
        addresses: The bound ``(host, port)`` pairs.
        rates: Samples for the status page's rates.
    """

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        metrics: EdgeMetrics,
        sockets: list[trio.socket.SocketType],
    ) -> None:
        self.snapshot = snapshot
        self.metrics = metrics
        self.sockets = sockets
        self.addresses = [
            (str(s.getsockname()[0]), int(s.getsockname()[1])) for s in sockets
        ]
        self.rates = RateTracker()
        self._slots = trio.Semaphore(MAX_CONNECTIONS)
        self._routes: dict[str, Callable[[h11.Request], Response]] = {
            "/": self._index,
            "/metrics": self._metrics,
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/status": self._status,
        }

    async def serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled; the sockets are closed on the way out."""
        listeners = [trio.SocketListener(sock) for sock in self.sockets]
        LOGGER.info(
            "admin endpoint on %s",
            ", ".join(f"http://{format_address(a)}/" for a in self.addresses),
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sample_rates)
                for listener in listeners:
                    nursery.start_soon(self._accept_loop, listener, nursery)
                task_status.started()
        finally:
            for sock in self.sockets:
                sock.close()

    async def _sample_rates(self) -> None:
        while True:
            self._take_sample()
            await trio.sleep(RATE_INTERVAL)

    def _take_sample(self) -> dict[str, float]:
        totals = rate_totals(list(self.metrics.samples()))
        self.rates.add(time.monotonic(), totals)
        return totals

    async def _accept_loop(
        self, listener: trio.SocketListener, nursery: trio.Nursery
    ) -> None:
        while True:
            await self._slots.acquire()
            try:
                stream = await listener.accept()
            except OSError as exc:
                self._slots.release()
                LOGGER.warning("admin endpoint: accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            except BaseException:
                self._slots.release()
                raise
            nursery.start_soon(self._handle, stream)

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            await self._serve_one(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            LOGGER.debug("admin endpoint: connection failed: %s", exc)
        finally:
            self._slots.release()
            await trio.aclose_forcefully(stream)

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_SIZE)
        request: h11.Request | None = None
        with trio.move_on_after(REQUEST_TIMEOUT) as timer:
            try:
                request = await _read_request(conn, stream)
            except h11.RemoteProtocolError as exc:
                await _send(
                    conn,
                    stream,
                    Response(
                        exc.error_status_hint,
                        f"{exc.error_status_hint} bad request\n".encode(),
                    ),
                    head_only=False,
                )
                return
        if timer.cancelled_caught:
            with trio.move_on_after(SEND_TIMEOUT):
                await _send(
                    conn,
                    stream,
                    Response(408, b"408 request timeout\n"),
                    head_only=False,
                )
            return
        if request is None:
            return  # closed before sending a request
        method = request.method
        path = request.target.split(b"?", 1)[0].decode("ascii", "replace")
        if method not in {b"GET", b"HEAD"}:
            response = Response(
                405, b"405 method not allowed\n", headers=((b"allow", _ALLOW),)
            )
        else:
            route = self._routes.get(path)
            response = (
                Response(404, b"404 not found\n") if route is None else route(request)
            )
        with trio.move_on_after(SEND_TIMEOUT):
            await _send(conn, stream, response, head_only=method == b"HEAD")

    # -- routes -----------------------------------------------------------

    @staticmethod
    def _index(request: h11.Request) -> Response:
        body = (
            b"<!doctype html><html><head><meta charset='utf-8'>"
            b"<meta name='viewport' content='width=device-width, initial-scale=1'>"
            b"<title>tlsedge admin</title></head><body><h1>tlsedge admin</h1><ul>"
            b"<li><a href='/status'>/status</a></li>"
            b"<li><a href='/metrics'>/metrics</a></li>"
            b"<li><a href='/healthz'>/healthz</a></li>"
            b"<li><a href='/readyz'>/readyz</a></li></ul></body></html>"
        )
        return Response(200, body, _HTML)

    def _metrics(self, request: h11.Request) -> Response:
        accept = _header(request, b"accept")
        body, content_type = self.metrics.exposition(accept)
        return Response(200, body, content_type.encode("ascii"))

    @staticmethod
    def _healthz(request: h11.Request) -> Response:
        return Response(200, b"ok\n")

    def _readyz(self, request: h11.Request) -> Response:
        snapshot = self.snapshot()
        if snapshot.draining:
            return Response(503, b"draining\n")
        if not snapshot.ready:
            return Response(503, b"not ready\n")
        return Response(200, b"ready\n")

    def _status(self, request: h11.Request) -> Response:
        samples = list(self.metrics.samples())
        now = time.monotonic()
        rates = self.rates.rates(now, rate_totals(samples))
        page = render_status_page(
            self.snapshot(), samples, rates, reloads=self.metrics.reloads
        )
        return Response(200, page.encode("utf-8"), _HTML)


async def _read_request(
    conn: h11.Connection, stream: trio.SocketStream
) -> h11.Request | None:
    """The request head, or None if the client closed first.

    Raises:
        h11.RemoteProtocolError: not HTTP/1.x, or a head over `MAX_HEADER_SIZE`
            (h11 alone lets a head that arrives complete in one read through).
    """
    received = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(MAX_HEADER_SIZE)
            received += len(data)
            if received > MAX_HEADER_SIZE:
                raise h11.RemoteProtocolError(
                    "request head too large", error_status_hint=431
                )
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            return event
        if isinstance(event, h11.ConnectionClosed):
            return None
        # Anything else before a request cannot happen in h11's server role.
        return None  # pragma: no cover


def _header(request: h11.Request, name: bytes) -> str:
    for key, value in request.headers:
        if key == name:
            return value.decode("latin-1")
    return ""


async def _send(
    conn: h11.Connection,
    stream: trio.SocketStream,
    response: Response,
    *,
    head_only: bool,
) -> None:
    headers = [
        (b"content-type", response.content_type),
        (b"content-length", str(len(response.body)).encode()),
        (b"cache-control", b"no-store"),
        (b"x-content-type-options", b"nosniff"),
        (b"connection", b"close"),
        (b"server", _SERVER_HEADER),
        *response.headers,
    ]
    if response.content_type == _HTML:
        headers.append(
            (
                b"content-security-policy",
                b"default-src 'none'; style-src 'unsafe-inline'; img-src data:",
            )
        )
    data = conn.send(h11.Response(status_code=response.status, headers=headers)) or b""
    if not head_only and response.body:
        data += conn.send(h11.Data(data=response.body)) or b""
    data += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(data)
