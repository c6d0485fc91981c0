"""Metrics: values after real traffic through an Edge, scraped from /metrics."""

from __future__ import annotations

import contextlib
import json
import os
import re
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trustme
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from tests.tlsedge.control.test_admin import (
    admin_address,
    http_get,
    metric_values,
    total,
)
from tests.tlsedge.control.test_status_page import (
    STARTED,
    backend,
    listener,
    server,
    snapshot,
)
from tests.tlsedge.e2e.test_http_edge import h11_edge
from tests.tlsedge.helpers import (
    Backend,
    address_of,
    close_clients,
    connect,
    make_config,
    proxy_echo_handler,
    read_all,
    running_edge,
    wait_until,
)
from tlsedge._core.accesslog import ConnectionLog
from tlsedge._core.metrics import (
    CONNECTION_BUCKETS,
    FLUSH_INTERVAL,
    HTTP_BUCKETS,
    MULTIPROC_ENV,
    REFUSED_TERMINATIONS,
    EdgeMetrics,
    tls_failure_reason,
)
from tlsedge._core.reload import ReloadResult
from tlsedge._core.snapshot import CheckRecord, Snapshot
from tlsedge._http.log import RequestLog


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


def header_v1(client: tuple[str, int], destination: tuple[str, int]) -> bytes:
    return (
        f"PROXY TCP4 {client[0]} {destination[0]} {client[1]} {destination[1]}\r\n"
    ).encode()


async def test_counters_after_real_traffic(nursery: trio.Nursery) -> None:
    backend = await Backend(proxy_echo_handler(proxy=False)).start(nursery)
    config = make_config(
        [
            {
                "name": "lb",
                "backend": "app",
                "proxy_protocol": {"trusted": ["127.0.0.0/8"], "versions": [1, 2]},
            },
            {
                "name": "strict",
                "backend": "app",
                "proxy_protocol": {"trusted": ["10.0.0.0/8"], "untrusted": "reject"},
            },
        ],
        [{"name": "app", "servers": [backend.address], "retries": 0}],
        {"admin": "127.0.0.1:0"},
    )
    async with running_edge(config) as edge:
        admin = admin_address(edge)
        before = (await http_get(admin, "/metrics")).text
        assert total(before, "tlsedge_connections_total") == 0
        assert total(before, "tlsedge_server_up", backend="app") == 1

        # 1. Accepted: a good PROXY header, then 5 bytes.
        client = await connect(address_of(edge, "lb"))
        await client.send_all(
            header_v1(("192.0.2.7", 4000), ("198.51.100.1", 443)) + b"hello"
        )
        await client.send_eof()
        answer = await read_all(client)
        assert json.loads(answer)["data"] == "hello"
        # 2. A bad header from a trusted peer.
        bad = await connect(address_of(edge, "lb"))
        await bad.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await read_all(bad) == b""
        # 3. An untrusted peer on a listener that rejects them.
        rejected = await connect(address_of(edge, "strict"))
        assert await read_all(rejected) == b""

        async def scrape() -> str:
            return (await http_get(admin, "/metrics")).text

        text = await scrape()
        with trio.fail_after(10):
            while total(text, "tlsedge_connections_closed_total") < 3:
                await trio.sleep(0.02)
                text = await scrape()

        assert total(text, "tlsedge_connections_total", listener="lb") == 2
        assert total(text, "tlsedge_connections_total", listener="strict") == 1
        assert total(text, "tlsedge_connections_active") == 0
        assert (
            total(
                text,
                "tlsedge_connections_refused_total",
                listener="lb",
                reason="header_error",
            )
            == 1
        )
        assert (
            total(
                text,
                "tlsedge_connections_refused_total",
                listener="strict",
                reason="rejected",
            )
            == 1
        )
        assert total(text, "tlsedge_connections_refused_total") == 2
        assert total(text, "tlsedge_connections_closed_total", listener="lb") == 2
        errors = {
            sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "tlsedge_proxy_header_errors"
            for sample in family.samples
            if sample.name == "tlsedge_proxy_header_errors_total"
            and sample.labels["listener"] == "lb"
        }
        assert sum(errors.values()) == 1
        assert "rejected" not in errors
        assert (
            total(
                text,
                "tlsedge_proxy_header_errors_total",
                listener="strict",
                reason="rejected",
            )
            == 1
        )
        # Bytes each way, by listener and by server.
        assert total(text, "tlsedge_client_bytes_received_total", listener="lb") == 5
        assert total(text, "tlsedge_client_bytes_sent_total", listener="lb") == len(
            answer
        )
        server = {"backend": "app", "server": backend.address}
        assert total(text, "tlsedge_server_connections_total", **server) == 1
        assert total(text, "tlsedge_server_bytes_sent_total", **server) == 5
        assert total(text, "tlsedge_server_bytes_received_total", **server) == len(
            answer
        )
        assert total(text, "tlsedge_server_active_connections", **server) == 0
        assert total(text, "tlsedge_server_up", **server) == 1
        assert total(text, "tlsedge_server_weight", **server) == 1
        assert total(text, "tlsedge_backend_retries_total") == 0
        assert total(text, "tlsedge_connection_duration_seconds_count") == 3
        assert total(text, "tlsedge_ready") == 1
        assert total(text, "tlsedge_draining") == 0
        assert (
            total(
                text,
                "tlsedge_listener_info",
                listener="strict",
                proxy_protocol="v1+v2",
                tls="off",
                mode="tcp",
            )
            == 1
        )
        assert total(text, "tlsedge_listener_max_connections", listener="lb") == 10000

        # A backend that refuses: connect_failed, counted per backend.
        backend.stop()
        failed = await connect(address_of(edge, "lb"))
        await failed.send_all(header_v1(("192.0.2.7", 4001), ("198.51.100.1", 443)))
        assert await read_all(failed) == b""
        with trio.fail_after(10):
            while total(text, "tlsedge_connections_closed_total") < 4:
                await trio.sleep(0.02)
                text = await scrape()
        assert total(text, "tlsedge_backend_connect_failures_total", backend="app") == 1
        assert (
            total(
                text,
                "tlsedge_connections_refused_total",
                listener="lb",
                reason="connect_failed",
            )
            == 1
        )


async def test_server_active_connections_while_open(nursery: trio.Nursery) -> None:
    async def hold(stream: trio.SocketStream) -> None:
        await stream.send_all(b"x")
        await read_all(stream)

    backend = await Backend(hold).start(nursery)
    config = make_config(
        [{"name": "in", "backend": "app"}],
        [{"name": "app", "servers": [backend.address]}],
        {"admin": "127.0.0.1:0"},
    )
    async with running_edge(config) as edge:
        admin = admin_address(edge)
        clients = [await connect(address_of(edge, "in")) for _ in range(3)]
        for client in clients:
            assert await client.receive_some(1) == b"x"
        text = (await http_get(admin, "/metrics")).text
        assert total(text, "tlsedge_connections_active", listener="in") == 3
        assert (
            total(
                text,
                "tlsedge_server_active_connections",
                backend="app",
                server=backend.address,
            )
            == 3
        )
        for client in clients:
            await client.aclose()
        await wait_until(lambda: edge.active_connections == 0)
        text = (await http_get(admin, "/metrics")).text
        assert total(text, "tlsedge_connections_active") == 0
        assert total(text, "tlsedge_server_active_connections") == 0


async def test_tls_handshakes_and_failures(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    backend = await Backend(proxy_echo_handler(proxy=False)).start(nursery)
    config = make_config(
        [
            {
                "name": "tls",
                "backend": "app",
                "tls": {
                    "certificates": [{"cert": str(cert_path), "key": str(key_path)}]
                },
            }
        ],
        [{"name": "app", "servers": [backend.address]}],
        {"admin": "127.0.0.1:0"},
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "tls")
        context = ssl.create_default_context()
        ca.configure_trust(context)
        raw = await trio.open_tcp_stream(*address)
        client = trio.SSLStream(raw, context, server_hostname="localhost")
        await client.do_handshake()
        await client.aclose()
        # Plain text on a TLS port: a handshake failure with OpenSSL's reason.
        plain = await connect(address)
        await plain.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with contextlib.suppress(trio.BrokenResourceError):
            await read_all(plain)  # a TLS alert (or a reset), then closed
        admin = admin_address(edge)
        with trio.fail_after(10):
            while True:
                text = (await http_get(admin, "/metrics")).text
                if total(text, "tlsedge_connections_closed_total") >= 2:
                    break
                await trio.sleep(0.02)
        assert total(text, "tlsedge_tls_handshakes_total", listener="tls") == 1
        assert (
            total(text, "tlsedge_tls_handshakes_total", version="TLSv1.3")
            + total(text, "tlsedge_tls_handshakes_total", version="TLSv1.2")
            == 1
        )
        failures = {
            sample.labels["reason"]
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "tlsedge_tls_handshake_failures_total"
        }
        assert total(text, "tlsedge_tls_handshake_failures_total") == 1
        assert len(failures) == 1, failures
        assert failures != {"other"}, failures


async def test_http_request_metrics_for_http_mode() -> None:
    metrics = EdgeMetrics()
    metrics.record_http_request("web", "app", 200, 0.02, server="10.0.0.1:80")
    metrics.record_http_request("web", "app", 204, 0.2, server="10.0.0.2:80")
    metrics.record_http_request("web", "app", 502, 3.0)  # no server took it
    text = metrics.exposition()[0].decode()
    assert total(text, "tlsedge_http_requests_total", code="2xx") == 2
    assert total(text, "tlsedge_http_requests_total", code="5xx") == 1
    # Per server: the requests that went to one.
    requests = "tlsedge_server_http_requests_total"
    assert total(text, requests, backend="app", server="10.0.0.1:80") == 1
    assert total(text, requests, server="10.0.0.2:80", code="2xx") == 1
    assert total(text, requests) == 2
    assert total(text, "tlsedge_http_request_duration_seconds_count") == 3
    assert (
        total(
            text,
            "tlsedge_http_request_duration_seconds_bucket",
            listener="web",
            backend="app",
            le="0.25",
        )
        == 2
    )
    # No live collector without an edge; registries are per instance.
    assert "tlsedge_ready" not in text
    assert (
        total(EdgeMetrics().exposition()[0].decode(), "tlsedge_http_requests_total")
        == 0
    )


async def test_a_sites_request_counts_are_record_http_request() -> None:
    # What an HTTP site's on_request counts (HttpRequestCounts.record, the
    # labels looked up once) is what record_http_request counts.
    counted, reference = EdgeMetrics(), EdgeMetrics()
    web = counted.http_requests("web", "app")
    assert counted.http_requests("web", "app") is web
    # No series before the first request.
    assert 'listener="web"' not in counted.exposition()[0].decode()
    requests = [
        (200, 0.02, "10.0.0.1:80"),
        (200, 0.3, "10.0.0.2:80"),
        (404, 0.001, "10.0.0.1:80"),
        (502, 3.0, None),
        (99, 0.5, "10.0.0.1:80"),  # "other"
        (200, 12.0, "10.0.0.1:80"),
    ]
    for status, seconds, to in requests:
        web.record(
            RequestLog(
                connection="c",
                listener="web",
                client=None,
                status=status,
                total=seconds,
                server=to,
            )
        )
        reference.record_http_request("web", "app", status, seconds, server=to)
    # Never answered: not counted.
    web.record(RequestLog(connection="c", listener="web", client=None, total=1.0))
    counted.http_requests("in", "app").count(200, 0.02, None)
    reference.record_http_request("in", "app", 200, 0.02)

    def families(metrics: EdgeMetrics) -> list[object]:
        return [
            (
                family.name,
                sorted(
                    (s.name, sorted(s.labels.items()), s.value)
                    for s in family.samples
                    if not s.name.endswith("_created")
                ),
            )
            for family in text_string_to_metric_families(
                metrics.exposition()[0].decode()
            )
            if "http" in family.name
        ]

    assert families(counted) == families(reference)
    assert total(counted.exposition()[0].decode(), "tlsedge_http_requests_total") == 7


async def test_record_derives_everything_from_the_connection_log() -> None:
    metrics = EdgeMetrics()
    metrics.connection_opened("in")
    log = ConnectionLog(id="1", listener="in", peer="127.0.0.1:1", backend="b")
    log.server = "127.0.0.1:8080"
    metrics.server_leased("b", log.server)
    metrics.server_connection_opened("b", log.server, attempts=3)
    metrics.server_released("b", log.server)
    log.tls = "TLSv1.3 TLS_AES_128_GCM_SHA256"
    log.bytes_from_client, log.bytes_from_server = 10, 20
    log.termination = "client_closed"
    metrics.record(log)
    text = metrics.exposition()[0].decode()
    assert total(text, "tlsedge_backend_retries_total", backend="b") == 2
    assert total(text, "tlsedge_tls_handshakes_total", version="TLSv1.3") == 1
    assert total(text, "tlsedge_server_active_connections") == 0
    assert total(text, "tlsedge_server_connections_total", backend="b") == 1
    assert total(text, "tlsedge_connections_refused_total") == 0
    assert total(text, "tlsedge_connections_closed_total", termination="client_closed")
    assert "connect_failed" in REFUSED_TERMINATIONS
    assert "client_closed" not in REFUSED_TERMINATIONS


def histogram_samples(
    text: str, name: str, **labels: str
) -> dict[tuple[str, str], float]:
    """``(sample name, le)`` to value for one histogram child in *text*."""
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
        if not sample.name.endswith("_created")
        and set(labels.items()) <= set(sample.labels.items())
    }


async def test_histograms_bucket_as_prometheus_client_observe_does() -> None:
    # Bounds themselves (le is inclusive), just above them, 0, past the last
    # bound; scrapes in between must not count anything twice.
    durations = [0.0, *CONNECTION_BUCKETS, *(b * 1.001 for b in CONNECTION_BUCKETS)]
    latencies = [0.0, *HTTP_BUCKETS, *(b + 1e-9 for b in HTTP_BUCKETS), 86400.0]
    metrics = EdgeMetrics()
    reference = CollectorRegistry()
    connection = Histogram(
        "tlsedge_connection_duration_seconds",
        "",
        ("listener",),
        registry=reference,
        buckets=CONNECTION_BUCKETS,
    )
    http = Histogram(
        "tlsedge_http_request_duration_seconds",
        "",
        ("listener", "backend"),
        registry=reference,
        buckets=HTTP_BUCKETS,
    )
    for index, seconds in enumerate(durations):
        metrics.connection_opened("in")
        log = ConnectionLog(id=str(index), listener="in", peer="127.0.0.1:1")
        log.duration = seconds
        metrics.record(log)
        connection.labels("in").observe(seconds)
        if index == len(durations) // 2:
            metrics.exposition()
    for seconds in latencies:
        metrics.record_http_request("web", "app", 200, seconds)
        http.labels("web", "app").observe(seconds)
        metrics.exposition()
    text = metrics.exposition()[0].decode()
    expected = generate_latest(reference).decode()
    for name, labels in (
        ("tlsedge_connection_duration_seconds", {"listener": "in"}),
        (
            "tlsedge_http_request_duration_seconds",
            {"listener": "web", "backend": "app"},
        ),
    ):
        got = histogram_samples(text, name, **labels)
        want = histogram_samples(expected, name, **labels)
        sum_key = (f"{name}_sum", "")
        assert got.pop(sum_key) == pytest.approx(want.pop(sum_key))
        assert got == want
    assert total(text, "tlsedge_connection_duration_seconds_count") == len(durations)
    assert total(text, "tlsedge_connections_total") == len(durations)
    assert total(text, "tlsedge_connections_active") == 0
    assert total(text, "tlsedge_http_requests_total", code="2xx") == len(latencies)


#: A worker process's events, counted and never scraped: only the periodic
#: flush can write them to the multiprocess directory.
_WORKER = """
import sys
import trio
from tlsedge._core.metrics import EdgeMetrics

async def main() -> None:
    metrics = EdgeMetrics()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(metrics.flush_periodically)
        for _ in range(3):
            metrics.connection_opened("in")
        metrics.server_leased("app", "127.0.0.1:8080")
        metrics.record_http_request("in", "app", 200, 0.02)
        print("counted", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        nursery.cancel_scope.cancel()

trio.run(main)
"""


async def test_a_worker_flushes_its_counts_for_the_others(tmp_path: Path) -> None:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", _WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, MULTIPROC_ENV: str(tmp_path)},
    )
    assert process.stdin is not None
    assert process.stdout is not None
    try:
        said = b""
        with trio.fail_after(20):
            while not said.endswith(b"\n"):
                said += await process.stdout.receive_some()
        assert said == b"counted\n"
        # What another worker's scrape reads: the files of every process.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]

        def scrape() -> str:
            return generate_latest(registry).decode()

        await wait_until(
            lambda: total(scrape(), "tlsedge_connections_total") == 3,
            FLUSH_INTERVAL + 10,
            0.05,
        )
        text = scrape()
        assert total(text, "tlsedge_connections_total", listener="in") == 3
        assert total(text, "tlsedge_connections_active", listener="in") == 3
        assert total(text, "tlsedge_server_active_connections", backend="app") == 1
        assert total(text, "tlsedge_http_requests_total", code="2xx") == 1
        assert (
            total(
                text,
                "tlsedge_http_request_duration_seconds_bucket",
                le="0.025",
            )
            == 1
        )
    finally:
        await process.stdin.aclose()
        with trio.fail_after(20):
            assert await process.wait() == 0
        await process.stdout.aclose()


@pytest.mark.parametrize(
    ("termination", "detail", "reason"),
    [
        ("tls_handshake_timeout", "no TLS handshake within 10 s", "timeout"),
        (
            "tls_error",
            "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1000)",
            "wrong_version_number",
        ),
        ("tls_error", "[SSL: NO_SHARED_CIPHER] no shared cipher", "no_shared_cipher"),
        ("tls_error", "EOF occurred in violation of protocol", "eof"),
        ("tls_error", None, "other"),
    ],
)
async def test_tls_failure_reason(
    termination: str, detail: str | None, reason: str
) -> None:
    assert tls_failure_reason(termination, detail) == reason


async def test_live_metrics_come_from_the_snapshot() -> None:
    down = server(
        ("10.0.0.2", 8080),
        healthy=False,
        weight=3,
        failures=6,
        successes=0,
        history=(
            CheckRecord(
                age=12.0, ok=False, detail="connection refused", source="check"
            ),
            CheckRecord(age=2.0, ok=False, detail="timeout", source="traffic"),
        ),
    )
    taken: list[Snapshot] = []

    def take() -> Snapshot:
        taken.append(
            snapshot(
                draining=True,
                workers=2,
                listeners=(
                    listener(),
                    listener("plain", tls=None, proxy_protocol=None),
                ),
                backends=(backend(server(history=()), down),),
            )
        )
        return taken[-1]

    text = EdgeMetrics(take).exposition()[0].decode()
    assert len(taken) == 1  # one snapshot per scrape
    values = metric_values(text)
    assert (
        values[
            (
                "tlsedge_worker_info",
                (("pid", "4242"), ("version", "9.8.7"), ("workers", "2")),
            )
        ]
        == 1
    )
    assert total(text, "tlsedge_start_time_seconds") == STARTED
    assert (total(text, "tlsedge_ready"), total(text, "tlsedge_draining")) == (0, 1)
    info = {
        labels["listener"]: labels
        for family in text_string_to_metric_families(text)
        if family.name == "tlsedge_listener_info"
        for labels in (sample.labels for sample in family.samples)
    }
    assert info["web"] == {
        "listener": "web",
        "bind": "0.0.0.0:8443",
        "mode": "tcp",
        "tls": "intermediate",
        "proxy_protocol": "v1+v2",
        "backend": "app",
    }
    assert (info["plain"]["tls"], info["plain"]["proxy_protocol"]) == ("off", "off")
    assert total(text, "tlsedge_listener_max_connections", listener="web") == 500
    up = "10.0.0.1:8080"
    assert total(text, "tlsedge_server_up", server=up) == 1
    assert total(text, "tlsedge_server_up", server="10.0.0.2:8080") == 0
    assert total(text, "tlsedge_server_weight", server="10.0.0.2:8080") == 3
    assert total(text, "tlsedge_server_check_consecutive_failures", backend="app") == 6
    # The last *check*, not the later traffic failure; none for a server
    # without checks.
    down_key = (("backend", "app"), ("server", "10.0.0.2:8080"))
    assert values[("tlsedge_server_last_check_age_seconds", down_key)] == 12.0
    assert values[("tlsedge_server_last_check_success", down_key)] == 0
    checked = {
        dict(labels)["server"]
        for name, labels in values
        if name.startswith("tlsedge_server_last_check_")
    }
    assert checked == {"10.0.0.2:8080"}


async def test_reload_series_come_from_the_record() -> None:
    metrics = EdgeMetrics()
    text = metrics.exposition()[0].decode()
    assert total(text, "tlsedge_config_last_reload_successful") == 1
    assert (
        total(text, "tlsedge_config_last_reload_timestamp_seconds")
        == metrics.reloads.loaded
    )
    for result in ("applied", "partial", "refused"):  # present from the start
        assert (
            "tlsedge_config_reloads_total",
            (("result", result),),
        ) in metric_values(text)
    metrics.reloads = (
        metrics.reloads.after(ReloadResult.APPLIED, STARTED)
        .after(ReloadResult.APPLIED, STARTED + 1)
        .after(ReloadResult.REFUSED, STARTED + 2, "no")
    )
    text = metrics.exposition()[0].decode()
    assert total(text, "tlsedge_config_last_reload_successful") == 0
    assert total(text, "tlsedge_config_last_reload_timestamp_seconds") == STARTED + 2
    assert total(text, "tlsedge_config_reloads_total", result="applied") == 2
    assert total(text, "tlsedge_config_reloads_total", result="partial") == 0
    assert total(text, "tlsedge_config_reloads_total", result="refused") == 1


# -- bytes of connections still open ------------------------------------------


def byte_counts(text: str, listener: str, backend: str, server: str) -> list[float]:
    """From and to the client by listener, to and from the server."""
    labels = {"backend": backend, "server": server}
    return [
        total(text, "tlsedge_client_bytes_received_total", listener=listener),
        total(text, "tlsedge_client_bytes_sent_total", listener=listener),
        total(text, "tlsedge_server_bytes_sent_total", **labels),
        total(text, "tlsedge_server_bytes_received_total", **labels),
    ]


async def test_a_tcp_relay_counts_its_bytes_while_it_runs(
    nursery: trio.Nursery,
) -> None:
    # A long session (a database connection, a gRPC stream) used to show
    # nothing until it closed.
    upload, download = 8 << 20, 3 << 20
    received = trio.Event()

    async def backend_handler(stream: trio.SocketStream) -> None:
        got = 0
        while got < upload:
            got += len(await stream.receive_some(1 << 16))
        received.set()
        await stream.send_all(b"d" * download)
        await read_all(stream)

    backend = await Backend(backend_handler).start(nursery)
    config = make_config(
        [{"name": "db", "backend": "app"}],
        [{"name": "app", "servers": [backend.address]}],
        {"admin": "127.0.0.1:0"},
    )
    async with running_edge(config) as edge:
        admin = admin_address(edge)
        client = await connect(address_of(edge, "db"))
        await client.send_all(b"u" * upload)
        await received.wait()
        got = 0
        while got < download:
            got += len(await client.receive_some(1 << 16))
        # Open: both ways counted, by listener and by server.
        text = (await http_get(admin, "/metrics")).text
        assert total(text, "tlsedge_connections_active", listener="db") == 1
        counts = byte_counts(text, "db", "app", backend.address)
        assert counts == [upload, download, upload, download]
        # More bytes: a later scrape has them too.
        await client.send_all(b"x" * 100)
        with trio.fail_after(10):
            while counts[0] < upload + 100:
                await trio.sleep(0.01)
                text = (await http_get(admin, "/metrics")).text
                counts = byte_counts(text, "db", "app", backend.address)
        assert counts == [upload + 100, download, upload + 100, download]
        await client.send_eof()
        await wait_until(lambda: edge.active_connections == 0)
        text = (await http_get(admin, "/metrics")).text
        assert total(text, "tlsedge_connections_closed_total", listener="db") == 1
        # Closed: the rest counted once, nothing twice.
        counts = byte_counts(text, "db", "app", backend.address)
        assert counts == [upload + 100, download, upload + 100, download]


async def _read_response(stream: trio.SocketStream) -> bytes:
    """One response with a Content-Length (or a 101 head), read whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(1 << 16)
    head, _, body = data.partition(b"\r\n\r\n")
    if b" 101 " in head.split(b"\r\n", 1)[0]:
        return data
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    assert length is not None, head
    while len(body) < int(length[1]):
        body += await stream.receive_some(1 << 16)
    return data[: len(head) + 4] + body


async def test_http_connections_count_their_bytes_while_they_run() -> None:
    # /status showed 0 B for a listener whose keep-alive connections carried
    # thousands of requests, and a WebSocket carried nothing until it closed.
    async with h11_edge(edge={"admin": "127.0.0.1:0"}) as (edge, app, address):
        admin = admin_address(edge)
        keep_alive = await connect(address)
        request = b"GET /download/200000 HTTP/1.1\r\nHost: example.com\r\n\r\n"
        sent = received = 0
        for _ in range(3):
            await keep_alive.send_all(request)
            sent += len(request)
            received += len(await _read_response(keep_alive))
        text = (await http_get(admin, "/metrics")).text
        assert byte_counts(text, "web", "app", app.address) == [sent, received] * 2
        # An upgraded connection: its relay's bytes count as they go.
        upgraded = await connect(address)
        upgrade = (
            b"GET /upgrade HTTP/1.1\r\nHost: example.com\r\n"
            b"Connection: Upgrade\r\nUpgrade: echo\r\n\r\n"
        )
        await upgraded.send_all(upgrade)
        head = await _read_response(upgraded)
        while not head.endswith(b"server-hello|"):
            head += await upgraded.receive_some(1 << 16)
        frame = b"frame" * 10000
        await upgraded.send_all(frame)
        echoed = b""
        while len(echoed) < len(frame):
            echoed += await upgraded.receive_some(1 << 16)
        assert echoed == frame.upper()
        sent += len(upgrade) + len(frame)
        received += len(head) + len(echoed)
        text = (await http_get(admin, "/metrics")).text
        assert total(text, "tlsedge_connections_active", listener="web") == 2
        assert byte_counts(text, "web", "app", app.address) == [sent, received] * 2
        # Both end: nothing is counted twice.
        await upgraded.send_eof()
        assert await read_all(upgraded) == b"|bye"
        await keep_alive.aclose()
        await wait_until(lambda: edge.active_connections == 0)
        received += len(b"|bye")
        text = (await http_get(admin, "/metrics")).text
        assert byte_counts(text, "web", "app", app.address) == [sent, received] * 2


class _Meter:
    """A connection's counts as a test sets them."""

    def __init__(self) -> None:
        self.counts: tuple[int, int, str | None] = (0, 0, None)

    def traffic(self) -> tuple[int, int, str | None]:
        return self.counts


async def test_open_connections_bytes_go_to_the_server_in_use() -> None:
    # An HTTP connection's requests may go to several servers: each flush
    # counts what came since the last one for the server used now; the end
    # counts the rest for the last one. Bytes before a server was chosen go
    # to the first one.
    metrics = EdgeMetrics()
    metrics.connection_opened("web")
    log = ConnectionLog(id="1", listener="web", peer="127.0.0.1:1", backend="app")
    meter = _Meter()
    metrics.metering(log, meter)

    def counts() -> list[float]:
        text = metrics.exposition()[0].decode()
        return [
            total(text, "tlsedge_client_bytes_received_total", listener="web"),
            total(text, "tlsedge_client_bytes_sent_total", listener="web"),
            total(text, "tlsedge_server_bytes_sent_total", server="a:1"),
            total(text, "tlsedge_server_bytes_received_total", server="a:1"),
            total(text, "tlsedge_server_bytes_sent_total", server="b:2"),
            total(text, "tlsedge_server_bytes_received_total", server="b:2"),
        ]

    meter.counts = (100, 0, None)  # a request head, no server yet
    assert counts() == [100, 0, 0, 0, 0, 0]
    meter.counts = (150, 1000, "a:1")
    assert counts() == [150, 1000, 150, 1000, 0, 0]
    assert counts() == [150, 1000, 150, 1000, 0, 0]  # no change, no count
    meter.counts = (300, 3000, "b:2")
    assert counts() == [300, 3000, 150, 1000, 150, 2000]
    log.bytes_from_client, log.bytes_from_server = 310, 3500
    log.server = "b:2"
    metrics.record(log)
    assert counts() == [310, 3500, 150, 1000, 160, 2500]
    meter.counts = (999, 999, "a:1")  # ended: no longer read
    assert counts() == [310, 3500, 150, 1000, 160, 2500]
