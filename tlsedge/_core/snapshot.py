"""A read-only view of a running edge, for everything that reports on it.

Theory of operation
-------------------
`Edge.snapshot` copies what the reporting side needs out of the edge's live
objects (listeners, backend pools, servers and their health bookkeeping) into
the frozen records below, at one instant. The admin endpoint (``/readyz``,
``/status``) and the metrics' live collector read a `Snapshot` and nothing
else: they never see the `Edge`, its sockets or its pools, so they cannot
change them, and they can be tested on snapshots built by hand.

This module is pure (no trio, socket or ssl): records only. Times inside a
snapshot are relative to the moment it was taken (``age``, ``trial_in``) or
wall-clock seconds since the epoch (``taken``, ``started``), so that rendering
a snapshot needs no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tlsedge._core.accesslog import format_address

__all__ = [
    "BackendSnapshot",
    "CheckRecord",
    "HealthCheckSettings",
    "ListenerSnapshot",
    "ListenerTls",
    "ProxyProtocolSettings",
    "ServerSnapshot",
    "Snapshot",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenerTls:
    """A listener's TLS settings as the status page and metrics show them."""

    #: The ``tls.policy`` name (``"intermediate"``).
    policy: str
    #: ``tls.client_auth``: ``"none"``, ``"optional"`` or ``"required"``.
    client_auth: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyProtocolSettings:
    """A listener's ``proxy_protocol`` settings as reported."""

    #: Accepted PROXY protocol versions, ascending.
    versions: tuple[int, ...]
    #: What happens to untrusted peers: ``"reject"`` or ``"direct"``.
    untrusted: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenerSnapshot:
    """One configured listener."""

    name: str
    #: ``"tcp"`` or ``"http"``.
    mode: str
    #: The backend's name.
    backend: str
    #: The configured ``bind``, as written (``"0.0.0.0:8443"``).
    bind: str
    #: The bound ``(host, port)`` of each listening socket.
    addresses: tuple[tuple[str, int], ...]
    #: ``max_connections`` of this listener.
    max_connections: int
    #: Connections of this worker holding one of those slots now.
    connections: int
    #: None: plain TCP.
    tls: ListenerTls | None
    #: None: no PROXY header expected.
    proxy_protocol: ProxyProtocolSettings | None


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckRecord:
    """One entry of a server's recent health history."""

    #: Seconds between the result and the snapshot.
    age: float
    #: Whether it counted as a pass.
    ok: bool
    #: What happened (``"HTTP 200"``, ``"connection refused"``).
    detail: str
    #: ``"check"`` for active checks, ``"traffic"`` for real connections.
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSnapshot:
    """One backend server: balancing state and health."""

    #: Numeric ``(host, port)``.
    address: tuple[str, int]
    weight: int
    #: False while the server is marked DOWN.
    healthy: bool
    #: Upstream connections of this worker in use to it now.
    active: int
    #: Consecutive failures (toward ``unhealthy_threshold``).
    failures: int
    #: Consecutive passed active checks (toward ``healthy_threshold``).
    successes: int
    #: While DOWN from failed traffic with no active checks: seconds until
    #: the balancer offers it trial traffic (0 once due). None otherwise.
    trial_in: float | None
    #: Recent results, oldest first.
    history: tuple[CheckRecord, ...]

    @property
    def name(self) -> str:
        """The address as the metrics' ``server`` label: ``"10.0.0.5:8080"``."""
        return format_address(self.address)

    @property
    def last_check(self) -> CheckRecord | None:
        """The most recent active check's result, if any."""
        for record in reversed(self.history):
            if record.source == "check":
                return record
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthCheckSettings:
    """A backend's active health checks (``[backends.health]``)."""

    #: ``"tcp"`` or ``"http"``.
    kind: str
    #: Seconds between checks.
    interval: float
    healthy_threshold: int
    unhealthy_threshold: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendSnapshot:
    """One backend and its servers."""

    name: str
    #: The balancing policy (``"round-robin"``).
    balance: str
    #: Connect retries.
    retries: int
    #: None: passive health only.
    health: HealthCheckSettings | None
    servers: tuple[ServerSnapshot, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """The state of one edge (one worker) at one instant."""

    #: tlsedge's version.
    version: str
    #: The process id of the worker this is.
    pid: int
    #: ``edge.workers``: how many workers share the ports.
    workers: int
    #: When the worker started (seconds since the epoch).
    started: float
    #: When the snapshot was taken (seconds since the epoch).
    taken: float
    #: Listeners up and not draining.
    ready: bool
    #: ``drain()`` was called: no new connections are accepted.
    draining: bool
    #: Client connections of this worker open now.
    active_connections: int
    #: ``edge.max_connections``.
    max_connections: int
    listeners: tuple[ListenerSnapshot, ...]
    backends: tuple[BackendSnapshot, ...]
