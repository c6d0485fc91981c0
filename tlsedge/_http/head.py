"""Strict HTTP/1.x head parser, requests and responses (pure: bytes in, a record out).

A head is the exact bytes from the start line up to and including the blank
line (the first CRLFCRLF). One parse does everything the proxy needs from it:
the start line, the fields in order (names as sent, values without OWS), the
framing the message declares (a Content-Length, chunked, or neither), and the
few values the proxy reads on every request (Host, the Connection tokens,
whether Upgrade is asked).

Strictness (the request-smuggling defences; the reason strings are part of the
contract, `tests/tlsedge/pipeline/http/test_h1.py` and `http/test_head.py` check
them):

* CRLF only: a bare CR or bare LF anywhere is refused (h11 takes a bare LF as a
  line end); no control character but HTAB; no obs-fold (h11 unfolds it);
  a field name is a token directly followed by ``:``.
* Framing: at most one ``Content-Length``, 1 to 18 digits (h11 merges
  ``5, 5`` and repeats and takes any length); never both ``Content-Length`` and
  ``Transfer-Encoding`` (h11 lets the coding win); one ``Transfer-Encoding``,
  exactly ``chunked`` (other codings: 501 for requests); none in HTTP/1.0.
* Requests: HTTP/1.0 or 1.1 only (505; h11 takes any ``x.y``); exactly one
  ``Host`` in HTTP/1.1, at most one in 1.0, and a well-formed ``uri-host
  [":" port]`` (h11 does not look at its value).

Speed: a well-formed head is validated by one compiled regex over the whole head;
the few fields the parse reads are then found by one case-insensitive
``findall`` whose pattern names them (each field line follows a LF), so no
other field is looked at in Python. Neither a request's fields nor a
response's are split into pairs: their field lines go on as received, minus
the lines the proxy drops, plus the ones it adds (`RequestHead.headers` and
`ResponseHead.headers` split them when asked). A head that
fails the regex is re-examined line by line (`_request_head_error`), only to
name the first rule it breaks.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

__all__ = [
    "FIELD_VALUE",
    "HOP_BY_HOP",
    "HOP_LINE_RE",
    "NOT_NAMED_AWAY",
    "HeadRejectedError",
    "RequestHead",
    "RequestRejectedError",
    "ResponseHead",
    "ResponseRejectedError",
    "field_error",
    "find_head_end",
    "method_error",
    "parse_request_head",
    "parse_response_head",
    "show_bytes",
    "split_field_lines",
    "target_error",
]

Header = tuple[bytes, bytes]

TOKEN: Final = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
TOKEN_RE: Final = re.compile(TOKEN)
# CR not before LF, or LF not after CR.
BARE_CR_OR_LF_RE: Final = re.compile(rb"\r(?!\n)|(?<!\r)\n")
# Control characters other than HTAB, CR, LF (those are checked separately).
CONTROL_RE: Final = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# RFC 3986 uri-host [":" port]: IP-literal or reg-name / IPv4 (empty allowed).
HOST_RE: Final = re.compile(
    rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~!$&'()*+,;=%-]*)(?::[0-9]{0,5})?"
)
REQUEST_LINE_RE: Final = re.compile(
    rb"(" + TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])"
)
#: RFC 9110 field-value: field-vchar (VCHAR / obs-text) at both ends, SP and
#: HTAB only inside; empty allowed. (Written with lookarounds: a third fewer
#: steps for the regex engine than the grammar's own shape.)
FIELD_VALUE: Final = rb"(?:(?![ \t])[\t\x20-\x7e\x80-\xff]*(?<![ \t]))?"
_FIELD_VALUE_RE: Final = re.compile(FIELD_VALUE)
# A request target as the request line takes it: visible ASCII.
_TARGET_RE: Final = re.compile(rb"[\x21-\x7e]+")
_CONTENT_LENGTH_RE: Final = re.compile(rb"[0-9]{1,18}")
_CODINGS_RE: Final = re.compile(TOKEN + rb"(?:[ \t]*,[ \t]*" + TOKEN + rb")*")
# A field line: a token, ":", then any bytes but controls (HTAB allowed), CRLF.
_FIELDS: Final = rb"((?:" + TOKEN + rb":[\t\x20-\x7e\x80-\xff]*\r\n)*)\r\n"
_REQUEST_HEAD_RE: Final = re.compile(
    rb"(" + TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9]\.[0-9])\r\n" + _FIELDS
)
_RESPONSE_HEAD_RE: Final = re.compile(
    rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: ([\t\x20-\x7e\x80-\xff]*))?\r\n" + _FIELDS
)
_VERSIONS: Final = frozenset({b"1.0", b"1.1"})
_NO_TOKENS: Final[frozenset[bytes]] = frozenset()
# Three-digit status codes from 100 to 599 (a lookup costs less than `int`).
_STATUS_CODES: Final = {b"%d" % status: status for status in range(100, 600)}
# The fields a request's parse reports, with their values (see below).
_REQUEST_FIELDS_RE: Final = re.compile(
    rb"\n(host|user-agent|content-length|transfer-encoding|connection|upgrade|expect)"
    rb":[ \t]*([^\r]*)",
    re.IGNORECASE,
)
#: Hop-by-hop fields (RFC 9110 section 7.6.1, and HTTP2-Settings, which RFC
#: 7540 section 3.2.1 made connection-specific), never forwarded either way.
HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"http2-settings",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"upgrade",
    }
)
#: ``Connection`` tokens that name no field the proxy would not drop anyway:
#: hop-by-hop fields, and framing and routing, which a ``Connection`` header
#: may not make us drop.
NOT_NAMED_AWAY: Final = HOP_BY_HOP | {b"host", b"content-length", b"transfer-encoding"}
#: A hop-by-hop field line, in field lines a head parser validated.
HOP_LINE_RE: Final = re.compile(
    rb"^(?:" + b"|".join(sorted(HOP_BY_HOP)) + rb"):[^\r]*\r\n",
    re.IGNORECASE | re.MULTILINE,
)
# The fields a response's framing depends on and the hop-by-hop ones, with
# their values (OWS before the value skipped, after it kept), searched in a
# head the regex validated: every field line follows a LF, and its name is
# directly followed by ":".
_RESPONSE_FIELDS_RE: Final = re.compile(
    rb"\n(content-length|transfer-encoding|"
    + b"|".join(sorted(HOP_BY_HOP))
    + rb"):[ \t]*([^\r]*)",
    re.IGNORECASE,
)
# The common response head, which goes to an HTTP/1.1 client as received
# (hop-by-hop lines cut): HTTP/1.1, a status from 100 to 599 with a reason
# phrase, and field lines as `tlsedge._http.body.encode_field_lines` writes
# them (``name: value``, one SP after the colon, a value neither empty nor
# with OWS around it). Every head it takes `_RESPONSE_HEAD_RE` takes too.
_COMMON_RESPONSE_HEAD_RE: Final = re.compile(
    rb"HTTP/1\.1 ([1-5][0-9][0-9]) [\t\x20-\x7e\x80-\xff]+\r\n((?:"
    + TOKEN
    + rb": [\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?\r\n)*)"
    rb"\r\n"
)


def method_error(method: bytes) -> str | None:
    """What is wrong with *method* as a request method (a token), or None."""
    if TOKEN_RE.fullmatch(method):
        return None
    return f"method {show_bytes(method)} is not a token"


def target_error(target: bytes) -> str | None:
    """What is wrong with *target* as the target of a request line (visible
    ASCII), or None."""
    if _TARGET_RE.fullmatch(target):
        return None
    return (
        f"request target {show_bytes(target)}: empty, or a control byte, space or "
        "non-ASCII byte in it"
    )


def field_error(name: bytes, value: bytes) -> str | None:
    """What is wrong with a field line's name (a token) or value (a
    field-value), or None: the rules a request head's fields and a trailer
    section's pass, whatever version they came in."""
    if not TOKEN_RE.fullmatch(name):
        return f"field name {show_bytes(name)} is not a token"
    if not _FIELD_VALUE_RE.fullmatch(value):
        return (
            f"field {show_bytes(name)}: NUL, CR, LF or another control byte in its "
            "value, or surrounding whitespace"
        )
    return None


def show_bytes(value: bytes) -> str:
    """*value* for a log or error message: at most 64 bytes, escaped."""
    text = repr(value[:64])[2:-1]
    return f"'{text}'"


class HeadRejectedError(Exception):
    """A head we refuse; ``status`` is the response code to answer with."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class RequestRejectedError(HeadRejectedError):
    """A request we refuse; ``status`` is the response code to send."""


class ResponseRejectedError(HeadRejectedError):
    """A response from upstream we refuse to forward (the client gets 502)."""

    def __init__(self, reason: str) -> None:
        super().__init__(502, reason)


class RequestHead(NamedTuple):
    """A parsed, validated request head (immutable: a named tuple, which is
    made in C, where a frozen dataclass sets each field with a call).

    ``field_lines`` are the field lines exactly as received (each ending with
    CRLF, no blank line after them): what the gate splices the upstream head
    from (`tlsedge._http.gate.from_http1`); `headers` splits them.
    ``content_length`` is None unless the request declares one; ``chunked`` is
    True for ``Transfer-Encoding: chunked``; neither means no body.
    ``connection`` holds the lowercased ``Connection`` tokens;
    ``user_agent`` the first ``User-Agent`` value, ``expect`` the last
    ``Expect`` value (or None).
    """

    method: bytes
    target: bytes
    version: bytes
    field_lines: bytes
    content_length: int | None
    chunked: bool
    host: bytes | None
    connection: frozenset[bytes]
    upgrade: bool
    user_agent: bytes | None
    expect: bytes | None

    @property
    def headers(self) -> list[Header]:
        """The fields in order: names as sent, values without OWS."""
        return split_field_lines(self.field_lines)


class ResponseHead(NamedTuple):
    """A parsed, validated response head (framing as declared, and immutable,
    as `RequestHead`).

    ``field_lines`` are the field lines exactly as received (each ending with
    CRLF, no blank line after them): what is forwarded, minus the hop-by-hop
    ones (`tlsedge._http.rules.end_to_end_fields`); `headers` splits them.
    ``forward``, for the common head (`_COMMON_RESPONSE_HEAD_RE`, its
    ``Connection`` naming no other field), is the status line and those
    end-to-end field lines as received, no blank line: what an HTTP/1.1
    client gets, spliced; None when they must be written again.
    """

    version: bytes
    status: int
    reason: bytes
    field_lines: bytes
    content_length: int | None
    chunked: bool
    connection: frozenset[bytes]
    forward: bytes | None = None

    @property
    def headers(self) -> list[Header]:
        """The fields in order: names as sent, values without OWS."""
        return split_field_lines(self.field_lines)


def split_field_lines(field_lines: bytes) -> list[Header]:
    """``(name, value)`` pairs of validated field lines (each ending with CRLF)."""
    return [
        (name, value.strip(b" \t"))
        for name, _, value in [
            line.partition(b":") for line in field_lines.split(b"\r\n")[:-1]
        ]
    ]


def find_head_end(buffer: bytes | bytearray, start: int = 0) -> int:
    """Offset just past the first CRLFCRLF in *buffer* (searched from about
    *start*, where the previous search stopped), or -1."""
    index = buffer.find(b"\r\n\r\n", max(0, start - 3))
    return -1 if index < 0 else index + 4


def _add_tokens(tokens: set[bytes], value: bytes) -> None:
    """Add a ``Connection`` value's tokens (lowercased) to *tokens* (*value*
    without OWS around it; empty tokens too)."""
    if b"," in value:
        tokens.update(t.strip(b" \t") for t in value.lower().split(b","))
    else:
        tokens.add(value.lower())


def parse_request_head(head: bytes, *, max_headers: int) -> RequestHead:
    """Parse and validate a raw request head (request line to CRLFCRLF).

    Args:
        head: The exact bytes, ending with the first ``b"\\r\\n\\r\\n"``.
        max_headers: Most header fields allowed.

    Raises:
        RequestRejectedError: with 400 (malformed, ambiguous framing: the
            request-smuggling vectors), 431 (too many fields), 501 (a transfer
            coding other than chunked) or 505 (not HTTP/1.0 or 1.1).
    """
    match = _REQUEST_HEAD_RE.fullmatch(head)
    if match is None:
        raise _request_head_error(head, max_headers)
    method, target, version, block = match.groups()
    if version not in _VERSIONS:
        raise RequestRejectedError(505, "only HTTP/1.0 and HTTP/1.1 are served")
    if block.count(b"\n") > max_headers:
        raise RequestRejectedError(431, f"more than {max_headers} header fields")
    # The first value of each framing field, and how many there were.
    length = coding = host = None
    lengths = codings = hosts = 0
    tokens: set[bytes] | None = None
    upgrade = False
    user_agent: bytes | None = None
    expect: bytes | None = None
    for name, raw in _REQUEST_FIELDS_RE.findall(head):
        lname = name.lower()
        value = raw.rstrip(b" \t")
        if lname == b"host":
            hosts += 1
            if host is None:
                host = value
        elif lname == b"user-agent":
            if user_agent is None:
                user_agent = value
        elif lname == b"content-length":
            lengths += 1
            if length is None:
                length = value
        elif lname == b"transfer-encoding":
            codings += 1
            if coding is None:
                coding = value
        elif lname == b"connection":
            if tokens is None:
                tokens = set()
            _add_tokens(tokens, value)
        elif lname == b"upgrade":
            upgrade = True
        else:
            expect = value
    content_length = None
    if length is not None:
        if lengths > 1:
            raise RequestRejectedError(400, "more than one Content-Length")
        if not _CONTENT_LENGTH_RE.fullmatch(length):
            raise RequestRejectedError(400, "malformed Content-Length")
        content_length = int(length)
    if coding is not None:
        if length is not None:
            raise RequestRejectedError(400, "both Content-Length and Transfer-Encoding")
        if version == b"1.0":
            raise RequestRejectedError(400, "Transfer-Encoding in an HTTP/1.0 request")
        if codings > 1:
            raise RequestRejectedError(400, "more than one Transfer-Encoding")
        if coding.lower() != b"chunked":
            if _CODINGS_RE.fullmatch(coding):
                raise RequestRejectedError(501, "transfer coding other than chunked")
            raise RequestRejectedError(400, "malformed Transfer-Encoding")
    if hosts > 1:
        raise RequestRejectedError(400, "more than one Host")
    if host is None and version == b"1.1":
        raise RequestRejectedError(400, "HTTP/1.1 request without Host")
    if host is not None and not HOST_RE.fullmatch(host):
        raise RequestRejectedError(400, "malformed Host")
    # (`tuple.__new__`: a named tuple's own ``__new__`` is a Python
    # function, a call that costs as much as the tuple.)
    return tuple.__new__(
        RequestHead,
        (
            method,
            target,
            version,
            block,
            content_length,
            coding is not None,
            host,
            _NO_TOKENS if tokens is None else frozenset(tokens - {b""}),
            upgrade,
            user_agent,
            expect,
        ),
    )


def _request_head_error(head: bytes, max_headers: int) -> RequestRejectedError:
    """The first rule a head that failed `_REQUEST_HEAD_RE` breaks, as an error.

    The checks and their order are the contract of the reasons: whole-head
    byte rules, the request line, the version, the field count, then each line.
    """
    if BARE_CR_OR_LF_RE.search(head):
        return RequestRejectedError(400, "bare CR or LF in the request head")
    if CONTROL_RE.search(head):
        return RequestRejectedError(400, "control character in the request head")
    lines = head[:-4].split(b"\r\n")
    match = REQUEST_LINE_RE.fullmatch(lines[0])
    if match is None:
        return RequestRejectedError(400, "malformed request line")
    if match.group(3) + b"." + match.group(4) not in _VERSIONS:
        return RequestRejectedError(505, "only HTTP/1.0 and HTTP/1.1 are served")
    if len(lines) - 1 > max_headers:
        return RequestRejectedError(431, f"more than {max_headers} header fields")
    for line in lines[1:]:
        if line[:1] in {b" ", b"\t"}:
            return RequestRejectedError(400, "obs-fold (header line starts with SP)")
        name, colon, _ = line.partition(b":")
        if not colon or not TOKEN_RE.fullmatch(name):
            return RequestRejectedError(400, "malformed header field")
    raise AssertionError(f"head refused by the regex but by no rule: {head!r}")


def parse_response_head(head: bytes, *, max_headers: int) -> ResponseHead:
    """Parse and validate a raw response head (status line to CRLFCRLF).

    The same byte and field rules as requests, plus: HTTP/1.0 or 1.1, a
    three-digit status from 100 to 599, and for framing at most one valid
    ``Content-Length``, never with ``Transfer-Encoding``, which may only be
    ``chunked`` (h11 cannot relay other codings either) and only in HTTP/1.1.

    Raises:
        ResponseRejectedError: the response cannot be relayed safely (502).
    """
    common = _COMMON_RESPONSE_HEAD_RE.fullmatch(head)
    if common is not None:
        version = b"1.1"
        status_text, block = common.groups()
        reason = head[13 : common.start(2) - 2]  # (after "HTTP/1.1 200 ")
        fields = _RESPONSE_FIELDS_RE.findall(head)
        if len(fields) <= 1 and block.count(b"\n") <= max_headers:
            # The commonest head: a status from 100 to 599 (the regex's),
            # no hop-by-hop field, at most a Content-Length, its value
            # without OWS (the regex's): spliced whole.
            content_length = None
            if fields:
                name, value = fields[0]
                if name.lower() != b"content-length":
                    return _response_head(head, common, fields, max_headers)
                if not value.isdigit() or len(value) > 18:
                    raise ResponseRejectedError(
                        "malformed Content-Length in the response"
                    )
                content_length = int(value)
            return tuple.__new__(
                ResponseHead,
                (
                    version,
                    _STATUS_CODES[status_text],
                    reason,
                    block,
                    content_length,
                    False,
                    _NO_TOKENS,
                    head[:-2],
                ),
            )
        return _response_head(head, common, fields, max_headers)
    match = _RESPONSE_HEAD_RE.fullmatch(head)
    if match is None:
        raise _response_head_error(head, max_headers)
    return _response_head(head, match, _RESPONSE_FIELDS_RE.findall(head), max_headers)


def _response_head(
    head: bytes,
    match: re.Match[bytes],
    fields: list[tuple[bytes, bytes]],
    max_headers: int,
) -> ResponseHead:
    """`parse_response_head` of a head a regex took: *match* is
    `_COMMON_RESPONSE_HEAD_RE`'s or `_RESPONSE_HEAD_RE`'s, *fields* what
    `_RESPONSE_FIELDS_RE` found in it."""
    common = match if match.re is _COMMON_RESPONSE_HEAD_RE else None
    if common is not None:
        version = b"1.1"
        status_text, block = common.groups()
        reason = head[13 : common.start(2) - 2]  # (after "HTTP/1.1 200 ")
    else:
        version, status_text, reason, block = match.groups()
        if version not in _VERSIONS:
            raise ResponseRejectedError(f"response version HTTP/{version.decode()}")
    status = int(status_text)
    if status < 100 or status > 599:
        raise ResponseRejectedError(f"response status {status} (expected 100-599)")
    if block.count(b"\n") > max_headers:
        raise ResponseRejectedError(f"more than {max_headers} response header fields")
    lengths: list[bytes] = []
    codings: list[bytes] = []
    tokens: set[bytes] = set()
    hop_by_hop = False
    for name, raw in fields:
        lname = name.lower()
        value = raw.rstrip(b" \t")
        if lname == b"content-length":
            lengths.append(value)
        elif lname == b"transfer-encoding":
            codings.append(value)
        else:
            hop_by_hop = True
            if lname == b"connection":
                _add_tokens(tokens, value)
    tokens.discard(b"")
    content_length = None
    if lengths:
        if len(lengths) > 1:
            raise ResponseRejectedError("more than one Content-Length in the response")
        if not _CONTENT_LENGTH_RE.fullmatch(lengths[0]):
            raise ResponseRejectedError("malformed Content-Length in the response")
        content_length = int(lengths[0])
    if codings:
        if lengths:
            raise ResponseRejectedError(
                "both Content-Length and Transfer-Encoding in the response"
            )
        if version == b"1.0":
            # RFC 9112 section 6.1: its framing is faulty.
            raise ResponseRejectedError("Transfer-Encoding in an HTTP/1.0 response")
        if len(codings) > 1 or codings[0].lower() != b"chunked":
            raise ResponseRejectedError(
                "response Transfer-Encoding other than a single 'chunked'"
            )
    forward = None
    if common is not None and tokens <= NOT_NAMED_AWAY:
        if hop_by_hop:
            forward = head[: common.start(2)] + HOP_LINE_RE.sub(b"", block)
        else:
            forward = head[:-2]
    return tuple.__new__(
        ResponseHead,
        (
            version,
            status,
            reason or b"",
            block,
            content_length,
            bool(codings),
            frozenset(tokens),
            forward,
        ),
    )


def _response_head_error(head: bytes, max_headers: int) -> ResponseRejectedError:
    """The first rule a head that failed `_RESPONSE_HEAD_RE` breaks, as an error."""
    if BARE_CR_OR_LF_RE.search(head):
        return ResponseRejectedError("bare CR or LF in the response head")
    if CONTROL_RE.search(head):
        return ResponseRejectedError("control character in the response head")
    lines = head[:-4].split(b"\r\n")
    if not _RESPONSE_HEAD_RE.fullmatch(lines[0] + b"\r\n\r\n"):
        return ResponseRejectedError("malformed status line")
    if len(lines) - 1 > max_headers:
        return ResponseRejectedError(f"more than {max_headers} response header fields")
    for line in lines[1:]:
        if line[:1] in {b" ", b"\t"}:
            return ResponseRejectedError("obs-fold in the response head")
        name, colon, _ = line.partition(b":")
        if not colon or not TOKEN_RE.fullmatch(name):
            return ResponseRejectedError("malformed response header field")
    raise AssertionError(f"head refused by the regex but by no rule: {head!r}")
