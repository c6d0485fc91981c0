"""The access-log lines' JSON encoding (`tlsedge._core.accesslog.JsonLine`), and
how addresses are written (`tlsedge._core.accesslog.format_address`), also over real
connections."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket

import pytest
import trio
from hypothesis import given, strategies as st

from proxyproto import ProxyHeader, encode_v2
from tests.tlsedge.control.test_admin import admin_address, http_get
from tests.tlsedge.core.test_admission import exchange_from
from tests.tlsedge.helpers import (
    Backend,
    access_records,
    address_of,
    make_config,
    running_edge,
    wait_access_records,
)
from tlsedge._core.accesslog import JsonLine, format_address, format_time
from tlsedge._core.termination import Termination
from tlsedge._http import log as http_log
from tlsedge._http.log import RequestLines, RequestLog

_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # inf and nan included: json's own spelling
    st.text(),
    st.sampled_from(list(Termination)),
    st.lists(st.integers(), max_size=3),
)


@given(st.lists(st.tuples(st.text(), _VALUES), unique_by=lambda kv: kv[0]))
def test_json_line_is_json_dumps(items: list[tuple[str, object]]) -> None:
    keys = [key for key, _ in items]
    values = [value for _, value in items]
    expected = json.dumps(dict(items), separators=(",", ":"))
    assert JsonLine(keys).encode(values) == expected


def test_json_line_first_members_come_first() -> None:
    line = JsonLine(["a", "b"], first='"type":"x"').encode([1, None])
    assert line == '{"type":"x","a":1,"b":null}'
    assert JsonLine([], first='"type":"x"').encode([]) == '{"type":"x"}'
    assert JsonLine([]).encode([]) == "{}"


def _full_log() -> RequestLog:
    return RequestLog(
        connection="c0ffee",
        listener="web",
        client="192.0.2.1:1234",
        start=1763950000.123456,
        method="GET",
        target='/a"\u00e9',
        version="1.1",
        host="example.com",
        user_agent="curl/8",
        status=200,
        bytes_in=40,
        bytes_out=210,
        connect=0.0001234567,
        first_byte=0.000345,
        total=1.23456789,
        backend="app",
        server="10.0.0.1:8080",
        tls="TLSv1.3 TLS_AES_128_GCM_SHA256",
        sni="example.com",
        request_id="r1",
        termination=Termination.OK,
        detail="what\nhappened",
    )


@pytest.mark.parametrize(
    "log",
    [
        _full_log(),
        # Every optional field None; a plain str termination.
        RequestLog(connection="c1", listener="\u2603", client=None, termination="x"),
    ],
)
def test_request_line_has_every_field_in_order(
    log: RequestLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected: dict[str, object] = {"type": "http", **dataclasses.asdict(log)}
    expected["start"] = format_time(log.start)
    for key in ("connect", "first_byte", "total"):
        value = getattr(log, key)
        expected[key] = None if value is None else round(value, 6)
    lines: list[str] = []
    monkeypatch.setattr(http_log, "write_access_line", lines.append)
    monkeypatch.setattr(http_log, "access_log_enabled", lambda: True)
    log.emit()
    (line,) = lines
    assert line == json.dumps(expected, separators=(",", ":"))


_TEXTS = st.one_of(st.none(), st.text())
_DURATIONS = st.floats(min_value=0, max_value=1e9)


@given(
    shared=st.fixed_dictionaries(
        {
            "connection": st.text(),
            "listener": st.text(),
            "client": _TEXTS,
            "backend": _TEXTS,
            "tls": _TEXTS,
            "sni": _TEXTS,
        }
    ),
    start=st.floats(min_value=0, max_value=2**33),
    texts=st.tuples(*[_TEXTS] * 5),
    status=st.one_of(st.none(), st.integers()),
    sizes=st.tuples(st.integers(min_value=0), st.integers(min_value=0)),
    durations=st.tuples(st.none() | _DURATIONS, st.none() | _DURATIONS, _DURATIONS),
    server=_TEXTS,
    request_id=_TEXTS,
    termination=st.sampled_from(list(Termination)) | st.text(),
    detail=_TEXTS,
)
def test_request_lines_are_json_dumps(
    *,
    shared: dict[str, str | None],
    start: float,
    texts: tuple[str | None, ...],
    status: int | None,
    sizes: tuple[int, int],
    durations: tuple[float | None, float | None, float],
    server: str | None,
    request_id: str | None,
    termination: str,
    detail: str | None,
) -> None:
    # The shared fields encoded once per connection, the rest per request:
    # the same text as json.dumps, every string escaped.
    lines = RequestLines(**shared)  # type: ignore[arg-type]
    method, target, version, host, agent = texts
    log = lines.new(start, method, target, version, host=host, user_agent=agent)
    log.status = status
    log.bytes_in, log.bytes_out = sizes
    log.connect, log.first_byte, log.total = durations
    log.server = server
    log.request_id = request_id
    log.termination = termination
    log.detail = detail
    expected = {
        "type": "http",
        "connection": shared["connection"],
        "listener": shared["listener"],
        "client": shared["client"],
        "start": format_time(start),
        "method": method,
        "target": target,
        "version": version,
        "host": host,
        "user_agent": agent,
        "status": status,
        "bytes_in": sizes[0],
        "bytes_out": sizes[1],
        "connect": None if durations[0] is None else round(durations[0], 6),
        "first_byte": None if durations[1] is None else round(durations[1], 6),
        "total": round(durations[2], 6),
        "backend": shared["backend"],
        "server": server,
        "tls": shared["tls"],
        "sni": shared["sni"],
        "request_id": request_id,
        "termination": termination,
        "detail": detail,
    }
    line = lines.line(log)
    assert line == json.dumps(expected, separators=(",", ":"))
    assert line.isascii()
    assert line.isprintable()
    assert line == log.to_json()


@given(
    start=st.floats(min_value=0, max_value=2**33),
    texts=st.tuples(*[_TEXTS] * 5),
)
def test_a_new_request_log_is_the_dataclass_with_its_defaults(
    start: float, texts: tuple[str | None, ...]
) -> None:
    lines = RequestLines(
        connection="c", listener="l", client="a", backend="b", tls="t", sni="s"
    )
    method, target, version, host, agent = texts
    made = lines.new(start, method, target, version, host=host, user_agent=agent)
    assert made == RequestLog(
        connection="c",
        listener="l",
        client="a",
        start=start,
        method=method,
        target=target,
        version=version,
        host=host,
        user_agent=agent,
        backend="b",
        tls="t",
        sni="s",
    )


_REPEATED = st.one_of(
    st.none(), st.sampled_from(["GET", "a", '"\u00e9', ""]), st.text()
)


@given(
    st.lists(
        st.tuples(
            *[_REPEATED] * 6,
            st.sampled_from(list(Termination)) | st.text(),
            st.sampled_from([0.0, 1.5, 1.9995, 2.0, 1e9 + 0.25])
            | st.floats(min_value=0, max_value=2**33),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_the_requests_of_one_connection_have_their_own_lines(
    requests: list[
        tuple[
            str | None,
            str | None,
            str | None,
            str | None,
            str | None,
            str | None,
            str,
            float,
        ]
    ],
) -> None:
    # A connection's lines reuse the JSON of a value its last request had,
    # and the text of its second: each line is still what a line of its own
    # would be.
    lines = RequestLines(
        connection="c", listener="l", client=None, backend="b", tls=None, sni=None
    )
    for method, target, version, host, agent, server, termination, start in requests:
        log = lines.new(start, method, target, version, host=host, user_agent=agent)
        log.server = server
        log.termination = termination
        assert lines.line(log) == log.to_json()
        assert json.loads(lines.line(log))["server"] == server


@pytest.mark.parametrize(
    "seconds",
    [
        0.0,
        0.5e-6,
        1.25e-05,  # repr: exponent
        0.0000995,
        0.0001,
        0.0078125,  # a tie in binary: to even
        0.1234565,
        0.5,
        1.0,
        12.0000004,
        86400.999999501,
        999999999.9999995,
        1e9,
        1e16,
    ],
)
def test_request_line_durations_are_rounded_to_the_microsecond(
    seconds: float,
) -> None:
    log = RequestLines(
        connection="c", listener="l", client=None, backend=None, tls=None, sni=None
    ).new(0.0)
    log.connect = log.first_byte = log.total = seconds
    text = repr(round(seconds, 6))
    assert f'"connect":{text},"first_byte":{text},"total":{text},' in log.to_json()


# -- addresses ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "text"),
    [
        (("192.0.2.66", 40000), "192.0.2.66:40000"),
        (("::ffff:192.0.2.66", 40000), "[::ffff:192.0.2.66]:40000"),
        (("2001:db8::1", 443), "[2001:db8::1]:443"),
        (None, None),
    ],
)
def test_format_address(address: tuple[str, int] | None, text: str | None) -> None:
    assert format_address(address) == text


def has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


async def http_app(stream: trio.SocketStream) -> None:
    """Read a PROXY v1 line and a request; answer with the line."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        data += chunk
    line = data.partition(b"\r\n")[0]
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(line), line)
    )


@pytest.mark.skipif(not has_ipv6(), reason="no IPv6: no IPv4-mapped socket")
async def test_ipv4_mapped_addresses_are_written_with_their_ipv4_address(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    # A dual-stack proxy in front names IPv4 clients ::ffff:a.b.c.d (TCP6);
    # the server is reached over a real dual-stack connection: an IPv6
    # socket to ::ffff:127.0.0.1.
    caplog.set_level(logging.INFO, logger="tlsedge")
    backend = await Backend(http_app).start(nursery)
    server = f"[::ffff:127.0.0.1]:{backend.port}"
    config = make_config(
        [
            {
                "name": "web",
                "backend": "b",
                "mode": "http",
                "allow": ["10.0.0.0/8"],
                "denied": "403",
                "proxy_protocol": {"trusted": ["127.0.0.2"]},
            }
        ],
        [{"name": "b", "servers": [server], "send_proxy": "v1"}],
        {"admin": "127.0.0.1:0"},
    )
    request = b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    destination = ("::ffff:192.0.2.1", 80)
    inside = encode_v2(
        ProxyHeader.from_addresses(("::ffff:10.0.0.66", 40000), destination)
    )
    outside = encode_v2(
        ProxyHeader.from_addresses(("::ffff:192.0.2.66", 40001), destination)
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "web")
        allowed = await exchange_from("127.0.0.2", address, inside + request)
        refused = await exchange_from("127.0.0.2", address, outside + request)
        status = (await http_get(admin_address(edge), "/status")).text
        await wait_access_records(caplog, 2)
    assert allowed.startswith(b"HTTP/1.1 200 ")
    # The PROXY v1 line to the server.
    assert allowed.endswith(
        b"\r\n\r\nPROXY TCP6 ::ffff:10.0.0.66 ::ffff:192.0.2.1 40000 80"
    )
    assert refused.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    records = {r["client"]: r for r in access_records(caplog)}
    assert records["[::ffff:10.0.0.66]:40000"]["server"] == server
    assert records["[::ffff:10.0.0.66]:40000"]["destination"] == (
        "[::ffff:192.0.2.1]:80"
    )
    denied = records["[::ffff:192.0.2.66]:40001"]
    assert denied["detail"] == (
        "client ::ffff:192.0.2.66 is in no allow network; answered 403"
    )
    assert server in status
    logged = " ".join(
        r.getMessage() for r in caplog.records if r.name != "tlsedge.access"
    )
    assert "[::ffff:192.0.2.66]:40001" in logged
    assert "c000" not in logged + status
    assert not any("c000" in json.dumps(r) for r in access_records(caplog))
