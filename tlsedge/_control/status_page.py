"""The admin endpoint's ``/status`` page: server-rendered HTML, no JavaScript.

In the spirit of HAProxy's stats page: the listeners (addresses, mode, TLS,
PROXY), HTTP requests per listener and per server (by status class, and per
second), each backend's servers with their health state and recent check
history, connections (open, total, per second), bytes and errors. Counts come
from the metrics registry, so with several workers they are the totals of all
of them; health, settings and state are those of the worker that answered.
The configuration section shows the reloads (the last one's result, time and
reason, counts by result): the edge's, the same from every worker.

`render_status_page` is a pure function of a `Snapshot` of the edge
(`Edge.snapshot`), the metric samples, the rates and the reload record: no
I/O, no clock (the times shown are the snapshot's), so a page can be rendered
from a snapshot built by hand.

The page refreshes itself every `REFRESH_SECONDS` (``<meta http-equiv=refresh>``)
and turns its tables into cards on narrow screens. Every value that reaches
the page goes through :func:`html.escape`.
"""

from __future__ import annotations

import collections
import html
import time
from collections.abc import Iterable, Mapping
from typing import Final

from tlsedge._core.accesslog import format_address
from tlsedge._core.reload import ReloadRecord, ReloadResult
from tlsedge._core.snapshot import (
    BackendSnapshot,
    CheckRecord,
    ListenerSnapshot,
    Snapshot,
)

__all__ = ["REFRESH_SECONDS", "render_status_page"]

#: Seconds between the page's own refreshes.
REFRESH_SECONDS: Final = 5

Sample = tuple[str, dict[str, str], float]

_CSS: Final = """
:root { color-scheme: light dark; --ok: #1a7f37; --bad: #cf222e; --warn: #9a6700;
  --line: #d0d7de; --head: #f0f3f6; --muted: #57606a; }
@media (prefers-color-scheme: dark) {
  :root { --line: #3d444d; --head: #1f2328; --muted: #9198a1; --ok: #3fb950;
    --bad: #f85149; --warn: #d29922; } }
* { box-sizing: border-box; }
body { font: 15px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
  margin: 0 auto; padding: 12px; max-width: 1200px; }
h1 { font-size: 1.4em; margin: 0 0 4px; }
h2 { font-size: 1.15em; margin: 24px 0 8px; }
.meta { color: var(--muted); font-size: .9em; margin: 0 0 12px; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px;
  font-weight: 600; font-size: .85em; color: #fff; vertical-align: middle; }
.badge.ok, .state.up { background: var(--ok); }
.badge.bad, .state.down { background: var(--bad); }
.badge.warn { background: var(--warn); }
.state { color: #fff; font-weight: 700; padding: 1px 8px; border-radius: 4px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr));
  gap: 8px; margin: 8px 0; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; }
.card b { display: block; font-size: 1.3em; }
.card span { color: var(--muted); font-size: .85em; }
table { border-collapse: collapse; width: 100%; margin: 4px 0 8px; }
th, td { border: 1px solid var(--line); padding: 4px 8px; text-align: left;
  vertical-align: top; }
th { background: var(--head); font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.hist { font-family: ui-monospace, monospace; letter-spacing: 1px;
  white-space: nowrap; }
.hist .ok { color: var(--ok); } .hist .fail { color: var(--bad); }
.detail { color: var(--muted); font-size: .85em; overflow-wrap: anywhere; }
.empty { color: var(--muted); font-style: italic; }
@media (max-width: 700px) {
  table, thead, tbody, tr, th, td { display: block; width: 100%; }
  thead { position: absolute; left: -9999px; }
  tr { border: 1px solid var(--line); border-radius: 6px; margin: 0 0 10px;
    padding: 4px 0; }
  td { border: none; padding: 3px 10px; text-align: right; }
  td.num { text-align: right; }
  td::before { content: attr(data-label); float: left; font-weight: 600;
    color: var(--muted); padding-right: 8px; }
  td:first-child { font-weight: 700; font-size: 1.05em; text-align: left; }
  td:first-child::before { content: ""; padding: 0; }
}
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


class _Totals:
    """Sums of registry samples, looked up by name and label values."""

    def __init__(self, samples: Iterable[Sample]) -> None:
        self._by_name: dict[str, list[tuple[dict[str, str], float]]] = (
            collections.defaultdict(list)
        )
        for name, labels, value in samples:
            self._by_name[name].append((labels, value))

    def sum(self, name: str, **labels: str) -> float:
        return sum(
            value
            for sample_labels, value in self._by_name.get(name, ())
            if all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """Sums of *name* grouped by the values of *label*."""
        grouped: dict[str, float] = collections.defaultdict(float)
        for sample_labels, value in self._by_name.get(name, ()):
            if all(sample_labels.get(k) == v for k, v in labels.items()):
                grouped[sample_labels.get(label, "")] += value
        return dict(grouped)


def _count(value: float) -> str:
    return f"{round(value):,}"


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def _rate_sum(rates: Mapping[str, float], prefix: str) -> str:
    """The sum of the rates whose key starts with *prefix*; "-" without rates."""
    if not rates:
        return "-"
    return _rate(sum(value for key, value in rates.items() if key.startswith(prefix)))


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def _td(label: str, content: str, css: str = "") -> str:
    """A cell; *content* must already be escaped HTML."""
    cls = f' class="{css}"' if css else ""
    return f'<td data-label="{_e(label)}"{cls}>{content}</td>'


def _table(headers: list[str], rows: list[str], empty: str) -> str:
    if not rows:
        return f'<p class="empty">{_e(empty)}</p>'
    head = "".join(f'<th scope="col">{_e(h)}</th>' for h in headers)
    return (
        f"<table><thead><tr>{head}</tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
    )


def _history(results: Iterable[CheckRecord]) -> str:
    marks = []
    for result in results:
        title = f"{result.source}: {result.detail} ({_duration(result.age)} ago)"
        mark, css = ("\u2713", "ok") if result.ok else ("\u2717", "fail")
        marks.append(
            f'<span class="{css}" title="{_e(title)}" aria-label="{_e(title)}">'
            f"{mark}</span>"
        )
    if not marks:
        return '<span class="empty">no checks yet</span>'
    return '<span class="hist">' + "".join(marks) + "</span>"


def _listeners(
    listeners: Iterable[ListenerSnapshot], totals: _Totals, rates: Mapping[str, float]
) -> str:
    rows = []
    for listener in listeners:
        name = listener.name
        binds = (
            ", ".join(format_address(a) for a in listener.addresses) or listener.bind
        )
        tls = (
            f"{listener.tls.policy}, client auth {listener.tls.client_auth}"
            if listener.tls is not None
            else "off"
        )
        pp = listener.proxy_protocol
        proxy = (
            "off"
            if pp is None
            else (
                "v"
                + "/v".join(str(v) for v in pp.versions)
                + f", untrusted: {pp.untrusted}"
            )
        )
        active = totals.sum("tlsedge_connections_active", listener=name)
        refused = totals.sum("tlsedge_connections_refused_total", listener=name)
        rows.append(
            "<tr>"
            + _td("Listener", _e(name))
            + _td("Bind", _e(binds))
            + _td("Mode", _e(listener.mode))
            + _td("TLS", _e(tls))
            + _td("PROXY", _e(proxy))
            + _td("Backend", _e(listener.backend))
            + _td(
                "Open / max",
                f"{_count(active)} / {_count(listener.max_connections)}",
                "num",
            )
            + _td(
                "Total",
                _count(totals.sum("tlsedge_connections_total", listener=name)),
                "num",
            )
            + _td("Conn/s (1 min)", _rate(rates.get("conn:" + name)), "num")
            + _td(
                "Bytes in",
                _bytes(
                    totals.sum("tlsedge_client_bytes_received_total", listener=name)
                ),
                "num",
            )
            + _td(
                "Bytes out",
                _bytes(totals.sum("tlsedge_client_bytes_sent_total", listener=name)),
                "num",
            )
            + _td("Refused", _count(refused), "num")
            + "</tr>"
        )
    return _table(
        [
            "Listener",
            "Bind",
            "Mode",
            "TLS",
            "PROXY",
            "Backend",
            "Open / max",
            "Total",
            "Conn/s (1 min)",
            "Bytes in",
            "Bytes out",
            "Refused",
        ],
        rows,
        "no listeners",
    )


#: The ``code`` label values of the HTTP request counters, in column order.
_STATUS_CLASSES: Final = ("1xx", "2xx", "3xx", "4xx", "5xx", "other")

_HTTP_REQUESTS: Final = "tlsedge_http_requests_total"
_SERVER_HTTP_REQUESTS: Final = "tlsedge_server_http_requests_total"


def _request_cells(by_class: Mapping[str, float], rate: float | None) -> str:
    """Requests, their rate, and the count of each status class."""
    return (
        _td("Requests", _count(sum(by_class.values())), "num")
        + _td("Req/s (1 min)", _rate(rate), "num")
        + "".join(
            _td(code, _count(by_class.get(code, 0.0)), "num")
            for code in _STATUS_CLASSES
        )
    )


_REQUEST_HEADERS: Final = ["Requests", "Req/s (1 min)", *_STATUS_CLASSES]


def _http(snapshot: Snapshot, totals: _Totals, rates: Mapping[str, float]) -> str:
    """HTTP requests by listener and by server, each by status class: the
    ``http`` listeners and the servers of their backends ("" without any)."""
    listeners = [lst for lst in snapshot.listeners if lst.mode == "http"]
    if not listeners:
        return ""
    rows = [
        "<tr>"
        + _td("Listener", _e(listener.name))
        + _td("Backend", _e(listener.backend))
        + _request_cells(
            totals.by(_HTTP_REQUESTS, "code", listener=listener.name),
            rates.get("req:" + listener.name),
        )
        + "</tr>"
        for listener in listeners
    ]
    behind = {listener.backend for listener in listeners}
    server_rows = [
        "<tr>"
        + _td("Server", _e(server.name))
        + _td("Backend", _e(backend.name))
        + _request_cells(
            totals.by(
                _SERVER_HTTP_REQUESTS, "code", backend=backend.name, server=server.name
            ),
            rates.get(f"server-req:{backend.name}/{server.name}"),
        )
        + "</tr>"
        for backend in snapshot.backends
        if backend.name in behind
        for server in backend.servers
    ]
    return (
        "<h2>HTTP requests</h2>"
        + _table(["Listener", "Backend", *_REQUEST_HEADERS], rows, "no listeners")
        + _table(["Server", "Backend", *_REQUEST_HEADERS], server_rows, "no servers")
    )


def _backends(backends: Iterable[BackendSnapshot], totals: _Totals) -> str:
    parts = []
    prefix = "tlsedge_backend"
    for backend in backends:
        name = backend.name
        health = backend.health
        checks = (
            f"{health.kind} check every {health.interval:g} s "
            f"(up after {health.healthy_threshold}, "
            f"down after {health.unhealthy_threshold})"
            if health is not None
            else "no active checks (passive only)"
        )
        servers = backend.servers
        up = sum(1 for s in servers if s.healthy)
        # A backend with no server (a DNS name with no records) is not healthy.
        badge = "ok" if servers and up == len(servers) else ("warn" if up else "bad")
        parts.append(
            f'<h2 id="backend-{_e(name)}">Backend {_e(name)} '
            f'<span class="badge {badge}">{up}/{len(servers)} UP</span></h2>'
            f'<p class="meta">{_e(backend.balance)}, {_e(checks)}, '
            f"retries {backend.retries}; "
            f"{_count(totals.sum(f'{prefix}_connect_failures_total', backend=name))}"
            " connections failed to connect, "
            f"{_count(totals.sum(f'{prefix}_no_server_total', backend=name))}"
            " found no server, "
            f"{_count(totals.sum(f'{prefix}_retries_total', backend=name))}"
            " retries</p>"
        )
        rows = []
        for server in servers:
            key = server.name
            if server.healthy:
                state = '<span class="state up">UP</span>'
            else:
                state = '<span class="state down">DOWN</span>'
                if server.trial_in is not None:
                    state += ' <span class="detail">(trial traffic soon)</span>'
            last = server.history[-1] if server.history else None
            last_text = (
                f"{last.detail} ({_duration(last.age)} ago)"
                if last is not None
                else "-"
            )
            labels = {"backend": name, "server": key}
            rows.append(
                "<tr>"
                + _td("Server", _e(key))
                + _td("State", state)
                + _td("Weight", _e(server.weight), "num")
                + _td(
                    "Open",
                    _count(totals.sum("tlsedge_server_active_connections", **labels)),
                    "num",
                )
                + _td(
                    "Total",
                    _count(totals.sum("tlsedge_server_connections_total", **labels)),
                    "num",
                )
                + _td(
                    "Bytes to",
                    _bytes(totals.sum("tlsedge_server_bytes_sent_total", **labels)),
                    "num",
                )
                + _td(
                    "Bytes from",
                    _bytes(totals.sum("tlsedge_server_bytes_received_total", **labels)),
                    "num",
                )
                + _td("Fails in a row", _e(server.failures), "num")
                + _td("Last result", f'<span class="detail">{_e(last_text)}</span>')
                + _td("History", _history(server.history))
                + "</tr>"
            )
        parts.append(
            _table(
                [
                    "Server",
                    "State",
                    "Weight",
                    "Open",
                    "Total",
                    "Bytes to",
                    "Bytes from",
                    "Fails in a row",
                    "Last result",
                    "History (oldest first)",
                ],
                rows,
                "no servers",
            )
        )
    if not parts:
        return '<p class="empty">no backends</p>'
    return "".join(parts)


def _errors(totals: _Totals) -> str:
    rows = []
    for metric, kind, label in (
        ("tlsedge_connections_refused_total", "refused", "reason"),
        ("tlsedge_proxy_header_errors_total", "PROXY header", "reason"),
        ("tlsedge_tls_handshake_failures_total", "TLS handshake", "reason"),
    ):
        for listener, _ in sorted(totals.by(metric, "listener").items()):
            for reason, count in sorted(
                totals.by(metric, label, listener=listener).items()
            ):
                if count:
                    rows.append(
                        "<tr>"
                        + _td("Kind", _e(kind))
                        + _td("Listener", _e(listener))
                        + _td("Reason", _e(reason))
                        + _td("Count", _count(count), "num")
                        + "</tr>"
                    )
    return _table(["Kind", "Listener", "Reason", "Count"], rows, "no errors so far")


def _terminations(totals: _Totals) -> str:
    rows = []
    for listener, _ in sorted(
        totals.by("tlsedge_connections_closed_total", "listener").items()
    ):
        causes = totals.by(
            "tlsedge_connections_closed_total", "termination", listener=listener
        )
        for cause, count in sorted(causes.items()):
            rows.append(
                "<tr>"
                + _td("Listener", _e(listener))
                + _td("Termination", _e(cause))
                + _td("Count", _count(count), "num")
                + "</tr>"
            )
    return _table(
        ["Listener", "Termination", "Count"], rows, "no connection has ended yet"
    )


_RESULT_BADGES: Final = {
    ReloadResult.APPLIED: "ok",
    ReloadResult.PARTIAL: "warn",
    ReloadResult.REFUSED: "bad",
}


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _reloads(record: ReloadRecord, now: float) -> str:
    """The configuration section: when it was loaded, the last reload's
    result and why, and the reloads by result."""
    loaded = f"Loaded at start {_utc(record.loaded)}."
    result, at = record.last_result, record.last_time
    if result is None or at is None:
        last = "No reload (SIGHUP) since."
    else:
        last = (
            f'Last reload <span class="badge {_RESULT_BADGES[result]}">'
            f"{_e(result.value.upper())}</span> {_e(_utc(at))} "
            f"({_e(_duration(now - at))} ago)"
        )
        if record.detail:
            last += f': <span class="detail">{_e(record.detail)}</span>'
        last += "."
    rows = [
        "<tr>"
        + _td("Result", _e(result.value))
        + _td("Reloads", _count(record.count(result)), "num")
        + "</tr>"
        for result in ReloadResult
    ]
    return f'<p class="meta">{_e(loaded)} {last}</p>' + _table(
        ["Result", "Reloads"], rows, "no reloads"
    )


def render_status_page(
    snapshot: Snapshot,
    samples: Iterable[Sample],
    rates: Mapping[str, float],
    *,
    reloads: ReloadRecord | None = None,
) -> str:
    """The ``/status`` page of the edge that *snapshot* shows.

    Args:
        snapshot: The edge's state (`Edge.snapshot`): listeners, backends,
            readiness, and the times the page shows.
        samples: Its metric samples (`EdgeMetrics.samples`), totals of every
            worker in multiprocess mode.
        rates: Per-second rates (`RateTracker`) by ``"conn:<listener>"``,
            ``"req:<listener>"`` and ``"server-req:<backend>/<server>"``.
        reloads: The edge's reloads (`EdgeMetrics.reloads`); None: no
            configuration section.

    Returns:
        A complete HTML document.
    """
    totals = _Totals(samples)
    if snapshot.draining:
        state = '<span class="badge warn">DRAINING</span>'
    elif snapshot.ready:
        state = '<span class="badge ok">READY</span>'
    else:
        state = '<span class="badge bad">STARTING</span>'
    workers = snapshot.workers
    scope = (
        f"Counts are totals over {workers} workers; health and state are those "
        f"of worker pid {snapshot.pid}."
        if workers > 1
        else f"pid {snapshot.pid}."
    )
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(snapshot.taken))
    cards = [
        (
            _count(totals.sum("tlsedge_connections_active")),
            "open connections",
        ),
        (_count(totals.sum("tlsedge_connections_total")), "connections total"),
        (_rate_sum(rates, "conn:"), "connections/s (1 min)"),
    ]
    if any(listener.mode == "http" for listener in snapshot.listeners):
        cards += [
            (_count(totals.sum(_HTTP_REQUESTS)), "HTTP requests"),
            (_rate_sum(rates, "req:"), "requests/s (1 min)"),
        ]
    cards += [
        (_bytes(totals.sum("tlsedge_client_bytes_received_total")), "from clients"),
        (_bytes(totals.sum("tlsedge_client_bytes_sent_total")), "to clients"),
        (_count(totals.sum("tlsedge_connections_refused_total")), "refused"),
    ]
    configuration = (
        ""
        if reloads is None
        else f"<h2>Configuration</h2>{_reloads(reloads, snapshot.taken)}"
    )
    cards_html = "".join(
        f'<div class="card"><b>{_e(value)}</b><span>{_e(label)}</span></div>'
        for value, label in cards
    )
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>tlsedge status</title>"
        f"<style>{_CSS}</style></head><body>"
        f"<h1>tlsedge status {state}</h1>"
        f'<p class="meta">tlsedge {_e(snapshot.version)}, up '
        f"{_e(_duration(snapshot.taken - snapshot.started))}, {_e(scope)} "
        f"Generated {_e(generated)}; refreshes every {REFRESH_SECONDS} s.</p>"
        f'<div class="cards">{cards_html}</div>'
        f"<h2>Listeners</h2>{_listeners(snapshot.listeners, totals, rates)}"
        f"{_http(snapshot, totals, rates)}"
        f"{_backends(snapshot.backends, totals)}"
        f"<h2>Errors</h2>{_errors(totals)}"
        f"<h2>Connections by termination</h2>{_terminations(totals)}"
        f"{configuration}"
        '<p class="meta"><a href="/metrics">/metrics</a> · '
        '<a href="/healthz">/healthz</a> · <a href="/readyz">/readyz</a></p>'
        "</body></html>\n"
    )
