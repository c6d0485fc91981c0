"""tlsedge's pure modules load no I/O framework, as proxyproto loads none.

The balancer, the configuration, the reload rules, the forwarding rules, the
access-log record, the snapshot and the status page are plain functions and
records: importing and using them must not pull in trio, asyncio, selectors,
socket or ssl. The check runs in a fresh interpreter, with the ``tlsedge``
package registered without running its ``__init__`` (which imports the
server, and so trio), so that each module is judged by its own imports.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

FORBIDDEN = ("trio", "asyncio", "socket", "ssl", "selectors")
PURE = (
    "tlsedge._core.snapshot",
    "tlsedge._control.status_page",
    "tlsedge._core.reload",
    "tlsedge._core.balancer",
    "tlsedge._core.config",
    "tlsedge._core.forwarded",
    "tlsedge._core.accesslog",
    "tlsedge._core.admission",
    "tlsedge._core.termination",
    "tlsedge._core.downstream",
    "tlsedge._core.proxy_wrap",
    "tlsedge._core.udp_flows",
    "tlsedge._http.head",
    "tlsedge._http.body",
    "tlsedge._http.rules",
    "tlsedge._http.events",
    "tlsedge._http.session",
    "tlsedge._http.exchange",
    "tlsedge._http.log",
    "tlsedge._http.h2session",
)

_SCRIPT = textwrap.dedent(
    """
    import importlib
    import importlib.util
    import sys
    import types
    from pathlib import Path

    spec = importlib.util.find_spec("tlsedge")
    package = types.ModuleType("tlsedge")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["tlsedge"] = package

    def loaded():
        return {name for name in FORBIDDEN if name in sys.modules}

    for module in PURE:
        before = loaded()
        importlib.import_module(module)
        print(module, " ".join(sorted(loaded() - before)))

    # Use them too: a lazy import inside a function would show up here.
    from tlsedge._core.balancer import Balancer, Server
    from tlsedge._core.config import config_from_mapping
    from tlsedge._core.forwarded import ForwardingContext, rewrite_forwarding_headers
    from tlsedge._core.snapshot import Snapshot
    from tlsedge._control.status_page import render_status_page

    config = config_from_mapping(
        {
            "listeners": [
                {"name": "in", "bind": "127.0.0.1:0", "backend": "b",
                 "mode": "http", "tls": {"certificates": [
                     {"cert": "c.pem", "key": "k.pem"}], "policy": "modern"}},
            ],
            "backends": [{"name": "b", "servers": ["127.0.0.1:9"]}],
        },
        base_dir=Path("/"),
    )
    context = ForwardingContext(
        client=("192.0.2.1", 1), destination=("192.0.2.2", 2), tls=True,
        trusted=False,
    )
    rewrite_forwarding_headers([], config.listeners[0].forwarded, context)
    balancer = Balancer([Server(("127.0.0.1", 9))], "least-connections")
    assert balancer.pick(None) is not None
    snapshot = Snapshot(
        version="0", pid=1, workers=1, started=0.0, taken=1.0, ready=True,
        draining=False, active_connections=0, max_connections=1, listeners=(),
        backends=(),
    )
    assert "READY" in render_status_page(snapshot, [], {})
    print("used", " ".join(sorted(loaded())))
    """
)


def test_pure_modules_import_no_io_framework() -> None:
    script = f"FORBIDDEN = {FORBIDDEN!r}\nPURE = {PURE!r}\n" + _SCRIPT
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.partition(" ")[::2] for line in result.stdout.splitlines())
    assert list(lines) == [*PURE, "used"]
    imported = {module: found for module, found in lines.items() if found}
    assert imported == {}, f"pure modules loaded an I/O framework: {imported}"
