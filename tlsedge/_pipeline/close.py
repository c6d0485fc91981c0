"""Stage: close: how a connection ended, decided in one place.

Every connection's path ends here, whatever its mode (tcp, http, a udp flow)
and wherever it stopped (a refusal, a bug, the relay's or the HTTP driver's
end, the drain deadline): `closed` settles its ``termination`` (a connection
whose path recorded no cause was cut by the drain deadline or the edge
stopping: ``drained``), counts it in the metrics and writes its one
access-log line. `failed` is what the path calls when a stage ends the
connection early: a `Refused` (with its log level and, for a PROXY header,
its metric), or a bug. `settle_health_check` tells a load balancer's check
from a client that went away, for the relay's and the HTTP driver's ends.
"""

from __future__ import annotations

import logging

from tlsedge._core.accesslog import ConnectionLog
from tlsedge._core.metrics import EdgeMetrics
from tlsedge._core.termination import Refused, Termination

__all__ = ["closed", "failed", "settle_health_check"]

LOGGER = logging.getLogger("tlsedge.server")

# Refusals logged above INFO (the backend's trouble) or not at all (0): a load
# balancer's check, a client that went away while sending its PROXY header.
_REFUSAL_LOG_LEVELS = {
    Termination.NO_SERVER: logging.WARNING,
    Termination.CONNECT_FAILED: logging.WARNING,
    Termination.HEALTH_CHECK: 0,
    Termination.CLIENT_ERROR: 0,
}


# How a connection ends when the client goes first; see `settle_health_check`.
_CLIENT_ENDED = frozenset({Termination.CLIENT_CLOSED, Termination.CLIENT_ERROR})


def settle_health_check(log: ConnectionLog, *, health_check: bool) -> None:
    """A load balancer's check (*health_check*: its PROXY header described
    no client) that connected and closed without a byte or a request ends
    as ``health_check``: checks close at once, often with an RST (HAProxy's
    do), and are no client error to count or alert on."""
    if (
        health_check
        and not log.requests
        and log.bytes_from_client == 0
        and log.termination in _CLIENT_ENDED
    ):
        log.termination = Termination.HEALTH_CHECK


def failed(log: ConnectionLog, exc: Exception, metrics: EdgeMetrics) -> None:
    """Record why a stage ended the connection early: a refusal, or a bug (a
    bug on one connection's path must not take the edge, and every other
    connection, down with it: logged with its traceback, and this connection
    closed). The access-log line follows, from `closed`."""
    if isinstance(exc, Refused):
        log.termination, log.detail = exc.termination, exc.detail
        if exc.reason is not None:
            metrics.proxy_header_error(log.listener, exc.reason)
        level = _REFUSAL_LOG_LEVELS.get(exc.termination, logging.INFO)
        if level:
            LOGGER.log(
                level,
                "listener %s: closing %s: %s: %s",
                log.listener,
                log.client or log.peer,
                exc.termination,
                exc.detail,
            )
        return
    log.termination = Termination.INTERNAL_ERROR
    log.detail = f"{type(exc).__name__}: {exc}"
    LOGGER.error(
        "listener %s: internal error on connection %s",
        log.listener,
        log.id,
        exc_info=exc,
    )


def closed(
    log: ConnectionLog,
    metrics: EdgeMetrics,
    duration: float,
    *,
    termination: Termination = Termination.DRAINED,
    detail: str | None = None,
) -> None:
    """The connection is over: settle how it ended, count it, log it.

    Args:
        log: Its access-log record, as its path filled it in.
        metrics: The edge's metrics.
        duration: How long it lasted, in seconds.
        termination: The cause, if its path recorded none (and *detail*
            with it): by default ``drained``, as a path ends without one
            only when the drain deadline or the edge stopping cut it.
        detail: More about *termination*.
    """
    if log.termination == Termination.UNKNOWN:
        log.termination = termination
        if detail is not None:
            log.detail = detail
    log.duration = duration
    metrics.record(log)
    log.emit()
