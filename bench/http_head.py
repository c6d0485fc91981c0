"""HTTP/1.1 head parsing: tlsedge._http.head vs httptools (llhttp) vs h11, in-process;
and the per-request cost of HTTP mode's protocol layer.

    python bench/http_head.py            # 30 passes x 2000 parses per side per case
    python bench/http_head.py --quick    # 5 passes x 500
    python bench/http_head.py --cycle    # the protocol layer per request (no httptools)
    python bench/http_head.py --cycle --profile   # ... and a cProfile of it

Per typical head (a short GET, a browser GET with 12 fields, a POST with
Content-Length, a chunked POST, a 200 response with 8 fields), each side parses
the same bytes into a method/target (status), version, list of fields and
framing: ours with `parse_request_head`/`parse_response_head`; httptools with a
fresh ``HttpRequestParser``/``HttpResponseParser`` per head and callbacks that
collect the fields (what a proxy must do with it); h11 with a fresh
``h11.Connection`` per head, ``receive_data`` + ``next_event`` (what
tlsedge does per request today). Sides alternate order per pass, GC off
during a pass. Prints the median and best µs per head and the ratios
(theirs/ours, > 1 means ours is faster). Before timing, all three must accept
every head and agree on the fields.

httptools is not a dependency of tlsedge: ``pip install httptools`` to run the
comparison.

``--cycle``: one keep-alive request as HTTP mode handles it, without I/O (wrk's
GET, nginx's 200 with a 6-byte body, X-Forwarded-For from an untrusted
client): the `ClientSession` reads the request, the gate
(`tlsedge._http.gate.from_http1`: the target form, the `RequestRewriter`'s
fields, the serialised head checked) makes the backend's request, an
`UpstreamExchange` writes it and reads the response, `end_to_end_fields` and
the session write the response and its body, and the request's access-log
line is encoded (not written). Prints the median and best µs per request over
the passes.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import h11
from _common import banner, fmt_ratio, median, render_table

from tlsedge._core.config import ForwardedConfig
from tlsedge._core.forwarded import ForwardingContext
from tlsedge._http.events import Body, EndOfBody, Request, Response
from tlsedge._http.exchange import UpstreamExchange
from tlsedge._http.gate import from_http1
from tlsedge._http.head import parse_request_head, parse_response_head
from tlsedge._http.log import RequestLog
from tlsedge._http.rules import (
    RequestRewriter,
    end_to_end_fields,
    reason_phrase,
)
from tlsedge._http.session import ClientSession

try:
    import httptools
except ImportError:
    httptools = None

MAX_HEADERS = 100

REQUESTS: dict[str, bytes] = {
    "short GET": b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
    "browser GET (12 fields)": (
        b"GET /static/app.js?v=1.4.2 HTTP/1.1\r\n"
        b"Host: www.example.com\r\n"
        b"User-Agent: Mozilla/5.0 (X11; Linux x86_64; rv:120.0) Gecko/20100101 "
        b"Firefox/120.0\r\n"
        b"Accept: text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8\r\n"
        b"Accept-Language: en-US,en;q=0.5\r\n"
        b"Accept-Encoding: gzip, deflate, br\r\n"
        b"Referer: https://www.example.com/index.html\r\n"
        b"Connection: keep-alive\r\n"
        b"Cookie: session=0123456789abcdef0123456789abcdef; theme=dark\r\n"
        b"Upgrade-Insecure-Requests: 1\r\n"
        b"Sec-Fetch-Dest: script\r\n"
        b"Sec-Fetch-Mode: no-cors\r\n"
        b'If-None-Match: "5f2b-1a2b3c"\r\n'
        b"\r\n"
    ),
    "POST Content-Length": (
        b"POST /api/v1/items HTTP/1.1\r\nHost: api.example.com\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1234\r\n"
        b"Authorization: Bearer abcdef0123456789\r\n\r\n"
    ),
    "POST chunked": (
        b"POST /upload HTTP/1.1\r\nHost: api.example.com\r\n"
        b"Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    ),
}
RESPONSES: dict[str, bytes] = {
    "200 response (8 fields)": (
        b"HTTP/1.1 200 OK\r\n"
        b"Server: nginx/1.22.1\r\n"
        b"Date: Mon, 23 Nov 2026 21:00:00 GMT\r\n"
        b"Content-Type: text/html; charset=utf-8\r\n"
        b"Content-Length: 5120\r\n"
        b"Connection: keep-alive\r\n"
        b"Cache-Control: max-age=3600\r\n"
        b'ETag: "5f2b-1a2b3c"\r\n'
        b"Vary: Accept-Encoding\r\n"
        b"\r\n"
    ),
}

Parse = Callable[[bytes], Any]


def ours_request(head: bytes) -> Any:
    return parse_request_head(head, max_headers=MAX_HEADERS).headers


def ours_response(head: bytes) -> Any:
    return parse_response_head(head, max_headers=MAX_HEADERS).headers


class _Collect:
    """httptools callbacks: the target and the fields, as a proxy needs them."""

    __slots__ = ("headers", "url")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))


def httptools_request(head: bytes) -> Any:
    sink = _Collect()
    parser = httptools.HttpRequestParser(sink)
    parser.feed_data(head)
    parser.get_method()
    parser.get_http_version()
    return sink.headers


def httptools_response(head: bytes) -> Any:
    sink = _Collect()
    parser = httptools.HttpResponseParser(sink)
    parser.feed_data(head)
    parser.get_status_code()
    parser.get_http_version()
    return sink.headers


def h11_request(head: bytes) -> Any:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(head)
    event = conn.next_event()
    assert isinstance(event, h11.Request)
    return list(event.headers)


_GET = h11.Request(method="GET", target="/", headers=[("Host", "h")])


def h11_response(head: bytes) -> Any:
    conn = h11.Connection(h11.CLIENT)
    conn.send(_GET)
    conn.send(h11.EndOfMessage())
    conn.receive_data(head)
    event = conn.next_event()
    assert isinstance(event, h11.Response)
    return list(event.headers)


def _lowered(headers: Any) -> list[tuple[bytes, bytes]]:
    return [(bytes(n).lower(), bytes(v)) for n, v in headers]


def _per_call_us(parse: Parse, head: bytes, count: int) -> float:
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(count):
            parse(head)
        return (time.perf_counter() - start) / count * 1e6
    finally:
        gc.enable()


CYCLE_REQUEST = (
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1:49839\r\nUser-Agent: wrk\r\nAccept: */*\r\n\r\n"
)
CYCLE_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\n"
    b"Date: Tue, 24 Nov 2026 04:00:00 GMT\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 6\r\nConnection: keep-alive\r\n\r\nhello\n"
)


def request_cycle() -> Callable[[], None]:
    """One keep-alive request through the protocol layer (see ``--cycle``)."""
    rewriter = RequestRewriter(
        forwarded=ForwardedConfig(),
        context=ForwardingContext(
            client=("127.0.0.1", 5555),
            destination=("127.0.0.1", 443),
            tls=True,
            trusted=False,
        ),
        underscores=False,
    )
    session = ClientSession(max_header_bytes=8192, max_headers=100)

    def one() -> None:
        session.receive_data(CYCLE_REQUEST)
        request = session.next_event()
        assert isinstance(request, Request)
        head = request.head
        assert isinstance(session.next_event(), EndOfBody)
        exchange = UpstreamExchange(from_http1(head, rewriter, max_body_size=0))
        out = [exchange.request_head("127.0.0.1:8080")]
        exchange.receive_data(CYCLE_RESPONSE)
        response = exchange.next_event()
        assert isinstance(response, Response)
        status = response.head.status
        out.append(
            session.send_response(
                status,
                reason_phrase(status, response.head.reason),
                end_to_end_fields(response.head, keep_upgrade=False),
                response.body,
            )
        )
        body = exchange.next_event()
        assert isinstance(body, Body)
        out.append(session.send_data(body.data))
        end = exchange.next_event()
        assert isinstance(end, EndOfBody)
        out.append(session.send_end(end.trailers))
        assert exchange.reusable
        session.start_next_cycle()
        log = RequestLog(
            connection="c0ffee",
            listener="web",
            client="127.0.0.1:5555",
            start=1763950000.123,
            method=head.method.decode("ascii"),
            target=head.target.decode("latin-1"),
            version=head.version.decode("ascii"),
            host=(head.host or b"").decode("ascii"),
            user_agent=(head.user_agent or b"").decode("latin-1"),
            status=status,
            bytes_in=request.size,
            bytes_out=sum(map(len, out)),
            connect=0.000012,
            first_byte=0.000345,
            total=0.000456,
            backend="app",
            server="127.0.0.1:8080",
            tls="TLSv1.3 TLS_AES_128_GCM_SHA256",
        )
        _LOG_LINES.append(log.to_json())

    return one


_LOG_LINES: list[str] = []


def cycle(passes: int, count: int, profile: bool) -> None:
    one = request_cycle()
    print(banner("HTTP mode's protocol layer, one keep-alive request"))
    print(f"{passes} passes x {count} requests; µs per request\n")
    times = []
    for _ in range(passes):
        gc.disable()
        try:
            start = time.perf_counter()
            for _ in range(count):
                one()
            times.append((time.perf_counter() - start) / count * 1e6)
        finally:
            gc.enable()
            _LOG_LINES.clear()
    print(f"median {median(times):.1f} µs, best {min(times):.1f} µs per request")
    if profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(lambda: [one() for _ in range(count)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 passes x 500")
    parser.add_argument(
        "--cycle", action="store_true", help="the protocol layer per request"
    )
    parser.add_argument("--profile", action="store_true", help="with --cycle")
    args = parser.parse_args()
    passes, count = (5, 500) if args.quick else (30, 2000)
    if args.cycle:
        cycle(passes, count, args.profile)
        return
    if httptools is None:
        sys.exit("bench/http_head.py needs httptools: pip install httptools")
    print(banner("HTTP/1.1 head parsing: ours vs httptools vs h11"))
    print(f"httptools {httptools.__version__}, h11 {h11.__version__}")  # type: ignore[attr-defined]
    print(f"{passes} passes x {count} parses per side per case; µs per head\n")
    cases: list[tuple[str, bytes, dict[str, Parse]]] = [
        (
            name,
            head,
            {"ours": ours_request, "httptools": httptools_request, "h11": h11_request},
        )
        for name, head in REQUESTS.items()
    ] + [
        (
            name,
            head,
            {
                "ours": ours_response,
                "httptools": httptools_response,
                "h11": h11_response,
            },
        )
        for name, head in RESPONSES.items()
    ]
    rows = []
    for name, head, sides in cases:
        parsed = {side: _lowered(parse(head)) for side, parse in sides.items()}
        assert parsed["ours"] == parsed["httptools"] == parsed["h11"], (name, parsed)
        times: dict[str, list[float]] = {side: [] for side in sides}
        order = list(sides)
        for _ in range(passes):
            for side in order:
                times[side].append(_per_call_us(sides[side], head, count))
            order.reverse()
        med = {side: median(values) for side, values in times.items()}
        rows.append(
            [
                name,
                *(
                    f"{med[s]:.2f} ({min(times[s]):.2f})"
                    for s in ("ours", "httptools", "h11")
                ),
                fmt_ratio(med["httptools"] / med["ours"]),
                fmt_ratio(med["h11"] / med["ours"]),
            ]
        )
    print(
        render_table(
            [
                "head",
                "ours µs med (best)",
                "httptools",
                "h11",
                "httptools/ours",
                "h11/ours",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
