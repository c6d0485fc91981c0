"""proxyproto is sans-IO: importing and using it loads no I/O framework."""

from __future__ import annotations

import subprocess
import sys
import textwrap

FORBIDDEN = ("trio", "asyncio", "socket", "ssl", "selectors")

_SCRIPT = textwrap.dedent(
    """
    import sys
    import proxyproto
    from proxyproto import HeaderReader, ProxyHeader, TLV, encode_v1, encode_v2, parse

    header = ProxyHeader.from_addresses(
        ("1.2.3.4", 1), ("5.6.7.8", 2), tlvs=(TLV.alpn(b"h2"),)
    )
    wire = encode_v2(header, crc32c=True)  # loads the CRC32C accelerator
    parsed, _ = parse(wire)
    assert parsed == header.__class__(**{
        **{f: getattr(header, f) for f in (
            "version", "command", "family", "transport", "source", "destination"
        )},
        "tlvs": parsed.tlvs,
    })
    reader = HeaderReader()
    reader.receive_data(encode_v1(ProxyHeader.unknown()) + b"rest")
    assert reader.next_event() is not None
    assert parsed.ssl is None and parsed.aws_vpce_id is None
    from proxyproto._crc32c import ACCELERATED
    print(ACCELERATED)
    print(" ".join(sorted(name for name in FORBIDDEN if name in sys.modules)))
    """
)


def test_no_io_framework_is_imported() -> None:
    script = f"FORBIDDEN = {FORBIDDEN!r}\n" + _SCRIPT
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    accelerated, loaded = result.stdout.splitlines()
    assert accelerated == "google_crc32c"  # the accelerated path was exercised
    assert loaded == "", f"proxyproto imported {loaded}"
