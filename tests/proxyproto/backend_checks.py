"""Clients and front ends for backends behind PROXY (test helpers).

The aiohttp and Tornado adapter tests run their server in a thread and talk
to it as the outside world does: a blocking socket that writes the header
itself (``connect``, ``Client``, ``tls_connect``), curl, and a real HAProxy or
tlsedge in front (``curl_through_haproxy``, ``curl_through_tlsedge``). Their
apps answer JSON describing what they saw.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trustme

from tests.peers import free_port, haproxy, require, wait_for_port

TIMEOUT = 10.0
ROOT = Path(__file__).resolve().parents[2]

V1_HEADER = b"PROXY TCP4 192.0.2.1 198.51.100.2 1234 443\r\n"
REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"


def connect(port: int) -> tuple[socket.socket, int]:
    """A connection from 127.0.0.1 with a pinned source port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.settimeout(TIMEOUT)
    try:
        source_port = free_port()
        sock.bind(("127.0.0.1", source_port))
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock, source_port


class Client:
    """Minimal HTTP/1.1 over a (possibly TLS) socket; JSON or raw bodies."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buffer = b""

    def request(self, path: str = "/", first: bytes = b"") -> dict[str, Any]:
        """GET *path* (after *first*, e.g. a PROXY header); the JSON answer."""
        result: dict[str, Any] = json.loads(self.get(path, first))
        return result

    def get(self, path: str = "/", first: bytes = b"") -> bytes:
        """GET *path*; the body of a 200 answer."""
        self.sock.sendall(first + f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
        return self.response()

    def response(self) -> bytes:
        """The body of the next answer, which must be a 200."""
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return body

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        self.buffer += data


def assert_closed(sock: socket.socket, within: float = TIMEOUT) -> None:
    """The server closes without sending anything (a reset counts: it had
    unread bytes from us)."""
    sock.settimeout(within)
    try:
        data = sock.recv(65536)
    except ConnectionResetError:
        data = b""
    assert data == b""


def write_tls_files(directory: Path) -> dict[str, Any]:
    """A CA, a server certificate for localhost/127.0.0.1 (``cert``, ``key``,
    ``server_context``), a client certificate with CN ``alice``
    (``client_cert``, ``client_key``) and a client context trusting the CA."""
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    files = {
        "cert": directory / "cert.pem",
        "key": directory / "key.pem",
        "ca": directory / "ca.pem",
        "client_cert": directory / "client.pem",
        "client_key": directory / "client.key",
    }
    cert.private_key_pem.write_to_path(str(files["key"]))
    files["cert"].write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    ca.cert_pem.write_to_path(str(files["ca"]))
    alice = ca.issue_cert("alice@example.test", common_name="alice")
    alice.cert_chain_pems[0].write_to_path(str(files["client_cert"]))
    alice.private_key_pem.write_to_path(str(files["client_key"]))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(files["cert"], files["key"])
    client = ssl.create_default_context(cafile=str(files["ca"]))
    return {**files, "server_context": server, "client": client}


class BIOSocket:
    """sendall/recv over an SSLObject (what Client needs)."""

    def __init__(
        self,
        sock: socket.socket,
        obj: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
    ) -> None:
        self.sock = sock
        self.obj = obj
        self.incoming = incoming
        self.outgoing = outgoing

    def sendall(self, data: bytes) -> None:
        self.obj.write(data)
        self.sock.sendall(self.outgoing.read())

    def recv(self, size: int) -> bytes:
        while True:
            try:
                return self.obj.read(size)
            except ssl.SSLWantReadError:
                data = self.sock.recv(65536)
                if not data:
                    return b""
                self.incoming.write(data)
            finally:
                pending = self.outgoing.read()
                if pending:
                    self.sock.sendall(pending)


def tls_connect(
    sock: socket.socket, header: bytes, context: ssl.SSLContext
) -> BIOSocket:
    """Send *header* and the ClientHello in one segment, then finish the
    handshake: the server must hand the bytes after the header to TLS."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    sock.sendall(header + outgoing.read())
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            pending = outgoing.read()
            if pending:
                sock.sendall(pending)
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed during the handshake") from None
            incoming.write(data)
    pending = outgoing.read()
    if pending:
        sock.sendall(pending)
    return BIOSocket(sock, obj, incoming, outgoing)


def curl(url: str, *extra: str) -> tuple[dict[str, Any], tuple[str, int]]:
    """GET *url* with curl from a pinned local port range: the JSON body and
    curl's own endpoint (what the backend must report as the client)."""
    binary = require("curl")
    low = min(free_port(), 65000)
    result = subprocess.run(
        [
            binary,
            "-sS",
            "--max-time",
            "10",
            "--local-port",
            f"{low}-{low + 40}",
            "-w",
            "\n%{local_ip} %{local_port}",
            *extra,
            url,
        ],
        capture_output=True,
        check=False,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr.decode()
    body, _, endpoint = result.stdout.rpartition(b"\n")
    ip, port = endpoint.decode().split()
    seen: dict[str, Any] = json.loads(body)
    return seen, (ip, int(port))


@contextlib.contextmanager
def haproxy_in_front(port: int, server_options: str, bind: str = "") -> Iterator[int]:
    """A real HAProxy relaying a frontend port to the backend on *port*
    (``server ... SERVER_OPTIONS``, ``bind ... BIND``); yields the frontend
    port."""
    front = free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front} {bind}\n    default_backend be\n"
        f"backend be\n    server app 127.0.0.1:{port} {server_options}\n"
    )
    with haproxy(config, [front]):
        yield front


def haproxy_tls_bind(tls_files: dict[str, Any], tmp_path: Path) -> str:
    """A ``bind`` suffix terminating TLS with the test certificate, asking
    for an optional client certificate (for ``send-proxy-v2-ssl-cn``)."""
    pem = tmp_path / "haproxy.pem"
    pem.write_bytes(tls_files["cert"].read_bytes() + tls_files["key"].read_bytes())
    return f"ssl crt {pem} verify optional ca-file {tls_files['ca']}"


@contextlib.contextmanager
def tlsedge_in_front(
    port: int, tls_files: dict[str, Any], tmp_path: Path
) -> Iterator[int]:
    """A real ``tlsedge run`` terminating TLS and relaying to *port* with
    ``send_proxy = "v2"`` (SSL TLV included); yields its port."""
    front = free_port()
    toml = tmp_path / "edge.toml"
    toml.write_text(
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{front}"\nbackend = "app"\n'
        f'[listeners.tls]\ncertificates = [{{ cert = "{tls_files["cert"]}", '
        f'key = "{tls_files["key"]}" }}]\n'
        f'[[backends]]\nname = "app"\nservers = ["127.0.0.1:{port}"]\n'
        'send_proxy = "v2"\n'
    )
    log = tmp_path / "edge.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tlsedge", "run", str(toml)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        try:
            wait_for_port(front, process=process)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}: {log.read_text()}") from None
        yield front
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
