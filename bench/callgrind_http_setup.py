"""Instructions to set up one HTTP/1.1 client connection (callgrind).

Run: ``python bench/callgrind_http_setup.py [--connections 100,1100]``

What a new client connection costs before its first byte is read: a process
under ``valgrind --tool=callgrind`` builds the listener's `HttpSite` once,
then *n* connections with `tlsedge._pipeline.http.h1.http_connection` over
one socket pair (built, not started: no request, no I/O), once per count;
the difference of the two counts divided by the extra connections is the
cost of one (start-up and imports cancel out). Needs ``valgrind``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

BUILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import trio
    from tlsedge._backends.keepalive import KeepAlivePool
    from tlsedge._backends.upstream import BackendPool
    from tlsedge._core.config import config_from_mapping
    from tlsedge._core.downstream import Downstream
    from tlsedge._pipeline.http.h1 import http_connection
    from tlsedge._pipeline.http.site import HttpSite
    from tlsedge._reactor.drain import Drain

    count = int(sys.argv[1])
    config = config_from_mapping(
        {
            "listeners": [
                {
                    "name": "web", "bind": "127.0.0.1:0", "mode": "http",
                    "backend": "app", "forwarded": {"x_forwarded_for": True},
                }
            ],
            "backends": [{"name": "app", "servers": ["127.0.0.1:9"]}],
        },
        base_dir=Path.cwd(),
    )

    def ignore(*_):
        pass

    async def main():
        site = HttpSite(
            listener=config.listeners[0],
            backend=await BackendPool.create(config.backends[0]),
            keepalive=KeepAlivePool(), drain=Drain(), on_request=ignore,
        )
        _, sock = trio.socket.socketpair()
        stream = trio.SocketStream(sock)
        downstream = Downstream(
            id="bench", listener="web", peer=("192.0.2.1", 1),
            client=("192.0.2.1", 1), destination=("192.0.2.2", 80),
        )
        for _ in range(count):
            http_connection(
                stream, downstream, site, proxy_header=None, spawn=ignore,
                on_done=ignore,
            )

    trio.run(main)
    """
)

COMPILE = (
    "import compileall, os, tlsedge;"
    " compileall.compile_dir(os.path.dirname(tlsedge.__file__), quiet=1)"
)


def instructions(connections: int, workdir: Path) -> int:
    """The process's instructions for building *connections* connections."""
    run = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={workdir / f'callgrind-{connections}.out'}",
            sys.executable,
            "-c",
            BUILD,
            str(connections),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        check=True,
    )
    match = re.search(r"Collected : (\d+)", run.stderr)
    if match is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{run.stderr}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--connections", default="100,1100", help="two connection counts"
    )
    args = parser.parse_args()
    low, high = (int(n) for n in args.connections.split(","))
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    # Stale bytecode would be compiled in the first (smaller) run only.
    subprocess.run([sys.executable, "-c", COMPILE], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        counts = {n: instructions(n, Path(tmp)) for n in (low, high)}
    for n, count in counts.items():
        print(f"{n:6d} connections: {count:>14,d} instructions")
    per_connection = (counts[high] - counts[low]) / (high - low)
    print(f"per connection set-up: {per_connection:,.0f} instructions")


if __name__ == "__main__":
    main()
