"""Connections and edges ended at every stage of their life, over real
loopback sockets."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from tests.tlsedge.helpers import make_config
from tlsedge._backends.upstream import BackendPool
from tlsedge._control.edge import Edge


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


# -- a drain while the edge starts ------------------------------------------------


@pytest.mark.parametrize("end", ["drain", "stop"])
@pytest.mark.parametrize("mode", ["tcp", "udp"])
async def test_a_drain_while_the_edge_starts_serves_nothing_and_returns(
    mode: str,
    end: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A SIGTERM (or SIGINT) can come while the edge resolves its backends
    (the signal handlers are up first: `tlsedge._control.run`). The listeners
    bound after it are closed, not served, and ``run()`` returns. (A udp
    listener was served on after a drain: ``run()`` never returned. A tcp
    one was served, ``ready``, until ``run()`` returned.)"""
    resolving, resolved = trio.Event(), trio.Event()
    create = BackendPool.create

    async def slow_create(*args: Any, **kwargs: Any) -> BackendPool:
        resolving.set()
        await resolved.wait()  # a slow DNS answer
        return await create(*args, **kwargs)

    monkeypatch.setattr(BackendPool, "create", slow_create)
    config = make_config(
        [{"name": "in", "backend": "b", "mode": mode}],
        [{"name": "b", "servers": ["127.0.0.1:9"]}],
    )
    edge = Edge(config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(edge.run)
        await resolving.wait()
        getattr(edge, end)()
        resolved.set()
        with trio.fail_after(5):
            while nursery.child_tasks:
                assert not edge.ready
                await trio.sleep(0.01)
    assert not edge.ready
    assert [s.fileno() for s in edge._listeners["in"].sockets] == [-1]
    assert "listener in on" not in caplog.text
