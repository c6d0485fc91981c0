"""The one gate between a client's request and an upstream (pure).

Every request, whatever version it arrived in, reaches an upstream as an
HTTP/1.1 head built here and nowhere else. `UpstreamRequest` is that head: its
constructor serialises a method, a target and fields, and checks the result
against one grammar before anything can send it (RFC 9110 section 5 and RFC
9112 sections 3 and 5):

* the method is a token; the target is visible ASCII (no control byte, SP or
  byte above 0x7E: what `tlsedge._http.head` refuses in a request line);
* each field name is a token; each value a field-value: no NUL, CR, LF or
  other control byte but HTAB, no SP or HTAB at either end (RFC 9113 section
  8.2.1 asks the same of HTTP/2 values);
* the framing fields agree with how the body will be sent (`BodyKind`): no
  Content-Length and no Transfer-Encoding without a body (a zero length
  allowed), exactly one valid positive Content-Length for a sized body,
  exactly ``Transfer-Encoding: chunked`` and no Content-Length for a chunked
  one; at most one Host.

The rules are `tlsedge._http.head`'s, the ones a client's HTTP/1.1 head is
parsed with (`method_error`, `target_error`, `field_error` name what breaks
them, one component at a time). The check runs on the bytes that will be
sent: one compiled expression for the whole head plus a count of its line
ends, which must be one per field and two more, so that no component can
carry a line of its own (a CR LF in a value would make two well-formed lines).
Only a refused head is taken apart again, to name what was wrong
(`RequestRejectedError`, 400).
`UpstreamRequest.last_chunk` does the same for the trailer section after a
chunked body.

The version-specific steps that come before are here too, so both versions
share them: `from_http1` (a head `tlsedge._http.head` parsed) and
`from_http2` (a stream's request `tlsedge._http.h2session.check_request`
checked) apply the target form, the body size limit, the Upgrade rules and
the forwarding rewrite (`tlsedge._http.rules.RequestRewriter`), and return an
`UpstreamRequest`. The drivers get nothing else to send: the exchange
(`tlsedge._http.exchange.UpstreamExchange`) takes only an `UpstreamRequest`.

The common HTTP/1.1 request (an origin-form target from a client that is no
trusted proxy, no Upgrade, no ``Connection`` naming a field it holds) is not
split into fields and written again: its head is *spliced*, the request line
and the field lines as received, minus the lines the proxy drops, plus the
forwarding lines (`tlsedge._http.rules.RequestRewriter.splice`). Every byte of
it then passed the parser's rules already, whole lines were cut and ours are
made from checked values, so it is not checked a second time; a test holds
the splice to the split-and-written path (`tests/tlsedge/http/test_gate.py`).
An HTTP/2 request is spliced the same way, from field lines made of its
fields, which `check_request` held to the same grammar (another test there
holds it to the written path).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from tlsedge._http.body import (
    CHUNKED_BODY,
    LENGTH_BODY,
    NO_BODY,
    BodyKind,
    encode_fields,
)
from tlsedge._http.head import (
    FIELD_VALUE,
    HOST_RE,
    TOKEN,
    RequestRejectedError,
    field_error,
    method_error,
    target_error,
)
from tlsedge._http.rules import (
    NOT_NAMED_AWAY,
    RequestRewriter,
    any_field,
    origin_form,
)

if TYPE_CHECKING:
    from tlsedge._http.h2session import H2Request
    from tlsedge._http.head import RequestHead

__all__ = ["MAX_INFORMATIONAL", "UpstreamRequest", "from_http1", "from_http2"]

Header = tuple[bytes, bytes]

#: Most 1xx responses relayed for one request (an upstream that sends more is
#: treated as broken: 502, or the response cut).
MAX_INFORMATIONAL: Final = 32

_FIELD_LINES: Final = rb"(?:" + TOKEN + rb": " + FIELD_VALUE + rb"\r\n)*\r\n"
_HEAD_RE: Final = re.compile(TOKEN + rb" [\x21-\x7e]+ HTTP/1\.1\r\n" + _FIELD_LINES)
_LAST_CHUNK_RE: Final = re.compile(rb"0\r\n" + _FIELD_LINES)
# In a head `_HEAD_RE` accepted: the fields the framing check reads.
_FRAMING_RE: Final = re.compile(
    rb"\n(content-length|transfer-encoding|host): ([^\r]*)", re.IGNORECASE
)
_CONTENT_LENGTH_RE: Final = re.compile(rb"[0-9]{1,18}")


class UpstreamRequest:
    """A request head that passed the gate: the bytes that go upstream, and
    the facts the drivers act on (see the module docstring).

    Args:
        method: The request method.
        target: The request target, as the upstream gets it.
        fields: The fields as the upstream gets them, in order.
        body: How the body goes upstream.
        request_id: The request id given to the upstream (for the log).
        upgrade: The request asks the upstream to switch protocols.

    Raises:
        RequestRejectedError: 400, saying which rule the request breaks.
    """

    __slots__ = (
        "body",
        "content_length",
        "data",
        "host",
        "method",
        "request_id",
        "upgrade",
    )

    def __init__(
        self,
        method: bytes,
        target: bytes,
        fields: Sequence[Header],
        body: BodyKind,
        *,
        request_id: bytes | None = None,
        upgrade: bool = False,
    ) -> None:
        data = encode_fields(method + b" " + target + b" HTTP/1.1\r\n", fields)
        if _HEAD_RE.fullmatch(data) is None or data.count(b"\n") != len(fields) + 2:
            raise RequestRejectedError(400, _head_error(method, target, fields))
        self.content_length, self.host = _framing(data, body)
        self.data = data
        self.method = method
        self.body = body
        self.request_id = request_id
        self.upgrade = upgrade

    def head_for(self, server: str) -> bytes:
        """The head to send to *server* (``host:port``): a request without
        Host (HTTP/1.0) gets the server's address as its Host."""
        if self.host is not None:
            return self.data
        host = server.encode("ascii")
        if not HOST_RE.fullmatch(host):
            raise RequestRejectedError(400, f"server address {server!r} as Host")
        return self.data[:-2] + b"Host: " + host + b"\r\n\r\n"

    @staticmethod
    def last_chunk(trailers: Sequence[Header]) -> bytes:
        """The end of a chunked body: the last chunk and the trailer section.

        Raises:
            RequestRejectedError: 400, a trailer field breaks the field rules.
        """
        if not trailers:
            return b"0\r\n\r\n"
        data = encode_fields(b"0\r\n", trailers)
        if (
            _LAST_CHUNK_RE.fullmatch(data) is None
            or data.count(b"\n") != len(trailers) + 2
        ):
            reason = next(
                (error for n, v in trailers if (error := field_error(n, v))),
                "a trailer field that spans lines",
            )
            raise RequestRejectedError(400, f"trailer {reason}")
        return data


def _framing(data: bytes, body: BodyKind) -> tuple[int | None, bytes | None]:
    """The Content-Length and Host of a head `_HEAD_RE` accepted, after
    checking that its framing fields agree with *body*."""
    length: int | None = None
    coding: bytes | None = None
    host: bytes | None = None
    for name, value in _FRAMING_RE.findall(data):
        first = name[0] | 0x20  # the name's first byte, lowercased
        if first == 0x68:  # "h": Host
            if host is not None:
                raise RequestRejectedError(400, "more than one Host")
            host = value
        elif first == 0x63:  # "c": Content-Length
            if length is not None or not _CONTENT_LENGTH_RE.fullmatch(value):
                raise RequestRejectedError(
                    400, "more than one or a malformed Content-Length"
                )
            length = int(value)
        else:  # Transfer-Encoding
            if coding is not None:
                raise RequestRejectedError(400, "more than one Transfer-Encoding")
            coding = value
    if body is CHUNKED_BODY:
        if length is not None or coding is None or coding.lower() != b"chunked":
            raise RequestRejectedError(
                400, "a chunked body needs Transfer-Encoding: chunked alone"
            )
    elif coding is not None:
        raise RequestRejectedError(400, "Transfer-Encoding without a chunked body")
    elif body is LENGTH_BODY:
        if not length:
            raise RequestRejectedError(400, "a sized body without its Content-Length")
    elif length:
        raise RequestRejectedError(
            400, f"Content-Length {length} on a request without a body"
        )
    return length, host


def _head_error(method: bytes, target: bytes, fields: Sequence[Header]) -> str:
    """The first rule a refused head breaks."""
    error = method_error(method) or target_error(target)
    if error is None:
        error = next((e for n, v in fields if (e := field_error(n, v))), None)
    return error or "a field that spans lines"


def _without_h2c(headers: list[Header]) -> list[Header]:
    """*headers* with h2c taken out of ``Upgrade`` (a field left empty goes).

    RFC 9113 section 3.1 retired the h2c upgrade; tunnelled after a 101, it
    would carry requests past the forwarding rules, the request id and the
    access log, so the edge never asks an upstream for it (nginx does not
    either).
    """
    out: list[Header] = []
    for name, value in headers:
        if name.lower() == b"upgrade":
            protocols = [p.strip(b" \t") for p in value.split(b",")]
            kept = [p for p in protocols if p and p.lower() != b"h2c"]
            if not kept:
                continue
            if len(kept) != len(protocols):
                out.append((name, b", ".join(kept)))
                continue
        out.append((name, value))
    return out


def from_http1(
    head: RequestHead, rewriter: RequestRewriter, *, max_body_size: int
) -> UpstreamRequest:
    """The upstream request for an HTTP/1.x request head.

    An absolute-form target goes as origin-form with its authority as Host
    (`tlsedge._http.rules.origin_form`). ``Upgrade`` is kept (with
    ``Connection: upgrade``) when the client asked for it with ``Connection:
    upgrade`` and named a protocol other than h2c.

    Raises:
        RequestRejectedError: 501 for CONNECT, 413 for a Content-Length over
            *max_body_size* (0: no limit), 400 for a target or a field the
            gate refuses.
    """
    if head.method == b"CONNECT":
        raise RequestRejectedError(501, "CONNECT is not supported")
    target, authority = origin_form(head.method, head.target)
    length = head.content_length or 0
    if max_body_size and length > max_body_size:
        raise RequestRejectedError(
            413, f"request body larger than {max_body_size} bytes"
        )
    if head.chunked:
        body = CHUNKED_BODY
    elif length:
        body = LENGTH_BODY
    else:
        body = NO_BODY
    # (RFC 9110 section 7.8: an Upgrade in an HTTP/1.0 request is ignored.)
    asks_upgrade = (
        head.upgrade and b"upgrade" in head.connection and head.version == b"1.1"
    )
    if authority is None and not asks_upgrade and not _names_a_field(head):
        spliced = rewriter.splice(head.field_lines, host=head.host)
        if spliced is not None:
            lines, request_id = spliced
            return _spliced(
                head.method,
                target,
                lines,
                body,
                content_length=head.content_length,
                host=head.host,
                request_id=request_id,
            )
    headers = head.headers
    upgrade = False
    if asks_upgrade:
        headers = _without_h2c(headers)
        upgrade = any(name.lower() == b"upgrade" for name, _ in headers)
    fields, request_id = rewriter.head_fields(
        headers,
        connection=head.connection,
        upgrade=upgrade,
        authority=authority,
        host=head.host,
    )
    return UpstreamRequest(
        head.method,
        target,
        fields,
        body,
        request_id=request_id,
        upgrade=upgrade,
    )


def _names_a_field(head: RequestHead) -> bool:
    """Whether the head's ``Connection`` names a field it holds (one the
    proxy drops, beyond the hop-by-hop ones)."""
    named = head.connection - NOT_NAMED_AWAY
    return bool(named) and any_field(head.field_lines, named)


def _spliced(
    method: bytes,
    target: bytes,
    field_lines: bytes,
    body: BodyKind,
    *,
    content_length: int | None,
    host: bytes | None,
    request_id: bytes | None,
) -> UpstreamRequest:
    """The upstream request spliced from a head the parser (or
    `tlsedge._http.h2session.check_request`) validated
    (`tlsedge._http.rules.RequestRewriter.splice`: whole lines cut out, ours
    appended): its request line and lines passed the rules already, and the
    framing fields (*content_length*, *host*) are the head's, which were
    checked with it."""
    request = object.__new__(UpstreamRequest)
    request.data = b"%s %s HTTP/1.1\r\n%s\r\n" % (method, target, field_lines)
    request.method = method
    request.body = body
    request.content_length = content_length
    request.host = host
    request.request_id = request_id
    request.upgrade = False
    return request


def from_http2(
    request: H2Request, rewriter: RequestRewriter, *, max_body_size: int
) -> UpstreamRequest:
    """The upstream request for an HTTP/2 stream's request.

    A body without ``content-length`` goes chunked, as an HTTP/1.1 client
    would send it (trailers can follow).

    Raises:
        RequestRejectedError: 413 for a content-length over *max_body_size*
            (0: no limit), 400 for what the gate refuses.
    """
    length = request.content_length
    if max_body_size and (length or 0) > max_body_size:
        raise RequestRejectedError(
            413, f"request body larger than {max_body_size} bytes"
        )
    fields = request.headers
    if length:
        body = LENGTH_BODY
    elif request.end_stream or length == 0:
        body = NO_BODY
    else:
        body = CHUNKED_BODY
        fields = [*fields, (b"transfer-encoding", b"chunked")]
    # The fields passed `check_request` (lowercase tokens, field-values, one
    # checked host, no connection-specific field): spliced as HTTP/1.1 lines.
    spliced = rewriter.splice(
        b"\r\n".join(map(b": ".join, fields)) + b"\r\n", host=request.host
    )
    if spliced is not None:
        lines, request_id = spliced
        return _spliced(
            request.method,
            request.target,
            lines,
            body,
            content_length=length,
            host=request.host,
            request_id=request_id,
        )
    headers, request_id = rewriter.head_fields(
        fields, connection=frozenset(), upgrade=False, authority=None, host=request.host
    )
    return UpstreamRequest(
        request.method,
        request.target,
        headers,
        body,
        request_id=request_id,
    )
