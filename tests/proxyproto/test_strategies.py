"""The public hypothesis strategies: valid ones are valid, invalid ones are
refused, and together they reach every family, TLV kind and mutation."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings, strategies as st

from proxyproto import (
    NEED_DATA,
    Command,
    Family,
    HeaderReader,
    ProxyHeader,
    RemoteProtocolError,
    SSLClient,
    SSLInfo,
    TLVType,
    Transport,
    UnixAddress,
    encode,
    parse,
)
from proxyproto.strategies import (
    INVALID_KINDS,
    MAX_ENCODED_V2_LENGTH,
    InvalidHeader,
    encoded_headers,
    host_names,
    invalid_headers,
    proxy_headers,
    ssl_infos,
    tlv,
    tlvs,
    unix_addresses,
)

# find() settings: no example database, enough tries for rare kinds.
# Generation only: the first match will do, shrinking it would only cost time.
FIND = settings(
    database=None,
    max_examples=2000,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


T = TypeVar("T")


def found(strategy: st.SearchStrategy[T], condition: Callable[[T], bool]) -> T:
    return find(strategy, condition, settings=FIND)


def labels(kind: str) -> set[str]:
    """The ``InvalidHeader.kind`` values a mutation name produces."""
    if kind == "v1_wrong_family":
        return {"v1_ipv4_in_tcp6", "v1_ipv6_in_tcp4"}
    return {kind}


@given(proxy_headers(), st.booleans())
def test_every_valid_header_encodes_and_parses(header: ProxyHeader, crc: bool) -> None:
    wire = encode(header, crc32c=crc)
    assert len(wire) <= (107 if header.version == 1 else MAX_ENCODED_V2_LENGTH)
    _, consumed = parse(wire)
    assert consumed == len(wire)


@given(encoded_headers())
def test_encoded_headers_fit_default_readers(pair: tuple[ProxyHeader, bytes]) -> None:
    header, wire = pair
    assert len(wire) <= MAX_ENCODED_V2_LENGTH
    assert parse(wire) == (header, len(wire))


@settings(max_examples=150)  # a sanity check of the strategy
@given(ssl_infos())
def test_ssl_infos_survive_the_wire(info: SSLInfo) -> None:
    from proxyproto import TLV

    header = ProxyHeader.local(tlvs=(TLV.ssl(info),))
    parsed, _ = parse(encode(header))
    assert parsed.ssl == info
    if info.client & SSLClient.SSL:
        assert info.version is not None


@settings(max_examples=150)  # a sanity check of the strategy
@given(unix_addresses)
def test_unix_addresses_are_representable(address: UnixAddress) -> None:
    assert len(address.path) <= 108
    if address.path[:1] == b"\x00":
        assert not address.path.endswith(b"\x00")
    else:
        assert b"\x00" not in address.path


@settings(max_examples=150)  # a sanity check of the strategy
@given(host_names)
def test_host_names_are_valid_authority_text(host: str) -> None:
    raw = host.encode("utf-8")
    assert 1 <= len(raw) <= 255
    assert host.isprintable()
    assert " " not in host


@settings(max_examples=150)  # a sanity check of the strategy
@given(tlvs())
def test_tlvs_never_carry_crc32c(values: tuple[object, ...]) -> None:
    assert all(getattr(t, "type", None) != TLVType.CRC32C for t in values)


@given(invalid_headers())
def test_every_invalid_header_is_refused_and_labelled(bad: InvalidHeader) -> None:
    assert bad.why
    assert bad.why[0].isalpha()
    assert bad.kind in {*INVALID_KINDS, "v1_ipv4_in_tcp6", "v1_ipv6_in_tcp4"}
    reader = HeaderReader()
    reader.receive_data(bad.data)
    if bad.incomplete:
        assert reader.next_event() is NEED_DATA
        reader.receive_data(b"")
    with pytest.raises(RemoteProtocolError):
        reader.next_event()


@pytest.mark.parametrize("kind", INVALID_KINDS)
def test_each_invalid_kind_is_refused(kind: str) -> None:
    @settings(max_examples=15, database=None)
    @given(invalid_headers(kinds=[kind]))
    def check(bad: InvalidHeader) -> None:
        assert bad.kind in labels(kind)
        assert bad.incomplete == (kind == "truncated")
        with pytest.raises(RemoteProtocolError):
            parse(bad.data)

    check()


# -- coverage -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "command", "family", "transport"),
    [
        (1, Command.PROXY, Family.INET, Transport.STREAM),
        (1, Command.PROXY, Family.INET6, Transport.STREAM),
        (1, Command.PROXY, Family.UNSPEC, Transport.UNSPEC),
        (2, Command.LOCAL, Family.UNSPEC, Transport.UNSPEC),
        *(
            (2, Command.PROXY, f, t)
            for f in (Family.INET, Family.INET6, Family.UNIX)
            for t in (Transport.STREAM, Transport.DGRAM)
        ),
    ],
)
def test_headers_cover_every_kind(
    version: int, command: Command, family: Family, transport: Transport
) -> None:
    found(
        proxy_headers(),
        lambda h: (
            (h.version, h.command, h.family, h.transport)
            == (version, command, family, transport)
        ),
    )


def test_unspec_proxy_only_on_request() -> None:
    header = found(
        proxy_headers(2, unspec_proxy=True),
        lambda h: h.command is Command.PROXY and h.family is Family.UNSPEC,
    )
    assert header.source is None

    @settings(max_examples=200, database=None)
    @given(proxy_headers(2))
    def never(h: ProxyHeader) -> None:
        assert h.command is Command.LOCAL or h.family is not Family.UNSPEC

    never()


TLV_KINDS: dict[str, Callable[[int], bool]] = {
    "alpn": lambda t: t == TLVType.ALPN,
    "authority": lambda t: t == TLVType.AUTHORITY,
    "noop": lambda t: t == TLVType.NOOP,
    "unique_id": lambda t: t == TLVType.UNIQUE_ID,
    "ssl": lambda t: t == TLVType.SSL,
    "netns": lambda t: t == TLVType.NETNS,
    "aws": lambda t: t == TLVType.AWS,
    "azure": lambda t: t == TLVType.AZURE,
    "gcp": lambda t: t == TLVType.GCP,
    "custom": lambda t: 0xE0 <= t <= 0xEF and t not in (0xE0, 0xEA, 0xEE),
    "experimental": lambda t: 0xF0 <= t <= 0xF7,
    "future": lambda t: 0xF8 <= t <= 0xFF,
    "unassigned": lambda t: t < 0xE0 and t not in (1, 2, 3, 4, 5, 0x20, 0x30),
}


@pytest.mark.parametrize("kind", sorted(TLV_KINDS))
def test_tlvs_cover_every_kind(kind: str) -> None:
    is_kind = TLV_KINDS[kind]
    found(tlvs(), lambda ts: any(is_kind(t.type) for t in ts))
    # tlv(kinds=[...]) draws only that kind.
    found(tlv(kinds=[kind]), lambda t: is_kind(t.type))


def test_tlvs_reach_the_edges() -> None:
    found(tlv(kinds=["unique_id"]), lambda t: len(t.value) == 128)
    found(tlv(kinds=["aws"]), lambda t: t.value[:1] == b"\x01")
    found(tlv(kinds=["aws"]), lambda t: t.value[:1] != b"\x01")


@pytest.mark.parametrize(
    "field", ["version", "cn", "cipher", "sig_alg", "key_alg", "group", "sig_scheme"]
)
def test_ssl_infos_cover_every_sub_tlv(field: str) -> None:
    found(ssl_infos(), lambda i: getattr(i, field) is not None)


def test_ssl_infos_cover_client_certs_and_unknown_sub_tlvs() -> None:
    found(
        ssl_infos(),
        lambda i: i.client_cert is not None and len(i.client_cert) > 1000,
    )
    found(ssl_infos(), lambda i: any(not 0x21 <= t.type <= 0x28 for t in i.tlvs))


def test_unix_addresses_cover_abstract_and_regular_paths() -> None:
    found(unix_addresses, lambda a: a.path[:1] == b"\x00" and len(a.path) > 1)
    found(unix_addresses, lambda a: len(a.path) > 1 and a.path[:1] != b"\x00")


def test_encoded_headers_cover_encoder_options() -> None:
    found(encoded_headers(2), lambda p: p[0].crc32c is not None)
    found(
        encoded_headers(2), lambda p: p[0].tlvs[-1:] != () and p[0].tlvs[-1].type == 4
    )
    # LOCAL with a dummy address block, as AWS NLB health checks send.
    found(encoded_headers(2), lambda p: p[1][12] == 0x20 and p[1][13] != 0x00)


def test_invalid_headers_draw_every_kind() -> None:
    # Counting over one run (the per-kind test above draws each on purpose).
    seen: set[str] = set()

    @settings(max_examples=600, database=None, phases=[Phase.generate])
    @given(invalid_headers())
    def collect(bad: InvalidHeader) -> None:
        seen.add(bad.kind)

    collect()
    assert len(seen) >= len(INVALID_KINDS) * 3 // 4, sorted(seen)
