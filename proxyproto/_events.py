"""The values proxyproto produces and consumes: headers, addresses, TLVs.

Everything in __all__ is re-exported as part of the public API.

All of them are frozen, slotted dataclasses. Constructing one yourself validates
it (an invalid header cannot exist, so it cannot be encoded); the parser builds
them through a private path that skips validation it has already done on the
wire bytes. Don't subclass these.

The TLV type numbers and limits come from `proxyproto._spec`, the checks of TLV
values from `proxyproto._tlv` (which imports nothing from here).
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from ipaddress import IPv4Address, IPv6Address
from operator import attrgetter
from typing import Literal, cast

from proxyproto._errors import LocalProtocolError, RemoteProtocolError
from proxyproto._ip import dotted_quad_value, ip_text, ipv6_value
from proxyproto._spec import MAX_TLV_VALUE_LENGTH, SSLClient, TLVType
from proxyproto._tlv import SSL_TEXT_FIELDS, validate_tlv, walk_ssl

__all__ = [
    "NEED_DATA",
    "NO_HEADER",
    "TLV",
    "Command",
    "Family",
    "InetAddress",
    "ProxyHeader",
    "SSLClient",
    "SSLInfo",
    "TLVType",
    "Transport",
    "UnixAddress",
]


class _Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"
    NO_HEADER = "NO_HEADER"

    def __repr__(self) -> str:
        return self.value


#: Returned by ``HeaderReader.next_event()`` when more bytes are needed.
NEED_DATA: Literal[_Sentinel.NEED_DATA] = _Sentinel.NEED_DATA
#: Returned by a reader built with ``optional=True`` when the connection does not
#: start with a PROXY header (all bytes are then in ``trailing_data``).
NO_HEADER: Literal[_Sentinel.NO_HEADER] = _Sentinel.NO_HEADER


class Command(enum.IntEnum):
    """The v2 command nibble. v1 headers are always PROXY."""

    #: The proxy made this connection itself (e.g. a health check): use the real
    #: socket endpoints.
    LOCAL = 0x0
    #: The connection is relayed on behalf of the client described in the header.
    PROXY = 0x1


class Family(enum.IntEnum):
    """Address family (high nibble of the v2 family byte)."""

    UNSPEC = 0x0
    INET = 0x1
    INET6 = 0x2
    UNIX = 0x3


class Transport(enum.IntEnum):
    """Transport protocol (low nibble of the v2 family byte)."""

    UNSPEC = 0x0
    STREAM = 0x1
    DGRAM = 0x2


# The v2 address block's UNIX path size, and the cloud vendors' TLV subtypes.
UNIX_PATH_LENGTH = 108  # sun_path, NUL padded in the v2 address block
AWS_SUBTYPE_VPCE_ID = 0x01
AZURE_SUBTYPE_PRIVATE_ENDPOINT_LINK_ID = 0x01


class _InetLayout:
    # InetAddress's slots, in a base class that InetSlots shares: a
    # ``__class__`` assignment between two classes that add no slots to a
    # common base skips comparing their slot lists (see HeaderSlots).
    __slots__ = ("host", "port")


@dataclass(frozen=True, slots=True)
class InetAddress(_InetLayout):
    """An IPv4 or IPv6 endpoint."""

    host: IPv4Address | IPv6Address
    port: int

    def __post_init__(self) -> None:
        if not isinstance(self.host, (IPv4Address, IPv6Address)):
            raise LocalProtocolError(
                f"InetAddress.host must be an IPv4Address or IPv6Address, "
                f"got {type(self.host).__name__}"
            )
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise LocalProtocolError(f"port must be an int, got {self.port!r}")
        if not 0 <= self.port <= 0xFFFF:
            raise LocalProtocolError(f"port must be 0..65535, got {self.port}")
        if isinstance(self.host, IPv6Address) and self.host.scope_id is not None:
            # Neither v1 text nor the v2 address block can carry a zone id: the
            # encoders would emit a line receivers refuse, or silently drop it.
            raise LocalProtocolError(
                f"IPv6 zone ids cannot be sent in a PROXY header: {self.host}"
            )

    @classmethod
    def parse(cls, host: str, port: int) -> InetAddress:
        """Build from a textual address, e.g. ``InetAddress.parse("::1", 443)``."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise LocalProtocolError(f"not an IP address: {host!r}") from None
        return cls(ip, port)

    def __str__(self) -> str:
        """``host:port``, IPv6 in brackets, IPv4-mapped as ``[::ffff:a.b.c.d]``."""
        if self.host.version == 6:
            return f"[{ip_text(self.host)}]:{self.port}"
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class UnixAddress:
    """A UNIX socket path as sent in the v2 address block (NUL padding removed).

    Abstract-namespace paths keep their leading NUL byte.
    """

    path: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.path, bytes):
            raise LocalProtocolError(
                f"UnixAddress.path must be bytes, got {type(self.path).__name__}"
            )
        if len(self.path) > UNIX_PATH_LENGTH:
            raise LocalProtocolError(
                f"UNIX path is {len(self.path)} bytes; at most "
                f"{UNIX_PATH_LENGTH} fit in the address block"
            )
        # The block is NUL padded: a regular path ends at its first NUL and an
        # abstract one (leading NUL) cannot end with NULs, or it would not
        # decode to the same path.
        if self.path[:1] == b"\x00":
            if self.path.endswith(b"\x00"):
                raise LocalProtocolError(
                    f"abstract UNIX path cannot end with NUL: {self.path[:32]!r}"
                )
        elif b"\x00" in self.path:
            raise LocalProtocolError(
                f"UNIX path cannot contain NUL: {self.path[:32]!r}"
            )


@dataclass(frozen=True, slots=True)
class TLV:
    """One type-length-value record, exactly as on the wire.

    ``type`` is an int; known types compare equal to their ``TLVType`` member.
    """

    type: int
    value: bytes
    # True once the value passed its type's check (the parser, the builders
    # below): encode_v2 does not check it again. Type and value are immutable,
    # so it stays true; a copy made with dataclasses.replace starts unchecked.
    _valid: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.type, bool) or not isinstance(self.type, int):
            raise LocalProtocolError(f"TLV type must be an int, got {self.type!r}")
        if not 0 <= self.type <= 0xFF:
            raise LocalProtocolError(f"TLV type must be 0..255, got {self.type}")
        if not isinstance(self.value, bytes):
            raise LocalProtocolError(
                f"TLV value must be bytes, got {type(self.value).__name__}"
            )
        if len(self.value) > MAX_TLV_VALUE_LENGTH:
            raise LocalProtocolError(
                f"TLV value is {len(self.value)} bytes; at most 65535 fit"
            )

    # Builders for the well-known types. They validate like the parser does,
    # raising LocalProtocolError for a value a strict receiver would refuse.

    @classmethod
    def alpn(cls, protocol: bytes) -> TLV:
        """ALPN (0x01): the negotiated application protocol, e.g. ``b"h2"``."""
        return _checked(cls(TLVType.ALPN, protocol))

    @classmethod
    def authority(cls, host: str) -> TLV:
        """AUTHORITY (0x02): the host name the client asked for (TLS SNI)."""
        return _checked(cls(TLVType.AUTHORITY, _encode_text(host, "utf-8")))

    @classmethod
    def unique_id(cls, value: bytes) -> TLV:
        """UNIQUE_ID (0x05): an opaque connection id of at most 128 bytes."""
        return _checked(cls(TLVType.UNIQUE_ID, value))

    @classmethod
    def netns(cls, name: str) -> TLV:
        """NETNS (0x30): the network namespace name."""
        return _checked(cls(TLVType.NETNS, _encode_text(name, "ascii")))

    @classmethod
    def noop(cls, length: int = 0) -> TLV:
        """NOOP (0x04): *length* bytes of padding."""
        if length < 0:
            raise LocalProtocolError(f"NOOP length must be >= 0, got {length}")
        return cls(TLVType.NOOP, bytes(length))

    @classmethod
    def ssl(cls, info: SSLInfo) -> TLV:
        """SSL (0x20) with its sub-TLVs."""
        return _checked(cls(TLVType.SSL, info.encode()))

    @classmethod
    def aws_vpce_id(cls, vpce_id: str) -> TLV:
        """AWS (0xEA) subtype 0x01: the PrivateLink VPC endpoint id."""
        data = bytes([AWS_SUBTYPE_VPCE_ID]) + _encode_text(vpce_id, "ascii")
        tlv = cls(TLVType.AWS, data)
        _decode_aws_vpce_id(tlv.value, LocalProtocolError)
        return tlv

    @classmethod
    def azure_link_id(cls, link_id: int) -> TLV:
        """Azure (0xEE) subtype 0x01: the private endpoint link id (u32)."""
        if not 0 <= link_id <= 0xFFFFFFFF:
            raise LocalProtocolError(f"Azure link id must fit in 32 bits: {link_id}")
        data = bytes([AZURE_SUBTYPE_PRIVATE_ENDPOINT_LINK_ID]) + link_id.to_bytes(
            4, "little"
        )
        return cls(TLVType.AZURE, data)

    @classmethod
    def gcp_psc_id(cls, connection_id: int) -> TLV:
        """GCP (0xE0): the Private Service Connect connection id (u64)."""
        if not 0 <= connection_id <= 0xFFFFFFFFFFFFFFFF:
            raise LocalProtocolError(
                f"GCP PSC connection id must fit in 64 bits: {connection_id}"
            )
        return cls(TLVType.GCP, connection_id.to_bytes(8, "big"))


def _encode_text(text: str, encoding: str) -> bytes:
    # Strict: silently replacing what does not fit ("?") would send a
    # different value than the caller asked for.
    try:
        return text.encode(encoding)
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(
            f"{text[:32]!r} cannot be encoded as {encoding}: {exc.reason}"
        ) from None


def _checked(tlv: TLV) -> TLV:
    validate_tlv(tlv.type, tlv.value, LocalProtocolError)
    _SET_TLV_VALID(tlv, True)
    return tlv


_NO_CLIENT_FLAGS = SSLClient(0)


class _SSLInfoLayout:
    # SSLInfo's slots, in a base class that _SSLInfoSlots shares (see
    # _InetLayout). The sub-TLVs are kept in _tlvs, behind the ``tlvs``
    # property (see _lazy_tlvs below), as ProxyHeader keeps its TLVs.
    __slots__ = (
        "_tlvs",
        "cipher",
        "client",
        "client_cert",
        "cn",
        "group",
        "key_alg",
        "sig_alg",
        "sig_scheme",
        "tlvs",
        "verify",
        "version",
    )
    _tlvs: tuple[TLV, ...] | bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class SSLInfo(_SSLInfoLayout):
    """The SSL TLV (0x20): what the proxy knows about the client's TLS session.

    Text fields are validated ASCII (CN: UTF-8) before you ever see them.
    A decoded one makes its ``tlvs`` records on first access.
    """

    #: ``SSLClient`` bits.
    client: SSLClient = _NO_CLIENT_FLAGS
    #: 0 if and only if the client presented a certificate and it verified.
    verify: int = 1
    version: str | None = None
    cn: str | None = None
    cipher: str | None = None
    sig_alg: str | None = None
    key_alg: str | None = None
    group: str | None = None
    sig_scheme: str | None = None
    #: The client certificate, DER.
    client_cert: bytes | None = None
    #: Every sub-TLV in wire order, including unknown ones.
    tlvs: tuple[TLV, ...] = field(default=())

    def __post_init__(self) -> None:
        if not 0 <= self.client <= 0xFF:
            raise LocalProtocolError(f"SSL client flags must fit a byte: {self.client}")
        if not 0 <= self.verify <= 0xFFFFFFFF:
            raise LocalProtocolError(f"SSL verify must fit 32 bits: {self.verify}")
        if isinstance(self._tlvs, bytes):  # only a decoder stores bytes
            raise LocalProtocolError("SSLInfo.tlvs must be a tuple of TLV, not bytes")
        if not self.tlvs:
            object.__setattr__(self, "tlvs", self._sub_tlvs_from_fields())

    @property
    def verified(self) -> bool:
        """True if the client presented a certificate and it verified."""
        return self.verify == 0 and bool(self.client & SSLClient.CERT_CONN)

    def _sub_tlvs_from_fields(self) -> tuple[TLV, ...]:
        fields: list[tuple[TLVType, str | None]] = [
            (TLVType.SSL_VERSION, self.version),
            (TLVType.SSL_CN, self.cn),
            (TLVType.SSL_CIPHER, self.cipher),
            (TLVType.SSL_SIG_ALG, self.sig_alg),
            (TLVType.SSL_KEY_ALG, self.key_alg),
            (TLVType.SSL_GROUP, self.group),
            (TLVType.SSL_SIG_SCHEME, self.sig_scheme),
        ]
        out = [
            TLV(t, _encode_text(v, "utf-8" if t == TLVType.SSL_CN else "ascii"))
            for t, v in fields
            if v is not None
        ]
        if self.client_cert is not None:
            out.append(TLV(TLVType.SSL_CLIENT_CERT, self.client_cert))
        return tuple(out)

    def encode(self) -> bytes:
        """The SSL TLV's value: client byte, verify u32, then the sub-TLVs."""
        parts = [bytes([self.client]), self.verify.to_bytes(4, "big")]
        for tlv in self.tlvs:
            parts.append(bytes([tlv.type]) + len(tlv.value).to_bytes(2, "big"))
            parts.append(tlv.value)
        return b"".join(parts)


Address = InetAddress | UnixAddress


class _HeaderLayout:
    # ProxyHeader's slots, in a base class that HeaderSlots shares (see
    # _InetLayout); the dataclass adds none of its own. The destination is
    # kept in _destination, behind the ``destination`` property (see
    # _destination below), and the TLVs in _tlvs, behind the ``tlvs``
    # property (see _tlvs below): the slots named destination and tlvs are
    # there for the dataclass to find (it would add them) and stay empty.
    __slots__ = (
        "_destination",
        "_tlvs",
        "command",
        "destination",
        "family",
        "source",
        "tlvs",
        "transport",
        "version",
    )
    _destination: Address | PendingInet | None
    _tlvs: tuple[TLV, ...] | bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyHeader(_HeaderLayout):
    """One decoded PROXY header.

    ``source`` and ``destination`` are None when the real socket endpoints apply:
    LOCAL commands, v1 ``UNKNOWN`` and v2 ``UNSPEC``. For LOCAL headers the
    family and transport are reported as UNSPEC whatever the sender put there,
    because the spec tells receivers to ignore them.

    The parser builds these objects directly from the validated wire bytes,
    without going through the validating constructor a second time, an
    INET/INET6 destination on first access to ``destination`` and the `TLV`
    records on first access to ``tlvs`` (both are checked when the header is
    read: reading them never raises).
    """

    version: int
    command: Command = Command.PROXY
    family: Family
    transport: Transport
    source: Address | None
    destination: Address | None
    tlvs: tuple[TLV, ...] = ()

    def __post_init__(self) -> None:
        _validate_header(self)

    # -- convenient constructors -------------------------------------------

    @classmethod
    def from_addresses(
        cls,
        source: InetAddress | UnixAddress | tuple[object, ...] | str | bytes,
        destination: InetAddress | UnixAddress | tuple[object, ...] | str | bytes,
        *,
        version: int = 2,
        transport: Transport = Transport.STREAM,
        tlvs: tuple[TLV, ...] = (),
    ) -> ProxyHeader:
        """A PROXY header for a relayed connection.

        *source* and *destination* may be socket addresses as returned by
        ``getpeername()`` / ``getsockname()`` (``(host, port)`` or the 4-tuple
        of IPv6, a ``str``/``bytes`` path for UNIX sockets) or address objects.
        Mixed families are resolved the way HAProxy does: an IPv4 endpoint
        paired with an IPv6 one is sent as an IPv4-mapped IPv6 address.
        """
        src = _to_address(source)
        dst = _to_address(destination)
        if isinstance(src, InetAddress) and isinstance(dst, InetAddress):
            if src.host.version != dst.host.version:
                src, dst = _as_ipv6(src), _as_ipv6(dst)
            family = Family.INET if src.host.version == 4 else Family.INET6
        elif isinstance(src, UnixAddress) and isinstance(dst, UnixAddress):
            family = Family.UNIX
        else:
            raise LocalProtocolError("source and destination are of different kinds")
        return cls(
            version=version,
            command=Command.PROXY,
            family=family,
            transport=transport,
            source=src,
            destination=dst,
            tlvs=tlvs,
        )

    @classmethod
    def local(cls, *, tlvs: tuple[TLV, ...] = ()) -> ProxyHeader:
        """A v2 LOCAL header (a health check: use the real endpoints)."""
        return cls(
            version=2,
            command=Command.LOCAL,
            family=Family.UNSPEC,
            transport=Transport.UNSPEC,
            source=None,
            destination=None,
            tlvs=tlvs,
        )

    @classmethod
    def unknown(cls, *, version: int = 1) -> ProxyHeader:
        """v1 ``PROXY UNKNOWN`` or v2 PROXY with UNSPEC family."""
        return cls(
            version=version,
            command=Command.PROXY,
            family=Family.UNSPEC,
            transport=Transport.UNSPEC,
            source=None,
            destination=None,
        )

    # -- typed TLV accessors ------------------------------------------------

    def tlv(self, tlv_type: int) -> bytes | None:
        """The value of the first TLV of *tlv_type*, or None."""
        tlvs = self._tlvs
        if isinstance(tlvs, bytes):
            return _first_value(tlvs, tlv_type)
        for t in tlvs:
            if t.type == tlv_type:
                return t.value
        return None

    @property
    def alpn(self) -> bytes | None:
        """ALPN (0x01), e.g. ``b"h2"``."""
        return self.tlv(TLVType.ALPN)

    @property
    def authority(self) -> str | None:
        """AUTHORITY (0x02): the host name (TLS SNI) the client asked for."""
        value = self.tlv(TLVType.AUTHORITY)
        return None if value is None else value.decode("utf-8")

    @property
    def unique_id(self) -> bytes | None:
        """UNIQUE_ID (0x05)."""
        return self.tlv(TLVType.UNIQUE_ID)

    @property
    def crc32c(self) -> int | None:
        """The CRC32C TLV's value (already verified by the reader by default)."""
        value = self.tlv(TLVType.CRC32C)
        return None if value is None else int.from_bytes(value, "big")

    @property
    def netns(self) -> str | None:
        """NETNS (0x30): the network namespace name."""
        value = self.tlv(TLVType.NETNS)
        return None if value is None else value.decode("ascii")

    @property
    def ssl(self) -> SSLInfo | None:
        """The SSL TLV (0x20), decoded."""
        tlvs = self._tlvs
        if isinstance(tlvs, bytes):
            value = _first_value(tlvs, _SSL)
            return None if value is None else _decode_checked_ssl(value)
        for t in tlvs:
            if t.type == _SSL:
                if t._valid:
                    return _decode_checked_ssl(t.value)
                return _decode_ssl(t.value)
        return None

    @property
    def aws_vpce_id(self) -> str | None:
        """AWS PrivateLink VPC endpoint id (TLV 0xEA, subtype 0x01).

        Raises:
            RemoteProtocolError: the TLV is there but malformed.
        """
        for t in self.tlvs:
            if t.type == TLVType.AWS and t.value[:1] == b"\x01":
                return _decode_aws_vpce_id(t.value, RemoteProtocolError)
        return None

    @property
    def azure_link_id(self) -> int | None:
        """Azure private endpoint link id (TLV 0xEE, subtype 0x01).

        Raises:
            RemoteProtocolError: the TLV is there but malformed.
        """
        for t in self.tlvs:
            if t.type == TLVType.AZURE and t.value[:1] == b"\x01":
                if len(t.value) != 5:
                    raise RemoteProtocolError(
                        f"Azure link id TLV must be 5 bytes, got {len(t.value)}",
                        reason="bad_tlv",
                    )
                return int.from_bytes(t.value[1:], "little")
        return None

    @property
    def gcp_psc_id(self) -> int | None:
        """GCP Private Service Connect connection id (TLV 0xE0).

        Raises:
            RemoteProtocolError: the TLV is there but is not 8 bytes.
        """
        value = self.tlv(TLVType.GCP)
        if value is None:
            return None
        if len(value) != 8:
            raise RemoteProtocolError(
                f"GCP PSC TLV must be 8 bytes, got {len(value)}", reason="bad_tlv"
            )
        return int.from_bytes(value, "big")


# What go-proxyproto and proxy-protocol-rs accept in a VPC endpoint id.
_VPCE_ID_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-"


def _decode_aws_vpce_id(
    value: bytes, error: type[LocalProtocolError | RemoteProtocolError]
) -> str:
    text = value[1:]
    if not text or text.translate(None, _VPCE_ID_BYTES):
        raise error(
            f"AWS VPC endpoint id must be non-empty [A-Za-z0-9-], got {text[:32]!r}",
            reason="bad_tlv",
        )
    return text.decode("ascii")


def _to_address(
    value: InetAddress | UnixAddress | tuple[object, ...] | str | bytes,
) -> InetAddress | UnixAddress:
    if isinstance(value, (InetAddress, UnixAddress)):
        return value
    if isinstance(value, str):
        # Socket paths are decoded with the filesystem encoding's error
        # handler (surrogateescape): undo that exactly.
        return UnixAddress(value.encode("utf-8", "surrogateescape"))
    if isinstance(value, bytes):
        return UnixAddress(value)
    if len(value) >= 2:
        host, port = value[0], value[1]
        if isinstance(host, str) and isinstance(port, int):
            return InetAddress.parse(host.partition("%")[0], port)
    raise LocalProtocolError(f"cannot make an address out of {value!r}")


def _as_ipv6(address: InetAddress) -> InetAddress:
    if isinstance(address.host, IPv4Address):
        return InetAddress(IPv6Address(f"::ffff:{address.host}"), address.port)
    return address


_FAMILY_HOST_VERSION = {Family.INET: 4, Family.INET6: 6}
_PROXY = Command.PROXY
_INET = Family.INET
_INET6 = Family.INET6


# The decoders' private construction path: no __init__, no __post_init__ (the
# values were validated on the wire). An object is filled as an instance of a
# plain class with the same slots, whose attribute stores are the interpreter's
# own (a frozen dataclass refuses them), then becomes an instance of the real
# class: Python allows __class__ assignment between classes of the same slot
# layout. Half the cost of a setter call per field. The decoders' most common
# paths (v2 INET, v1 TCP4) do this inline, as each call costs about as much as
# what it would wrap: HeaderSlots, InetSlots and blank_ipv4 are for them.


class HostSlots:
    """What a decoder stores in a blank IPv4Address/IPv6Address (typing only)."""

    _ip: int
    _scope_id: str | None


class HeaderSlots(_HeaderLayout):
    """ProxyHeader's slots, to fill, then ``__class__ = ProxyHeader``."""

    __slots__ = ()
    version: int
    command: Command
    family: Family
    transport: Transport
    source: Address | InetSlots | None


class InetSlots(_InetLayout):
    """InetAddress's slots, to fill, then ``__class__ = InetAddress``."""

    __slots__ = ()
    host: IPv4Address | IPv6Address | HostSlots
    port: int


class _TLVSlots:
    __slots__ = TLV.__slots__
    type: int
    value: bytes
    _valid: bool


def new_header(  # noqa: PLR0917 (positional: keywords cost more per call)
    version: int,
    command: Command,
    family: Family,
    transport: Transport,
    source: Address | None,
    destination: Address | None,
    tlvs: tuple[TLV, ...] | bytes,
) -> ProxyHeader:
    """A ProxyHeader of values the caller has validated; *tlvs* as
    ``ProxyHeader._tlvs`` holds them (see _tlvs)."""
    header = HeaderSlots()
    header.version = version
    header.command = command
    header.family = family
    header.transport = transport
    header.source = source
    header._destination = destination
    header._tlvs = tlvs
    header.__class__ = ProxyHeader  # type: ignore[assignment]
    return header  # type: ignore[return-value]


def new_inet(host: IPv4Address | IPv6Address, port: int) -> InetAddress:
    """An InetAddress of values the caller has validated."""
    address = InetSlots()
    address.host = host
    address.port = port
    address.__class__ = InetAddress  # type: ignore[assignment]
    return address  # type: ignore[return-value]


# ipaddress's constructors check their argument in Python (a third of a
# microsecond each); the decoders' values are in range by construction (a u32,
# a u128, or checked text), so they make the object without its constructor
# and store the value slot themselves (IPv4Address and IPv6Address have no
# __setattr__ of their own). ``_ip`` (and IPv6's ``_scope_id``) is what every
# ipaddress version since 3.3 stores: checked here, so a Python that changes
# it fails at import, not at the first header.
#: An IPv4Address without its value: store it in ``_ip``.
blank_ipv4 = cast(Callable[[], HostSlots], partial(object.__new__, IPv4Address))
#: An IPv6Address without its value: store it in ``_ip``, None in ``_scope_id``.
blank_ipv6 = cast(Callable[[], HostSlots], partial(object.__new__, IPv6Address))
if "_ip" not in IPv4Address.__slots__ or not {"_ip", "_scope_id"} <= set(
    IPv6Address.__slots__
):
    raise ImportError("proxyproto needs ipaddress's _ip and _scope_id slots")
#: ``int(host)`` for the encoders, without the call to ``__int__``.
host_value: Callable[[IPv4Address | IPv6Address], int] = attrgetter("_ip")


def new_inet6_header(  # noqa: PLR0917 (positional: keywords cost more per call)
    version: int,
    transport: Transport,
    source: int,
    source_port: int,
    destination: int,
    destination_port: int,
    tlvs: tuple[TLV, ...] | bytes,
) -> ProxyHeader:
    """A PROXY header of the INET6 family, from IPv6 host values without zone
    id (0 <= value < 2**128), ports and TLVs the caller has validated."""
    header = HeaderSlots()
    header.version = version
    header.command = _PROXY
    header.family = _INET6
    header.transport = transport
    header.source = _new_inet6(source, source_port)
    header._destination = (destination, destination_port)
    header._tlvs = tlvs
    header.__class__ = ProxyHeader  # type: ignore[assignment]
    return header  # type: ignore[return-value]


def _new_inet6(value: int, port: int) -> InetAddress:
    host = blank_ipv6()
    host._ip = value
    host._scope_id = None
    address = InetSlots()
    address.host = host
    address.port = port
    address.__class__ = InetAddress  # type: ignore[assignment]
    return address  # type: ignore[return-value]


# -- the destination, made on first access -------------------------------------
# A receiver reads the source address of nearly every header, the destination
# (its own address, as the client saw it) less often. The decoders store an
# INET or INET6 destination as its checked (host value, port) pair, or, from a
# v1 line, as the pair's checked text (see PendingInet); the
# `destination` property makes the InetAddress on first access and stores it
# in place of the pair, so it is made once (two threads reading at once may
# both make one: equal values, the last stored stays). Everything that reads
# the field goes through the property and gets the InetAddress: ==, hash,
# repr, pickle and copy (the dataclass's __getstate__), dataclasses.replace.
# The storage, _destination, is read as it is by the encoders (which take a
# pair as it is, encode_v1 its text too) and by the validating constructor,
# which refuses a pair: only a decoder stores one.

#: An unread INET/INET6 destination: its host value and port, or (v1) their
#: text, which the decoder's regular expression has checked (a dotted quad of
#: octets 0..255 without leading zeros, or IPv6 text as ``IPv6Address``
#: takes it without zone id; a port 0..65535 without a leading zero), or (v2
#: INET6, read by HeaderReader) the address's 16 bytes and the port.
PendingInet = tuple[int, int] | tuple[bytes, bytes] | tuple[bytes, int]
_from_bytes = int.from_bytes
_set_destination: Callable[[ProxyHeader, Address | PendingInet | None], None] = (
    _HeaderLayout.__dict__["_destination"].__set__
)


def _destination(header: ProxyHeader) -> Address | None:
    pending = header._destination
    if type(pending) is not tuple:
        return pending  # type: ignore[return-value]
    value, port = pending
    # The InetAddress made in line, as the decoders make the source.
    if header.family is _INET:
        host = blank_ipv4()
        if type(value) is bytes:  # v1 TCP4 text (see PendingInet)
            value = dotted_quad_value(value)
            port = int(port)
        host._ip = value  # type: ignore[assignment]
    else:
        host = blank_ipv6()
        if type(port) is bytes:  # v1 TCP6 text (see PendingInet)
            value = ipv6_value(value)  # type: ignore[arg-type, assignment]
            port = int(port)
        elif type(value) is bytes:  # v2 INET6's 16 bytes (see PendingInet)
            value = _from_bytes(value)
        host._ip = value  # type: ignore[assignment]
        host._scope_id = None
    address = InetSlots()
    address.host = host
    address.port = port  # type: ignore[assignment]
    address.__class__ = InetAddress  # type: ignore[assignment]
    _set_destination(header, address)  # type: ignore[arg-type]
    return address  # type: ignore[return-value]


type.__setattr__(
    ProxyHeader,
    "destination",
    property(
        _destination,
        _set_destination,
        doc="The destination address (of a decoded header: made on first access).",
    ),
)


# -- the TLV records, made on first access -----------------------------------
# Most receivers read a TLV or two through the accessors (authority, ssl, the
# cloud ids), or none, and never the records. A decoder checks every TLV (so
# a header with a bad one is refused when read) and stores the checked TLV
# bytes, the header's tail after the address block, in _tlvs; the accessors
# find their value in those bytes, and the ``tlvs`` property makes the TLV
# records on first access and stores their tuple in place of the bytes, as
# ``destination`` does its address (everything that reads the field gets the
# tuple; the validating constructor refuses bytes).
def _lazy_tlvs(layout: type, top_level: bool, doc: str) -> property:
    """The ``tlvs`` property over *layout*'s ``_tlvs`` slot: checked TLV
    bytes become their records (top-level TLVs, or SSL sub-TLVs, which are
    not valid as top-level ones) on first access, stored in their place."""
    store = layout.__dict__["_tlvs"]
    read, write = store.__get__, store.__set__

    def tlvs(owner: object) -> tuple[TLV, ...]:
        value = read(owner)
        if type(value) is bytes:
            value = tlv_records(value, top_level)
            write(owner, value)
        return value  # type: ignore[no-any-return]

    return property(tlvs, write, doc=doc)


type.__setattr__(
    ProxyHeader,
    "tlvs",
    _lazy_tlvs(
        _HeaderLayout,
        True,
        "The TLVs in wire order (of a decoded header: made on first access).",
    ),
)


def _first_value(tlvs: bytes, tlv_type: int) -> bytes | None:
    # The value of the first TLV of *tlv_type* in checked TLV bytes.
    pos, end = 0, len(tlvs)
    while pos < end:
        stop = pos + 3 + ((tlvs[pos + 1] << 8) | tlvs[pos + 2])
        if tlvs[pos] == tlv_type:
            return tlvs[pos + 3 : stop]
        pos = stop
    return None


def tlv_records(tlvs: bytes, valid: bool) -> tuple[TLV, ...]:
    """The TLV records of well-formed TLV bytes (each record's type, length
    and value, the lengths within the bytes); *valid*: as for new_tlv."""
    records = []
    pos, end = 0, len(tlvs)
    while pos < end:
        stop = pos + 3 + ((tlvs[pos + 1] << 8) | tlvs[pos + 2])
        tlv = _TLVSlots()
        tlv.type = tlvs[pos]
        tlv.value = tlvs[pos + 3 : stop]
        tlv._valid = valid
        tlv.__class__ = TLV  # type: ignore[assignment]
        records.append(tlv)
        pos = stop
    return tuple(records)  # type: ignore[arg-type]


def new_tlv(tlv_type: int, value: bytes, valid: bool) -> TLV:
    """A TLV of values the caller has validated; *valid*: the value passed its
    type's check (see TLV._valid)."""
    tlv = _TLVSlots()
    tlv.type = tlv_type
    tlv.value = value
    tlv._valid = valid
    tlv.__class__ = TLV  # type: ignore[assignment]
    return tlv  # type: ignore[return-value]


def _validate_header(h: ProxyHeader) -> None:
    destination = h._destination  # as stored: a pair is refused
    tlvs = h._tlvs  # as stored: bytes are refused
    if h.version not in (1, 2):
        raise LocalProtocolError(f"version must be 1 or 2, got {h.version!r}")
    if type(tlvs) is not tuple or not all(isinstance(t, TLV) for t in tlvs):
        raise LocalProtocolError("tlvs must be a tuple of TLV")
    if h.version == 1:
        if h.command is not Command.PROXY:
            raise LocalProtocolError("v1 headers only have the PROXY command")
        if h.tlvs:
            raise LocalProtocolError("v1 headers cannot carry TLVs")
        if h.family is Family.UNIX:
            raise LocalProtocolError("v1 headers cannot carry UNIX addresses")
        if h.family is not Family.UNSPEC and h.transport is not Transport.STREAM:
            raise LocalProtocolError("v1 headers only describe TCP (STREAM)")
    if h.command is Command.LOCAL or h.family is Family.UNSPEC:
        if h.command is Command.LOCAL and h.family is not Family.UNSPEC:
            raise LocalProtocolError("LOCAL headers have family UNSPEC")
        if h.transport is not Transport.UNSPEC:
            raise LocalProtocolError("UNSPEC family goes with UNSPEC transport")
        if h.source is not None or destination is not None:
            raise LocalProtocolError(
                "LOCAL and UNSPEC headers carry no addresses (source and "
                "destination must be None)"
            )
        return
    if h.transport is Transport.UNSPEC:
        raise LocalProtocolError(
            f"family {h.family.name} needs transport STREAM or DGRAM, not UNSPEC"
        )
    for role, address in (("source", h.source), ("destination", destination)):
        if h.family is Family.UNIX:
            if not isinstance(address, UnixAddress):
                raise LocalProtocolError(f"UNIX family needs a UnixAddress {role}")
        elif (
            not isinstance(address, InetAddress)
            or address.host.version != _FAMILY_HOST_VERSION[h.family]
        ):
            raise LocalProtocolError(
                f"{h.family.name} family needs an InetAddress {role} with an "
                f"IPv{_FAMILY_HOST_VERSION[h.family]} host, got {address!r}"
            )


# Marks a TLV built by a checking builder (_checked) as valid: the slot's own
# setter, past the frozen dataclass's __setattr__.
_SET_TLV_VALID = TLV.__dict__["_valid"].__set__


class _SSLInfoSlots(_SSLInfoLayout):
    """SSLInfo's slots, to fill, then ``__class__ = SSLInfo``."""

    __slots__ = ()
    client: SSLClient
    verify: int
    version: str | None
    cn: str | None
    cipher: str | None
    sig_alg: str | None
    key_alg: str | None
    group: str | None
    sig_scheme: str | None
    client_cert: bytes | None


type.__setattr__(
    SSLInfo,
    "tlvs",
    _lazy_tlvs(
        _SSLInfoLayout,
        False,
        "Every sub-TLV in wire order, including unknown ones (of a decoded "
        "SSL TLV: made on first access).",
    ),
)


def _decode_ssl(value: bytes) -> SSLInfo:
    """Decode an SSL TLV's value that has not been checked.

    Raises:
        RemoteProtocolError: the value is invalid.
    """
    walk_ssl(value, RemoteProtocolError)
    return _decode_checked_ssl(value)


def _decode_checked_ssl(value: bytes) -> SSLInfo:
    """Decode an SSL TLV's value that passed its check (`walk_ssl`'s)."""
    # Built like the parser builds headers (no constructor: every value was
    # checked); the first sub-TLV of each type fills its field. A checked
    # text is ASCII (UTF-8 for the CN): UTF-8 decodes either.
    info = _SSLInfoSlots()
    info.version = info.cn = info.cipher = info.sig_alg = None
    info.key_alg = info.group = info.sig_scheme = info.client_cert = None
    names = _SSL_FIELD_NAMES
    pos, end = _SSL_FIXED_LENGTH, len(value)
    while pos < end:
        sub_type = value[pos]
        stop = pos + 3 + ((value[pos + 1] << 8) | value[pos + 2])
        name = names.get(sub_type)
        if name is not None and getattr(info, name) is None:
            sub_value = value[pos + 3 : stop]
            setattr(
                info,
                name,
                sub_value if sub_type == _SSL_CLIENT_CERT else sub_value.decode(),
            )
        pos = stop
    client = _CLIENT_FLAGS.get(value[0])
    if client is None:
        client = _CLIENT_FLAGS[value[0]] = SSLClient(value[0])
    info.client = client
    info.verify = int.from_bytes(value[1:_SSL_FIXED_LENGTH])
    info._tlvs = value[_SSL_FIXED_LENGTH:]  # records on first access
    info.__class__ = SSLInfo  # type: ignore[assignment]
    return info  # type: ignore[return-value]


_SSL = int(TLVType.SSL)
_SSL_CLIENT_CERT = int(TLVType.SSL_CLIENT_CERT)
_SSL_FIXED_LENGTH = 5  # u8 client + u32 verify
# The SSLInfo field of each sub-TLV type that has one.
_SSL_FIELD_NAMES: dict[int, str] = {
    int(sub_type): name
    for sub_type, name in (
        *SSL_TEXT_FIELDS.items(),
        (TLVType.SSL_CN, "cn"),
        (TLVType.SSL_CLIENT_CERT, "client_cert"),
    )
}
# SSLClient(byte) goes through the Enum machinery (~1 us): 256 values at most.
_CLIENT_FLAGS: dict[int, SSLClient] = {}
