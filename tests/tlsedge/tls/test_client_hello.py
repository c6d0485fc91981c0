"""The ClientHello's server name, read before OpenSSL (`tlsedge._tls.client_hello`).

ClientHellos from Python's ``ssl`` and hand-built ones, checked whole, in
pieces, behind a HelloRetryRequest, and against the real thing: the check
flags exactly the names that make ``_ssl`` report an unraisable exception.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import ssl
import struct

import pytest
import trustme
from hypothesis import given, settings, strategies as st

from tests.tlsedge.helpers import capture_unraisable, client_hello, tls_extension
from tlsedge._tls.client_hello import ServerNameCheck, non_ascii_server_name

BAD_NAME = b"\xff\xfe\xc3("


CHANGE_CIPHER_SPEC = b"\x14\x03\x03\x00\x01\x01"


def python_client_hello(server_hostname: str | None = "edge.test") -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = ssl.create_default_context().wrap_bio(
        incoming, outgoing, server_hostname=server_hostname
    )
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


def check(*pieces: bytes) -> str | None:
    names = ServerNameCheck()
    refusals = [names.feed(piece) for piece in pieces]
    found = [r for r in refusals if r is not None]
    assert len(found) <= 1
    return found[0] if found else None


def test_real_client_hellos_pass() -> None:
    assert check(python_client_hello("edge.test")) is None
    assert check(python_client_hello(None)) is None  # no server name


def test_a_non_ascii_server_name_is_found() -> None:
    assert check(client_hello(BAD_NAME)) == (
        "the ClientHello's server name is not ASCII: b'\\xff\\xfe\\xc3('"
    )
    assert check(client_hello(b"edge.test")) is None
    assert check(client_hello(None)) is None


def test_byte_by_byte_and_with_what_follows() -> None:
    hello = client_hello(BAD_NAME)
    assert check(*(hello[i : i + 1] for i in range(len(hello)))) is not None
    assert check(hello + CHANGE_CIPHER_SPEC) is not None
    good = client_hello(b"edge.test")
    assert check(*(good[i : i + 1] for i in range(len(good)))) is None


def test_a_client_hello_over_several_records() -> None:
    hello = client_hello(BAD_NAME)
    message = hello[5:]
    records = b"".join(
        b"\x16\x03\x01" + struct.pack("!H", len(part)) + part
        for part in (message[:7], message[7:100], message[100:])
    )
    assert check(records) is not None


def test_the_second_client_hello_after_a_hello_retry_request() -> None:
    # A good first ClientHello; then (the server asked for another key
    # share) a ChangeCipherSpec, refused 0-RTT data and a bad second one.
    early_data = b"\x17\x03\x03\x00\x05" + os.urandom(5)
    assert (
        check(
            client_hello(b"edge.test", key_share=False),
            CHANGE_CIPHER_SPEC + early_data + client_hello(BAD_NAME),
        )
        is not None
    )


def test_the_check_stops_where_tls_1_2_encrypts() -> None:
    client_key_exchange = b"\x16\x03\x03\x00\x06\x10\x00\x00\x02\x01\x02"
    names = ServerNameCheck()
    assert names.feed(client_hello(b"edge.test") + client_key_exchange) is None
    assert names.done
    # What follows is encrypted, as far as it knows.
    assert names.feed(client_hello(BAD_NAME)) is None


@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x2e\x01\x03\x01",  # an SSLv2-style ClientHello
        b"GET / HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x48\x01",  # a record longer than OpenSSL reads
    ],
)
def test_what_openssl_refuses_itself_ends_the_check(data: bytes) -> None:
    names = ServerNameCheck()
    assert names.feed(data) is None
    assert names.done


@pytest.mark.parametrize(
    "extension_bytes",
    [
        tls_extension(0, b""),  # empty
        tls_extension(0, struct.pack("!HBH", 7, 1, 4) + BAD_NAME),  # not host_name
        tls_extension(0, struct.pack("!HBH", 9, 0, 4) + BAD_NAME),  # list length off
        tls_extension(0, struct.pack("!HBH", 7, 0, 5) + BAD_NAME),  # name length off
        tls_extension(0, struct.pack("!HBH", 7, 0, 4) + BAD_NAME + b"x"),  # trailing
    ],
)
def test_a_malformed_extension_is_left_to_openssl(extension_bytes: bytes) -> None:
    body = (
        b"\x03\x03"
        + bytes(32)
        + b"\x00"
        + struct.pack("!HH", 2, 0x1301)
        + b"\x01\x00"
        + struct.pack("!H", len(extension_bytes))
        + extension_bytes
    )
    assert non_ascii_server_name(body) is None


@given(st.binary(max_size=300))
def test_any_bytes_are_checked_without_error(data: bytes) -> None:
    assert ServerNameCheck().feed(data) is None or data[:1] == b"\x16"
    name = non_ascii_server_name(data)
    assert name is None or (name in data and not name.isascii())


@given(
    st.binary(min_size=1, max_size=300),
    st.lists(st.integers(0, 400), max_size=6),
)
def test_any_split_gives_the_same_answer(name: bytes, cuts: list[int]) -> None:
    hello = client_hello(name)
    bounds = sorted({0, len(hello), *(c % (len(hello) + 1) for c in cuts)})
    pieces = [hello[a:b] for a, b in itertools.pairwise(bounds)]
    assert (check(*pieces) is None) == (check(hello) is None)


# -- against Python's ssl --------------------------------------------------------


@pytest.fixture(scope="module")
def server_context() -> ssl.SSLContext:
    ca = trustme.CA()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("edge.test").configure_cert(context)
    context.sni_callback = lambda *_: None
    return context


def openssl_reads(context: ssl.SSLContext, hello: bytes) -> bool:
    """True when the server's ssl reported an unraisable exception reading
    *hello* (what the check exists to prevent)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = context.wrap_bio(incoming, outgoing, server_side=True)
    incoming.write(hello)
    with capture_unraisable() as seen, contextlib.suppress(ssl.SSLError):
        server.do_handshake()
    return bool(seen)


@settings(max_examples=200, deadline=None)
@given(
    st.binary(min_size=1, max_size=255).filter(lambda name: b"\0" not in name)
    | st.text("abc.-é", min_size=1, max_size=20).map(str.encode)
)
def test_the_check_flags_what_ssl_cannot_decode(
    server_context: ssl.SSLContext, name: bytes
) -> None:
    hello = client_hello(name)
    assert (check(hello) is not None) == openssl_reads(server_context, hello)
