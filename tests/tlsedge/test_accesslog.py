"""The access-log lines' JSON encoding (`tlsedge._accesslog.JsonLine`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, strategies as st

from tlsedge._accesslog import JsonLine, format_time
from tlsedge._http import log as http_log
from tlsedge._http.log import RequestLog
from tlsedge._termination import Termination

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
