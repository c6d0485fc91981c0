"""Headers, addresses and errors: construction, validation, lazy addresses."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from ipaddress import IPv4Address, IPv6Address
from typing import Any

import pytest

import proxyproto
from proxyproto import (
    NEED_DATA,
    NO_HEADER,
    TLV,
    Command,
    Family,
    InetAddress,
    LocalProtocolError,
    ProxyHeader,
    ProxyProtocolError,
    RemoteProtocolError,
    Transport,
    UnixAddress,
    encode,
    parse,
)

from .vectors import V1_VALID, V2_VALID


def inet(host: str, port: int) -> InetAddress:
    return InetAddress.parse(host, port)


# -- addresses ---------------------------------------------------------------------


def test_inet_address_parse_and_str() -> None:
    assert inet("1.2.3.4", 80) == InetAddress(IPv4Address("1.2.3.4"), 80)
    assert str(inet("1.2.3.4", 80)) == "1.2.3.4:80"
    assert str(inet("::1", 443)) == "[::1]:443"


@pytest.mark.parametrize(
    ("host", "port"),
    [
        pytest.param("1.2.3.4", -1, id="port-negative"),
        pytest.param("1.2.3.4", 65536, id="port-65536"),
        pytest.param("1.2.3.4", True, id="port-bool"),
        pytest.param("1.2.3.4", "80", id="port-str"),
        pytest.param("example.com", 80, id="host-name"),
        pytest.param("1.2.3.256", 80, id="host-bad"),
        pytest.param("", 80, id="host-empty"),
    ],
)
def test_inet_address_invalid(host: str, port: Any) -> None:
    with pytest.raises(LocalProtocolError):
        InetAddress.parse(host, port)


def test_inet_address_refuses_ipv6_zone_ids() -> None:
    # Neither v1 nor v2 can carry a zone id; the v1 encoder would otherwise
    # emit "fe80::1%eth0", which receivers (and our decoder) refuse.
    with pytest.raises(LocalProtocolError, match="zone"):
        InetAddress.parse("fe80::1%eth0", 1)
    with pytest.raises(LocalProtocolError, match="zone"):
        InetAddress(IPv6Address("fe80::1%2"), 1)


def test_inet_address_host_must_be_ip_object() -> None:
    with pytest.raises(LocalProtocolError):
        InetAddress("1.2.3.4", 80)  # type: ignore[arg-type]


def test_unix_address() -> None:
    assert UnixAddress(b"\0abstract").path == b"\0abstract"
    UnixAddress(b"x" * 108)
    with pytest.raises(LocalProtocolError):
        UnixAddress(b"x" * 109)
    with pytest.raises(LocalProtocolError):
        UnixAddress("/tmp/sock")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(b"/a\x00b", id="nul-inside"),
        pytest.param(b"/a\x00", id="nul-at-end"),
        pytest.param(b"\x00abc\x00", id="abstract-nul-at-end"),
        pytest.param(b"\x00", id="abstract-only-nul"),
    ],
)
def test_unix_address_refuses_paths_that_cannot_round_trip(path: bytes) -> None:
    # The v2 block is NUL padded, so these would decode to another path.
    with pytest.raises(LocalProtocolError, match="NUL"):
        UnixAddress(path)


@pytest.mark.parametrize(
    "path", [b"", b"/run/x.sock", b"\x00abstract", b"\x00a\x00b", b"x" * 108]
)
def test_unix_address_round_trips(path: bytes) -> None:
    header = ProxyHeader.from_addresses(path, path)
    assert parse(encode(header))[0] == header


# -- constructors -------------------------------------------------------------------


def test_from_addresses_socket_tuples_ipv4() -> None:
    header = ProxyHeader.from_addresses(("10.0.0.1", 5000), ("10.0.0.2", 443))
    assert header.version == 2
    assert header.command is Command.PROXY
    assert header.family is Family.INET
    assert header.transport is Transport.STREAM
    assert header.source == inet("10.0.0.1", 5000)
    assert header.destination == inet("10.0.0.2", 443)


def test_from_addresses_ipv6_four_tuples_with_scope() -> None:
    header = ProxyHeader.from_addresses(
        ("fe80::1%eth0", 5000, 0, 2), ("::1", 443, 0, 0)
    )
    assert header.family is Family.INET6
    assert header.source == inet("fe80::1", 5000)
    assert header.destination == inet("::1", 443)


def test_from_addresses_mixed_families_are_mapped_to_ipv6() -> None:
    header = ProxyHeader.from_addresses(("1.2.3.4", 1), ("::1", 2))
    assert header.family is Family.INET6
    assert header.source == InetAddress(IPv6Address("::ffff:1.2.3.4"), 1)
    assert header.destination == inet("::1", 2)
    header = ProxyHeader.from_addresses(("::1", 1), ("1.2.3.4", 2))
    assert header.destination == InetAddress(IPv6Address("::ffff:1.2.3.4"), 2)


def test_from_addresses_unix_paths() -> None:
    header = ProxyHeader.from_addresses("/run/a.sock", b"\0abstract")
    assert header.family is Family.UNIX
    assert header.source == UnixAddress(b"/run/a.sock")
    assert header.destination == UnixAddress(b"\0abstract")


def test_from_addresses_unix_path_with_undecodable_bytes() -> None:
    # socket.getsockname() decodes paths with surrogateescape.
    path = b"/run/\xff.sock".decode("utf-8", "surrogateescape")
    header = ProxyHeader.from_addresses(path, path)
    assert header.source == UnixAddress(b"/run/\xff.sock")


def test_from_addresses_address_objects_and_options() -> None:
    header = ProxyHeader.from_addresses(
        inet("1.2.3.4", 1),
        inet("5.6.7.8", 2),
        version=1,
    )
    assert header.version == 1
    header = ProxyHeader.from_addresses(
        inet("1.2.3.4", 1), inet("5.6.7.8", 2), transport=Transport.DGRAM
    )
    assert header.transport is Transport.DGRAM


@pytest.mark.parametrize(
    ("source", "destination", "kwargs"),
    [
        pytest.param(("1.2.3.4", 1), "/a", {}, id="inet-and-unix"),
        pytest.param(("1.2.3.4",), ("1.2.3.4", 1), {}, id="1-tuple"),
        pytest.param((1234, 1), ("1.2.3.4", 1), {}, id="int-host"),
        pytest.param(("host.example", 1), ("1.2.3.4", 1), {}, id="host-name"),
        pytest.param(("1.2.3.4", 70000), ("1.2.3.4", 1), {}, id="port-range"),
        pytest.param("/a", "/b", {"version": 1}, id="v1-unix"),
        pytest.param(
            ("1.2.3.4", 1),
            ("1.2.3.4", 1),
            {"version": 1, "transport": Transport.DGRAM},
            id="v1-udp",
        ),
        pytest.param(("1.2.3.4", 1), ("1.2.3.4", 1), {"version": 3}, id="version-3"),
        pytest.param(
            ("1.2.3.4", 1),
            ("1.2.3.4", 1),
            {"transport": Transport.UNSPEC},
            id="inet-unspec-transport",
        ),
        pytest.param(
            ("1.2.3.4", 1),
            ("1.2.3.4", 1),
            {"version": 1, "tlvs": (TLV.noop(),)},
            id="v1-tlvs",
        ),
        pytest.param(
            ("1.2.3.4", 1), ("1.2.3.4", 1), {"tlvs": [TLV.noop()]}, id="tlvs-list"
        ),
        pytest.param(
            ("1.2.3.4", 1),
            ("1.2.3.4", 1),
            {"tlvs": (b"\x04\x00\x00",)},
            id="tlvs-bytes",
        ),
    ],
)
def test_from_addresses_invalid(
    source: Any, destination: Any, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(LocalProtocolError):
        ProxyHeader.from_addresses(source, destination, **kwargs)


def test_local_and_unknown() -> None:
    local = ProxyHeader.local()
    assert (local.version, local.command, local.family, local.transport) == (
        2,
        Command.LOCAL,
        Family.UNSPEC,
        Transport.UNSPEC,
    )
    assert local.source is None
    assert local.destination is None
    assert ProxyHeader.local(tlvs=(TLV.noop(),)).tlvs == (TLV.noop(),)
    unknown = ProxyHeader.unknown()
    assert (unknown.version, unknown.command, unknown.family) == (
        1,
        Command.PROXY,
        Family.UNSPEC,
    )
    assert ProxyHeader.unknown(version=2).version == 2


_V4 = inet("1.2.3.4", 1)
_V6 = inet("::1", 2)
_UNIX = UnixAddress(b"/a")


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(
            {"family": Family.INET, "source": _V6, "destination": _V6},
            id="inet-with-ipv6",
        ),
        pytest.param(
            {"family": Family.INET6, "source": _V4, "destination": _V4},
            id="inet6-with-ipv4",
        ),
        pytest.param(
            {"family": Family.INET, "source": _V4, "destination": _V6}, id="mixed"
        ),
        pytest.param(
            {"family": Family.INET, "source": _V4, "destination": None},
            id="missing-destination",
        ),
        pytest.param(
            {"family": Family.UNIX, "source": _UNIX, "destination": _V4},
            id="unix-with-inet",
        ),
        pytest.param(
            {"family": Family.INET, "source": _UNIX, "destination": _UNIX},
            id="inet-with-unix",
        ),
        pytest.param(
            {"family": Family.UNSPEC, "source": _V4, "destination": _V4},
            id="unspec-with-addresses",
        ),
        pytest.param(
            {
                "command": Command.LOCAL,
                "family": Family.INET,
                "source": _V4,
                "destination": _V4,
            },
            id="local-with-addresses",
        ),
        pytest.param(
            {
                "command": Command.LOCAL,
                "family": Family.UNSPEC,
                "transport": Transport.STREAM,
                "source": None,
                "destination": None,
            },
            id="local-with-transport",
        ),
        pytest.param(
            {
                "version": 1,
                "command": Command.LOCAL,
                "family": Family.UNSPEC,
                "transport": Transport.UNSPEC,
                "source": None,
                "destination": None,
            },
            id="v1-local",
        ),
        pytest.param({"version": 0}, id="version-0"),
    ],
)
def test_invalid_headers_cannot_be_constructed(kwargs: dict[str, Any]) -> None:
    fields: dict[str, Any] = {
        "version": 2,
        "command": Command.PROXY,
        "family": Family.INET,
        "transport": Transport.STREAM,
        "source": _V4,
        "destination": _V4,
    }
    fields.update(kwargs)
    with pytest.raises(LocalProtocolError):
        ProxyHeader(**fields)


def test_replace_validates() -> None:
    header = ProxyHeader.from_addresses(("1.2.3.4", 1), ("5.6.7.8", 2))
    with pytest.raises(LocalProtocolError):
        dataclasses.replace(header, command=Command.LOCAL)
    assert dataclasses.replace(header, tlvs=(TLV.noop(),)).tlvs == (TLV.noop(),)


def test_headers_are_frozen() -> None:
    header = ProxyHeader.local()
    with pytest.raises(dataclasses.FrozenInstanceError):
        header.version = 1  # type: ignore[misc]


# -- lazy addresses of parsed headers -------------------------------------------------

LAZY_VECTORS = [
    pytest.param(V1_VALID["tcp4"].data, id="v1-tcp4"),
    pytest.param(V1_VALID["tcp6"].data, id="v1-tcp6"),
    pytest.param(V2_VALID["tcp4"].data, id="v2-tcp4"),
    pytest.param(V2_VALID["tcp6"].data, id="v2-tcp6"),
    pytest.param(V2_VALID["unix-abstract"].data, id="v2-unix"),
    pytest.param(V2_VALID["alpn-authority"].data, id="v2-tlvs"),
    pytest.param(V2_VALID["local-aws-nlb-health-check"].data, id="v2-local"),
]


def _eager(data: bytes) -> ProxyHeader:
    """The same header, constructed through the validating constructor."""
    h = parse(data)[0]
    return ProxyHeader(
        version=h.version,
        command=h.command,
        family=h.family,
        transport=h.transport,
        source=h.source,
        destination=h.destination,
        tlvs=h.tlvs,
    )


@pytest.mark.parametrize("data", LAZY_VECTORS)
def test_lazy_equality_both_ways(data: bytes) -> None:
    eager = _eager(data)
    assert parse(data)[0] == eager
    assert eager == parse(data)[0]
    assert parse(data)[0] == parse(data)[0]


@pytest.mark.parametrize("data", LAZY_VECTORS)
def test_lazy_hash(data: bytes) -> None:
    assert hash(parse(data)[0]) == hash(_eager(data))
    assert len({parse(data)[0], _eager(data)}) == 1


@pytest.mark.parametrize("data", LAZY_VECTORS)
def test_lazy_repr(data: bytes) -> None:
    assert repr(parse(data)[0]) == repr(_eager(data))
    assert "_wire" not in repr(parse(data)[0])


@pytest.mark.parametrize("data", LAZY_VECTORS)
def test_lazy_replace(data: bytes) -> None:
    replaced = dataclasses.replace(parse(data)[0])
    assert replaced == _eager(data)
    assert replaced.source == _eager(data).source


@pytest.mark.parametrize("data", LAZY_VECTORS)
@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_lazy_copy(data: bytes, clone: Any) -> None:
    copied = clone(parse(data)[0])
    assert copied == _eager(data)
    assert copied.destination == _eager(data).destination


@pytest.mark.parametrize("data", LAZY_VECTORS)
def test_lazy_pickle(data: bytes) -> None:
    restored = pickle.loads(pickle.dumps(parse(data)[0]))
    assert restored == _eager(data)
    assert restored.source == _eager(data).source
    assert pickle.loads(pickle.dumps(_eager(data))) == _eager(data)


@pytest.mark.parametrize("data", LAZY_VECTORS)
def test_lazy_encode(data: bytes) -> None:
    assert encode(parse(data)[0]) == encode(_eager(data))


@pytest.mark.parametrize("data", LAZY_VECTORS)
def test_lazy_addresses_are_built_once(data: bytes) -> None:
    header = parse(data)[0]
    assert header.source is header.source
    assert header.destination is header.destination


@pytest.mark.parametrize("data", LAZY_VECTORS)
def test_unknown_attribute_still_raises(data: bytes) -> None:
    header = parse(data)[0]
    with pytest.raises(AttributeError, match="no_such_thing"):
        getattr(header, "no_such_thing")  # noqa: B009
    assert not hasattr(header, "sourc")
    assert header.source == _eager(data).source  # still works afterwards


@pytest.mark.parametrize("data", LAZY_VECTORS)
def test_lazy_destination_has_the_public_type(data: bytes) -> None:
    header = parse(data)[0]
    assert type(header.destination) is type(_eager(data).destination)
    if isinstance(header.destination, InetAddress):
        assert type(header.destination.host) is type(header.source.host)  # type: ignore[union-attr]


def test_lazy_destination_survives_copy_and_replace() -> None:
    # Both read the destination of a header that had not made it yet.
    header = parse(V2_VALID["tcp6"].data)[0]
    copied = copy.copy(header)
    assert copied.destination == header.destination
    assert dataclasses.replace(header).destination == header.destination


@pytest.mark.parametrize(
    "destination", [(0x01020304, 80), (1, 2, 3), ()], ids=["pair", "triple", "empty"]
)
def test_a_tuple_is_never_taken_for_a_destination(destination: Any) -> None:
    # The decoders keep an unread destination as a (value, port) pair; the
    # validating constructor must not let one in.
    with pytest.raises(LocalProtocolError, match="destination"):
        ProxyHeader(
            version=2,
            family=Family.INET,
            transport=Transport.STREAM,
            source=_V4,
            destination=destination,
        )


# -- errors ---------------------------------------------------------------------------


def test_base_error_cannot_be_instantiated() -> None:
    with pytest.raises(TypeError):
        ProxyProtocolError("nope")


def test_errors_have_a_reason() -> None:
    assert LocalProtocolError("x").reason == "invalid"
    assert RemoteProtocolError("x", reason="eof").reason == "eof"
    assert isinstance(RemoteProtocolError("x"), ProxyProtocolError)
    assert isinstance(LocalProtocolError("x"), ProxyProtocolError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)


def test_sentinels() -> None:
    assert repr(NEED_DATA) == "NEED_DATA"
    assert repr(NO_HEADER) == "NO_HEADER"
    assert NEED_DATA != NO_HEADER  # type: ignore[comparison-overlap]


def test_public_api() -> None:
    for name in proxyproto.__all__:
        assert hasattr(proxyproto, name), name
