"""Run ``proxyproto probe --diagnose`` against real HAProxy, nginx and tlsedge
ports (the sample output in docs/probe.md)::

    python -m tests.proxyproto.diagnose_peers            # all three
    python -m tests.proxyproto.diagnose_peers nginx --json

Each server gets three ports, configured as ``test_diagnose.py`` checks them:
``proxy`` (a PROXY header required, then plain HTTP), ``proxy+tls`` (a
header, then TLS) and ``plain`` (no header expected). Every port answers
``GET /`` with 200 (tlsedge through a small HTTP backend run here).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.peers import free_port, haproxy, nginx, require, wait_for_port
from tests.proxyproto.client_peers import TlsFiles, tls_files

__all__ = ["LABELS", "PEERS", "running_peer"]

PEERS = ("haproxy", "nginx", "tlsedge")
LABELS = ("proxy", "proxy+tls", "plain")
_HEADER_TIMEOUT = 3  # seconds, for every server


def _haproxy_config(ports: dict[str, int], files: TlsFiles) -> str:
    return (
        "global\n    maxconn 256\n"
        "defaults\n    mode http\n    timeout connect 5s\n"
        f"    timeout client {_HEADER_TIMEOUT}s\n    timeout server 5s\n"
        f"    timeout http-request {_HEADER_TIMEOUT}s\n"
        "frontend fe\n"
        f"    bind 127.0.0.1:{ports['proxy']} accept-proxy\n"
        f"    bind 127.0.0.1:{ports['proxy+tls']} accept-proxy ssl crt "
        f"{files.chain_and_key_pem}\n"
        f"    bind 127.0.0.1:{ports['plain']}\n"
        "    http-request return status 200 content-type text/plain string ok\n"
    )


def _nginx_config(ports: dict[str, int], files: TlsFiles) -> str:
    answer = 'return 200 "ok\\n";'
    return (
        "http {\n    access_log off;\n"
        f"    client_header_timeout {_HEADER_TIMEOUT}s;\n"
        f"    server {{ listen 127.0.0.1:{ports['proxy']} proxy_protocol; "
        f"{answer} }}\n"
        f"    server {{ listen 127.0.0.1:{ports['proxy+tls']} ssl proxy_protocol;\n"
        f"        ssl_certificate {files.cert_pem};\n"
        f"        ssl_certificate_key {files.key_pem};\n"
        f"        {answer} }}\n"
        f"    server {{ listen 127.0.0.1:{ports['plain']}; {answer} }}\n"
        "}\n"
    )


def _tlsedge_config(ports: dict[str, int], files: TlsFiles, backend: int) -> str:
    proxy = (
        '[listeners.proxy_protocol]\ntrusted = ["127.0.0.1/32"]\n'
        f"timeout = {_HEADER_TIMEOUT}.0\n"
    )
    listeners = [
        (label, proxy if label != "plain" else "")
        for label in ("proxy", "proxy+tls", "plain")
    ]
    text = '[edge]\naccess_log = "off"\n'
    for label, extra in listeners:
        text += (
            f'[[listeners]]\nname = "{label}"\nbind = "127.0.0.1:{ports[label]}"\n'
            f'mode = "http"\nbackend = "app"\n{extra}'
        )
        if label == "proxy+tls":
            text += (
                "[listeners.tls]\n"
                f'certificates = [{{ cert = "{files.cert_pem}", '
                f'key = "{files.key_pem}" }}]\n'
            )
    return text + (f'[[backends]]\nname = "app"\nservers = ["127.0.0.1:{backend}"]\n')


class _Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _http_backend() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def _tlsedge(config: str, ports: list[int], directory: Path) -> Iterator[None]:
    path = directory / "edge.toml"
    path.write_text(config)
    process = subprocess.Popen(
        [sys.executable, "-m", "tlsedge", "run", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        for port in ports:
            wait_for_port(port, process=process)
        yield
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def running_peer(name: str, directory: Path) -> Iterator[dict[str, int]]:
    """Run *name* (``haproxy``, ``nginx`` or ``tlsedge``) with its three
    ports (certificates written to *directory*); yield ``{label: port}``."""
    files = tls_files(directory)
    ports = {label: free_port() for label in LABELS}
    if name == "haproxy":
        with haproxy(_haproxy_config(ports, files), list(ports.values())):
            yield ports
    elif name == "nginx":
        with nginx(_nginx_config(ports, files), list(ports.values())):
            yield ports
    elif name == "tlsedge":
        with (
            _http_backend() as backend,
            _tlsedge(
                _tlsedge_config(ports, files, backend), list(ports.values()), directory
            ),
        ):
            yield ports
    else:
        raise ValueError(f"expected one of {', '.join(PEERS)}, got {name!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.proxyproto.diagnose_peers [PEER...] [--json]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    extra = [a for a in args if a.startswith("-")]
    names = [a for a in args if not a.startswith("-")] or list(PEERS)
    for name in names:
        if name not in PEERS:
            sys.stderr.write(f"usage: expected peers among {', '.join(PEERS)}\n")
            return 2
        if name != "tlsedge":
            require(name)
    for name in names:
        with (
            tempfile.TemporaryDirectory(prefix="diagnose-") as tmp,
            running_peer(name, Path(tmp)) as ports,
        ):
            for label, port in ports.items():
                print(f"# {name}, {label} port")
                command = ["probe", "--diagnose", f"127.0.0.1:{port}", *extra]
                print("$ proxyproto " + " ".join(command), flush=True)
                code = subprocess.run(
                    [sys.executable, "-m", "proxyproto", *command], check=False
                ).returncode
                print(f"(exit {code})\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
