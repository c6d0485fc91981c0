"""The proxy's HTTP rules (pure): targets, hop-by-hop fields, trailers, retries.

What a reverse proxy changes in a message, apart from framing (the session and
the exchange own that): the request target goes upstream in origin-form
(`origin_form`); hop-by-hop fields and the fields ``Connection`` names are
dropped both ways (`strip_hop_by_hop`; `end_to_end_fields` cuts them out of a
response's field lines as received); the request's fields for the backend
get the forwarding headers (`RequestRewriter`); trailers lose framing,
hop-by-hop and forwarding fields (`RequestRewriter.clean_trailers`); and a
request that failed before any response byte is sent again only when that
cannot run it twice (`may_retry`). Error responses are small plain-text bodies
(`error_response_bytes`).
"""

from __future__ import annotations

import dataclasses
import functools
import http
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from tlsedge._core.config import ForwardedConfig, ListenerConfig
from tlsedge._core.downstream import Downstream
from tlsedge._core.forwarded import (
    FORWARDING_HEADERS,
    ForwardingContext,
    choose_request_id,
    client_ip_text,
    forwarded_element,
    forwarding_key,
    is_trusted_peer,
    new_request_id,
    rewrite_forwarding_headers,
)
from tlsedge._http.body import encode_field_lines
from tlsedge._http.head import (
    HOP_BY_HOP,
    HOP_LINE_RE,
    HOST_RE,
    NOT_NAMED_AWAY,
    TOKEN,
    RequestRejectedError,
    ResponseHead,
    split_field_lines,
)

__all__ = [
    "HOP_BY_HOP",
    "IDEMPOTENT_METHODS",
    "MAX_LOGGED_TEXT",
    "NOT_NAMED_AWAY",
    "RequestRewriter",
    "any_field",
    "end_to_end_fields",
    "error_response_bytes",
    "log_text",
    "may_retry",
    "origin_form",
    "reason_phrase",
    "response_trailers",
    "strip_hop_by_hop",
]

Header = tuple[bytes, bytes]

#: Request targets and User-Agent values are cut to this many characters in the
#: access log.
MAX_LOGGED_TEXT: Final = 512
#: RFC 9110 section 9.2.2, as far as retrying without a body is concerned.
IDEMPOTENT_METHODS: Final = frozenset(
    {b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"}
)
#: Fields a ``Connection`` header may not make us drop: framing and routing.
_PROTECTED: Final = frozenset({b"host", b"content-length", b"transfer-encoding"})
#: Fields dropped from trailers, a request's or a response's: framing,
#: routing, hop-by-hop (RFC 9110 section 6.5.1; HTTP/2 makes a stream whose
#: trailers carry one malformed).
_NOT_IN_TRAILERS: Final = NOT_NAMED_AWAY | {b"trailer", b"expect"}
# The first bytes of every hop-by-hop name, either case: other names are kept
# without lowercasing them.
_HOP_FIRST_BYTES: Final = frozenset(b"cChHkKpPtTuU")

# A hop-by-hop field line but Upgrade, in field lines a head parser validated.
_HOP_LINE_BUT_UPGRADE_RE: Final = re.compile(
    rb"^(?:connection|http2-settings|keep-alive|proxy-connection|te):[^\r]*\r\n",
    re.IGNORECASE | re.MULTILINE,
)
# The characters of a token (RFC 9110 section 5.6.2).
_TOKEN_CHARS: Final = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]"
# Validated field lines as we write them (`encode_field_lines`): ``name: value``
# with one SP after the colon, a value neither empty nor with OWS around it.
_AS_WRITTEN_RE: Final = re.compile(
    rb"(?:" + TOKEN + rb": [^ \t\r](?:[^\r]*[^ \t\r])?\r\n)*"
)

_REASONS: Final = {
    400: b"Bad Request",
    408: b"Request Timeout",
    413: b"Content Too Large",
    431: b"Request Header Fields Too Large",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}

# RFC 3986 scheme ":" hier-part (an absolute-form target; origin-form starts "/").
_ABSOLUTE_FORM_RE: Final = re.compile(rb"([A-Za-z][A-Za-z0-9+.-]*):(.*)")


def origin_form(method: bytes, target: bytes) -> tuple[bytes, bytes | None]:
    """The request target to send upstream, and the authority to send as Host.

    Origin-form (``/path?query``) and, for OPTIONS, asterisk-form (``*``) go on
    as they are (no authority). An absolute-form target
    (``http://example.com:8080/path?query``) becomes origin-form (``/path?query``;
    ``/`` for an empty path, ``*`` for an OPTIONS request with neither path nor
    query) and its authority (``example.com:8080``, as sent) is returned to
    replace ``Host``: RFC 9112 section 3.2.2 has a server use the target's
    authority and ignore ``Host``, and a proxy send a ``Host`` made from the
    target. So the backend's target, its ``Host`` and ``Forwarded: host=``
    agree. The scheme does not change ``X-Forwarded-Proto`` (the listener's TLS
    does).

    Raises:
        RequestRejectedError: 400 for every other target: a scheme other than
            ``http``/``https``, no ``//authority``, an empty host, userinfo
            (``user@``), a malformed authority, a fragment (``#``), ``*`` with
            a method other than OPTIONS, or none of the forms at all. (CONNECT
            and its authority-form get 501 before this.)
    """
    if target[:1] == b"/":
        return target, None
    if target == b"*":
        if method == b"OPTIONS":
            return target, None
        raise RequestRejectedError(400, "the target '*' is only for OPTIONS")
    match = _ABSOLUTE_FORM_RE.fullmatch(target)
    if match is None:
        raise RequestRejectedError(
            400, "malformed request target: expected '/path' or 'http://host/path'"
        )
    scheme, rest = match.groups()
    if scheme.lower() not in {b"http", b"https"}:
        shown = scheme[:32].decode("ascii")
        raise RequestRejectedError(
            400, f"request target with scheme {shown!r}: expected http or https"
        )
    if not rest.startswith(b"//"):
        raise RequestRejectedError(400, "absolute-form target without '//host'")
    if b"#" in rest:
        raise RequestRejectedError(400, "fragment ('#') in the request target")
    ends = [i for i in (rest.find(b"/", 2), rest.find(b"?", 2)) if i >= 0]
    end = min(ends, default=len(rest))
    authority, path = rest[2:end], rest[end:]
    if b"@" in authority:
        raise RequestRejectedError(400, "userinfo ('user@') in the request target")
    if not HOST_RE.fullmatch(authority):
        raise RequestRejectedError(400, "malformed host in the request target")
    if authority[:1] in {b"", b":"}:
        raise RequestRejectedError(400, "empty host in the request target")
    if not path:
        path = b"*" if method == b"OPTIONS" else b"/"
    elif path[:1] == b"?":
        path = b"/" + path
    return path, authority


def _connection_tokens(headers: Sequence[Header]) -> set[bytes]:
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return tokens


def strip_hop_by_hop(
    headers: Sequence[Header],
    *,
    keep_upgrade: bool,
    connection: frozenset[bytes] | set[bytes] | None = None,
) -> list[Header]:
    """*headers* without hop-by-hop fields and the fields ``Connection`` names.

    Framing and ``Host`` survive whatever ``Connection`` says (a client must not
    make us drop the framing we forward). With *keep_upgrade*, ``Upgrade`` stays
    and ``Connection: upgrade`` is the only connection option sent.
    *connection*: the ``Connection`` tokens when the caller has them (a parsed
    head does); else they are gathered from *headers*.
    """
    tokens = _connection_tokens(headers) if connection is None else connection
    named = tokens - _PROTECTED
    if named:
        drop = HOP_BY_HOP | named
        first = _HOP_FIRST_BYTES | frozenset(
            byte for name in named for byte in name[:1].lower() + name[:1].upper()
        )
    else:
        drop, first = HOP_BY_HOP, _HOP_FIRST_BYTES
    if keep_upgrade:
        drop = drop - {b"upgrade"}
    out = [(n, v) for n, v in headers if n[0] not in first or n.lower() not in drop]
    if keep_upgrade:
        out.append((b"Connection", b"upgrade"))
    return out


def response_trailers(trailers: Sequence[Header]) -> list[Header]:
    """A response's trailers for the client: what `strip_hop_by_hop` keeps,
    without the framing and routing fields, as request trailers lose them."""
    return [
        (name, value)
        for name, value in strip_hop_by_hop(trailers, keep_upgrade=False)
        if name.lower() not in _NOT_IN_TRAILERS
    ]


def end_to_end_fields(head: ResponseHead, *, keep_upgrade: bool) -> bytes:
    """*head*'s field lines to forward: `strip_hop_by_hop` of its fields, encoded.

    The lines are kept as received and only the hop-by-hop ones cut out, unless
    they are not as `tlsedge._http.body.encode_field_lines` writes them (OWS
    other than one SP after the colon, an empty value) or ``Connection``
    names a field that is there: then the fields are split, stripped and
    written again.
    """
    lines = head.field_lines
    named = head.connection - NOT_NAMED_AWAY
    if not _AS_WRITTEN_RE.fullmatch(lines) or (named and any_field(lines, named)):
        return encode_field_lines(
            strip_hop_by_hop(
                split_field_lines(lines),
                keep_upgrade=keep_upgrade,
                connection=head.connection,
            )
        )
    if keep_upgrade:
        return _HOP_LINE_BUT_UPGRADE_RE.sub(b"", lines) + b"Connection: upgrade\r\n"
    return HOP_LINE_RE.sub(b"", lines)


@functools.lru_cache(maxsize=16)
def _dropped_lines_re(underscores: bool, request_id: bytes | None) -> re.Pattern[bytes]:
    """The field lines `RequestRewriter.splice` cuts from an untrusted
    client's request: what `strip_hop_by_hop`, the underscore rule and
    `tlsedge._core.forwarded.rewrite_forwarding_headers` drop from its fields.

    Hop-by-hop names as written; the forwarding fields and the request id's
    (*request_id*, lower case) in either spelling (``_`` for ``-``); with
    *underscores* off, every name holding a ``_``.
    """
    either = [key.replace(b"-", b"[-_]") for key in sorted(FORWARDING_HEADERS)]
    if request_id is not None:
        either.append(re.escape(request_id).replace(b"\\-", b"[-_]"))
    names = [re.escape(name) for name in sorted(HOP_BY_HOP)] + either
    if not underscores:
        names.append(_TOKEN_CHARS + b"*_" + _TOKEN_CHARS + b"*")
    return re.compile(
        rb"^(?:" + b"|".join(names) + rb"):[^\r]*\r\n", re.IGNORECASE | re.MULTILINE
    )


def any_field(lines: bytes, names: Iterable[bytes]) -> bool:
    """Whether validated field lines hold a field of one of *names* (lower case)."""
    lowered = b"\n" + lines.lower()
    return any(b"\n" + name + b":" in lowered for name in names)


def error_response_bytes(
    status: int, message: str, *, head_only: bool = False
) -> bytes:
    """A complete small plain-text response with ``Connection: close``.

    *head_only* (the answer to a HEAD request): the head alone, its
    Content-Length still that of the body a GET would get.
    """
    reason = _REASONS.get(status, b"Error")
    body = error_body(status, message)
    head = (
        b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (status, reason, len(body))
    )
    return head if head_only else head + body


def error_body(status: int, message: str) -> bytes:
    """The plain-text body of our own error responses (HTTP/1.1 and HTTP/2)."""
    return f"{status} {_REASONS.get(status, b'Error').decode()}: {message}\n".encode()


def reason_phrase(status: int, reason: bytes) -> bytes:
    """The upstream's reason phrase, or the standard one when it sent none."""
    if reason:
        return reason
    try:
        return http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


def log_text(value: bytes) -> str:
    """A peer's bytes for the access log: latin-1, cut at `MAX_LOGGED_TEXT`."""
    text = value.decode("latin-1")
    if len(text) > MAX_LOGGED_TEXT:
        return text[:MAX_LOGGED_TEXT] + "..."
    return text


def may_retry(*, method: bytes, has_body: bool, reused: bool, retried: bool) -> bool:
    """Whether a request that failed before any response byte may be sent again.

    Never with a body (it may have been consumed). On a fresh connection when
    the failed one was a reused one (the server closed an idle connection just
    as we sent); once on another server when the method is idempotent.
    """
    if has_body:
        return False
    return reused or (method in IDEMPOTENT_METHODS and not retried)


@dataclass(frozen=True, slots=True)
class RequestRewriter:
    """The fields a request's head and trailers take upstream, for one connection.

    Built once per client connection (the forwarding facts of a connection do
    not change between its requests).

    Attributes:
        forwarded: The listener's ``[listeners.forwarded]`` settings.
        context: The connection's forwarding facts (``host`` is per request).
        underscores: ``underscores_in_headers``: keep field names with ``_``.
    """

    forwarded: ForwardedConfig
    context: ForwardingContext
    underscores: bool
    #: The lines `splice` adds to every request of the connection (they do
    #: not change between requests).
    _our_lines: bytes = field(init=False, repr=False, compare=False)
    #: The lines `splice` cuts (`_dropped_lines_re`).
    _dropped: re.Pattern[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        forwarded, context = self.forwarded, self.context
        lines = []
        if forwarded.x_forwarded_for:
            ip = client_ip_text(context.client[0] if context.client else None)
            lines.append(b"X-Forwarded-For: " + ip + b"\r\n")
        if forwarded.x_forwarded_proto:
            proto = b"https" if context.tls else b"http"
            lines.append(b"X-Forwarded-Proto: " + proto + b"\r\n")
        if forwarded.x_forwarded_port and context.destination is not None:
            port = str(int(context.destination[1])).encode()
            lines.append(b"X-Forwarded-Port: " + port + b"\r\n")
        object.__setattr__(self, "_our_lines", b"".join(lines))
        object.__setattr__(
            self, "_dropped", _dropped_lines_re(self.underscores, self.request_id_name)
        )

    @classmethod
    def for_connection(
        cls, listener: ListenerConfig, downstream: Downstream
    ) -> RequestRewriter:
        """The rewriter of one client connection of *listener* (any protocol)."""
        return cls(
            forwarded=listener.forwarded,
            context=ForwardingContext(
                client=downstream.client,
                destination=downstream.destination,
                tls=downstream.tls is not None,
                trusted=is_trusted_peer(
                    downstream.client_ip, listener.forwarded.trusted_proxies
                ),
            ),
            underscores=listener.http.underscores_in_headers,
        )

    @property
    def request_id_name(self) -> bytes | None:
        """The request-id field's name, lowercased, or None."""
        rid = self.forwarded.request_id
        return rid.lower().encode() if rid else None

    def head_fields(
        self,
        headers: Sequence[Header],
        *,
        connection: frozenset[bytes],
        upgrade: bool,
        authority: bytes | None,
        host: bytes | None,
    ) -> tuple[list[Header], bytes | None]:
        """The request's fields for the backend, and the request id (if any).

        *authority* (from an absolute-form target) replaces ``Host``. Fields
        named with ``_`` are dropped unless ``underscores_in_headers``.
        """
        out = strip_hop_by_hop(headers, keep_upgrade=upgrade, connection=connection)
        if not self.underscores:
            out = [(n, v) for n, v in out if b"_" not in n]
        if authority is not None:
            out = [(b"Host", authority)] + [
                (n, v) for n, v in out if n.lower() != b"host"
            ]
            host = authority
        # The host only goes into Forwarded: a context per request only then.
        context = (
            dataclasses.replace(self.context, host=host)
            if self.forwarded.forwarded
            else self.context
        )
        request_id: bytes | None = None
        rid_header: Header | None = None
        rid_name = self.request_id_name
        if rid_name is not None:
            request_id = choose_request_id(out, rid_name, trusted=self.context.trusted)
            rid_header = (self.forwarded.request_id.encode(), request_id)
        out = rewrite_forwarding_headers(
            out, self.forwarded, context, request_id=rid_header
        )
        return out, request_id

    def splice(
        self, field_lines: bytes, *, host: bytes | None
    ) -> tuple[bytes, bytes | None] | None:
        """The field lines for the backend and the request id (if any), cut
        and spliced from the request's own validated *field_lines*: what
        `head_fields` gives, without splitting a field.

        The lines that go are cut out whole (hop-by-hop, the client's
        forwarding fields and request id, and names with ``_`` unless
        ``underscores_in_headers``: `_dropped_lines_re`); ours are appended in
        `head_fields`' order. None when the fields must be split after all:
        from a trusted proxy (its forwarding chains are joined with our hop).
        The caller keeps to requests whose ``Connection`` names no field
        present, with no Upgrade and an origin-form target.

        Args:
            field_lines: A parsed head's field lines (`RequestHead.field_lines`).
            host: The request's Host (for ``Forwarded: host=``).
        """
        if self.context.trusted:
            return None
        lines = self._dropped.sub(b"", field_lines) + self._our_lines
        forwarded = self.forwarded
        if forwarded.forwarded:
            context = dataclasses.replace(self.context, host=host)
            lines += b"Forwarded: " + forwarded_element(context) + b"\r\n"
        request_id = None
        if forwarded.request_id:
            request_id = new_request_id()
            lines += forwarded.request_id.encode() + b": " + request_id + b"\r\n"
        return lines, request_id

    def clean_trailers(self, trailers: Sequence[Header]) -> list[Header]:
        """Trailers without framing, hop-by-hop and forwarding fields.

        The same name rules as the head's fields: untrusted peers' forwarding
        fields, the request id and every ``_`` spelling of those go; so does
        any name with ``_`` unless ``underscores_in_headers``.
        """
        rid = self.request_id_name
        rid_key = forwarding_key(rid) if rid is not None else None
        trusted = self.context.trusted
        out: list[Header] = []
        for name, value in trailers:
            lower, key = name.lower(), forwarding_key(name)
            if (
                lower in _NOT_IN_TRAILERS
                or (b"_" in name and not self.underscores)
                or key == rid_key
                or (key in FORWARDING_HEADERS and (not trusted or key != lower))
            ):
                continue
            out.append((name, value))
        return out
