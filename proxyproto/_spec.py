"""Numbers the PROXY protocol specification registers for TLVs: the TLV
types (with the cloud vendors' custom ones), the SSL TLV's client flags and
the limits on TLV values.

The bottom of the package: `proxyproto._tlv` (which checks TLV values) and
`proxyproto._events` (the TLV and header records, which re-export these) both
import from here, and this module imports nothing of the package.
"""

from __future__ import annotations

import enum

__all__ = [
    "MAX_ALPN_LENGTH",
    "MAX_AUTHORITY_LENGTH",
    "MAX_TLV_VALUE_LENGTH",
    "MAX_UNIQUE_ID_LENGTH",
    "SSLClient",
    "TLVType",
]


class TLVType(enum.IntEnum):
    """Registered v2 TLV types, plus the cloud vendors' custom ones."""

    ALPN = 0x01
    AUTHORITY = 0x02
    CRC32C = 0x03
    NOOP = 0x04
    UNIQUE_ID = 0x05
    SSL = 0x20
    SSL_VERSION = 0x21
    SSL_CN = 0x22
    SSL_CIPHER = 0x23
    SSL_SIG_ALG = 0x24
    SSL_KEY_ALG = 0x25
    SSL_GROUP = 0x26
    SSL_SIG_SCHEME = 0x27
    SSL_CLIENT_CERT = 0x28
    NETNS = 0x30
    #: Google Cloud Private Service Connect: 8-byte big-endian connection id.
    GCP = 0xE0
    #: AWS (NLB / PrivateLink): subtype byte, 0x01 = VPC endpoint id.
    AWS = 0xEA
    #: Azure Private Link: subtype 0x01 + 4-byte little-endian link id.
    AZURE = 0xEE


class SSLClient(enum.IntFlag):
    """Bits of the SSL TLV's ``client`` field."""

    #: The client connected over TLS.
    SSL = 0x01
    #: The client presented a certificate on this connection.
    CERT_CONN = 0x02
    #: The client presented a certificate at least once in this TLS session.
    CERT_SESS = 0x04


# Limits from the spec and from HAProxy's receiver.
MAX_UNIQUE_ID_LENGTH = 128  # spec: "maximum length of 128 bytes"
MAX_AUTHORITY_LENGTH = 255  # a DNS name; HAProxy refuses longer
MAX_ALPN_LENGTH = 255  # an ALPN protocol id is 1..255 bytes (RFC 7301)
MAX_TLV_VALUE_LENGTH = 0xFFFF  # u16 length field
