"""With ``workers = 2``, the counters in the shared metrics directory agree
with the workers' access log once they drained and exited: the counts of
connections that ended during the drain (each worker's last flush, in
`Edge.run`) are neither lost nor counted twice, and every live gauge is
back to 0."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from prometheus_client import CollectorRegistry, multiprocess

from tests.peers import free_port
from tests.tlsedge.control.test_admin import supervisor
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


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


def _config(port: int, web: int, *, tcp: str, http: str, log: Path) -> str:
    return (
        "[edge]\nworkers = 2\n"
        f'access_log = "{log}"\ndrain_timeout = 0.5\n\n'
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n\n'
        f'[[listeners]]\nname = "web"\nbind = "127.0.0.1:{web}"\nbackend = "h"\n'
        'mode = "http"\n\n'
        f'[[backends]]\nname = "b"\nservers = ["{tcp}"]\n\n'
        f'[[backends]]\nname = "h"\nservers = ["{http}"]\n'
    )


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
    port, web = free_port(), free_port()
    access_log = tmp_path / "access.log"
    path = tmp_path / "edge.toml"
    path.write_text(
        _config(port, web, tcp=tcp.address, http=http.address, log=access_log)
    )
    metrics_dir = tmp_path / "metrics"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    log = tmp_path / "log"
    ended, held, requests = 16, 6, 8
    async with supervisor(path, log, env) as process:
        await wait_until(lambda: log.read_text().count("listener in on") == 2, 30, 0.05)
        for _ in range(ended):
            await exchange(("127.0.0.1", port), b"x")
        # Open at the drain: relays and idle HTTP keep-alive connections,
        # ended (and counted) by the drain as the workers exit.
        open_clients = []
        for _ in range(held):
            client = await connect(("127.0.0.1", port))
            await Client(client, client).receive_until(b"hi")
            open_clients.append(client)
        for _ in range(requests // 2):
            client = await connect(("127.0.0.1", web))
            for _ in range(2):
                await client.send_all(REQUEST)
                await Client(client, client).receive_until(OK)
            open_clients.append(client)
        accepted = ended + held + requests // 2
        # Both workers served some (SO_REUSEPORT spreads by source port).
        assert len(list(metrics_dir.glob("counter_*.db"))) == 2
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0
    records = [json.loads(line) for line in access_log.read_text().splitlines()]
    assert sum("type" not in r for r in records) == accepted
    assert sum(r.get("termination") == "drained" for r in records) == (
        held + requests // 2
    )
    assert sum(r.get("type") == "http" for r in records) == requests
    assert_metrics_agree(_samples(metrics_dir), records)
