"""What every HTTP connection of one listener is served with: its site."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tlsedge._backends.keepalive import KeepAlivePool
from tlsedge._backends.upstream import BackendPool
from tlsedge._core.config import HttpConfig, ListenerConfig
from tlsedge._http.log import RequestLog
from tlsedge._pipeline.http.upstream_step import Failure, response_timeout
from tlsedge._reactor.drain import Drain

__all__ = ["HttpSite"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpSite:
    """An HTTP listener as its connections see it (as a web server's
    "site"): the listener's settings, the backend its requests go to and
    that backend's idle upstream connections, the edge's drain signal and
    request hook, and what follows from them. The same for every connection
    of the listener, so made once per listener (the edge remakes it when a
    reload swaps the listener's settings or backend: a connection keeps the
    site it started with); what differs per connection (the client, its
    `Downstream`, its PROXY header, its result) is given to each connection.

    Attributes:
        listener: The listener's settings (``http``, ``http2``,
            ``forwarded``, timeouts).
        backend: Where requests go.
        keepalive: Idle upstream connections of *backend*, shared by the
            edge's connections.
        drain: The edge's drain signal.
        on_request: Called with each request's `RequestLog` once it is
            complete (right after its access-log line), e.g. for metrics.
        listener_name: The listener's name (log lines).
        http: ``listener.http``.
        idle_timeout: ``listener.idle_timeout``.
        backend_name: The backend's name (request lines).
        response_timeout_failure: No response head within the listener's
            ``response_timeout``: 504.
    """

    listener: ListenerConfig
    backend: BackendPool
    keepalive: KeepAlivePool
    drain: Drain
    on_request: Callable[[RequestLog], None] | None = None
    listener_name: str = field(init=False)
    http: HttpConfig = field(init=False)
    idle_timeout: float = field(init=False)
    backend_name: str = field(init=False)
    response_timeout_failure: Failure = field(init=False)

    def __post_init__(self) -> None:
        # (Frozen: derived fields are set as the dataclass's own __init__ does.)
        derived = {
            "listener_name": self.listener.name,
            "http": self.listener.http,
            "idle_timeout": self.listener.idle_timeout,
            "backend_name": self.backend.name,
            "response_timeout_failure": response_timeout(
                self.listener.http.response_timeout
            ),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)
