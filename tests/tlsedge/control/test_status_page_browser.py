"""The /status page in a real headless browser (Debian's chromium).

The page must load, show a backend server UP, then DOWN once its listener is
stopped, and render on a phone-sized window (a screenshot is taken each run).
Skips when chromium is absent, unless TLSEDGE_REQUIRE_PEERS=1.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import trio

from tests.peers import require
from tests.tlsedge.control.test_admin import admin_address
from tests.tlsedge.helpers import (
    Backend,
    address_of,
    exchange,
    make_config,
    running_edge,
    tag_handler,
    wait_until,
)

pytestmark = pytest.mark.peers

#: Chromium's first start (profile creation) can be slow on a busy machine.
BROWSER_TIMEOUT = 90.0


def _chromium_args(binary: str, profile: Path) -> list[str]:
    return [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--window-size=390,844",
    ]


async def _chromium(args: list[str]) -> str:
    with trio.fail_after(BROWSER_TIMEOUT):
        result = await trio.run_process(
            args,
            capture_stdout=True,
            capture_stderr=True,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    return result.stdout.decode(errors="replace")


async def dump_dom(binary: str, profile: Path, url: str) -> str:
    """The DOM chromium rendered for *url*."""
    return await _chromium([*_chromium_args(binary, profile), "--dump-dom", url])


async def screenshot(binary: str, profile: Path, url: str, png: Path) -> None:
    await _chromium([*_chromium_args(binary, profile), f"--screenshot={png}", url])


def _state_of(dom: str, server: str) -> str:
    row = re.search(
        r"<tr><td[^>]*>" + re.escape(server) + r"</td>.*?</tr>", dom, re.DOTALL
    )
    assert row is not None, f"no row for {server} in the rendered page"
    state = re.search(r'class="state (up|down)">(UP|DOWN)<', row[0])
    assert state is not None, row[0]
    return state[2]


async def test_status_page_in_a_browser(nursery: trio.Nursery, tmp_path: Path) -> None:
    binary = require("chromium")
    app = await Backend(tag_handler("a"), name="a").start(nursery)
    spare = await Backend(tag_handler("b"), name="b").start(nursery)
    config = make_config(
        [
            {"name": "public", "backend": "app"},
            {
                "name": "from-lb",
                "backend": "app",
                "proxy_protocol": {"trusted": ["127.0.0.0/8"]},
            },
        ],
        [
            {
                "name": "app",
                "servers": [app.address, spare.address],
                "health": {
                    "interval": 0.2,
                    "timeout": 0.2,
                    "healthy_threshold": 1,
                    "unhealthy_threshold": 2,
                },
            }
        ],
        {"admin": "127.0.0.1:0"},
    )
    profile = tmp_path / "profile"
    async with running_edge(config) as edge:
        for _ in range(3):
            await exchange(address_of(edge, "public"))
        host, port = admin_address(edge)
        url = f"http://{host}:{port}/status"

        dom = await dump_dom(binary, profile, url)
        assert "<title>tlsedge status</title>" in dom
        assert _state_of(dom, app.address) == "UP"
        assert _state_of(dom, spare.address) == "UP"
        assert "2/2 UP" in dom

        spare.stop()

        def spare_is_down() -> bool:
            (app_backend,) = edge.snapshot().backends
            (server,) = (s for s in app_backend.servers if s.name == spare.address)
            return not server.healthy

        await wait_until(spare_is_down, 10, 0.05)
        dom = await dump_dom(binary, profile, url)
        assert _state_of(dom, spare.address) == "DOWN"
        assert _state_of(dom, app.address) == "UP"
        assert "1/2 UP" in dom
        assert "connection refused" in dom

        png = tmp_path / "status.png"
        await screenshot(binary, profile, url, png)
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        assert len(data) > 5000
