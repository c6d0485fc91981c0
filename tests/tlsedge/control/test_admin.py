"""The admin endpoint: probes, HTTP behaviour, the status page, workers = 2."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.peers import free_port
from tests.tlsedge.helpers import (
    Backend,
    address_of,
    close_clients,
    connect,
    exchange,
    make_config,
    read_all,
    running_edge,
    tag_handler,
    wait_until,
)
from tlsedge._control import admin as _admin
from tlsedge._control.edge import Edge
from tlsedge._core.config import ConfigError
from tlsedge._core.metrics import EdgeMetrics

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


class HTTPResponse:
    """A parsed HTTP/1.1 response (the admin endpoint always closes)."""

    def __init__(self, raw: bytes) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split(" ")[1])
        self.headers = {
            key.strip().lower(): value.strip()
            for key, _, value in (line.partition(":") for line in lines[1:])
        }

    @property
    def text(self) -> str:
        return self.body.decode()


async def http_request(
    address: tuple[str, int], raw: bytes, *, within: float = 10.0
) -> HTTPResponse:
    """Send *raw* to the admin endpoint; read the response until EOF."""
    with trio.fail_after(within):
        client = await trio.open_tcp_stream(*address)
        try:
            await client.send_all(raw)
            return HTTPResponse(await read_all(client))
        finally:
            await client.aclose()


async def http_get(
    address: tuple[str, int], path: str, method: str = "GET"
) -> HTTPResponse:
    """One request with *method* for *path*."""
    return await http_request(
        address,
        f"{method} {path} HTTP/1.1\r\nHost: admin\r\n\r\n".encode(),
    )


def admin_address(edge: Edge) -> tuple[str, int]:
    assert edge.admin is not None
    return edge.admin.addresses[0]


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` from a /metrics body."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of *name* whose labels include *labels*."""
    return sum(
        value
        for (sample, sample_labels), value in metric_values(text).items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def edge_config(backend: Backend, **backend_extra: Any) -> Any:
    return make_config(
        [{"name": "in", "backend": "b"}],
        [{"name": "b", "servers": [backend.address], **backend_extra}],
        {"admin": "127.0.0.1:0", "drain_timeout": 30.0},
    )


async def test_probes_flip_to_503_while_draining(nursery: trio.Nursery) -> None:
    backend = await Backend(tag_handler("hi", hold=True)).start(nursery)
    async with running_edge(edge_config(backend)) as edge:
        admin = admin_address(edge)
        assert admin[0] == "127.0.0.1"
        health = await http_get(admin, "/healthz")
        ready = await http_get(admin, "/readyz")
        assert (health.status, health.text) == (200, "ok\n")
        assert (ready.status, ready.text) == (200, "ready\n")
        assert ready.headers["connection"] == "close"
        # An open connection keeps the drain (and so the edge) going.
        client = await connect(address_of(edge, "in"))
        assert await client.receive_some(2) == b"hi"
        edge.drain()
        ready = await http_get(admin, "/readyz")
        assert (ready.status, ready.text) == (503, "draining\n")
        assert (await http_get(admin, "/healthz")).status == 200
        metrics = await http_get(admin, "/metrics")
        assert total(metrics.text, "tlsedge_draining") == 1
        assert total(metrics.text, "tlsedge_ready") == 0
        # The listening sockets are closed now; the page still shows their
        # addresses (it once failed on asking a closed socket for its name).
        status = await http_get(admin, "/status")
        assert status.status == 200
        assert '<span class="badge warn">DRAINING</span>' in status.text
        host, port = address_of(edge, "in")
        assert f">{host}:{port}<" in _row_of(status.text, "in")


async def test_readyz_is_503_before_the_listeners_are_up() -> None:
    config = make_config(
        [{"name": "in", "backend": "b"}],
        [{"name": "b", "servers": ["127.0.0.1:9"]}],
        {"admin": "127.0.0.1:0"},
    )
    edge = Edge(config)
    server = _admin.AdminServer(edge.snapshot, EdgeMetrics(), [])
    response = server._readyz(_request(b"/readyz"))
    assert (response.status, response.body) == (503, b"not ready\n")
    assert server._healthz(_request(b"/healthz")).status == 200


def _request(target: bytes) -> Any:
    import h11

    return h11.Request(method="GET", target=target, headers=[("Host", "x")])


async def test_http_errors_and_head(nursery: trio.Nursery) -> None:
    backend = await Backend(tag_handler("hi")).start(nursery)
    async with running_edge(edge_config(backend)) as edge:
        admin = admin_address(edge)
        missing = await http_get(admin, "/nope")
        assert (missing.status, missing.text) == (404, "404 not found\n")
        post = await http_get(admin, "/metrics", method="POST")
        assert post.status == 405
        assert post.headers["allow"] == "GET, HEAD"
        head = await http_get(admin, "/status", method="HEAD")
        assert head.status == 200
        assert head.body == b""
        assert int(head.headers["content-length"]) > 1000
        assert head.headers["content-type"] == "text/html; charset=utf-8"
        # A query string does not change the route.
        assert (await http_get(admin, "/healthz?verbose=1")).status == 200
        index = await http_get(admin, "/")
        assert 'href="/status"' in index.text or "href='/status'" in index.text
        bad = await http_request(admin, b"NOT HTTP AT ALL\r\n\r\n")
        assert bad.status == 400
        huge = await http_request(
            admin,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: "
            + b"a" * (_admin.MAX_HEADER_SIZE + 10)
            + b"\r\n\r\n",
        )
        assert huge.status == 431


async def test_request_head_timeout(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_admin, "REQUEST_TIMEOUT", 0.3)
    backend = await Backend(tag_handler("hi")).start(nursery)
    async with running_edge(edge_config(backend)) as edge:
        response = await http_request(
            admin_address(edge), b"GET /healthz HTTP/1.1\r\nHost:", within=5
        )
        assert response.status == 408


async def test_admin_address_may_not_share_a_listener_port() -> None:
    with pytest.raises(ConfigError, match=r"edge\.admin: .*collides"):
        make_config(
            [{"name": "in", "bind": "127.0.0.1:8443", "backend": "b"}],
            [{"name": "b", "servers": ["127.0.0.1:9"]}],
            {"admin": "127.0.0.1:8443"},
        )
    with pytest.raises(ConfigError, match="collides"):
        make_config(
            [{"name": "in", "bind": "0.0.0.0:8443", "backend": "b"}],
            [{"name": "b", "servers": ["127.0.0.1:9"]}],
            {"admin": "127.0.0.1:8443"},
        )


async def test_admin_bind_failure_is_a_config_error() -> None:
    with trio.socket.socket() as taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = make_config(
            [{"name": "in", "backend": "b"}],
            [{"name": "b", "servers": ["127.0.0.1:9"]}],
            {"admin": f"127.0.0.1:{port}"},
        )
        with pytest.raises(ConfigError, match=r"edge\.admin"):
            await Edge(config).run()


HEALTH = {"interval": 0.1, "timeout": 0.1, "healthy_threshold": 1}


async def test_status_page_shows_a_server_going_down(nursery: trio.Nursery) -> None:
    up = await Backend(tag_handler("up"), name="up").start(nursery)
    down = await Backend(tag_handler("down"), name="down").start(nursery)
    config = make_config(
        [
            {"name": "web", "backend": "app"},
            {
                "name": "lb",
                "backend": "app",
                "proxy_protocol": {"trusted": ["127.0.0.0/8"]},
            },
        ],
        [
            {
                "name": "app",
                "servers": [up.address, down.address],
                "health": {**HEALTH, "unhealthy_threshold": 1},
            }
        ],
        {"admin": "127.0.0.1:0"},
    )
    async with running_edge(config) as edge:
        admin = admin_address(edge)
        await exchange(address_of(edge, "web"))
        page = await http_get(admin, "/status")
        assert page.status == 200
        html = page.text
        assert '<meta http-equiv="refresh" content="5">' in html
        assert 'name="viewport"' in html
        assert "<script" not in html
        for text in ("web", "lb", "app", up.address, down.address, "READY"):
            assert text in html
        assert html.count('class="state up">UP<') == 2
        assert "v1/v2, untrusted: reject" in html
        down.stop()
        await wait_until(
            lambda: not edge.snapshot().backends[0].servers[1].healthy, 10, 0.05
        )
        html = (await http_get(admin, "/status")).text
        row = _row_of(html, down.address)
        assert 'class="state down">DOWN<' in row
        assert "connection refused" in row
        assert 'class="fail"' in row
        assert 'class="state up">UP<' in _row_of(html, up.address)
        assert "1/2 UP" in html
        metrics = (await http_get(admin, "/metrics")).text
        assert total(metrics, "tlsedge_server_up", server=down.address) == 0
        assert total(metrics, "tlsedge_server_up", server=up.address) == 1
        assert total(metrics, "tlsedge_server_last_check_success", server=up.address)


def _row_of(html: str, server: str) -> str:
    match = re.search(
        r"<tr><td[^>]*>" + re.escape(server) + r"</td>.*?</tr>", html, re.DOTALL
    )
    assert match is not None, f"no row for {server}"
    return match[0]


# -- workers = 2: one scrape gives the totals of both -------------------------


@contextlib.asynccontextmanager
async def supervisor(
    config: Path, log: Path, env: dict[str, str]
) -> AsyncIterator[trio.Process]:
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tlsedge", "run", str(config)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=env,
        )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            with trio.move_on_after(15) as cleanup, trio.CancelScope(shield=True):
                await process.wait()
            if cleanup.cancelled_caught:
                process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


async def scrape(admin: tuple[str, int], within: float = 20.0) -> str:
    with trio.fail_after(within):
        while True:
            try:
                response = await http_get(admin, "/metrics")
            except (OSError, trio.BrokenResourceError):
                await trio.sleep(0.05)
                continue
            assert response.status == 200
            return response.text


async def test_two_workers_report_totals(nursery: trio.Nursery, tmp_path: Path) -> None:
    backend = await Backend(tag_handler("hi")).start(nursery)
    port, admin_port = free_port(), free_port()
    path = tmp_path / "edge.toml"
    path.write_text(
        f'[edge]\nworkers = 2\nadmin = "127.0.0.1:{admin_port}"\n\n'
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n\n'
        f'[[backends]]\nname = "b"\nservers = ["{backend.address}"]\n'
    )
    metrics_dir = tmp_path / "metrics"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    log = tmp_path / "log"
    admin = ("127.0.0.1", admin_port)
    count = 24
    async with supervisor(path, log, env) as process:
        await wait_until(lambda: log.read_text().count("listener in on") == 2, 30, 0.05)
        await wait_until(lambda: log.read_text().count("admin endpoint on") == 2, 30)
        assert total(await scrape(admin), "tlsedge_connections_total") == 0
        for _ in range(count):
            assert await exchange(("127.0.0.1", port)) == b"hi"
        # Both workers served some (SO_REUSEPORT spreads by source port):
        # each one's counters live in its own file.
        await wait_until(
            lambda: len(list(metrics_dir.glob("counter_*.db"))) == 2, 10, 0.05
        )
        # A client has its EOF a moment before the worker records the
        # connection: wait until the last one is counted, then scrape.
        with trio.fail_after(10):
            while True:
                text = await scrape(admin)
                if total(text, "tlsedge_connections_closed_total") == count:
                    break
                await trio.sleep(0.05)
        pids = set()
        for _ in range(6):
            text = await scrape(admin)
            assert total(text, "tlsedge_connections_total", listener="in") == count
            assert total(text, "tlsedge_server_connections_total") == count
            assert total(text, "tlsedge_client_bytes_sent_total") == 2 * count
            assert total(text, "tlsedge_connections_active") == 0
            for family in text_string_to_metric_families(text):
                if family.name == "tlsedge_worker_info":
                    pids.add(family.samples[0].labels["pid"])
                    assert family.samples[0].labels["workers"] == "2"
        assert pids <= {str(pid) for pid in _children(process.pid)}
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0
    # The supervisor was given the directory, so it keeps it.
    assert metrics_dir.is_dir()


async def test_two_workers_show_the_bytes_of_each_others_open_connections(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # A connection stays open in one worker; a scrape answered by either
    # worker shows its bytes (the other one's at most a flush interval old).
    upload = 1 << 20
    received: list[int] = []

    async def count_until_eof(stream: trio.SocketStream) -> None:
        received.append(0)
        while chunk := await stream.receive_some(1 << 16):
            received[-1] += len(chunk)

    backend = await Backend(count_until_eof).start(nursery)
    port, admin_port = free_port(), free_port()
    path = tmp_path / "edge.toml"
    path.write_text(
        f'[edge]\nworkers = 2\nadmin = "127.0.0.1:{admin_port}"\n\n'
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n\n'
        f'[[backends]]\nname = "b"\nservers = ["{backend.address}"]\n'
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}
    log = tmp_path / "log"
    admin = ("127.0.0.1", admin_port)
    async with supervisor(path, log, env) as process:
        await wait_until(lambda: log.read_text().count("listener in on") == 2, 30, 0.05)
        await wait_until(lambda: log.read_text().count("admin endpoint on") == 2, 30)
        client = await connect(("127.0.0.1", port))
        await client.send_all(b"u" * upload)
        await wait_until(lambda: received == [upload])
        seen_by: set[str] = set()
        with trio.fail_after(30):
            while len(seen_by) < 2:
                text = await scrape(admin)
                assert total(text, "tlsedge_connections_closed_total") == 0
                if total(text, "tlsedge_client_bytes_received_total") == upload:
                    seen_by.add(_worker_pid(text))
                await trio.sleep(0.05)
        assert seen_by <= {str(pid) for pid in _children(process.pid)}
        await client.aclose()


def _worker_pid(text: str) -> str:
    """The pid of the worker that answered a scrape."""
    for family in text_string_to_metric_families(text):
        if family.name == "tlsedge_worker_info":
            return str(family.samples[0].labels["pid"])
    raise AssertionError("no tlsedge_worker_info")


def _children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry))
    return found
