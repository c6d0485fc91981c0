"""Instructions per PROXY header read through ``HeaderReader`` (callgrind).

Run: ``python bench/callgrind_codec.py [--kind v1-tcp4|v1-tcp6|v2-inet|v2-inet6|
v2-tlvs] [--destination] [--read authority,ssl] [--headers 2000,12000]``

Wall-clock figures on a shared machine move with the load; instruction counts
do not. A child process makes 200 distinct headers as ``codec.py`` does
(random addresses, ports 1024-65535 from 80/443/8443), reads 200 of them to
warm up, then N of them, each as a server does: a new ``HeaderReader()``,
``receive_data``, ``next_event``, ``trailing_data``, ``header.source.host``
(and ``header.destination.host`` with ``--destination``; ``header.authority``
and ``header.ssl.cn`` with ``--read authority,ssl``, as codec.py's "read
src/authority/ssl.cn" row does). ``v2-tlvs`` is codec.py's "INET+TLVs" header:
a v2 INET header with ALPN ``h2``, AUTHORITY ``www.example.com``, a random
16-byte UNIQUE_ID and its SSL TLV (client SSL|CERT_CONN|CERT_SESS, verify 0,
version, CN, cipher, sig_alg, key_alg sub-TLVs). It runs under
``valgrind --tool=callgrind`` once per count with ``PYTHONHASHSEED=0`` (a
random seed moves the count by hundreds); the instructions for the smaller
count are taken from those for the larger, so start-up and imports cancel
out. Set ``PYTHONPATH`` to the tree to measure. Needs ``valgrind``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import textwrap

DRIVER = textwrap.dedent(
    """
    import random
    import struct
    import sys
    from ipaddress import IPv4Address, IPv6Address

    from proxyproto import HeaderReader

    kind, destination, count = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    reads = [name for name in sys.argv[4].split(",") if name]

    def tlv(tlv_type, value):
        return struct.pack("!BH", tlv_type, len(value)) + value

    ssl = b"\\x07\\x00\\x00\\x00\\x00" + b"".join(
        tlv(sub_type, text)
        for sub_type, text in (
            (0x21, b"TLSv1.3"),
            (0x22, b"client.example.com"),
            (0x23, b"TLS_AES_128_GCM_SHA256"),
            (0x24, b"SHA256"),
            (0x25, b"RSA2048"),
        )
    )
    rng = random.Random(1)
    pool = []
    for _ in range(200):
        sport = rng.randrange(1024, 65536)
        dport = rng.choice((80, 443, 8443))
        if kind == "v1-tcp4":
            src = IPv4Address(rng.getrandbits(32))
            dst = IPv4Address((10 << 24) | rng.getrandbits(24))
            pool.append(f"PROXY TCP4 {src} {dst} {sport} {dport}\\r\\n".encode())
        elif kind == "v1-tcp6":
            src6 = IPv6Address(rng.getrandbits(128))
            dst6 = IPv6Address((0x2001_0DB8 << 96) | rng.getrandbits(32))
            pool.append(f"PROXY TCP6 {src6} {dst6} {sport} {dport}\\r\\n".encode())
        elif kind == "v2-inet6":
            pool.append(
                b"\\r\\n\\r\\n\\x00\\r\\nQUIT\\n"
                + struct.pack("!BBH", 0x21, 0x21, 36)
                + rng.getrandbits(128).to_bytes(16)
                + ((0x2001_0DB8 << 96) | rng.getrandbits(32)).to_bytes(16)
                + struct.pack("!HH", sport, dport)
            )
        else:
            tlvs = b""
            if kind == "v2-tlvs":
                tlvs = (
                    tlv(0x01, b"h2")
                    + tlv(0x02, b"www.example.com")
                    + tlv(0x05, rng.randbytes(16))
                    + tlv(0x20, ssl)
                )
            pool.append(
                b"\\r\\n\\r\\n\\x00\\r\\nQUIT\\n"
                + struct.pack(
                    "!BBHIIHH", 0x21, 0x11, 12 + len(tlvs), rng.getrandbits(32),
                    (10 << 24) | rng.getrandbits(24), sport, dport,
                )
                + tlvs
            )

    def run(n):
        done = 0
        while True:
            for data in pool:
                reader = HeaderReader()
                reader.receive_data(data)
                header = reader.next_event()
                reader.trailing_data
                header.source.host
                if destination:
                    header.destination.host
                if "authority" in reads:
                    header.authority
                if "ssl" in reads:
                    header.ssl.cn
                done += 1
                if done >= n:
                    return

    run(200)
    run(count)
    """
)


def instructions(kind: str, *, destination: bool, reads: str, count: int) -> int:
    """The instructions of a process that reads *count* headers (and 200)."""
    run = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-P",  # the tree to measure from PYTHONPATH, not the current directory
            "-c",
            DRIVER,
            kind,
            "1" if destination else "0",
            str(count),
            reads,
        ],
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Collected : (\d+)", run.stderr)
    if found is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{run.stderr}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kind", choices=("v1-tcp4", "v1-tcp6", "v2-inet", "v2-inet6", "v2-tlvs")
    )
    parser.add_argument(
        "--destination", action="store_true", help="read the destination too"
    )
    parser.add_argument(
        "--read",
        default="",
        help="TLV accessors to read too: authority, ssl (comma-separated)",
    )
    parser.add_argument("--headers", default="2000,12000", help="LOW,HIGH")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    low, high = (int(n) for n in args.headers.split(","))
    kinds = [args.kind] if args.kind else ["v1-tcp4", "v1-tcp6", "v2-inet", "v2-inet6"]
    for kind in kinds:
        counts = [
            instructions(kind, destination=args.destination, reads=args.read, count=n)
            for n in (low, high)
        ]
        per_header = (counts[1] - counts[0]) / (high - low)
        read = "source and destination" if args.destination else "source"
        if args.read:
            read += ", " + args.read.replace(",", ", ")
        print(f"{kind}: {per_header:,.0f} instructions per header (reading {read})")


if __name__ == "__main__":
    main()
