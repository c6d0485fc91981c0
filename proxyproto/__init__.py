"""proxyproto: a strict, fast, sans-IO PROXY protocol v1/v2 codec.

Bytes in, events and bytes out; no I/O framework is imported here (adapters for
trio, asyncio and blocking sockets live in their own modules and import their
framework only when used)::

    reader = HeaderReader()
    reader.receive_data(data)          # b"" means EOF
    event = reader.next_event()        # ProxyHeader or NEED_DATA
    rest = reader.trailing_data        # bytes after the header, untouched
"""

from __future__ import annotations

from proxyproto._crc32c import crc32c
from proxyproto._errors import (
    LocalProtocolError as LocalProtocolError,
    ProxyProtocolError as ProxyProtocolError,
    RemoteProtocolError as RemoteProtocolError,
)
from proxyproto._events import (
    NEED_DATA as NEED_DATA,
    NO_HEADER as NO_HEADER,
    TLV as TLV,
    Command as Command,
    Family as Family,
    InetAddress as InetAddress,
    ProxyHeader as ProxyHeader,
    SSLClient as SSLClient,
    SSLInfo as SSLInfo,
    TLVType as TLVType,
    Transport as Transport,
    UnixAddress as UnixAddress,
)
from proxyproto._options import (
    DEFAULT_MAX_V2_LENGTH as DEFAULT_MAX_V2_LENGTH,
    V1_MAX_LENGTH as V1_MAX_LENGTH,
)
from proxyproto._policy import Policy as Policy, TrustPolicy as TrustPolicy
from proxyproto._reader import HeaderReader as HeaderReader, parse as parse
from proxyproto._v1 import encode_v1 as encode_v1
from proxyproto._v2 import V2_SIGNATURE as V2_SIGNATURE, encode_v2 as encode_v2
from proxyproto._version import __version__ as __version__


def encode(header: ProxyHeader, *, crc32c: bool = False) -> bytes:
    """Serialise *header* in its own version (``encode_v1`` or ``encode_v2``).

    Raises:
        LocalProtocolError: the header cannot be represented.
    """
    if header.version == 1:
        return encode_v1(header)
    return encode_v2(header, crc32c=crc32c)


__all__ = [
    "DEFAULT_MAX_V2_LENGTH",
    "NEED_DATA",
    "NO_HEADER",
    "TLV",
    "V1_MAX_LENGTH",
    "V2_SIGNATURE",
    "Command",
    "Family",
    "HeaderReader",
    "InetAddress",
    "LocalProtocolError",
    "Policy",
    "ProxyHeader",
    "ProxyProtocolError",
    "RemoteProtocolError",
    "SSLClient",
    "SSLInfo",
    "TLVType",
    "Transport",
    "TrustPolicy",
    "UnixAddress",
    "crc32c",
    "encode",
    "encode_v1",
    "encode_v2",
    "parse",
]
