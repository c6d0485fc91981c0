"""With ``workers = 2``, the counters agree with the workers' access log:
on ``/metrics`` while they run (each worker's counts flushed periodically,
every live gauge back to 0 once its connections ended), and in the shared
metrics directory once they drained and exited: the counts of connections
that ended during the drain (each worker's last flush, in `Edge.run`) are
neither lost nor counted twice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client import CollectorRegistry, multiprocess

from tests.peers import free_port
from tests.tlsedge.control.test_admin import metric_values, scrape, supervisor, total
from tests.tlsedge.e2e.test_lifecycle import (
    OK,
    REQUEST,
    Client,
    Sample,
    ScriptedBackend,
    assert_metrics_agree,
)
from tests.tlsedge.helpers import (
    Backend,
    close_clients,
    connect,
    exchange,
    tag_handler,
    wait_until,
)
from tests.tlsedge.pipeline.test_udp import Client as UdpClient, servers


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


def _config(ports: dict[str, int], servers: dict[str, str], log: Path) -> str:
    """Listeners ``in`` (tcp), ``web`` (http) and ``dns`` (udp) on *ports*
    (and ``admin``), each to its backend's server in *servers*."""
    text = (
        f'[edge]\nworkers = 2\nadmin = "127.0.0.1:{ports["admin"]}"\n'
        f'access_log = "{log}"\ndrain_timeout = 0.5\n\n'
    )
    for name, mode in (("in", "tcp"), ("web", "http"), ("dns", "udp")):
        text += (
            f'[[listeners]]\nname = "{name}"\nbind = "127.0.0.1:{ports[name]}"\n'
            f'backend = "{name}"\nmode = "{mode}"\n\n'
            f'[[backends]]\nname = "{name}"\nservers = ["{servers[name]}"]\n\n'
        )
    return text


async def _udp_server(*, task_status: trio.TaskStatus[list[Any]]) -> None:
    """A udp echo server (answers ``u|<datagram>``), until cancelled."""
    async with servers("u") as started:
        task_status.started(started)
        await trio.sleep_forever()


def _lines(access_log: Path) -> int:
    return len(access_log.read_text().splitlines()) if access_log.exists() else 0


def _records(access_log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in access_log.read_text().splitlines()]


def _scraped(text: str) -> list[Sample]:
    """The samples of a ``/metrics`` body."""
    return [
        (name, dict(labels), value)
        for (name, labels), value in metric_values(text).items()
    ]


def _samples(directory: Path) -> list[Sample]:
    """What the workers' files add up to (what a scrape would say)."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    return [
        (sample.name, sample.labels, sample.value)
        for family in registry.collect()
        for sample in family.samples
    ]


async def test_the_counts_of_two_workers_agree_with_the_access_log_after_a_drain(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    tcp = await Backend(tag_handler("hi", hold=True)).start(nursery)
    http = ScriptedBackend("http")
    await http.start(nursery)
    (udp,) = await nursery.start(_udp_server)
    ports = {name: free_port() for name in ("in", "web", "dns", "admin")}
    port, web, dns = ports["in"], ports["web"], ("127.0.0.1", ports["dns"])
    access_log = tmp_path / "access.log"
    path = tmp_path / "edge.toml"
    servers = {"in": tcp.address, "web": http.address, "dns": udp.address}
    path.write_text(_config(ports, servers, access_log))
    metrics_dir = tmp_path / "metrics"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    log = tmp_path / "log"
    admin = ("127.0.0.1", ports["admin"])
    ended, held, requests, flows = 16, 6, 8, 6
    async with supervisor(path, log, env) as process:
        started = ["listener in on", "listener web on", "listener dns on"]
        await wait_until(
            lambda: all(log.read_text().count(line) == 2 for line in started), 30, 0.05
        )
        await wait_until(lambda: log.read_text().count("admin endpoint on") == 2, 30)
        for _ in range(ended):
            await exchange(("127.0.0.1", port), b"x")
        # A scrape answered by either worker shows both workers' counts
        # (the other's at its last periodic flush): wait for the last one.
        await wait_until(lambda: _lines(access_log) == ended)
        with trio.fail_after(10):
            while True:
                text = await scrape(admin)
                if total(text, "tlsedge_connections_closed_total") == ended:
                    break
                await trio.sleep(0.05)
        assert_metrics_agree(_scraped(text), _records(access_log))
        # Open at the drain: relays, idle HTTP keep-alive connections and
        # udp flows, ended (and counted) by the drain as the workers exit
        # (the tcp clients are closed after the test: `close_clients`).
        for _ in range(held):
            client = await connect(("127.0.0.1", port))
            await Client(client, client).receive_until(b"hi")
        for _ in range(requests // 2):
            client = await connect(("127.0.0.1", web))
            for _ in range(2):
                await client.send_all(REQUEST)
                await Client(client, client).receive_until(OK)
        async with contextlib.AsyncExitStack() as udp_clients:
            for _ in range(flows):
                flow = await udp_clients.enter_async_context(UdpClient())
                assert await flow.ask(dns, b"1") == b"u|1"
                assert await flow.ask(dns, b"2") == b"u|2"
        accepted = ended + held + requests // 2 + flows
        # Both workers served some (SO_REUSEPORT spreads by source port).
        assert len(list(metrics_dir.glob("counter_*.db"))) == 2
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0
    records = _records(access_log)
    assert sum("type" not in r for r in records) == accepted
    assert sum(r.get("termination") == "drained" for r in records) == (
        held + requests // 2 + flows
    )
    assert sum(r.get("type") == "http" for r in records) == requests
    samples = _samples(metrics_dir)
    assert_metrics_agree(samples, records)
    datagrams = {
        labels["direction"]: value
        for name, labels, value in samples
        if name == "tlsedge_udp_datagrams_total"
    }
    assert datagrams == {"from_client": 2 * flows, "from_server": 2 * flows}
