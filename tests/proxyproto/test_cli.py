"""The ``proxyproto`` command: decode, encode, exit codes, ``python -m``."""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import shutil
import subprocess
import sys
from ipaddress import IPv4Address, IPv6Address
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from proxyproto import (
    TLV,
    V2_SIGNATURE,
    Command,
    Family,
    InetAddress,
    ProxyHeader,
    SSLClient,
    SSLInfo,
    TLVType,
    Transport,
    UnixAddress,
    encode_v1,
    encode_v2,
    parse,
)
from proxyproto._cli import decode_header, main
from proxyproto.strategies import (
    encoded_headers,
    host_names,
    inet_addresses,
    invalid_headers,
    unix_addresses,
)

INET = ProxyHeader.from_addresses(("192.0.2.1", 56324), ("192.0.2.2", 443))


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def run_json(*argv: str) -> tuple[int, Any]:
    code, out, _ = run(*argv, "--json")
    return code, json.loads(out)


def cli(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "proxyproto", *argv],
        input=stdin,
        capture_output=True,
        check=False,
        timeout=60,
    )


def address_json(address: InetAddress | UnixAddress | None) -> Any:
    if address is None:
        return None
    if isinstance(address, InetAddress):
        return [address.host, address.port]
    return address.path.hex()


def address_from_json(entry: Any) -> Any:
    if entry is None:
        return None
    if "host" in entry:
        return [ipaddress.ip_address(entry["host"]), entry["port"]]
    return entry["path_hex"]


# -- decode ---------------------------------------------------------------------


@settings(max_examples=150)
@given(encoded_headers(), st.binary(max_size=20))
def test_decode_json_matches_the_codec(
    pair: tuple[ProxyHeader, bytes], rest: bytes
) -> None:
    header, wire = pair
    code, result = run_json("decode", (wire + rest).hex())
    assert code == 0
    assert result["ok"] is True
    assert result["version"] == header.version
    assert result["command"] == header.command.name
    assert result["family"] == header.family.name
    assert result["transport"] == header.transport.name
    assert address_from_json(result["source"]) == address_json(header.source)
    assert address_from_json(result["destination"]) == address_json(header.destination)
    assert [(t["type"], t["value_hex"]) for t in result["tlvs"]] == [
        (t.type, t.value.hex()) for t in header.tlvs
    ]
    assert result["header_length"] == len(wire)
    assert result["trailing_bytes"] == len(rest)
    assert result["header_hex"] == wire.hex()
    for tlv in result["tlvs"]:
        assert "MALFORMED" not in tlv["text"]
        if tlv["type"] == TLVType.CRC32C:
            assert tlv["verified"] is True


@settings(max_examples=100)
@given(encoded_headers())
def test_decode_text_never_fails_on_valid_headers(
    pair: tuple[ProxyHeader, bytes],
) -> None:
    header, wire = pair
    code, out, err = run("decode", wire.hex())
    assert code == 0, err
    assert out.startswith(f"PROXY protocol v{header.version} header\n")
    assert f"header length  {len(wire)} bytes" in out
    assert out.isascii() or all(ch.isprintable() or ch == "\n" for ch in out)


@settings(max_examples=100)
@given(invalid_headers())
def test_decode_refuses_invalid_headers(bad: Any) -> None:
    code, result = run_json("decode", bad.data.hex(), "--max-v2-length", "4096")
    assert code == 1
    assert result["ok"] is False
    assert result["reason"]
    assert result["received_bytes"] == len(bad.data)
    if bad.incomplete:
        assert result["reason"] == "incomplete"


def test_decode_text_fields() -> None:
    header = ProxyHeader.from_addresses(
        ("192.0.2.1", 56324),
        ("192.0.2.2", 443),
        tlvs=(
            TLV.alpn(b"h2"),
            TLV.authority("example.com"),
            TLV.ssl(
                SSLInfo(
                    client=SSLClient.SSL | SSLClient.CERT_CONN,
                    verify=0,
                    version="TLSv1.3",
                    cn="Zoë",
                    cipher="TLS_AES_128_GCM_SHA256",
                    client_cert=b"\x30\x82" + bytes(100),
                )
            ),
            TLV(TLVType.AWS, b"\x01vpce-08d2bf15fac5001c9"),
            TLV(TLVType.AZURE, bytes.fromhex("01c1450021")),
            TLV(TLVType.GCP, bytes.fromhex("ffffffffc0a86402")),
            TLV(0xE5, b"\xca\xfe"),
            TLV.netns("blue"),
        ),
    )
    wire = encode_v2(header, crc32c=True)
    code, out, _ = run("decode", wire.hex() + "474554")
    assert code == 0
    for expected in (
        "version        2",
        "command        PROXY (ver/cmd byte 0x21)",
        "family         INET (family byte 0x11)",
        "transport      STREAM",
        "source         192.0.2.1:56324",
        "destination    192.0.2.2:443",
        "0x01 ALPN",
        "'h2'",
        "'example.com'",
        "client=SSL|CERT_CONN (0x03) verify=0 (client certificate verified)",
        "0x21 SSL_VERSION",
        "'TLSv1.3'",
        "'Zoë'",
        "TLS_AES_128_GCM_SHA256",
        "DER certificate, 102 bytes",
        "VPCE_ID 'vpce-08d2bf15fac5001c9'",
        "PRIVATEENDPOINT_LINKID 553665985",
        "PSC connection id 18446744072646845442",
        "0xe5 CUSTOM",
        "hex cafe",
        "'blue'",
        "(verified)",
        f"header length  {len(wire)} bytes",
        "trailing bytes 3",
    ):
        assert expected in out, expected


def test_decode_local_with_dummy_addresses() -> None:
    wire = V2_SIGNATURE + b"\x20\x11\x00\x0c" + bytes(12)
    code, out, _ = run("decode", wire.hex())
    assert code == 0
    assert "LOCAL" in out
    assert "family byte 0x11, ignored for LOCAL" in out
    assert "(none: the real connection endpoints apply)" in out


def test_decode_v1_unix_and_unknown() -> None:
    code, result = run_json("decode", b"PROXY UNKNOWN\r\nrest".hex())
    assert code == 0
    assert result["family"] == "UNSPEC"
    assert result["source"] is None
    assert result["trailing_bytes"] == 4
    unix = ProxyHeader.from_addresses(b"/run/a.sock", b"\x00abstract")
    code, result = run_json("decode", encode_v2(unix).hex())
    assert code == 0
    assert result["source"]["path"] == "'/run/a.sock'"
    assert result["destination"]["abstract"] is True


def test_decode_escapes_peer_bytes() -> None:
    evil = b"\x1b[31mred\x07\r\n"
    header = ProxyHeader.from_addresses(
        evil, b"/tmp/s", tlvs=(TLV.alpn(evil), TLV(0xE7, evil), TLV.unique_id(evil))
    )
    for args in ((), ("--json",)):
        code, out, _ = run("decode", encode_v2(header).hex(), *args)
        assert code == 0
        assert "\x1b" not in out
        assert "\x07" not in out
        assert "\r" not in out
    code, out, _ = run("decode", encode_v2(header).hex())
    assert "\\x1b[31mred\\x07\\r\\n" in out


def test_decode_crc_mismatch() -> None:
    wire = bytearray(encode_v2(INET, crc32c=True))
    wire[-1] ^= 1
    code, out, _ = run("decode", wire.hex())
    assert code == 1
    assert "CRC32C mismatch" in out
    assert "reason: crc32c_mismatch" in out
    code, out, _ = run("decode", wire.hex(), "--no-verify-crc32c")
    assert code == 0
    assert "(MISMATCH)" in out


def test_decode_malformed_vendor_tlv_is_shown_not_fatal() -> None:
    header = dataclass_replace_tlvs(INET, (TLV(TLVType.AWS, b"\x01bad id!"),))
    code, out, _ = run("decode", encode_v2(header).hex())
    assert code == 0
    assert "MALFORMED" in out


def dataclass_replace_tlvs(header: ProxyHeader, tlvs: tuple[TLV, ...]) -> ProxyHeader:
    import dataclasses

    return dataclasses.replace(header, tlvs=tlvs)


@pytest.mark.parametrize(
    ("data", "reason", "message"),
    [
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 02\r\n", "bad_v1", "leading zeros"),
        (b"GET / HTTP/1.1\r\n\r\n", "bad_signature", "not a PROXY header"),
        (V2_SIGNATURE + b"\x21\x13\x00\x00", "bad_family", "0x13"),
        (V2_SIGNATURE[:8], "incomplete", "got 8 bytes, at least 8 more needed"),
        (b"PROXY TCP4 1.2.3.4", "incomplete", "got 18 bytes"),
        (b"", "incomplete", "got 0 bytes"),
    ],
)
def test_decode_errors(data: bytes, reason: str, message: str) -> None:
    if data:
        code, out, _ = run("decode", data.hex())
    else:
        proc = cli("decode", "-", stdin=b"")
        code, out = proc.returncode, proc.stdout.decode()
    assert code == 1
    assert f"(reason: {reason})" in out
    assert message in out
    if data:
        code, result = run_json("decode", data.hex())
        assert result == {**result, "ok": False, "reason": reason}
        assert result["received_bytes"] == len(data)


def test_decode_versions_option() -> None:
    code, out, _ = run("decode", encode_v2(INET).hex(), "--versions", "1")
    assert code == 1
    assert "only v1" in out


def test_decode_bad_hex_is_a_usage_error() -> None:
    code, _, err = run("decode", "zz")
    assert code == 2
    assert "not hex" in err


@pytest.mark.parametrize("raw", [True, False])
def test_decode_stdin(raw: bool) -> None:
    wire = encode_v2(INET, crc32c=True) + b"payload"
    stdin = wire if raw else (wire.hex(" ", 4) + "\n").encode()
    proc = cli("decode", "-", "--json", stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["source"]["text"] == "192.0.2.1:56324"
    assert result["trailing_bytes"] == 7


def test_decode_stdin_v1_text_is_raw() -> None:
    # A v1 line is not hex, so it is taken as raw bytes.
    proc = cli("decode", "-", stdin=b"PROXY TCP6 ::1 ::2 1 2\r\n")
    assert proc.returncode == 0, proc.stderr
    assert b"source         [::1]:1" in proc.stdout


# -- encode ---------------------------------------------------------------------


def endpoint(address: InetAddress) -> str:
    return str(address)


@st.composite
def encode_requests(draw: st.DrawFn) -> tuple[list[str], ProxyHeader, dict[str, Any]]:
    """CLI arguments and the header (plus encoder options) they describe."""
    version = draw(st.sampled_from([1, 2]))
    kind = draw(st.sampled_from(["inet", "unix", "local", "unknown"]))
    if version == 1 and kind in ("unix", "local"):
        kind = "inet"
    args = ["encode", "--version", str(version)]
    tlvs: list[TLV] = []
    if version == 2:
        if draw(st.booleans()):
            alpn = draw(st.sampled_from(["h2", "http/1.1", "acme-tls/1"]))
            args += ["--alpn", alpn]
            tlvs.append(TLV.alpn(alpn.encode()))
        if draw(st.booleans()):
            host = draw(host_names)
            args += [f"--authority={host}"]
            tlvs.append(TLV.authority(host))
        if draw(st.booleans()):
            cn = draw(st.sampled_from(["client.example", "Zoë"]))
            args += ["--ssl-version", "TLSv1.3", "--ssl-cn", cn, "--ssl-verify", "0"]
            args += ["--ssl-client", "ssl,cert-conn"]
            info = SSLInfo(
                client=SSLClient.SSL | SSLClient.CERT_CONN,
                verify=0,
                version="TLSv1.3",
                cn=cn,
            )
            tlvs.append(TLV.ssl(info))
        if draw(st.booleans()):
            uid = draw(st.text("abcdef0123456789_.", min_size=1, max_size=64))
            args += [f"--unique-id={uid}"]
            tlvs.append(TLV.unique_id(uid.encode()))
        if draw(st.booleans()):
            args += ["--netns", "blue"]
            tlvs.append(TLV.netns("blue"))
        if draw(st.booleans()):
            args += ["--aws-vpce-id", "vpce-08d2bf15fac5001c9"]
            tlvs.append(TLV.aws_vpce_id("vpce-08d2bf15fac5001c9"))
        if draw(st.booleans()):
            link = draw(st.integers(0, 2**32 - 1))
            args += ["--azure-link-id", str(link)]
            tlvs.append(TLV.azure_link_id(link))
        if draw(st.booleans()):
            psc = draw(st.integers(0, 2**64 - 1))
            args += ["--gcp-psc-id", hex(psc)]
            tlvs.append(TLV.gcp_psc_id(psc))
        for tlv_type, value in draw(
            st.lists(
                st.tuples(st.integers(0xE1, 0xE9), st.binary(max_size=8)), max_size=2
            )
        ):
            args += ["--tlv", f"0x{tlv_type:02x}:{value.hex()}"]
            tlvs.append(TLV(tlv_type, value))
    options: dict[str, Any] = {}
    if version == 2 and draw(st.booleans()):
        args.append("--crc32c")
        options["crc32c"] = True
    transport = Transport.STREAM
    if version == 2 and kind in ("inet", "unix") and draw(st.booleans()):
        args += ["--transport", "dgram"]
        transport = Transport.DGRAM
    if kind == "inet":
        family = draw(st.sampled_from([4, 6]))
        src = draw(inet_addresses.filter(lambda a: a.host.version == family))
        dst = draw(inet_addresses.filter(lambda a: a.host.version == family))
        args += ["--source", endpoint(src), "--destination", endpoint(dst)]
        header = ProxyHeader.from_addresses(
            src, dst, version=version, transport=transport, tlvs=tuple(tlvs)
        )
    elif kind == "unix":
        paths = draw(
            st.lists(
                unix_addresses.filter(
                    lambda a: (
                        a.path[:1] not in (b"", b"\x00")
                        and a.path.isascii()
                        and a.path.decode().isprintable()
                    )
                ),
                min_size=2,
                max_size=2,
            )
        )
        args += [f"--source=unix:{paths[0].path.decode()}"]
        args += [f"--destination=unix:{paths[1].path.decode()}"]
        header = ProxyHeader.from_addresses(
            paths[0], paths[1], transport=transport, tlvs=tuple(tlvs)
        )
    elif kind == "local":
        args.append("--local")
        header = ProxyHeader.local(tlvs=tuple(tlvs))
    else:
        args.append("--unknown")
        header = ProxyHeader(
            version=version,
            command=Command.PROXY,
            family=Family.UNSPEC,
            transport=Transport.UNSPEC,
            source=None,
            destination=None,
            tlvs=tuple(tlvs),
        )
    return args, header, options


@settings(max_examples=150)
@given(encode_requests())
def test_encode_builds_the_header_it_is_asked_for(
    request_: tuple[list[str], ProxyHeader, dict[str, Any]],
) -> None:
    args, header, options = request_
    code, out, err = run(*args)
    assert code == 0, err
    wire = bytes.fromhex(out.strip())
    if header.version == 1:
        assert wire == encode_v1(header)
    else:
        assert wire == encode_v2(header, **options)
    # ... and decode reads back every field.
    code, result = run_json("decode", out.strip(), "--accept-unspec-proxy")
    assert code == 0
    assert result["version"] == header.version
    assert result["family"] == header.family.name
    assert address_from_json(result["source"]) == address_json(header.source)
    assert len(result["tlvs"]) == len(header.tlvs) + bool(options)


def test_encode_pad_to_and_raw() -> None:
    code, out, _ = run(
        "encode", "--source", "1.2.3.4:1", "--destination", "5.6.7.8:2",
        "--pad-to", "100", "--crc32c",
    )  # fmt: skip
    assert code == 0
    wire = bytes.fromhex(out.strip())
    assert len(wire) == 100
    header, consumed = parse(wire)
    assert consumed == 100
    assert [t.type for t in header.tlvs] == [TLVType.CRC32C, TLVType.NOOP]
    proc = cli(
        "encode", "--raw", "--version", "1", "--source", "[2001:db8::1]:1",
        "--destination", "[2001:db8::2]:443",
    )  # fmt: skip
    assert proc.returncode == 0
    assert proc.stdout == b"PROXY TCP6 2001:db8::1 2001:db8::2 1 443\r\n"


def test_encode_raw_pipes_into_decode() -> None:
    encoded = cli("encode", "--raw", "--source", "[::1]:5", "--destination", "[::2]:6")
    decoded = cli("decode", "-", "--json", stdin=encoded.stdout + b"GET /")
    result = json.loads(decoded.stdout)
    assert result["source"] == {"host": "::1", "port": 5, "text": "[::1]:5"}
    assert result["trailing_bytes"] == 5


def test_encode_tlv_by_name_and_ssl_defaults() -> None:
    code, out, _ = run(
        "encode", "--local", "--tlv", "noop:", "--tlv", "unique_id:6162",
        "--ssl-cipher", "ECDHE-RSA-AES128-GCM-SHA256",
    )  # fmt: skip
    assert code == 0
    header, _ = parse(bytes.fromhex(out.strip()))
    assert header.command is Command.LOCAL
    assert header.unique_id == b"ab"
    assert header.ssl is not None
    assert header.ssl.client == 0  # no VERSION, so not flagged as TLS
    assert header.ssl.verify == 1
    assert header.ssl.cipher == "ECDHE-RSA-AES128-GCM-SHA256"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--version", "1", "--source", "1.2.3.4:1", "--destination",
          "1.2.3.4:2", "--alpn", "h2"], "v1 headers cannot carry TLVs"),
        (["--version", "1", "--local"], "--local is a v2 command"),
        ([], "give --source and --destination"),
        (["--source", "1.2.3.4:1"], "go together"),
        (["--source", "1.2.3.4:1", "--destination", "::1:2"], "brackets"),
        (["--source", "1.2.3.4", "--destination", "1.2.3.4:2"], "IP:PORT"),
        (["--source", "1.2.3.4:70000", "--destination", "1.2.3.4:2"], "0..65535"),
        (["--source", "nothost:1", "--destination", "1.2.3.4:2"], "not an IP"),
        (["--local", "--aws-vpce-id", "bad id!"], "AWS VPC endpoint id"),
        (["--local", "--unique-id", "x" * 129], "at most 128"),
        (["--local", "--tlv", "0x1ff:00"], "0..255"),
        (["--local", "--tlv", "BOGUS:00"], "unknown TLV type"),
        (["--local", "--tlv", "0xe5"], "TYPE:HEX"),
        (["--local", "--pad-to", "10"], "pad"),
        (["--source", "1.2.3.4:1", "--destination", "[::1]:2", "--version", "1",
          "--transport", "dgram"], "STREAM"),
        (["--source", "unix:/a", "--destination", "unix:/b", "--version", "1"],
         "UNIX"),
    ],
)  # fmt: skip
def test_encode_errors(args: list[str], message: str) -> None:
    code, out, err = run("encode", *args)
    assert code == 2
    assert out == ""
    assert message in err


# -- the command itself -----------------------------------------------------------


def test_python_m_help() -> None:
    proc = cli("--help")
    assert proc.returncode == 0
    for word in (b"decode", b"encode", b"probe", b"exit codes"):
        assert word in proc.stdout
    for sub in ("decode", "encode", "probe"):
        proc = cli(sub, "--help")
        assert proc.returncode == 0, sub
        assert b"usage: proxyproto " + sub.encode() in proc.stdout


def test_usage_errors_exit_2() -> None:
    assert cli().returncode == 2
    assert cli("frobnicate").returncode == 2
    assert run("probe", "no-port")[0] == 2
    assert run("probe", "127.0.0.1:1", "--versions", "3")[0] == 2
    assert run("probe", "127.0.0.1:1", "--examples", "0")[0] == 2


def test_console_script() -> None:
    path = shutil.which("proxyproto")
    if path is None:
        pytest.skip("the proxyproto script is not installed on PATH")
    proc = subprocess.run(
        [path, "--version"], capture_output=True, check=False, timeout=60
    )
    assert proc.returncode == 0
    assert proc.stdout.startswith(b"proxyproto ")


def test_import_proxyproto_does_not_load_the_cli() -> None:
    code = (
        "import sys, proxyproto; "
        "print(sorted(m for m in sys.modules if m in "
        "('proxyproto._cli', 'proxyproto._probe', 'socket', 'argparse')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, check=True, timeout=60
    )
    assert proc.stdout.strip() == b"[]"


def test_decode_header_api() -> None:
    result = decode_header(encode_v1(ProxyHeader.unknown()))
    assert result["ok"] is True
    assert result["header_length"] == 15


def test_addresses_in_json_are_text() -> None:
    header = ProxyHeader.from_addresses(
        InetAddress(IPv4Address("10.0.0.1"), 1), InetAddress(IPv4Address("10.0.0.2"), 2)
    )
    _, result = run_json("decode", encode_v2(header).hex())
    assert result["source"] == {"host": "10.0.0.1", "port": 1, "text": "10.0.0.1:1"}
    header6 = ProxyHeader.from_addresses(
        InetAddress(IPv6Address("::1"), 1), InetAddress(IPv6Address("::2"), 2)
    )
    _, result = run_json("decode", encode_v2(header6).hex())
    assert result["destination"]["text"] == "[::2]:2"
