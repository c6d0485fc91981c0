"""The README's proxyproto snippets run as shown.

Every ```python block between "## proxyproto in ten lines" and "## tlsedge" is
executed. A block with top-level ``await`` (the trio server) runs under trio
with a real listener on 127.0.0.1 and a handler; its trust policy admits only
10.0.0.0/8, so a connection from here must be closed without a byte.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import trio

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def proxyproto_blocks() -> list[str]:
    text = README.read_text()
    start = text.index("## proxyproto in ten lines")
    end = text.index("\n## tlsedge", start)
    return _BLOCK.findall(text, start, end)


BLOCKS = proxyproto_blocks()


def test_the_readme_has_proxyproto_snippets() -> None:
    assert len(BLOCKS) >= 4


def compiled(source: str) -> Any:
    return compile(source, str(README), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize(
    "source",
    [b for b in BLOCKS if not inspect.CO_COROUTINE & compiled(b).co_flags],
)
def test_snippet_runs(source: str) -> None:
    exec(compiled(source), {})


@pytest.mark.parametrize(
    "source",
    [b for b in BLOCKS if inspect.CO_COROUTINE & compiled(b).co_flags],
)
async def test_async_snippet_serves(source: str) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    handled: list[object] = []

    async def handler(stream: trio.abc.Stream) -> None:
        handled.append(stream)
        await stream.aclose()

    namespace = {"listener": listener, "handler": handler, "trio": trio}
    async with trio.open_nursery() as nursery:

        async def serve() -> None:
            await eval(compiled(source), namespace)

        nursery.start_soon(serve)
        async with await trio.open_tcp_stream("127.0.0.1", port) as client:
            await client.send_all(b"PROXY TCP4 192.0.2.1 192.0.2.2 1 2\r\n")
            with trio.fail_after(5):
                try:
                    answer = await client.receive_some()
                except trio.BrokenResourceError:
                    answer = b""
        nursery.cancel_scope.cancel()
    assert answer == b""
    assert handled == []
