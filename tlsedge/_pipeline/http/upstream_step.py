"""What the HTTP/1.1 and HTTP/2 drivers share about one upstream exchange.

Both drivers (`tlsedge._pipeline.http.h1`, `tlsedge._pipeline.http.h2`) run each
request as an `UpstreamExchange` over a connection from
`tlsedge._pipeline.http.upstreams.UpstreamConnections`, and decide the same things the
same way when it ends: how an attempt failed (`Failure`: the termination, the
log text, the error status if no response was started, whether it may be
sent again), whether to retry it (`should_retry`, after
`tlsedge._http.rules.may_retry`), and whether the connection goes back to be
reused (`is_clean`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import trio

from tlsedge._core.termination import Termination
from tlsedge._http.exchange import UpstreamError, UpstreamExchange
from tlsedge._http.log import RequestLog
from tlsedge._http.rules import may_retry
from tlsedge._pipeline.http.upstreams import Upstream
from tlsedge._reactor.raw_stream import RawStream

__all__ = [
    "IO_ERRORS",
    "UPSTREAM_READ_STALLED",
    "UPSTREAM_WRITE_STALLED",
    "Failure",
    "head_not_sent",
    "is_clean",
    "log_retry",
    "response_timeout",
    "should_retry",
    "upstream_failure",
]

LOGGER = logging.getLogger("tlsedge.http")

#: What a failed read or write raises (`RawStream`).
IO_ERRORS: Final = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an exchange (or its current attempt) failed."""

    termination: str
    detail: str
    status: int | None  # the error response, if none was started
    retryable: bool = False  # upstream failed before any response byte


UPSTREAM_WRITE_STALLED: Final = Failure(
    Termination.SERVER_ERROR,
    "upstream did not read for idle_timeout",
    502,
    retryable=True,
)
UPSTREAM_READ_STALLED: Final = Failure(
    Termination.SERVER_ABORTED, "upstream response stalled for idle_timeout", None
)


def response_timeout(seconds: float) -> Failure:
    """No response head within ``response_timeout`` (*seconds*): 504."""
    return Failure(
        Termination.RESPONSE_TIMEOUT,
        f"no response within response_timeout ({seconds:g} s)",
        504,
    )


def head_not_sent(exc: Exception) -> Failure:
    """The upstream failed before it took the request head: nothing was
    answered yet, so the request may go again (`may_retry`)."""
    return Failure(
        Termination.SERVER_ERROR, f"upstream write failed: {exc}", 502, retryable=True
    )


def upstream_failure(exc: UpstreamError, *, response_started: bool) -> Failure:
    """The upstream broke the exchange: the client's response is cut if it
    began, else 502 (retryable when the upstream sent nothing)."""
    if response_started:
        return Failure(Termination.SERVER_ABORTED, str(exc), None)
    return Failure(Termination.SERVER_ERROR, str(exc), 502, retryable=exc.empty)


def should_retry(
    failure: Failure | None,
    upstream: Upstream | None,
    *,
    response_started: bool,
    method: bytes,
    has_body: bool,
    retried: bool,
) -> bool:
    """Whether the failed attempt on *upstream* goes again on a new connection."""
    return (
        failure is not None
        and failure.retryable
        and upstream is not None
        and not response_started
        and may_retry(
            method=method, has_body=has_body, reused=upstream.reused, retried=retried
        )
    )


def log_retry(listener: str, log: RequestLog, failure: Failure) -> None:
    LOGGER.info(
        "listener %s: %s %s: retrying on a new connection: %s",
        listener,
        log.method,
        log.target,
        failure.detail,
    )


def is_clean(
    failure: Failure | None,
    conn: UpstreamExchange | None,
    raw: RawStream | None,
    *,
    body_stopped: bool,
) -> bool:
    """Whether the exchange left its connection fit for another one."""
    return (
        failure is None
        and not body_stopped
        and conn is not None
        and conn.reusable
        and raw is not None
        and not raw.out
    )
