"""The one place a connection's ending is decided (`tlsedge._pipeline.close`),
and the registry of what runs on the reactor with no task
(`tlsedge._pipeline.stages.InFlight`)."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from tests.tlsedge.control.test_admin import total
from tests.tlsedge.helpers import access_records
from tlsedge._core.accesslog import ConnectionLog
from tlsedge._core.metrics import EdgeMetrics
from tlsedge._core.termination import Refused, Termination
from tlsedge._pipeline.close import closed, failed, settle_health_check
from tlsedge._pipeline.stages import InFlight


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> ConnectionLog:
    caplog.set_level(logging.INFO, logger="tlsedge")
    return ConnectionLog(id="1", listener="in", peer="127.0.0.1:1")


def closed_total(metrics: EdgeMetrics, termination: str) -> float:
    text = metrics.exposition()[0].decode()
    return total(text, "tlsedge_connections_closed_total", termination=termination)


def test_a_connection_that_recorded_no_cause_was_drained(
    log: ConnectionLog, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = EdgeMetrics()
    closed(log, metrics, 1.5)
    (record,) = access_records(caplog)
    assert record["termination"] == "drained"
    assert record["duration"] == 1.5
    assert closed_total(metrics, "drained") == 1


def test_the_cause_recorded_first_stands(
    log: ConnectionLog, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = EdgeMetrics()
    log.termination, log.detail = Termination.CLIENT_CLOSED, "bye"
    closed(log, metrics, 0.0, termination=Termination.IDLE_TIMEOUT, detail="idle")
    (record,) = access_records(caplog)
    assert (record["termination"], record["detail"]) == ("client_closed", "bye")
    assert closed_total(metrics, "client_closed") == 1


def test_a_cause_given_at_the_end_applies_when_none_was_recorded(
    log: ConnectionLog, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = EdgeMetrics()
    closed(log, metrics, 0.0, termination=Termination.SERVER_ERROR, detail="refused")
    (record,) = access_records(caplog)
    assert (record["termination"], record["detail"]) == ("server_error", "refused")


def test_a_refusal_is_recorded_logged_and_counted(
    log: ConnectionLog, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = EdgeMetrics()
    refused = Refused(Termination.HEADER_ERROR, "bad signature", reason="signature")
    failed(log, refused, metrics)
    assert (log.termination, log.detail) == ("header_error", "bad signature")
    text = metrics.exposition()[0].decode()
    assert total(text, "tlsedge_proxy_header_errors_total", reason="signature") == 1
    assert "closing 127.0.0.1:1: header_error: bad signature" in caplog.text


def test_a_health_check_refusal_is_not_logged(
    log: ConnectionLog, caplog: pytest.LogCaptureFixture
) -> None:
    failed(log, Refused(Termination.HEALTH_CHECK, "closed"), EdgeMetrics())
    assert log.termination == "health_check"
    assert "closing" not in caplog.text


def test_a_bug_is_an_internal_error_with_its_traceback(
    log: ConnectionLog, caplog: pytest.LogCaptureFixture
) -> None:
    try:
        raise ValueError("oops")
    except ValueError as exc:
        bug = exc
    failed(log, bug, EdgeMetrics())
    assert (log.termination, log.detail) == ("internal_error", "ValueError: oops")
    (logged,) = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert logged.exc_info is not None
    assert logged.exc_info[1] is bug


@pytest.mark.parametrize(
    ("health_check", "requests", "bytes_from_client", "ended", "settled"),
    [
        (True, None, 0, "client_closed", "health_check"),  # tcp: connect, close
        (True, 0, 0, "client_error", "health_check"),  # http: an RST, no request
        (True, None, 1, "client_closed", "client_closed"),  # a byte came
        (True, 1, 0, "client_closed", "client_closed"),  # a request came
        (True, None, 0, "server_error", "server_error"),  # the server's end
        (False, None, 0, "client_closed", "client_closed"),  # a real client
    ],
)
def test_a_load_balancers_check_that_closes_at_once_is_a_health_check(
    health_check: bool,
    requests: int | None,
    bytes_from_client: int,
    ended: str,
    settled: str,
) -> None:
    log = ConnectionLog(id="1", listener="in", peer="127.0.0.1:1")
    log.requests, log.bytes_from_client = requests, bytes_from_client
    log.termination = ended
    settle_health_check(log, health_check=health_check)
    assert log.termination == settled


class _Stage:
    """A stand-in for a stage on the reactor: its end may start the next."""

    def __init__(self, in_flight: InFlight, then: _Stage | None = None) -> None:
        self.in_flight = in_flight
        self.then = then

    def start(self) -> None:
        """Nothing: `end` ends it."""

    def drain(self) -> None:
        self.end()

    def end(self) -> None:
        """End, then start the next stage (as a header read's end starts
        the handshake)."""
        self.in_flight.ended(self)
        if self.then is not None:
            self.in_flight.start(self.then)


async def test_in_flight_waits_for_the_stage_an_end_starts() -> None:
    in_flight = InFlight()
    handshake = _Stage(in_flight)
    header_read = _Stage(in_flight, then=handshake)
    in_flight.start(header_read)
    waited = trio.Event()

    async def wait() -> None:
        await in_flight.wait_empty()
        waited.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        header_read.end()
        await trio.testing.wait_all_tasks_blocked()
        assert not waited.is_set()
        assert list(in_flight) == [handshake]
        handshake.end()
    assert waited.is_set()
    assert len(in_flight) == 0


async def test_in_flight_drain_all_ends_everything() -> None:
    in_flight = InFlight()
    stages = [_Stage(in_flight) for _ in range(3)]
    for stage in stages:
        in_flight.start(stage)
    in_flight.drain_all()
    assert len(in_flight) == 0
    with trio.fail_after(1):
        await in_flight.wait_empty()
