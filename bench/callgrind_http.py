"""Instructions per keep-alive HTTP/1.1 request through the proxy (callgrind).

Run: ``python bench/callgrind_http.py [--requests 100,300]
[--access-log off|writer|logger]``

Wall-clock figures on a shared machine move with the load; instruction counts
do not. This runs the proxy (`tlsedge._http.driver.serve_http` on the
reactor, one plain client connection, X-Forwarded-For on) in a process under
``valgrind --tool=callgrind``, once per request count, with the client and
the backend in processes of their own (not counted). One keep-alive
connection carries every request, over one pooled upstream connection; the
proxy process's instructions for the smaller count are taken from those for
the larger, so start-up and imports cancel out, and the difference divided
by the extra requests is the proxy's cost of one request: the driver, the
session, the exchange, the gate, the access-log record (logged to a null
handler), the reactor and the system-call wrappers. Needs ``valgrind``.
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

BACKEND = textwrap.dedent(
    """
    import socket, sys
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    answer = b"HTTP/1.1 200 OK\\r\\nContent-Length: 6\\r\\n\\r\\nhello\\n"
    while True:
        conn, _ = listener.accept()
        buffered = b""
        while True:
            data = conn.recv(65536)
            if not data:
                break
            buffered += data
            while b"\\r\\n\\r\\n" in buffered:
                _, buffered = buffered.split(b"\\r\\n\\r\\n", 1)
                conn.sendall(answer)
        conn.close()
    """
)

CLIENT = textwrap.dedent(
    """
    import socket, sys
    port, count = int(sys.argv[1]), int(sys.argv[2])
    request = (
        b"GET / HTTP/1.1\\r\\nHost: example.com\\r\\n"
        b"User-Agent: bench\\r\\n\\r\\n"
    )
    sock = socket.create_connection(("127.0.0.1", port))
    for _ in range(count):
        sock.sendall(request)
        got = b""
        while not got.endswith(b"hello\\n"):
            data = sock.recv(65536)
            if not data:
                sys.exit("proxy closed")
            got += data
    sock.close()
    """
)

PROXY = textwrap.dedent(
    """
    import logging, os, sys
    from pathlib import Path
    import trio
    from tlsedge._config import config_from_mapping
    from tlsedge._downstream import Downstream
    from tlsedge._drain import Drain
    from tlsedge._http.driver import serve_http
    from tlsedge._http.pool import KeepAlivePool
    from tlsedge._upstream import BackendPool

    logging.getLogger("tlsedge").addHandler(logging.NullHandler())
    logging.getLogger("tlsedge").propagate = False
    backend_port, ready_file, access_log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if access_log == "logger":
        logging.getLogger("tlsedge.access").setLevel(logging.INFO)
    elif access_log != "off":
        from tlsedge._logging import setup_logging
        setup_logging("warning", access_log=access_log, stream=open(os.devnull, "w"))
    config = config_from_mapping(
        {
            "listeners": [
                {
                    "name": "web", "bind": "127.0.0.1:0", "mode": "http",
                    "backend": "app", "forwarded": {"x_forwarded_for": True},
                }
            ],
            "backends": [
                {"name": "app", "servers": [f"127.0.0.1:{backend_port}"]}
            ],
        },
        base_dir=Path.cwd(),
    )

    async def main():
        pool = await BackendPool.create(config.backends[0])
        keepalive = KeepAlivePool()
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen()
        Path(ready_file).write_text(str(listener.getsockname()[1]))
        sock, peer = await listener.accept()
        stream = trio.SocketStream(sock)
        local = sock.getsockname()
        await serve_http(
            stream,
            Downstream(
                id="bench", listener="web", peer=peer, client=peer,
                destination=(local[0], local[1]),
            ),
            listener=config.listeners[0], backend=pool, keepalive=keepalive,
            proxy_header=None, drain=Drain(),
        )
        await stream.aclose()
        keepalive.close()

    trio.run(main)
    """
)


COMPILE = (
    "import compileall, os, tlsedge;"
    " compileall.compile_dir(os.path.dirname(tlsedge.__file__), quiet=1)"
)


def instructions(
    requests: int, backend_port: int, workdir: Path, access_log: str
) -> int:
    """The proxy process's instructions for *requests* keep-alive requests."""
    ready = workdir / f"ready-{requests}"
    out = workdir / f"callgrind-{requests}.out"
    proxy = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-c",
            PROXY,
            str(backend_port),
            str(ready),
            str(workdir / "access.log") if access_log == "writer" else access_log,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    try:
        while not ready.exists() or not ready.read_text():
            if proxy.poll() is not None:
                raise SystemExit(f"the proxy did not start: {proxy.stderr}")
            subprocess.run(["sleep", "0.2"], check=True)
        port = int(ready.read_text())
        subprocess.run(
            [sys.executable, "-c", CLIENT, str(port), str(requests)], check=True
        )
        _, err = proxy.communicate(timeout=600)
    finally:
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()
    match = re.search(r"Collected : (\d+)", err)
    if match is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{err}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="100,300", help="two request counts")
    parser.add_argument(
        "--access-log",
        choices=("off", "writer", "logger"),
        default="off",
        help="off: no line built (the default); writer: an AccessLogWriter to a"
        " file, as the tlsedge command sets it up; logger: logging records to a"
        " null handler",
    )
    args = parser.parse_args()
    low, high = (int(n) for n in args.requests.split(","))
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    # Stale bytecode would be compiled in the first (smaller) run only.
    subprocess.run([sys.executable, "-c", COMPILE], check=True)
    backend = subprocess.Popen(
        [sys.executable, "-c", BACKEND], stdout=subprocess.PIPE, text=True
    )
    try:
        assert backend.stdout is not None
        backend_port = int(backend.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            counts = {
                n: instructions(n, backend_port, Path(tmp), args.access_log)
                for n in (low, high)
            }
    finally:
        backend.kill()
        backend.wait()
    per_request = (counts[high] - counts[low]) / (high - low)
    path = os.environ.get("PYTHONPATH", "")
    print(
        f"python -V: {sys.version.split()[0]}; PYTHONPATH={path};"
        f" access log: {args.access_log}"
    )
    for n, count in counts.items():
        print(f"{n:6d} requests: {count:>14,d} instructions")
    print(f"per keep-alive request: {per_request:,.0f} instructions")


if __name__ == "__main__":
    main()
