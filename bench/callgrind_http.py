"""Instructions per keep-alive request through the proxy (callgrind).

Run: ``python bench/callgrind_http.py [--requests 100,300] [--tls] [--floor]
[--http2 [--streams 10] [--sans-io h2|session]] [--access-log off|writer|logger]
[--metrics] [--keep DIR]``, or ``python bench/callgrind_http.py --setup [--requests
100,1100]``

Wall-clock figures on a shared machine move with the load; instruction counts
do not. This runs the proxy (`tlsedge._pipeline.http.h1.serve_http` on the
reactor, one plain client connection, X-Forwarded-For on) in a process under
``valgrind --tool=callgrind``, once per request count, with the client and
the backend in processes of their own (not counted). One keep-alive
connection carries every request, over one pooled upstream connection; the
proxy process's instructions for the smaller count are taken from those for
the larger, so start-up and imports cancel out, and the difference divided
by the extra requests is the proxy's cost of one request: the driver, the
session, the exchange, the gate, the access-log record (logged to a null
handler), the reactor and the system-call wrappers; with ``--metrics``, the
request's metrics too (an `EdgeMetrics` counting each request as the edge's
HTTP sites do). With ``--http2`` the
client speaks HTTP/2 with prior knowledge (``h2``) on one connection, to
`tlsedge._pipeline.http.h2.h2_connection`: one stream at a time, or with
``--streams N`` N streams sent together and their responses awaited before
the next N (the request counts should be multiples of N). ``--http2
--sans-io h2`` (or ``session``) counts the same exchanges without sockets
or a backend, through the ``h2`` library alone (as `H2Session` configures
it) or through `tlsedge._http.h2session.H2Session`: what framing and HPACK
cost, and what the session adds. ``--tls`` puts TLS 1.3 between the
HTTP/1.1 client and the proxy (a `TLSStream` over the accepted socket,
Python's default server context, a ``trustme`` certificate; the handshake
is start-up and cancels out): what the client side's records cost per
request. ``--floor [--tls]`` counts `epoll_floor.py` (issue 24's
one-epoll-loop prototype, no features) on the same exchanges instead: the
floor of a CPython process. ``--setup`` counts what a new HTTP/1.1 client
connection costs before its first byte is read: the two counts are
connections built with `tlsedge._pipeline.http.h1.http_connection` from
one listener's `HttpSite` (not started), and the difference divided by the
extra connections is the set-up of one. Needs ``valgrind``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Final

BACKEND = textwrap.dedent(
    """
    import socket, sys, threading
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    answer = b"HTTP/1.1 200 OK\\r\\nContent-Length: 6\\r\\n\\r\\nhello\\n"

    def serve(conn):
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

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
    """
)

CLIENT = textwrap.dedent(
    """
    import socket, sys
    port, count, ca = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4]
    request = (
        b"GET / HTTP/1.1\\r\\nHost: example.com\\r\\n"
        b"User-Agent: bench\\r\\n\\r\\n"
    )
    sock = socket.create_connection(("127.0.0.1", port))
    if ca:
        import ssl
        context = ssl.create_default_context(cafile=ca)
        sock = context.wrap_socket(sock, server_hostname="localhost")
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

CLIENT_H2 = textwrap.dedent(
    """
    import socket, sys
    import h2.config, h2.connection, h2.events
    port, count, streams = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sock = socket.create_connection(("127.0.0.1", port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    headers = [
        (":method", "GET"), (":scheme", "http"), (":authority", "example.com"),
        (":path", "/"), ("user-agent", "bench"),
    ]
    for _ in range(count // streams):
        for _ in range(streams):
            stream_id = conn.get_next_available_stream_id()
            conn.send_headers(stream_id, headers, end_stream=True)
        sock.sendall(conn.data_to_send())
        left = streams
        while left:
            data = sock.recv(65536)
            if not data:
                sys.exit("proxy closed")
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                if isinstance(event, h2.events.StreamEnded):
                    left -= 1
            sock.sendall(conn.data_to_send())
    conn.close_connection()
    sock.sendall(conn.data_to_send())
    sock.close()
    """
)

# The client side of --sans-io: each batch's bytes (a pickled list), made
# outside valgrind. Answers are small enough to need no WINDOW_UPDATE.
CLIENT_H2_BYTES = textwrap.dedent(
    """
    import pickle, sys
    import h2.config, h2.connection
    out, count, streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    batches = [conn.data_to_send()]
    headers = [
        (":method", "GET"), (":scheme", "http"), (":authority", "example.com"),
        (":path", "/"), ("user-agent", "bench"),
    ]
    for _ in range(count // streams):
        for _ in range(streams):
            stream_id = conn.get_next_available_stream_id()
            conn.send_headers(stream_id, headers, end_stream=True)
        batches.append(conn.data_to_send())
    with open(out, "wb") as file:
        pickle.dump(batches, file)
    """
)

# --sans-io: the server side of the same exchanges in memory, through `h2`
# alone (configured as `H2Session` configures it) or through `H2Session`;
# each request answered with a head and a 6-byte body, the bytes to send
# taken once per batch.
SANS_IO = textwrap.dedent(
    """
    import pickle, sys
    import h2.config, h2.connection, h2.events
    from tlsedge._core.config import Http2Config
    from tlsedge._http.h2session import H2_CONFIGURATION, H2Session, StreamOpened
    layer, batches_file = sys.argv[1], sys.argv[2]
    with open(batches_file, "rb") as file:
        batches = pickle.load(file)
    head = [(b"content-length", b"6")]
    if layer == "h2":
        conn = h2.connection.H2Connection(H2_CONFIGURATION)
        conn.initiate_connection()
        for batch in batches:
            for event in conn.receive_data(batch):
                if isinstance(event, h2.events.RequestReceived):
                    conn.send_headers(event.stream_id, [(b":status", b"200"), *head])
                    conn.send_data(event.stream_id, b"hello\\n", end_stream=True)
            conn.data_to_send()
    else:
        session = H2Session(Http2Config(), max_headers=100)
        for batch in batches:
            for event in session.receive_data(batch, 0.0):
                if isinstance(event, StreamOpened):
                    session.send_headers(event.stream_id, 200, head, end_stream=False)
                    session.send_data(event.stream_id, b"hello\\n", end_stream=True)
            session.data_to_send()
    """
)

PROXY = textwrap.dedent(
    """
    import logging, os, sys
    from pathlib import Path
    import trio
    from tlsedge._core.config import config_from_mapping
    from tlsedge._core.downstream import Downstream
    from tlsedge._reactor.drain import Drain
    from functools import partial
    from tlsedge._pipeline.http.h1 import run_to_end, serve_http
    from tlsedge._pipeline.http.h2 import h2_connection
    from tlsedge._pipeline.http.site import HttpSite
    from tlsedge._backends.keepalive import KeepAlivePool
    from tlsedge._backends.upstream import BackendPool

    import gc
    logging.getLogger("tlsedge").addHandler(logging.NullHandler())
    logging.getLogger("tlsedge").propagate = False
    backend_port, ready_file, version = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    access_log, certs, metrics = sys.argv[4], sys.argv[5], sys.argv[6]
    if access_log == "logger":
        logging.getLogger("tlsedge.access").setLevel(logging.INFO)
    elif access_log != "off":
        from tlsedge._control.logs import setup_logging
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
        gc.freeze()  # (start-up's objects: not walked by every collection)
        pool = await BackendPool.create(config.backends[0])
        keepalive = KeepAlivePool()
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen()
        Path(ready_file).write_text(str(listener.getsockname()[1]))
        sock, peer = await listener.accept()
        stream = trio.SocketStream(sock)
        if certs:
            import ssl
            from tlsedge._tls.stream import TLSStream
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(certs)
            stream = TLSStream(stream, context, server_side=True)
            await stream.do_handshake()
            from tlsedge._core.downstream import SSLFacts
            facts = SSLFacts(
                version=stream.ssl_object.version(),
                cipher=stream.ssl_object.cipher()[0], alpn=None,
                server_name="localhost", client_cert_der=None, client_cn=None,
                verified=False, sig_alg="ECDSA-SHA256", key_alg="EC256",
            )
        local = sock.getsockname()
        downstream = Downstream(
            id="bench", listener="web", peer=peer, client=peer,
            destination=(local[0], local[1]), tls=facts if certs else None,
        )
        on_request = None
        if metrics:  # as Pipeline.http_site
            from tlsedge._core.metrics import EdgeMetrics
            on_request = EdgeMetrics().http_requests("web", pool.name).record
        site = HttpSite(
            listener=config.listeners[0], backend=pool, keepalive=keepalive,
            drain=Drain(), on_request=on_request,
        )
        if version == "2":
            await run_to_end(
                partial(h2_connection, stream, downstream, site, proxy_header=None)
            )
        else:
            await serve_http(stream, downstream, site, proxy_header=None)
        await stream.aclose()
        keepalive.close()

    trio.run(main)
    """
)

# --setup: build *count* HTTP/1.1 connections of one listener's site over
# one socket pair (not started: no request, no I/O).
SETUP = textwrap.dedent(
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


def instructions(
    requests: int,
    backend_port: int,
    workdir: Path,
    *,
    http2: bool,
    streams: int,
    access_log: str,
    certs: tuple[Path, Path] | None,
    metrics: bool,
) -> int:
    """The proxy process's instructions for *requests* keep-alive requests
    (over TLS with *certs*: the proxy's certificate chain and key file, and
    the CA file the client trusts; with *metrics*, each request counted in
    an `EdgeMetrics` as the edge counts it)."""
    ready = workdir / f"ready-{requests}"
    out = workdir / f"callgrind-{requests}.out"
    ready.unlink(missing_ok=True)  # (a kept directory's, from an earlier run)
    proxy = subprocess.Popen(
        _under_callgrind(
            out,
            "-c",
            PROXY,
            str(backend_port),
            str(ready),
            "2" if http2 else "1",
            str(workdir / "access.log") if access_log == "writer" else access_log,
            str(certs[0]) if certs else "",
            "metrics" if metrics else "",
        ),
        stderr=subprocess.PIPE,
        text=True,
        env=_ENV,
    )
    try:
        while not ready.exists() or not ready.read_text():
            if proxy.poll() is not None:
                raise SystemExit(f"the proxy did not start: {proxy.stderr}")
            subprocess.run(["sleep", "0.2"], check=True)
        port = int(ready.read_text())
        subprocess.run(
            [
                sys.executable,
                "-c",
                CLIENT_H2 if http2 else CLIENT,
                str(port),
                str(requests),
                str(streams),
                str(certs[1]) if certs else "",
            ],
            check=True,
        )
        _, err = proxy.communicate(timeout=600)
    finally:
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()
    return _collected(err)


def sans_io_instructions(
    requests: int, workdir: Path, *, layer: str, streams: int
) -> int:
    """The instructions of *requests* HTTP/2 exchanges in memory (--sans-io)."""
    batches = workdir / f"client-{requests}.pickle"
    subprocess.run(
        [
            sys.executable,
            "-c",
            CLIENT_H2_BYTES,
            str(batches),
            str(requests),
            str(streams),
        ],
        check=True,
    )
    return _callgrind(
        workdir / f"callgrind-{requests}.out", SANS_IO, layer, str(batches)
    )


def setup_instructions(connections: int, workdir: Path) -> int:
    """The instructions of building *connections* connections (--setup)."""
    return _callgrind(workdir / f"callgrind-{connections}.out", SETUP, str(connections))


def _callgrind(out: Path, script: str, *args: str) -> int:
    """The instructions of running *script* with *args* under callgrind."""
    run = subprocess.run(
        _under_callgrind(out, "-c", script, *args),
        stderr=subprocess.PIPE,
        text=True,
        env=_ENV,
        check=True,
    )
    return _collected(run.stderr)


#: The measured processes' environment: string hashing fixed, so that runs
#: of the same code count the same.
_ENV: Final = {**os.environ, "PYTHONHASHSEED": "0"}


def _under_callgrind(out: Path, *python_args: str) -> list[str]:
    """The command that runs this Python with *python_args* under callgrind,
    its counts written to *out*."""
    return [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        *python_args,
    ]


def _collected(err: str) -> int:
    match = re.search(r"Collected : (\d+)", err)
    if match is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{err}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="100,300", help="two request counts")
    parser.add_argument("--http2", action="store_true", help="HTTP/2 (h2c) clients")
    parser.add_argument(
        "--streams",
        type=int,
        default=1,
        help="with --http2: streams in flight at once (h2load's -m)",
    )
    parser.add_argument(
        "--sans-io",
        choices=["h2", "session"],
        help="HTTP/2 without sockets: the h2 library alone, or H2Session over it",
    )
    parser.add_argument(
        "--setup",
        action="store_true",
        help="instructions to set up one HTTP/1.1 connection (the counts are"
        " connections built, not requests)",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="keep the callgrind outputs in this directory (for callgrind_annotate)",
    )
    parser.add_argument(
        "--access-log",
        choices=("off", "writer", "logger"),
        default="off",
        help="off: no line built (the default); writer: an AccessLogWriter to a"
        " file, as the tlsedge command sets it up; logger: logging records to a"
        " null handler",
    )
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="count each request in an EdgeMetrics, as the edge's HTTP sites do"
        " (Pipeline.http_site's on_request)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="HTTP/1.1 over TLS (TLS 1.3, Python's default server context, a"
        " trustme certificate): what the client side's TLS adds",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="count bench/epoll_floor.py (issue 24's one-loop prototype) instead"
        " of tlsedge; with --tls over TLS",
    )
    args = parser.parse_args()
    if (args.tls or args.floor) and (args.http2 or args.sans_io):
        parser.error("--tls and --floor are for HTTP/1.1 clients")
    low, high = (int(n) for n in args.requests.split(","))
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    # Stale bytecode would be compiled in the first (smaller) run only.
    subprocess.run([sys.executable, "-c", COMPILE], check=True)
    if args.setup:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp) if args.keep is None else args.keep
            workdir.mkdir(parents=True, exist_ok=True)
            counts = {n: setup_instructions(n, workdir) for n in (low, high)}
        for n, count in counts.items():
            print(f"{n:6d} connections: {count:>14,d} instructions")
        per_connection = (counts[high] - counts[low]) / (high - low)
        print(f"per connection set-up: {per_connection:,.0f} instructions")
        return
    if args.sans_io is not None:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp) if args.keep is None else args.keep
            workdir.mkdir(parents=True, exist_ok=True)
            counts = {
                n: sans_io_instructions(
                    n, workdir, layer=args.sans_io, streams=args.streams
                )
                for n in (low, high)
            }
        _report(counts, low, high, access_log="off")
        return
    backend = subprocess.Popen(
        [sys.executable, "-c", BACKEND], stdout=subprocess.PIPE, text=True
    )
    try:
        assert backend.stdout is not None
        backend_port = int(backend.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp) if args.keep is None else args.keep
            workdir.mkdir(parents=True, exist_ok=True)
            certs = _certificates(workdir) if args.tls or args.floor else None
            if args.floor:
                assert certs is not None
                floor_certs = (certs[0], certs[1] if args.tls else Path(""))
                counts = {
                    n: floor_instructions(n, backend_port, workdir, floor_certs)
                    for n in (low, high)
                }
                _report(counts, low, high, access_log="none (the floor)")
                return
            counts = {
                n: instructions(
                    n,
                    backend_port,
                    workdir,
                    http2=args.http2,
                    streams=args.streams,
                    access_log=args.access_log,
                    certs=certs,
                    metrics=args.metrics,
                )
                for n in (low, high)
            }
    finally:
        backend.kill()
        backend.wait()
    _report(counts, low, high, access_log=args.access_log, metrics=args.metrics)


def floor_instructions(
    requests: int, backend_port: int, workdir: Path, certs: tuple[Path, Path]
) -> int:
    """`epoll_floor.py`'s instructions for *requests* keep-alive requests
    (HTTPS when *certs* has a CA file the client is to use, else plain)."""
    out = workdir / f"callgrind-floor-{requests}.out"
    chain, ca = certs
    http_port, https_port = _free_port(), _free_port()
    floor = subprocess.Popen(
        _under_callgrind(
            out,
            str(Path(__file__).with_name("epoll_floor.py")),
            str(http_port),
            str(https_port),
            str(backend_port),
            str(chain),
        ),
        stderr=subprocess.PIPE,
        text=True,
        env=_ENV,
    )
    try:
        port = https_port if ca.name else http_port
        while not _listening(port):
            if floor.poll() is not None:
                raise SystemExit(f"the floor did not start: {floor.stderr}")
            subprocess.run(["sleep", "0.2"], check=True)
        subprocess.run(
            [
                sys.executable,
                "-c",
                CLIENT,
                str(port),
                str(requests),
                "1",
                str(ca) if ca.name else "",
            ],
            check=True,
        )
        floor.send_signal(signal.SIGINT)  # KeyboardInterrupt: callgrind writes out
        _, err = floor.communicate(timeout=600)
    finally:
        if floor.poll() is None:
            floor.kill()
            floor.wait()
    return _collected(err)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    """True once *port* listens (read from /proc/net/tcp: a test connection
    would be a client of the floor)."""
    wanted = f":{port:04X} "
    with open("/proc/net/tcp") as table:
        return any(wanted in line and " 0A " in line for line in table)


def _certificates(workdir: Path) -> tuple[Path, Path]:
    """A server certificate for "localhost" (chain and key in one file) and
    the CA file that trusts it."""
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("localhost")
    chain, ca_file = workdir / "server.pem", workdir / "ca.pem"
    server.private_key_and_cert_chain_pem.write_to_path(str(chain))
    ca.cert_pem.write_to_path(str(ca_file))
    return chain, ca_file


def _report(
    counts: dict[int, int],
    low: int,
    high: int,
    *,
    access_log: str,
    metrics: bool = False,
) -> None:
    per_request = (counts[high] - counts[low]) / (high - low)
    path = os.environ.get("PYTHONPATH", "")
    print(
        f"python -V: {sys.version.split()[0]}; PYTHONPATH={path};"
        f" access log: {access_log}; metrics: {'on' if metrics else 'off'}"
    )
    for n, count in counts.items():
        print(f"{n:6d} requests: {count:>14,d} instructions")
    print(f"per keep-alive request: {per_request:,.0f} instructions")


if __name__ == "__main__":
    main()
