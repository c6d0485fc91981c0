"""Named PROXY protocol test vectors, as hex, shared by the unit tests.

Every vector says where it comes from and why it is valid or invalid. Section
numbers refer to /work/shared/reference/proxy-protocol.md (the spec digest);
"spec" is HAProxy's ``doc/proxy-protocol.txt``.

The bytes are written out by hand (never produced by our encoder), so a bug in
the encoder cannot hide the same bug in the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass


def hx(text: str) -> bytes:
    """Bytes from hex text; whitespace is ignored so fields can be spaced out."""
    return bytes.fromhex("".join(text.split()))


# spec 2.2: the 12-byte v2 signature, "\r\n\r\n\0\r\nQUIT\n".
SIG = hx("0d 0a 0d 0a 00 0d 0a 51 55 49 54 0a")

# ---------------------------------------------------------------------------
# v1 (text), spec 2.1 / digest 1.2
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class V1Valid:
    """A valid v1 line and what it decodes to (proto None = UNKNOWN)."""

    data: bytes
    proto: str | None = None
    src: str = ""
    dst: str = ""
    sport: int = 0
    dport: int = 0


V1_VALID: dict[str, V1Valid] = {
    # spec 2.1 example form: TCP4, single spaces, CRLF.
    "tcp4": V1Valid(
        b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n",
        "TCP4",
        "192.168.0.1",
        "192.168.0.11",
        56324,
        443,
    ),
    # Port 0 is a valid port ("0" is not a leading zero); Netty wrongly refuses it.
    "tcp4-port-0": V1Valid(
        b"PROXY TCP4 0.0.0.0 255.255.255.255 0 0\r\n",
        "TCP4",
        "0.0.0.0",
        "255.255.255.255",
        0,
        0,
    ),
    # Largest ports and octets.
    "tcp4-port-65535": V1Valid(
        b"PROXY TCP4 255.255.255.255 10.0.0.1 65535 65535\r\n",
        "TCP4",
        "255.255.255.255",
        "10.0.0.1",
        65535,
        65535,
    ),
    # The longest TCP4 line, 56 bytes incl. CRLF (spec 2.1).
    "tcp4-longest": V1Valid(
        b"PROXY TCP4 255.255.255.255 255.255.255.255 65535 65535\r\n",
        "TCP4",
        "255.255.255.255",
        "255.255.255.255",
        65535,
        65535,
    ),
    "tcp6": V1Valid(
        b"PROXY TCP6 2001:db8::1 2001:db8::2 4242 443\r\n",
        "TCP6",
        "2001:db8::1",
        "2001:db8::2",
        4242,
        443,
    ),
    # IPv6 hex groups may be any case (spec: "hexadecimal").
    "tcp6-uppercase": V1Valid(
        b"PROXY TCP6 2001:DB8::A ::1 1 2\r\n", "TCP6", "2001:db8::a", "::1", 1, 2
    ),
    # An IPv4-mapped IPv6 address is IPv6 text, so it is fine in TCP6.
    "tcp6-ipv4-mapped": V1Valid(
        b"PROXY TCP6 ::ffff:1.2.3.4 ::ffff:5.6.7.8 80 443\r\n",
        "TCP6",
        "::ffff:1.2.3.4",
        "::ffff:5.6.7.8",
        80,
        443,
    ),
    # The longest TCP6 line, 104 bytes incl. CRLF (spec 2.1).
    "tcp6-longest": V1Valid(
        b"PROXY TCP6 ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff "
        b"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff 65535 65535\r\n",
        "TCP6",
        "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        65535,
        65535,
    ),
    # spec 2.1: the short UNKNOWN form, 15 bytes.
    "unknown-short": V1Valid(b"PROXY UNKNOWN\r\n"),
    # spec 2.1: the worst case, UNKNOWN + two full IPv6 + ports = 107 bytes.
    "unknown-107-bytes": V1Valid(
        b"PROXY UNKNOWN ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff "
        b"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff 65535 65535\r\n"
    ),
    # spec 2.1: "the receiver must ignore anything presented before the CRLF".
    "unknown-junk": V1Valid(b"PROXY UNKNOWN what ever\tyou  like!\r\n"),
    "unknown-non-ascii-junk": V1Valid(b"PROXY UNKNOWN \xff\xfe\x00\x80\r\n"),
    "unknown-trailing-space": V1Valid(b"PROXY UNKNOWN \r\n"),
}

# The 107-byte worst case line, also used for the 107-byte limit tests.
V1_LONGEST = V1_VALID["unknown-107-bytes"].data
assert len(V1_LONGEST) == 107
assert len(V1_VALID["tcp6-longest"].data) == 104
assert len(V1_VALID["tcp4-longest"].data) == 56

_TCP4_OK = b"PROXY TCP4 1.2.3.4 5.6.7.8 80 443\r\n"

# Invalid v1 lines: (bytes, expected reason). All must be refused even when
# complete; see digest 1.2 and section 5 (Python's int()/ipaddress leniency).
V1_INVALID: dict[str, tuple[bytes, str]] = {
    # Leading zeros are octal in some parsers: refused (spec 2.1, go-proxyproto).
    "octet-leading-zero": (b"PROXY TCP4 01.2.3.4 5.6.7.8 80 443\r\n", "bad_v1"),
    "octet-00": (b"PROXY TCP4 1.2.3.00 5.6.7.8 80 443\r\n", "bad_v1"),
    "port-leading-zero": (b"PROXY TCP4 1.2.3.4 5.6.7.8 080 443\r\n", "bad_v1"),
    "port-00": (b"PROXY TCP4 1.2.3.4 5.6.7.8 00 443\r\n", "bad_v1"),
    # int() accepts signs, "_" and spaces; the grammar does not.
    "port-plus": (b"PROXY TCP4 1.2.3.4 5.6.7.8 +80 443\r\n", "bad_v1"),
    "port-minus": (b"PROXY TCP4 1.2.3.4 5.6.7.8 -1 443\r\n", "bad_v1"),
    "port-underscore": (b"PROXY TCP4 1.2.3.4 5.6.7.8 8_0 443\r\n", "bad_v1"),
    "tcp6-port-plus": (b"PROXY TCP6 ::1 ::2 +80 443\r\n", "bad_v1"),
    "tcp6-port-leading-zero": (b"PROXY TCP6 ::1 ::2 80 0443\r\n", "bad_v1"),
    # Single spaces only.
    "double-space": (b"PROXY TCP4 1.2.3.4  5.6.7.8 80 443\r\n", "bad_v1"),
    "leading-space": (b"PROXY  TCP4 1.2.3.4 5.6.7.8 80 443\r\n", "bad_v1_protocol"),
    "trailing-space": (b"PROXY TCP4 1.2.3.4 5.6.7.8 80 443 \r\n", "bad_v1"),
    "tab": (b"PROXY TCP4 1.2.3.4\t5.6.7.8 80 443\r\n", "bad_v1"),
    # Case-sensitive keywords (gunicorn's .upper() accepts these).
    "lowercase-tcp4": (b"PROXY tcp4 1.2.3.4 5.6.7.8 80 443\r\n", "bad_v1_protocol"),
    "lowercase-proxy": (b"proxy TCP4 1.2.3.4 5.6.7.8 80 443\r\n", "bad_signature"),
    "unknown-protocol": (b"PROXY TCP5 1.2.3.4 5.6.7.8 80 443\r\n", "bad_v1_protocol"),
    # "UNKNOWN" is a token: it is followed by SP or CRLF, not glued to junk.
    "unknown-glued": (b"PROXY UNKNOWNjunk\r\n", "bad_v1_protocol"),
    # IPv6 zone ids are not part of the grammar (ipaddress accepts them).
    "zone-id": (b"PROXY TCP6 fe80::1%eth0 fe80::2 80 443\r\n", "bad_v1"),
    # "The advertised protocol family dictates what format to use."
    "ipv4-in-tcp6": (b"PROXY TCP6 1.2.3.4 5.6.7.8 80 443\r\n", "bad_v1"),
    "ipv6-in-tcp4": (b"PROXY TCP4 ::1 ::2 80 443\r\n", "bad_v1"),
    "bad-ipv6": (b"PROXY TCP6 1:::2 ::2 80 443\r\n", "bad_v1"),
    "ipv6-too-many-groups": (b"PROXY TCP6 1:2:3:4:5:6:7:8:9 ::2 80 443\r\n", "bad_v1"),
    # Only CRLF terminates the line (spec 2.1: "lone CR or LF").
    "bare-lf": (b"PROXY TCP4 1.2.3.4 5.6.7.8 80 443\n", "bad_v1"),
    "lone-cr": (b"PROXY TCP4 1.2.3.4 5.6.7.8 80 443\rX\r\n", "bad_v1"),
    "cr-cr-lf": (b"PROXY TCP4 1.2.3.4 5.6.7.8 80 443\r\r\n", "bad_v1"),
    "unknown-bare-lf": (b"PROXY UNKNOWN x\ny\r\n", "bad_v1"),
    "unknown-lone-cr": (b"PROXY UNKNOWN \rX\r\n", "bad_v1"),
    # Field counts.
    "missing-port": (b"PROXY TCP4 1.2.3.4 5.6.7.8 80\r\n", "bad_v1"),
    "missing-everything": (b"PROXY TCP4\r\n", "bad_v1"),
    "extra-field": (b"PROXY TCP4 1.2.3.4 5.6.7.8 80 443 9\r\n", "bad_v1"),
    "no-space-after-proxy": (b"PROXY\r\n", "bad_signature"),
    # Ranges.
    "octet-256": (b"PROXY TCP4 1.2.3.256 5.6.7.8 80 443\r\n", "bad_v1"),
    "three-octets": (b"PROXY TCP4 1.2.3 5.6.7.8 80 443\r\n", "bad_v1"),
    "port-65536": (b"PROXY TCP4 1.2.3.4 5.6.7.8 65536 443\r\n", "bad_v1"),
    "port-99999": (b"PROXY TCP4 1.2.3.4 5.6.7.8 80 99999\r\n", "bad_v1"),
    "port-6-digits": (b"PROXY TCP4 1.2.3.4 5.6.7.8 80 100000\r\n", "bad_v1"),
    "empty-port": (b"PROXY TCP6 ::1 ::2  443\r\n", "bad_v1"),
    # Non-ASCII bytes (e.g. Unicode digits, which bytes.isdigit() refuses).
    "non-ascii-port": (b"PROXY TCP4 1.2.3.4 5.6.7.8 8\xd9\xa0 443\r\n", "bad_v1"),
    "non-ascii-byte": (b"PROXY TCP4 1.2.3.4 5.6.7.8 80 44\xb3\r\n", "bad_v1"),
    # spec 2.1: no CRLF within 107 bytes -> invalid. CRLF at bytes 107-108.
    "108-bytes-with-crlf": (
        b"PROXY UNKNOWN " + b"a" * 92 + b"\r\n",
        "v1_too_long",
    ),
}
assert len(V1_INVALID["108-bytes-with-crlf"][0]) == 108

# ---------------------------------------------------------------------------
# v2 (binary), spec 2.2 / digest 1.3
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class V2Valid:
    """A valid v2 header and its expected decoding.

    ``src``/``dst`` are IP text, UNIX paths (bytes) or None; ``tlvs`` is a
    tuple of (type, value).
    """

    data: bytes
    command: int  # 0 LOCAL, 1 PROXY
    family: int
    transport: int
    src: str | bytes | None = None
    dst: str | bytes | None = None
    sport: int = 0
    dport: int = 0
    tlvs: tuple[tuple[int, bytes], ...] = ()


_UNIX_SRC = b"/var/run/src.sock"
_UNIX_DST = b"/var/run/dst.sock"
_UNIX_BLOCK = _UNIX_SRC.ljust(108, b"\0") + _UNIX_DST.ljust(108, b"\0")
_ABSTRACT_SRC = b"\0abstract-src"
_ABSTRACT_BLOCK = _ABSTRACT_SRC.ljust(108, b"\0") + b"\0x".ljust(108, b"\0")

V2_VALID: dict[str, V2Valid] = {
    # spec 2.2 layout: TCP over IPv4 (fam 0x11), 12-byte block:
    # 192.168.0.1:54321 -> 192.168.0.2:443.
    "tcp4": V2Valid(
        SIG + hx("21 11 000c  c0a80001 c0a80002 d431 01bb"),
        1,
        1,
        1,
        "192.168.0.1",
        "192.168.0.2",
        54321,
        443,
    ),
    # UDP over IPv4 (fam 0x12), ports 0 and 65535.
    "udp4": V2Valid(
        SIG + hx("21 12 000c  0a000001 0a000002 0000 ffff"),
        1,
        1,
        2,
        "10.0.0.1",
        "10.0.0.2",
        0,
        65535,
    ),
    # TCP over IPv6 (fam 0x21), 36-byte block.
    "tcp6": V2Valid(
        SIG
        + hx(
            "21 21 0024"
            "20010db8000000000000000000000001"
            "20010db8000000000000000000000002"
            "1092 01bb"
        ),
        1,
        2,
        1,
        "2001:db8::1",
        "2001:db8::2",
        4242,
        443,
    ),
    # UDP over IPv6 (fam 0x22), IPv4-mapped source.
    "udp6-mapped": V2Valid(
        SIG
        + hx(
            "21 22 0024"
            "00000000000000000000ffff01020304"
            "00000000000000000000000000000001"
            "0035 0035"
        ),
        1,
        2,
        2,
        "::ffff:1.2.3.4",
        "::1",
        53,
        53,
    ),
    # UNIX stream (fam 0x31), 216-byte block of two NUL-padded 108-byte paths.
    "unix-stream": V2Valid(
        SIG + hx("21 31 00d8") + _UNIX_BLOCK, 1, 3, 1, _UNIX_SRC, _UNIX_DST
    ),
    "unix-dgram": V2Valid(
        SIG + hx("21 32 00d8") + _UNIX_BLOCK, 1, 3, 2, _UNIX_SRC, _UNIX_DST
    ),
    # Linux abstract socket names start with a NUL byte, which must be kept.
    "unix-abstract": V2Valid(
        SIG + hx("21 31 00d8") + _ABSTRACT_BLOCK, 1, 3, 1, _ABSTRACT_SRC, b"\0x"
    ),
    # spec 2.2: LOCAL with UNSPEC and len 0, what senders should emit.
    "local-unspec": V2Valid(SIG + hx("20 00 0000"), 0, 0, 0),
    # AWS NLB health check (go-proxyproto#12): LOCAL, fam 0x11 and 12 dummy
    # bytes. The receiver must honour len and ignore the family.
    "local-aws-nlb-health-check": V2Valid(
        SIG + hx("20 11 000c  ac1f0001 ac1f0002 9c40 0050"), 0, 0, 0
    ),
    # LOCAL with len shorter than its family's block: the block is skipped.
    "local-short-block": V2Valid(SIG + hx("20 21 0004 01020304"), 0, 0, 0),
    # LOCAL with TLVs: NOOP of 4 zeros and a UNIQUE_ID "id".
    "local-tlvs": V2Valid(
        SIG + hx("20 00 000c  04 0004 00000000  05 0002 6964"),
        0,
        0,
        0,
        tlvs=((0x04, bytes(4)), (0x05, b"id")),
    ),
    # Zero-length TLVs are valid (NOOP, UNIQUE_ID, custom, AUTHORITY is not:
    # it must be a non-empty host name, so it is not here).
    "zero-length-tlvs": V2Valid(
        SIG + hx("21 11 0015  01020304 05060708 0050 01bb  04 0000  05 0000  e5 0000"),
        1,
        1,
        1,
        "1.2.3.4",
        "5.6.7.8",
        80,
        443,
        tlvs=((0x04, b""), (0x05, b""), (0xE5, b"")),
    ),
    # Duplicate TLVs are kept, in wire order (Envoy's dedup was a bug: #42075).
    "duplicate-tlvs": V2Valid(
        SIG
        + hx(
            "21 11 001d  01020304 05060708 0050 01bb  e0 0001 aa  f0 0001 01"
            "  f0 0001 02  ff 0002 0304"
        ),
        1,
        1,
        1,
        "1.2.3.4",
        "5.6.7.8",
        80,
        443,
        tlvs=((0xE0, b"\xaa"), (0xF0, b"\x01"), (0xF0, b"\x02"), (0xFF, b"\x03\x04")),
    ),
    # ALPN h2 + AUTHORITY example.com, as HAProxy's send-proxy-v2 emits.
    "alpn-authority": V2Valid(
        SIG
        + hx("21 11 001f  7f000001 7f000001 c350 01bb  01 0002 6832  02 000b")
        + b"example.com",
        1,
        1,
        1,
        "127.0.0.1",
        "127.0.0.1",
        50000,
        443,
        tlvs=((0x01, b"h2"), (0x02, b"example.com")),
    ),
}

# Every fam byte the spec defines (digest 1.3), with the block size it implies.
V2_FAMILY_BYTES = (0x00, 0x11, 0x12, 0x21, 0x22, 0x31, 0x32)

# Invalid v2 headers: (bytes, expected reason).
V2_INVALID: dict[str, tuple[bytes, str]] = {
    # spec 2.2: "the receiver must only accept" version 2.
    "version-1": (SIG + hx("11 11 000c") + bytes(12), "bad_version"),
    "version-0": (SIG + hx("01 11 000c") + bytes(12), "bad_version"),
    "version-3": (SIG + hx("31 11 000c") + bytes(12), "bad_version"),
    "version-f": (SIG + hx("f1 11 000c") + bytes(12), "bad_version"),
    # Unassigned commands: "the receiver must drop the connection".
    "command-2": (SIG + hx("22 11 000c") + bytes(12), "bad_command"),
    "command-f": (SIG + hx("2f 11 000c") + bytes(12), "bad_command"),
    # Family bytes not among the 7 (go-proxyproto 5914db8: 0x13 -> nil address).
    "family-0x13": (SIG + hx("21 13 000c") + bytes(12), "bad_family"),
    "family-0x10": (SIG + hx("21 10 000c") + bytes(12), "bad_family"),
    "family-0x20": (SIG + hx("21 20 0024") + bytes(36), "bad_family"),
    # Digest 1.3: PROXY with UNSPEC refused by default (go, proxy-protocol-rs).
    "proxy-unspec": (SIG + hx("21 00 0000"), "unspec_proxy"),
    # CVE-2019-14243 (mastercactapus/proxyprotocol): len 0 with INET family
    # panicked the decoder; the address block must fit in len.
    "cve-2019-14243-tcp4": (SIG + hx("21 11 0000"), "truncated_addresses"),
    "cve-2019-14243-udp4": (SIG + hx("21 12 0000"), "truncated_addresses"),
    # HAProxy efd3aa934: len shorter than the IPv6 block.
    "short-ipv6-block": (SIG + hx("21 21 000c") + bytes(12), "truncated_addresses"),
    "short-unix-block": (SIG + hx("21 31 0024") + bytes(36), "truncated_addresses"),
    # HAProxy 488ee7fb6: a TLV must end within the header. ALPN says 3 bytes,
    # only 2 are left: overrun by one byte.
    "tlv-overrun-by-one": (
        SIG + hx("21 11 0011  01020304 05060708 0050 01bb  01 0003 6832"),
        "bad_tlv",
    ),
    # TLV header (type + u16 length) truncated: 1 or 2 bytes left.
    "tlv-header-1-byte": (
        SIG + hx("21 11 000d  01020304 05060708 0050 01bb  04"),
        "bad_tlv",
    ),
    "tlv-header-2-bytes": (
        SIG + hx("21 11 000e  01020304 05060708 0050 01bb  04 00"),
        "bad_tlv",
    ),
    # CRC32C TLV must be exactly 4 bytes (HAProxy).
    "crc32c-3-bytes": (
        SIG + hx("21 11 0012  01020304 05060708 0050 01bb  03 0003 000000"),
        "bad_tlv",
    ),
    # Two CRC32C TLVs: which one would be checked? Refused.
    "two-crc32c": (
        SIG
        + hx(
            "21 11 001a  01020304 05060708 0050 01bb  03 0004 00000000"
            "  03 0004 00000000"
        ),
        "bad_tlv",
    ),
    # A wrong checksum: "MUST treat the TCP connection ... as invalid".
    "crc32c-mismatch": (
        SIG + hx("21 11 0013  01020304 05060708 0050 01bb  03 0004 00000000"),
        "crc32c_mismatch",
    ),
    # ALPN must be 1..255 bytes (RFC 7301).
    "alpn-empty": (
        SIG + hx("21 11 000f  01020304 05060708 0050 01bb  01 0000"),
        "bad_tlv",
    ),
    # Envoy CVE-2024-23324: invalid UTF-8 in AUTHORITY must be refused.
    "authority-invalid-utf8": (
        SIG + hx("21 11 0011  01020304 05060708 0050 01bb  02 0002 c328"),
        "bad_tlv",
    ),
    "authority-space": (
        SIG + hx("21 11 0012  01020304 05060708 0050 01bb  02 0003 612062"),
        "bad_tlv",
    ),
    "authority-control": (
        SIG + hx("21 11 0012  01020304 05060708 0050 01bb  02 0003 610a62"),
        "bad_tlv",
    ),
    "netns-non-ascii": (
        SIG + hx("21 11 0011  01020304 05060708 0050 01bb  30 0002 c3a9"),
        "bad_tlv",
    ),
    # spec: UNIQUE_ID is at most 128 bytes.
    "unique-id-129": (
        SIG + hx("21 11 0090  01020304 05060708 0050 01bb  05 0081") + bytes(129),
        "bad_tlv",
    ),
    # SSL TLV shorter than its packed client(1) + verify(4) prefix.
    "ssl-4-bytes": (
        SIG + hx("21 11 0013  01020304 05060708 0050 01bb  20 0004 00000000"),
        "bad_tlv",
    ),
    # SSL with PP2_CLIENT_SSL but no VERSION sub-TLV (go-proxyproto tlvparse).
    "ssl-no-version": (
        SIG + hx("21 11 0014  01020304 05060708 0050 01bb  20 0005 01 00000000"),
        "bad_tlv",
    ),
    # SSL sub-TLV VERSION says 8 bytes, 7 present.
    "ssl-sub-tlv-overrun": (
        SIG
        + hx("21 11 001e  01020304 05060708 0050 01bb  20 000f 01 00000000  21 0008")
        + b"TLSv1.3",
        "bad_tlv",
    ),
    # SSL sub-TLV header truncated (2 bytes after the prefix).
    "ssl-sub-tlv-header-truncated": (
        SIG + hx("21 11 0016  01020304 05060708 0050 01bb  20 0007 00 00000000 2100"),
        "bad_tlv",
    ),
}

# A PROXY TCP4 header with len 4097 (0x1001): over the default 4096 limit. Only
# the 16 fixed bytes: the reader must refuse it without waiting for the rest.
V2_LEN_4097_FIXED = SIG + hx("21 11 1001")

# ---------------------------------------------------------------------------
# A real AWS NLB style header (digest 1.6): INET, CRC32C TLV, AWS 0xEA TLV
# (subtype 0x01 + 22-byte VPC endpoint id, len 0x17), then NOOP padding of
# 36 bytes (len 0x24); total len 0x54 = 12 + 7 + 26 + 39. Addresses are
# 192.0.2.10:46052 -> 10.0.1.20:80. The CRC (0xe2aebcb3) was computed with
# google_crc32c.value over the header with the CRC field zeroed; the CRC test
# module re-checks it with google_crc32c.
# ---------------------------------------------------------------------------
AWS_VPCE_ID = "vpce-08d2bf15fac5001c9"
AWS_NLB_CRC = 0xE2AEBCB3
AWS_NLB_CRC_OFFSET = 31  # 16 fixed + 12 addresses + 3 TLV header
AWS_NLB = (
    SIG
    + hx("21 11 0054  c000020a 0a000114 b3e4 0050")
    + hx("03 0004 e2aebcb3")
    + hx("ea 0017 01")
    + AWS_VPCE_ID.encode()
    + hx("04 0024")
    + bytes(36)
)
assert len(AWS_NLB) == 16 + 0x54

# ---------------------------------------------------------------------------
# Cloud TLV values (digest 1.6)
# ---------------------------------------------------------------------------
# Azure Private Link: subtype 0x01 + u32 little-endian; spec vector.
AZURE_VALUE = hx("01 c1 45 00 21")
AZURE_LINK_ID = 553665985
# GCP PSC: u64 big-endian, no subtype; spec vector.
GCP_VALUE = hx("ff ff ff ff c0 a8 64 02")
GCP_PSC_ID = 18446744072646845442

# ---------------------------------------------------------------------------
# CRC32C check values, RFC 3720 appendix B.4 (and the "123456789" check value
# of the CRC catalogue).
# ---------------------------------------------------------------------------
CRC32C_VECTORS: dict[str, tuple[bytes, int]] = {
    "32-zeros": (bytes(32), 0x8A9136AA),
    "32-ones": (b"\xff" * 32, 0x62A8AB43),
    "incrementing": (bytes(range(32)), 0x46DD794E),
    "decrementing": (bytes(range(31, -1, -1)), 0x113FDB5C),
    "check-123456789": (b"123456789", 0xE3069283),
    "empty": (b"", 0x00000000),
}

# A TLS 1.3 ClientHello-like blob: what follows the header on a TLS edge. It
# starts with the record header 16 03 01 and contains CR, LF and NUL bytes.
CLIENT_HELLO = hx("16 03 01 00 2e 01 00 00 2a 03 03") + bytes(range(32)) + b"\r\n\0"
