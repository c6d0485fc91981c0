"""Shared helpers for tlsedge's end-to-end tests."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from tlsedge._config import Config, config_from_mapping

__all__ = ["make_config", "open_client", "read_all"]


def make_config(
    listeners: list[Mapping[str, Any]],
    backends: list[Mapping[str, Any]],
    edge: Mapping[str, Any] | None = None,
) -> Config:
    """A Config from plain dicts (listeners default to 127.0.0.1:0)."""
    data: dict[str, Any] = {
        "listeners": [{"bind": "127.0.0.1:0", **lst} for lst in listeners],
        "backends": backends,
    }
    if edge is not None:
        data["edge"] = dict(edge)
    return config_from_mapping(data, base_dir=Path.cwd())


async def open_client(address: tuple[str, int]) -> trio.SocketStream:
    """A plain TCP connection to the edge."""
    return await trio.open_tcp_stream(*address)


async def read_all(stream: trio.abc.ReceiveStream, limit: int = 1 << 26) -> bytes:
    """Read until EOF."""
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(bytes(chunk))
        total += len(chunk)
        if total > limit:
            raise AssertionError("more data than expected")
