"""The /status page rendered from snapshots built by hand (no edge, no sockets)."""

from __future__ import annotations

import dataclasses
import re

from tlsedge._control.status_page import render_status_page
from tlsedge._core.reload import ReloadRecord, ReloadResult
from tlsedge._core.snapshot import (
    BackendSnapshot,
    CheckRecord,
    HealthCheckSettings,
    ListenerSnapshot,
    ListenerTls,
    ProxyProtocolSettings,
    ServerSnapshot,
    Snapshot,
)

STARTED = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


def server(
    address: tuple[str, int] = ("10.0.0.1", 8080), **changes: object
) -> ServerSnapshot:
    base = ServerSnapshot(
        address=address,
        weight=1,
        healthy=True,
        active=0,
        failures=0,
        successes=3,
        trial_in=None,
        history=(CheckRecord(age=4.0, ok=True, detail="HTTP 200", source="check"),),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def backend(*servers: ServerSnapshot, name: str = "app") -> BackendSnapshot:
    return BackendSnapshot(
        name=name,
        balance="round-robin",
        retries=3,
        health=HealthCheckSettings(
            kind="http", interval=10.0, healthy_threshold=2, unhealthy_threshold=6
        ),
        servers=servers,
    )


def listener(name: str = "web", **changes: object) -> ListenerSnapshot:
    base = ListenerSnapshot(
        name=name,
        mode="tcp",
        backend="app",
        bind="0.0.0.0:8443",
        addresses=(("0.0.0.0", 8443), ("::", 8443)),
        max_connections=500,
        connections=2,
        tls=ListenerTls(policy="intermediate", client_auth="none"),
        proxy_protocol=ProxyProtocolSettings(versions=(1, 2), untrusted="reject"),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def snapshot(**changes: object) -> Snapshot:
    base = Snapshot(
        version="9.8.7",
        pid=4242,
        workers=1,
        started=STARTED,
        taken=STARTED + 3725.0,
        ready=True,
        draining=False,
        active_connections=2,
        max_connections=10000,
        listeners=(listener(),),
        backends=(backend(server()),),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def render(snap: Snapshot, samples: list[tuple[str, dict[str, str], float]]) -> str:
    return render_status_page(snap, samples, {})


def row_of(html: str, first_cell: str) -> str:
    match = re.search(
        r"<tr><td[^>]*>" + re.escape(first_cell) + r"</td>.*?</tr>", html, re.DOTALL
    )
    assert match is not None, f"no row for {first_cell}"
    return match[0]


async def test_a_ready_edge_with_its_listener_and_server() -> None:
    samples = [
        ("tlsedge_connections_active", {"listener": "web"}, 2.0),
        ("tlsedge_connections_total", {"listener": "web"}, 1234.0),
        ("tlsedge_server_connections_total", {"backend": "app", "server": "x"}, 5.0),
    ]
    html = render(snapshot(), samples)
    assert html.startswith("<!doctype html>")
    assert '<span class="badge ok">READY</span>' in html
    # The times come from the snapshot: uptime and the generation time.
    assert "tlsedge 9.8.7, up 1h 2m, pid 4242." in html
    assert "Generated 2023-11-14 23:15:25 UTC" in html
    row = row_of(html, "web")
    assert ">0.0.0.0:8443, [::]:8443<" in row
    assert ">intermediate, client auth none<" in row
    assert ">v1/v2, untrusted: reject<" in row
    assert ">2 / 500<" in row
    assert ">1,234<" in row
    server_row = row_of(html, "10.0.0.1:8080")
    assert 'class="state up">UP<' in server_row
    assert "HTTP 200 (4s ago)" in server_row
    assert '<span class="badge ok">1/1 UP</span>' in html
    assert "http check every 10 s (up after 2, down after 6)" in html


async def test_a_down_server() -> None:
    down = server(
        ("2001:db8::5", 443),
        healthy=False,
        failures=6,
        successes=0,
        trial_in=12.0,
        history=(
            CheckRecord(age=130.0, ok=True, detail="HTTP 200", source="check"),
            CheckRecord(
                age=20.0, ok=False, detail="connection refused", source="check"
            ),
            CheckRecord(
                age=3.0, ok=False, detail="timeout after 5 s", source="traffic"
            ),
        ),
    )
    html = render(snapshot(backends=(backend(server(), down),)), [])
    row = row_of(html, "[2001:db8::5]:443")
    assert 'class="state down">DOWN<' in row
    assert "(trial traffic soon)" in row
    assert "timeout after 5 s (3s ago)" in row  # the last result
    assert row.count('class="fail"') == 2
    assert row.count('class="ok"') == 1
    assert 'title="check: HTTP 200 (2m 10s ago)"' in row
    assert ">6<" in row  # fails in a row
    assert '<span class="badge warn">1/2 UP</span>' in html
    every_down = render(snapshot(backends=(backend(down),)), [])
    assert '<span class="badge bad">0/1 UP</span>' in every_down


async def test_a_draining_edge_and_one_that_is_starting() -> None:
    draining = render(snapshot(ready=False, draining=True), [])
    assert '<span class="badge warn">DRAINING</span>' in draining
    assert "READY" not in draining
    starting = render(snapshot(ready=False), [])
    assert '<span class="badge bad">STARTING</span>' in starting


async def test_an_empty_backend_is_not_shown_as_healthy() -> None:
    html = render(snapshot(backends=(backend(name="empty"),)), [])
    assert '<span class="badge bad">0/0 UP</span>' in html
    assert '<p class="empty">no servers</p>' in html
    nothing = render(snapshot(listeners=(), backends=()), [])
    assert '<p class="empty">no listeners</p>' in nothing
    assert '<p class="empty">no backends</p>' in nothing


async def test_names_and_details_are_escaped() -> None:
    evil = "<script>alert('x')</script>"
    snap = snapshot(
        listeners=(listener(name='"><evil>web', backend="a&b"),),
        backends=(
            backend(
                server(
                    healthy=False,
                    history=(
                        CheckRecord(age=1.0, ok=False, detail=evil, source="check"),
                    ),
                ),
                name='x"><evil>',
            ),
        ),
    )
    samples = [
        (
            "tlsedge_connections_refused_total",
            {"listener": "<evil>", "reason": "r"},
            1.0,
        )
    ]
    html = render(snap, samples)
    assert "<script>" not in html
    assert "<evil>" not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "&quot;&gt;&lt;evil&gt;web" in html
    assert ">a&amp;b<" in html
    assert 'id="backend-x&quot;&gt;&lt;evil&gt;"' in html
    assert ">&lt;evil&gt;<" in html  # a label value from the metrics


async def test_the_configuration_section_shows_the_reloads() -> None:
    loaded = ReloadRecord(loaded=STARTED)
    html = render_status_page(snapshot(), [], {}, reloads=loaded)
    assert "Loaded at start 2023-11-14 22:13:20 UTC. No reload (SIGHUP) since." in html
    assert ">0<" in row_of(html, "refused")
    refused = loaded.after(ReloadResult.APPLIED, STARTED + 60).after(
        ReloadResult.REFUSED, STARTED + 3600, "listeners[0].tls: <bad> & worse"
    )
    html = render_status_page(snapshot(), [], {}, reloads=refused)
    assert (
        'Last reload <span class="badge bad">REFUSED</span> 2023-11-14 23:13:20 UTC '
        '(2m 5s ago): <span class="detail">listeners[0].tls: &lt;bad&gt; &amp; '
        "worse</span>."
    ) in html
    assert ">1<" in row_of(html, "applied")
    assert ">0<" in row_of(html, "partial")
    assert ">1<" in row_of(html, "refused")
    partial = refused.after(ReloadResult.PARTIAL, STARTED + 3700, "edge.workers")
    html = render_status_page(snapshot(), [], {}, reloads=partial)
    assert '<span class="badge warn">PARTIAL</span>' in html


def cells(row: str) -> list[str]:
    """The contents of a row's cells."""
    return re.findall(r"<td[^>]*>(.*?)</td>", row, re.DOTALL)


async def test_http_requests_by_listener_and_server() -> None:
    web = listener("web", mode="http")
    relay = listener("relay", mode="tcp", backend="db")
    db = backend(server(("10.0.0.9", 5432)), name="db")
    snap = snapshot(
        listeners=(web, relay),
        backends=(backend(server(), server(("10.0.0.2", 8080))), db),
    )
    requests = "tlsedge_http_requests_total"
    per_server = "tlsedge_server_http_requests_total"
    first = {"backend": "app", "server": "10.0.0.1:8080"}
    samples = [
        (requests, {"listener": "web", "backend": "app", "code": "2xx"}, 5000.0),
        (requests, {"listener": "web", "backend": "app", "code": "3xx"}, 12.0),
        (requests, {"listener": "web", "backend": "app", "code": "4xx"}, 30.0),
        (requests, {"listener": "web", "backend": "app", "code": "5xx"}, 3.0),
        (per_server, {**first, "code": "2xx"}, 4000.0),
        (per_server, {**first, "code": "5xx"}, 2.0),
        ("tlsedge_client_bytes_received_total", {"listener": "web"}, 3 << 20),
    ]
    rates = {"conn:web": 0.37, "req:web": 6012.4, "server-req:app/10.0.0.1:8080": 4800}
    html = render_status_page(snap, samples, rates)
    section = html.split("<h2>HTTP requests</h2>", 1)[1].split("<h2", 1)[0]
    # Listener: requests, rate, then 1xx..5xx and other.
    assert cells(row_of(section, "web")) == [
        "web",
        "app",
        "5,045",
        "6012",
        "0",
        "5,000",
        "12",
        "30",
        "3",
        "0",
    ]
    assert "relay" not in section  # a tcp listener has no requests
    assert cells(row_of(section, "10.0.0.1:8080")) == [
        "10.0.0.1:8080",
        "app",
        "4,002",
        "4800",
        "0",
        "4,000",
        "0",
        "0",
        "2",
        "0",
    ]
    assert cells(row_of(section, "10.0.0.2:8080"))[2:4] == ["0", "-"]
    assert "10.0.0.9" not in section  # behind no http listener
    # The overall cards: requests and their rate next to connections.
    assert "<b>5,045</b><span>HTTP requests</span>" in html
    assert "<b>6012</b><span>requests/s (1 min)</span>" in html
    assert "<b>0.37</b><span>connections/s (1 min)</span>" in html
    assert "<b>3.0 MiB</b><span>from clients</span>" in html


async def test_no_http_section_without_an_http_listener() -> None:
    html = render(snapshot(), [])
    assert "HTTP requests" not in html
    assert "requests/s" not in html
