"""The ``proxyproto`` command: decode, encode, send and probe PROXY headers.

``proxyproto decode HEX|-``
    Print a header field by field (``--json`` for machine-readable output).
``proxyproto encode --source IP:PORT --destination IP:PORT [...]``
    Build a v1/v2 header and print its hex (``--raw`` writes the bytes).
``proxyproto send HOST:PORT [...]``
    Connect, send a header (the encode options), optionally TLS, then a
    request; copy the answer to stdout (``proxyproto._send``).
``proxyproto probe HOST:PORT``
    Fuzz a PROXY receiver with valid and invalid headers and report what it
    wrongly accepts or refuses (see ``proxyproto._probe``); with
    ``--diagnose``, say in one line what the port expects
    (``proxyproto._diagnose``).

Everything printed that came from a peer (TLV text, UNIX paths, a response) is
escaped first: a header is attacker-controlled data (``send`` copies the
answer to stdout as it came, like curl).

Exit codes: 0 success; 1 an invalid header (decode), no answer (send) or
findings (probe); 2 usage errors, bad input and connection failures;
``probe --diagnose``: 0 a header required, 1 guesses, 2 unreachable, 3 no
header expected, 4 undetermined.
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from proxyproto import (
    NEED_DATA,
    TLV,
    Command,
    Family,
    HeaderReader,
    InetAddress,
    LocalProtocolError,
    ProxyHeader,
    RemoteProtocolError,
    SSLClient,
    SSLInfo,
    TLVType,
    Transport,
    UnixAddress,
    __version__,
    crc32c,
    encode_v1,
    encode_v2,
)
from proxyproto._client import HeaderPlan, plan_header
from proxyproto._extras import missing_extra
from proxyproto._ip import ip_text

__all__ = ["decode_header", "main"]

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2

_HEX_BYTES = frozenset((string.hexdigits + string.whitespace).encode("ascii"))
# Address block size by v2 family byte (LOCAL headers skip it by its family).
_BLOCK_SIZES = {0x00: 0, 0x11: 12, 0x12: 12, 0x21: 36, 0x22: 36, 0x31: 216, 0x32: 216}
_SHOWN_BYTES = 48  # long binary values are shown cut, with their length


class _UsageError(Exception):
    """Bad command-line input: message to stderr, exit 2."""


# ---------------------------------------------------------------------------
# Escaping: peer bytes are never printed raw
# ---------------------------------------------------------------------------


def _esc_bytes(data: bytes, limit: int | None = None) -> str:
    """Printable ASCII as is, everything else as ``\\xNN``, in quotes."""
    shown = data if limit is None else data[:limit]
    text = repr(shown)[1:]
    if limit is not None and len(data) > limit:
        text = text[:-1] + "...'"
    return text


def _hex_text(data: bytes) -> str:
    if not data:
        return "(empty)"
    if len(data) > _SHOWN_BYTES:
        return f"hex {data[:_SHOWN_BYTES].hex()}..."
    return f"hex {data.hex()}"


def _esc_text(text: str) -> str:
    # repr escapes control and other non-printable characters (including
    # bidi overrides); printable non-ASCII letters stay readable.
    return repr(text)


def _type_name(tlv_type: int) -> str:
    try:
        return TLVType(tlv_type).name
    except ValueError:
        pass
    if 0xE0 <= tlv_type <= 0xEF:
        return "CUSTOM"
    if 0xF0 <= tlv_type <= 0xF7:
        return "EXPERIMENT"
    if tlv_type >= 0xF8:
        return "FUTURE"
    return "UNASSIGNED"


# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------


def _address_json(address: InetAddress | UnixAddress | None) -> dict[str, Any] | None:
    if address is None:
        return None
    if isinstance(address, InetAddress):
        host = ip_text(address.host)
        return {"host": host, "port": address.port, "text": str(address)}
    return {
        "path": _esc_bytes(address.path),
        "path_hex": address.path.hex(),
        "abstract": address.path[:1] == b"\x00",
        "text": "unix:" + _esc_bytes(address.path),
    }


def _tlv_region(wire: bytes) -> tuple[int, int]:
    """Where the TLVs of a valid v2 header start and end in *wire*."""
    total = 16 + int.from_bytes(wire[14:16], "big")
    block = _BLOCK_SIZES.get(wire[13], 0)
    return min(16 + block, total), total


def _crc_check(wire: bytes) -> bool | None:
    """Recompute the CRC32C of a v2 header over its wire bytes (None: no TLV)."""
    pos, end = _tlv_region(wire)
    while pos + 3 <= end:
        length = int.from_bytes(wire[pos + 1 : pos + 3], "big")
        if wire[pos] == TLVType.CRC32C and length == 4:
            at = pos + 3
            zeroed = wire[:at] + b"\x00\x00\x00\x00" + wire[at + 4 :]
            return crc32c(zeroed) == int.from_bytes(wire[at : at + 4], "big")
        pos += 3 + length
    return None


def _ssl_json(tlv: TLV) -> dict[str, Any]:
    info = ProxyHeader.local(tlvs=(tlv,)).ssl
    assert info is not None
    client = SSLClient(info.client)
    subs: list[dict[str, Any]] = []
    for sub in info.tlvs:
        entry: dict[str, Any] = {
            "type": sub.type,
            "name": _type_name(sub.type) if 0x21 <= sub.type <= 0x28 else "UNKNOWN",
            "length": len(sub.value),
            "value_hex": sub.value.hex(),
        }
        if sub.type == TLVType.SSL_CLIENT_CERT:
            entry["text"] = f"DER certificate, {len(sub.value)} bytes"
        elif 0x21 <= sub.type <= 0x27:
            entry["text"] = _esc_text(sub.value.decode("utf-8"))
        else:
            entry["text"] = _esc_bytes(sub.value, _SHOWN_BYTES)
        subs.append(entry)
    flags = [flag.name for flag in SSLClient if flag & client and flag.name]
    unknown_bits = int(client) & ~0x07
    if unknown_bits:
        flags.append(f"0x{unknown_bits:02x}")
    return {
        "client": f"0x{int(client):02x}",
        "client_flags": flags,
        "verify": info.verify,
        "verified": info.verified,
        "sub_tlvs": subs,
    }


def _tlv_json(tlv: TLV, crc_ok: bool | None) -> dict[str, Any]:
    value = tlv.value
    entry: dict[str, Any] = {
        "type": tlv.type,
        "name": _type_name(tlv.type),
        "length": len(value),
        "value_hex": value.hex(),
    }
    alone = ProxyHeader.local(tlvs=(tlv,))
    try:
        if tlv.type == TLVType.ALPN:
            entry["text"] = _esc_bytes(value)
        elif tlv.type == TLVType.AUTHORITY:
            entry["text"] = _esc_text(value.decode("utf-8"))
        elif tlv.type == TLVType.CRC32C:
            entry["crc32c"] = f"0x{int.from_bytes(value, 'big'):08x}"
            entry["verified"] = crc_ok
            entry["text"] = entry["crc32c"] + (
                " (verified)" if crc_ok else " (MISMATCH)"
            )
        elif tlv.type == TLVType.NOOP:
            entry["text"] = f"padding, {len(value)} bytes"
        elif tlv.type == TLVType.UNIQUE_ID:
            entry["text"] = _esc_bytes(value, _SHOWN_BYTES)
        elif tlv.type == TLVType.NETNS:
            entry["text"] = _esc_text(value.decode("ascii"))
        elif tlv.type == TLVType.SSL:
            entry["ssl"] = _ssl_json(tlv)
            ssl = entry["ssl"]
            entry["text"] = (
                f"client={'|'.join(ssl['client_flags']) or '0'} ({ssl['client']}) "
                f"verify={ssl['verify']}"
                + (" (client certificate verified)" if ssl["verified"] else "")
            )
        elif tlv.type == TLVType.AWS:
            entry["subtype"] = value[0] if value else None
            if value[:1] == b"\x01":
                entry["vpce_id"] = alone.aws_vpce_id
                entry["text"] = f"VPCE_ID {_esc_text(entry['vpce_id'])}"
            else:
                entry["text"] = f"subtype {_esc_bytes(value[:1])}: " + _esc_bytes(
                    value[1:], _SHOWN_BYTES
                )
        elif tlv.type == TLVType.AZURE:
            entry["subtype"] = value[0] if value else None
            if value[:1] == b"\x01":
                entry["link_id"] = alone.azure_link_id
                entry["text"] = (
                    f"PRIVATEENDPOINT_LINKID {entry['link_id']} "
                    f"(0x{entry['link_id']:08x}, little-endian on the wire)"
                )
            else:
                entry["text"] = _esc_bytes(value, _SHOWN_BYTES)
        elif tlv.type == TLVType.GCP:
            entry["psc_connection_id"] = alone.gcp_psc_id
            entry["text"] = f"PSC connection id {entry['psc_connection_id']}"
        else:
            entry["text"] = _hex_text(value)
    except (RemoteProtocolError, UnicodeDecodeError) as exc:
        # Vendor TLVs are opaque to the parser; their accessors validate.
        entry["error"] = str(exc)
        entry["text"] = f"MALFORMED: {exc}"
    return entry


def decode_header(data: bytes, **options: Any) -> dict[str, Any]:
    """Decode the PROXY header at the start of *data* into a JSON-able dict.

    ``result["ok"]`` says whether it is a complete, valid header; if not,
    ``error`` and ``reason`` say why. *options* are ``HeaderReader`` options.
    """
    try:
        reader = HeaderReader(**options)
    except LocalProtocolError as exc:
        raise _UsageError(str(exc)) from None
    if data:  # b"" would mean EOF
        reader.receive_data(data)
    try:
        event = reader.next_event()
        if event is NEED_DATA:
            needed = reader.bytes_needed
            return {
                "ok": False,
                "error": f"incomplete PROXY header: got {len(data)} bytes, at "
                f"least {needed} more needed",
                "reason": "incomplete",
                "received_bytes": len(data),
                "bytes_needed": needed,
            }
    except RemoteProtocolError as exc:
        return {
            "ok": False,
            "error": str(exc),
            "reason": exc.reason,
            "received_bytes": len(data),
        }
    assert isinstance(event, ProxyHeader)
    trailing = reader.trailing_data
    wire = data[: len(data) - len(trailing)]
    result: dict[str, Any] = {
        "ok": True,
        "version": event.version,
        "command": event.command.name,
        "family": event.family.name,
        "transport": event.transport.name,
    }
    if event.version == 2:
        result["ver_cmd_byte"] = f"0x{wire[12]:02x}"
        result["family_byte"] = f"0x{wire[13]:02x}"
    result["source"] = _address_json(event.source)
    result["destination"] = _address_json(event.destination)
    crc_ok = _crc_check(wire) if event.version == 2 else None
    result["tlvs"] = [_tlv_json(tlv, crc_ok) for tlv in event.tlvs]
    result["header_length"] = len(wire)
    result["trailing_bytes"] = len(trailing)
    result["header_hex"] = wire.hex()
    result["trailing_hex"] = trailing.hex()
    return result


def _render_decoded(result: dict[str, Any]) -> str:
    if not result["ok"]:
        return f"error: {result['error']} (reason: {result['reason']})"
    lines = [f"PROXY protocol v{result['version']} header"]

    def field(name: str, value: object) -> None:
        lines.append(f"  {name:<15}{value}")

    field("version", result["version"])
    command = result["command"]
    if "ver_cmd_byte" in result:
        command += f" (ver/cmd byte {result['ver_cmd_byte']})"
    field("command", command)
    family = result["family"]
    if "family_byte" in result:
        family += f" (family byte {result['family_byte']}"
        if result["command"] == "LOCAL" and result["family_byte"] != "0x00":
            family += ", ignored for LOCAL"
        family += ")"
    field("family", family)
    field("transport", result["transport"])
    for role in ("source", "destination"):
        address = result[role]
        field(
            role,
            "(none: the real connection endpoints apply)"
            if address is None
            else address["text"],
        )
    if result["version"] == 2:
        field("tlvs", len(result["tlvs"]))
    for tlv in result["tlvs"]:
        lines.append(
            f"    0x{tlv['type']:02x} {tlv['name']:<11}{tlv['length']:>6} bytes  "
            f"{tlv['text']}"
        )
        lines.extend(
            f"        0x{sub['type']:02x} {sub['name']:<16}{sub['length']:>6} "
            f"bytes  {sub['text']}"
            for sub in tlv.get("ssl", {}).get("sub_tlvs", ())
        )
    field("header length", f"{result['header_length']} bytes")
    field("trailing bytes", result["trailing_bytes"])
    return "\n".join(lines)


def _read_input(value: str, stdin: TextIO) -> bytes:
    if value == "-":
        data = stdin.buffer.read()
        if data and all(b in _HEX_BYTES for b in data):
            return _from_hex(data.decode("ascii"))
        return data
    return _from_hex(value)


def _from_hex(text: str) -> bytes:
    cleaned = "".join(text.split())
    if cleaned[:2].lower() == "0x":
        cleaned = cleaned[2:]
    try:
        return bytes.fromhex(cleaned)
    except ValueError as exc:
        raise _UsageError(f"not hex: {exc}") from None


def _cmd_decode(args: argparse.Namespace, out: TextIO, stdin: TextIO) -> int:
    data = _read_input(args.input, stdin)
    result = decode_header(
        data,
        versions=args.versions,
        max_v2_length=args.max_v2_length,
        verify_crc32c=not args.no_verify_crc32c,
        accept_unspec_proxy=args.accept_unspec_proxy,
        accept_ipv4_in_tcp6=args.accept_ipv4_in_tcp6,
    )
    if args.json:
        out.write(json.dumps(result, indent=2) + "\n")
    else:
        out.write(_render_decoded(result) + "\n")
    return EXIT_OK if result["ok"] else EXIT_INVALID


# ---------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------


def _parse_endpoint(text: str) -> InetAddress | UnixAddress:
    """``IP:PORT``, ``[IPv6]:PORT`` or ``unix:PATH``."""
    if text.startswith("unix:"):
        return UnixAddress(text[5:].encode("utf-8", "surrogateescape"))
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not port_text.isascii():
        raise _UsageError(f"expected IP:PORT, [IPv6]:PORT or unix:PATH, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise _UsageError(f"put IPv6 addresses in brackets: [{host}]:{port_text}")
    return InetAddress.parse(host, int(port_text))


def _parse_tlv_type(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        pass
    try:
        return int(TLVType[text.upper().replace("-", "_")])
    except KeyError:
        names = ", ".join(t.name for t in TLVType)
        raise _UsageError(
            f"unknown TLV type {text!r}: use a number (0xE5) or one of {names}"
        ) from None


def _parse_raw_tlv(text: str) -> TLV:
    type_text, sep, value = text.partition(":")
    if not sep:
        raise _UsageError(f"--tlv expects TYPE:HEX, got {text!r}")
    return TLV(_parse_tlv_type(type_text), _from_hex(value))


def _parse_ssl_client(text: str) -> SSLClient:
    try:
        return SSLClient(int(text, 0))
    except ValueError:
        pass
    flags = SSLClient(0)
    for name in filter(None, text.split(",")):
        try:
            flags |= SSLClient[name.strip().upper().replace("-", "_")]
        except KeyError:
            raise _UsageError(
                f"unknown SSL client flag {name!r}: use ssl, cert-conn, cert-sess "
                f"or a number"
            ) from None
    return flags


_SSL_TEXT_OPTIONS = (
    "version",
    "cn",
    "cipher",
    "sig_alg",
    "key_alg",
    "group",
    "sig_scheme",
)


def _ssl_tlv(args: argparse.Namespace) -> TLV | None:
    texts = {name: getattr(args, f"ssl_{name}") for name in _SSL_TEXT_OPTIONS}
    cert = _from_hex(args.ssl_client_cert) if args.ssl_client_cert else None
    used = any(v is not None for v in texts.values()) or cert is not None
    if not used and args.ssl_client is None and args.ssl_verify is None:
        return None
    # The spec: the SSL flag comes with a VERSION sub-TLV.
    default_client = SSLClient.SSL if texts["version"] is not None else SSLClient(0)
    client = default_client if args.ssl_client is None else args.ssl_client
    verify = 1 if args.ssl_verify is None else args.ssl_verify
    info = SSLInfo(client=client, verify=verify, client_cert=cert, **texts)
    return TLV.ssl(info)


def _header_tlvs(args: argparse.Namespace) -> list[TLV]:
    """The TLVs the header options ask for, in the documented order."""
    tlvs: list[TLV] = []
    if args.alpn is not None:
        tlvs.append(TLV.alpn(args.alpn.encode("utf-8")))
    if args.authority is not None:
        tlvs.append(TLV.authority(args.authority))
    ssl = _ssl_tlv(args)
    if ssl is not None:
        tlvs.append(ssl)
    if args.unique_id is not None:
        tlvs.append(TLV.unique_id(args.unique_id.encode("utf-8")))
    if args.netns is not None:
        tlvs.append(TLV.netns(args.netns))
    if args.aws_vpce_id is not None:
        tlvs.append(TLV.aws_vpce_id(args.aws_vpce_id))
    if args.azure_link_id is not None:
        tlvs.append(TLV.azure_link_id(args.azure_link_id))
    if args.gcp_psc_id is not None:
        tlvs.append(TLV.gcp_psc_id(args.gcp_psc_id))
    tlvs.extend(args.tlv)
    if args.version == 1 and (tlvs or args.crc32c or args.pad_to is not None):
        raise _UsageError("v1 headers cannot carry TLVs, a CRC32C or padding")
    return tlvs


def _command_header(args: argparse.Namespace, tlvs: list[TLV]) -> ProxyHeader:
    """The header of ``--local`` (v2 LOCAL) or ``--unknown``."""
    if args.local:
        if args.version == 1:
            raise _UsageError("--local is a v2 command (v1 has only PROXY)")
        return ProxyHeader.local(tlvs=tuple(tlvs))
    return ProxyHeader(
        version=args.version,
        command=Command.PROXY,
        family=Family.UNSPEC,
        transport=Transport.UNSPEC,
        source=None,
        destination=None,
        tlvs=tuple(tlvs),
    )


def build_header(args: argparse.Namespace) -> bytes:
    """The header the ``encode`` options describe, encoded.

    Raises:
        LocalProtocolError: the options describe an impossible header.
        _UsageError: contradictory or missing options.
    """
    tlvs = _header_tlvs(args)
    addressed = args.source is not None or args.destination is not None
    if sum((addressed, args.local, args.unknown)) != 1:
        raise _UsageError(
            "give --source and --destination, or --local, or --unknown (one of them)"
        )
    if args.local or args.unknown:
        header = _command_header(args, tlvs)
    else:
        if args.source is None or args.destination is None:
            raise _UsageError("--source and --destination go together")
        header = ProxyHeader.from_addresses(
            args.source,
            args.destination,
            version=args.version,
            transport=Transport[args.transport.upper()],
            tlvs=tuple(tlvs),
        )
    if args.version == 1:
        return encode_v1(header)
    return encode_v2(header, crc32c=args.crc32c, pad_to=args.pad_to)


def _cmd_encode(args: argparse.Namespace, out: TextIO) -> int:
    wire = build_header(args)
    if args.raw:
        out.flush()
        out.buffer.write(wire)
        out.buffer.flush()
    else:
        out.write(wire.hex() + "\n")
    return EXIT_OK


# ---------------------------------------------------------------------------
# send
# ---------------------------------------------------------------------------


def _send_plan(args: argparse.Namespace) -> HeaderPlan:
    """The header plan the ``send`` options describe."""
    tlvs = _header_tlvs(args)
    if args.local and args.unknown:
        raise _UsageError("--local and --unknown exclude each other")
    if args.local or args.unknown:
        if args.source is not None or args.destination is not None:
            raise _UsageError("--local and --unknown take no --source/--destination")
        return plan_header(
            _command_header(args, tlvs), crc32c=args.crc32c, pad_to=args.pad_to
        )
    return plan_header(
        version=args.version,
        source=args.source,
        destination=args.destination,
        tlvs=tuple(tlvs),
        crc32c=args.crc32c,
        pad_to=args.pad_to,
    )


def _send_request(args: argparse.Namespace, target: str, stdin: TextIO) -> bytes:
    if args.get is not None:
        if not args.get.isprintable() or " " in args.get:
            raise _UsageError(f"--get: not a request target: {args.get!r}")
        return (
            f"GET {args.get} HTTP/1.1\r\nHost: {target}\r\n"
            f"User-Agent: proxyproto/{__version__}\r\nConnection: close\r\n\r\n"
        ).encode()
    if args.data == "-":
        return stdin.buffer.read()
    try:
        with open(args.data, "rb") as f:
            return f.read()
    except OSError as exc:
        raise _UsageError(f"--data: {exc}") from None


def _header_text(header: bytes) -> str:
    decoded = decode_header(header, max_v2_length=0xFFFF)
    text = f"v{decoded['version']} {decoded['command']}"
    if decoded["source"] is not None:
        text += f" {decoded['source']['text']} -> {decoded['destination']['text']}"
    if decoded["tlvs"]:
        text += ", TLVs " + " ".join(tlv["name"] for tlv in decoded["tlvs"])
    return f"{text} ({len(header)} bytes)"


def _cmd_send(args: argparse.Namespace, out: TextIO, stdin: TextIO) -> int:
    import ssl

    from proxyproto import _send

    host, port = _parse_target(args.target)
    plan = _send_plan(args)
    context = None
    if args.tls:
        try:
            context = ssl.create_default_context(cafile=args.cacert)
        except (OSError, ssl.SSLError) as exc:
            raise _UsageError(f"--cacert: {exc}") from None
        if args.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    elif args.cacert or args.insecure or args.sni:
        raise _UsageError("--cacert, --insecure and --sni go with --tls")
    name = f"[{host}]" if ":" in host else host
    config = _send.SendConfig(
        host=host,
        port=port,
        plan=plan,
        request=_send_request(args, f"{name}:{port}", stdin),
        tls=context,
        server_name=args.sni or host,
        connect_timeout=args.connect_timeout,
        wait=args.wait,
    )
    out.flush()
    try:
        result = _send.send(config, out.buffer)
    except _send.SendError as exc:
        sys.stderr.write(f"proxyproto send: error: {exc}\n")
        return EXIT_USAGE
    endings = {
        "closed": "the server closed the connection",
        "reset": "the server reset the connection",
        "silent": f"the server stayed silent for {args.wait:g} s",
    }
    if args.verbose:
        then = f", TLS ({result.tls_version})" if result.tls_version else ""
        sys.stderr.write(
            f"proxyproto send: sent {_header_text(result.header)}{then}, "
            f"{len(config.request)} request bytes; received {result.received} "
            f"bytes, then {endings[result.ending]}\n"
        )
    if result.received:
        return EXIT_OK
    sys.stderr.write(
        f"proxyproto send: no answer: {endings[result.ending]} without sending "
        f"a byte (a server refusing the header does this)\n"
    )
    return EXIT_INVALID


# ---------------------------------------------------------------------------
# probe
# ---------------------------------------------------------------------------


def _parse_versions(text: str) -> frozenset[int]:
    try:
        versions = frozenset(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 1, 2 or 1,2, got {text!r}"
        ) from None
    if not versions or not versions <= {1, 2}:
        raise argparse.ArgumentTypeError(f"expected 1, 2 or 1,2, got {text!r}")
    return versions


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _parse_target(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _UsageError(f"expected HOST:PORT (IPv6 as [::1]:PORT), got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _cmd_diagnose(args: argparse.Namespace, out: TextIO) -> int:
    from proxyproto import _diagnose

    host, port = _parse_target(args.target)
    payload = _diagnose.http_request(host)
    if args.payload is not None:
        payload = _from_hex(args.payload)
    config = _diagnose.DiagnoseConfig(
        host=host,
        port=port,
        payload=payload,
        wait=args.wait,
        connect_timeout=args.connect_timeout,
        sni=args.sni,
    )
    diagnosis = _diagnose.diagnose(config)
    if args.json:
        out.write(json.dumps(diagnosis.to_json(), indent=2) + "\n")
    else:
        out.write(diagnosis.line() + "\n")
    return int(diagnosis.verdict)


def _cmd_probe(args: argparse.Namespace, out: TextIO) -> int:
    try:
        from proxyproto import _probe
    except ModuleNotFoundError as exc:
        missing_extra(
            exc,
            feature="proxyproto probe",
            package="hypothesis",
            extra="probe",
            command=True,
        )

    host, port = _parse_target(args.target)
    payload = b""
    if args.payload_http:
        payload = _probe.HTTP_PAYLOAD
    if args.payload is not None:
        payload += _from_hex(args.payload)
    config = _probe.ProbeConfig(
        host=host,
        port=port,
        seed=args.seed,
        examples=args.examples,
        versions=args.versions,
        payload=payload,
        wait=args.wait,
        max_time=args.max_time,
        concurrency=args.concurrency,
        connect_timeout=args.connect_timeout,
        trickle_ms=args.trickle_ms,
        idle_max=0.0 if args.no_timing else args.idle_max,
        timing=not args.no_timing,
    )
    report = _probe.run(config)
    if args.json:
        out.write(json.dumps(report.to_json(), indent=2) + "\n")
    else:
        out.write(report.render() + "\n")
    return report.exit_code


# ---------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------

_DESCRIPTION = "Decode, encode, send and probe PROXY protocol v1/v2 headers."
_EPILOG = """\
examples:
  proxyproto decode 0d0a0d0a000d0a515549540a2111000cc0000201c00002020d0401bb
  printf 'PROXY TCP4 1.2.3.4 5.6.7.8 1 2\\r\\n' | proxyproto decode -
  proxyproto encode --source 192.0.2.1:56324 --destination 192.0.2.2:443 --alpn h2
  proxyproto encode --raw --version 1 --source [2001:db8::1]:1 \\
      --destination [2001:db8::2]:443 | cat - request.txt | nc 127.0.0.1 8080
  proxyproto send 127.0.0.1:8443 --source 203.0.113.7:5555 --tls --get /
  proxyproto probe --diagnose 127.0.0.1:8080
  proxyproto probe 127.0.0.1:8080 --payload-http --seed 1

exit codes: 0 ok / no findings, 1 invalid header / no answer / findings, 2
usage or connection errors; probe --diagnose: 0 header required, 1 guesses,
2 unreachable, 3 no header expected, 4 undetermined (docs/probe.md)
"""


def _add_header_options(parser: argparse.ArgumentParser, *, send: bool) -> None:
    """The options that describe a header (``encode`` and ``send``)."""
    own = " (default: the connection's own)" if send else ""
    parser.add_argument("--version", type=int, choices=(1, 2), default=2)
    parser.add_argument(
        "--source",
        type=_endpoint_arg,
        metavar="IP:PORT",
        help="client endpoint" + own,
    )
    parser.add_argument(
        "--destination",
        type=_endpoint_arg,
        metavar="IP:PORT",
        help="server endpoint ([IPv6]:PORT; unix:PATH for v2)" + own,
    )
    parser.add_argument("--local", action="store_true", help="v2 LOCAL command")
    parser.add_argument(
        "--unknown",
        action="store_true",
        help="v1 PROXY UNKNOWN, or v2 PROXY with UNSPEC family",
    )
    if not send:
        parser.add_argument(
            "--transport", choices=("stream", "dgram"), default="stream", help="v2 only"
        )
    parser.add_argument("--alpn", help="ALPN TLV, e.g. h2")
    parser.add_argument("--authority", help="AUTHORITY TLV (host name / SNI)")
    parser.add_argument("--unique-id", help="UNIQUE_ID TLV (text, <= 128 bytes)")
    parser.add_argument("--netns", help="NETNS TLV")
    parser.add_argument("--aws-vpce-id", help="AWS TLV 0xEA, VPC endpoint id")
    parser.add_argument(
        "--azure-link-id", type=_int_arg, help="Azure TLV 0xEE, link id (u32)"
    )
    parser.add_argument(
        "--gcp-psc-id", type=_int_arg, help="GCP TLV 0xE0, PSC connection id (u64)"
    )
    parser.add_argument(
        "--tlv",
        type=_raw_tlv_arg,
        action="append",
        default=[],
        metavar="TYPE:HEX",
        help="any TLV, e.g. 0xE5:cafe or NOOP: (repeatable)",
    )
    ssl = parser.add_argument_group(
        "SSL TLV (0x20)",
        "any of these adds an SSL TLV; its client flags default to 'ssl' when "
        "--ssl-version is given (else none), and verify to 1 (no verified "
        "client certificate)",
    )
    for name in _SSL_TEXT_OPTIONS:
        ssl.add_argument(f"--ssl-{name.replace('_', '-')}", metavar="TEXT")
    ssl.add_argument("--ssl-client-cert", metavar="HEX", help="DER client certificate")
    ssl.add_argument(
        "--ssl-client",
        type=_ssl_client_arg,
        metavar="FLAGS",
        help="client flags: comma list of ssl, cert-conn, cert-sess, or a number",
    )
    ssl.add_argument(
        "--ssl-verify", type=_int_arg, metavar="N", help="0 = certificate verified"
    )
    parser.add_argument(
        "--crc32c", action="store_true", help="add a CRC32C TLV (v2 only)"
    )
    parser.add_argument(
        "--pad-to",
        type=int,
        metavar="N",
        help="pad with a NOOP TLV to N bytes in total (v2 only)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="proxyproto",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    decode = sub.add_parser(
        "decode",
        help="print a PROXY header field by field",
        description="Decode the PROXY header at the start of the input. The rest "
        "of the input is counted as trailing bytes (application data).",
    )
    decode.add_argument(
        "input",
        metavar="HEX|-",
        help="the header in hex, or - to read stdin (raw bytes or hex text)",
    )
    decode.add_argument("--json", action="store_true", help="machine-readable output")
    decode.add_argument(
        "--versions",
        type=_parse_versions,
        default=frozenset({1, 2}),
        help="accepted versions: 1, 2 or 1,2 (default)",
    )
    decode.add_argument(
        "--max-v2-length",
        type=int,
        default=65535,
        metavar="N",
        help="largest v2 length field accepted (default 65535: decode anything "
        "valid; receivers usually cap it at 4096)",
    )
    decode.add_argument(
        "--no-verify-crc32c",
        action="store_true",
        help="decode a header whose CRC32C does not match (shown as MISMATCH)",
    )
    decode.add_argument(
        "--accept-unspec-proxy",
        action="store_true",
        help="accept v2 PROXY with UNSPEC family",
    )
    decode.add_argument(
        "--accept-ipv4-in-tcp6",
        action="store_true",
        help="accept IPv4 addresses in v1 TCP6 lines (as nginx emits)",
    )

    encode = sub.add_parser(
        "encode",
        help="build a PROXY header",
        description="Build a v1 or v2 PROXY header and print it as hex (or raw "
        "bytes with --raw). TLVs appear in the order ALPN, AUTHORITY, SSL, "
        "UNIQUE_ID, NETNS, AWS, AZURE, GCP, then --tlv ones, then CRC32C and "
        "padding.",
    )
    _add_header_options(encode, send=False)
    encode.add_argument(
        "--raw", action="store_true", help="write the bytes to stdout instead of hex"
    )

    send = sub.add_parser(
        "send",
        help="send a PROXY header, then a request; print the answer",
        description="Connect to HOST:PORT, send a v1 or v2 PROXY header (the "
        "encode options; by default naming this connection's own endpoints, "
        "as curl --haproxy-protocol does), optionally start TLS, send the "
        "request (stdin, --data FILE or --get PATH) and copy the answer to "
        "stdout until the server closes or stays silent for --wait seconds. "
        "Exit 0: an answer came; 1: none (the server closed, reset or stayed "
        "silent without a byte, as when it refuses the header); 2: usage "
        "errors, no connection, a failed TLS handshake.",
    )
    send.add_argument("target", metavar="HOST:PORT")
    _add_header_options(send, send=True)
    request = send.add_mutually_exclusive_group()
    request.add_argument(
        "--data",
        metavar="FILE",
        default="-",
        help="the bytes to send after the header (default -: stdin)",
    )
    request.add_argument(
        "--get",
        metavar="PATH",
        help="send 'GET PATH HTTP/1.1' with Host and Connection: close",
    )
    send.add_argument("--tls", action="store_true", help="start TLS after the header")
    send.add_argument("--cacert", metavar="FILE", help="CA certificates (PEM)")
    send.add_argument(
        "--insecure",
        action="store_true",
        help="do not check the server's certificate",
    )
    send.add_argument(
        "--sni", metavar="NAME", help="TLS server name (default: HOST if a name)"
    )
    send.add_argument(
        "--wait",
        type=_positive_float,
        default=2.0,
        metavar="SECONDS",
        help="the answer ends after this long without a byte (default 2)",
    )
    send.add_argument(
        "--connect-timeout",
        type=_positive_float,
        default=5.0,
        metavar="SECONDS",
        help="TCP connect and TLS handshake timeout (default 5)",
    )
    send.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="say on stderr what was sent and how the answer ended",
    )

    probe = sub.add_parser(
        "probe",
        help="fuzz a PROXY receiver and report what it wrongly accepts/refuses",
        description="Send a battery of valid and labelled invalid PROXY headers "
        "(built deterministically from proxyproto.strategies and --seed) to a "
        "server that requires a PROXY header, and report the invalid ones it "
        "accepted and the valid ones it refused. A header counts as accepted "
        "when the target answers (after the header and the payload) or keeps "
        "the connection open for --wait seconds; refused when it closes or "
        "resets without answering.",
    )
    probe.add_argument("target", metavar="HOST:PORT")
    probe.add_argument(
        "--diagnose",
        action="store_true",
        help="say in one line whether the port expects a header, which "
        "versions, TLS or plain after it, whether it guesses (exit codes: "
        "docs/probe.md); uses --wait, --connect-timeout, --payload, --sni, --json",
    )
    probe.add_argument(
        "--seed", type=int, default=None, help="battery seed (default: random)"
    )
    probe.add_argument(
        "--examples",
        type=_positive_int,
        default=5,
        metavar="N",
        help="examples per category (default 5)",
    )
    probe.add_argument(
        "--versions",
        type=_parse_versions,
        default=frozenset({1, 2}),
        help="versions the target accepts: 1, 2 or 1,2 (default)",
    )
    probe.add_argument(
        "--payload-http",
        action="store_true",
        help="send 'GET / HTTP/1.1' with Host: probe after each header",
    )
    probe.add_argument(
        "--payload", metavar="HEX", help="bytes to send after each header"
    )
    probe.add_argument(
        "--wait",
        type=_positive_float,
        default=1.0,
        metavar="SECONDS",
        help="how long to wait for an answer or a close (default 1)",
    )
    probe.add_argument(
        "--max-time",
        type=_positive_float,
        default=120.0,
        metavar="SECONDS",
        help="stop sending new probes after this long (default 120)",
    )
    probe.add_argument(
        "--concurrency",
        type=_positive_int,
        default=8,
        metavar="N",
        help="connections at once (default 8)",
    )
    probe.add_argument(
        "--connect-timeout",
        type=_positive_float,
        default=3.0,
        metavar="SECONDS",
        help="TCP connect timeout (default 3)",
    )
    probe.add_argument(
        "--trickle-ms",
        type=_positive_float,
        default=50.0,
        metavar="MS",
        help="delay between bytes of the trickled header (default 50)",
    )
    probe.add_argument(
        "--idle-max",
        type=_positive_float,
        default=15.0,
        metavar="SECONDS",
        help="how long to wait for the target to close a connection that sends "
        "no header (default 15)",
    )
    probe.add_argument(
        "--no-timing", action="store_true", help="skip the timing probes"
    )
    probe.add_argument(
        "--sni",
        metavar="NAME",
        help="TLS server name for --diagnose (default: HOST if a name)",
    )
    probe.add_argument("--json", action="store_true", help="machine-readable report")
    return parser


def _usage_type(func: Any) -> Any:
    """Turn _UsageError/LocalProtocolError into argparse type errors."""

    def convert(text: str) -> Any:
        try:
            return func(text)
        except (_UsageError, LocalProtocolError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = func.__name__
    return convert


_endpoint_arg = _usage_type(_parse_endpoint)
_raw_tlv_arg = _usage_type(_parse_raw_tlv)
_ssl_client_arg = _usage_type(_parse_ssl_client)


def _parse_int(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise _UsageError(f"not an integer: {text!r}") from None


_int_arg = _usage_type(_parse_int)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``proxyproto`` command; returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    out = sys.stdout
    try:
        if args.command == "decode":
            return _cmd_decode(args, out, sys.stdin)
        if args.command == "encode":
            return _cmd_encode(args, out)
        if args.command == "send":
            return _cmd_send(args, out, sys.stdin)
        if args.diagnose:
            return _cmd_diagnose(args, out)
        return _cmd_probe(args, out)
    except (_UsageError, LocalProtocolError) as exc:
        sys.stderr.write(f"proxyproto {args.command}: error: {exc}\n")
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. piped into head
        return EXIT_OK
