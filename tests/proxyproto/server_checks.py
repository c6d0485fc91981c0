"""Servers run as real processes behind PROXY senders (test helpers).

The Twisted (Daphne, twistd) and gunicorn adapters are tested with the server
running as its own process, as users run it: ``server_process`` starts it and
waits until its ports listen, without connecting (a connection without a
header would be a refusal in the log under test). ``Client`` speaks just
enough HTTP/1.1 to read the JSON the test apps answer; ``tls_connect`` sends
a header and the ClientHello in one segment; ``tlsedge_in_front`` runs a real
tlsedge that terminates TLS and sends a v2 header with an SSL TLV.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trustme

from proxyproto import TLV, ProxyHeader, TLVType, encode_v2
from tests.peers import free_port, require

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 10.0
_STARTUP_TIMEOUT = 30.0

V1_HEADER = b"PROXY TCP4 192.0.2.1 198.51.100.2 1234 443\r\n"


def _listening_ports() -> set[int]:
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@contextlib.contextmanager
def server_process(
    args: list[str], ports: list[int], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python ARGS`` (with the worktree importable) until the block
    ends; output goes to *log*. Waits until every port in *ports* listens."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while not set(ports) <= _listening_ports():
            if process.poll() is not None:
                raise RuntimeError(f"{args[:2]} exited: {log.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args[:2]} did not listen: {log.read_text()}")
            time.sleep(0.05)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_log(log: Path, text: str, timeout: float = TIMEOUT) -> str:
    """The log once it contains *text* (servers write their lines late)."""
    deadline = time.monotonic() + timeout
    while text not in (content := log.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{text!r} not in the log:\n{content}"
        time.sleep(0.05)
    return content


def wait_for_lines(
    log: Path, offset: int, text: str, timeout: float = TIMEOUT
) -> list[str]:
    """The lines written to *log* past *offset*, once one contains *text*."""
    deadline = time.monotonic() + timeout
    while True:
        with log.open("rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
        if any(text in line for line in lines):
            return lines
        assert time.monotonic() < deadline, f"{text!r} not in the log:\n{lines}"
        time.sleep(0.05)


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
    """Minimal HTTP/1.1 over a (possibly TLS) socket; bodies are JSON."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buffer = b""

    def request(self, path: str = "/", first: bytes = b"") -> dict[str, Any]:
        self.sock.sendall(first + f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
        return self.response()

    def response(self) -> dict[str, Any]:
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
        result: dict[str, Any] = json.loads(body)
        return result

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError(f"server closed the connection: {self.buffer!r}")
        self.buffer += data


def assert_closed(sock: socket.socket, within: float = TIMEOUT) -> None:
    """The server closes without sending anything."""
    sock.settimeout(within)
    try:
        data = sock.recv(65536)
    except ConnectionResetError:
        data = b""
    assert data == b""


def v2_header(source: tuple[str, int] = ("2001:db8::1", 5555)) -> bytes:
    """A v2 header with AUTHORITY and UNIQUE_ID TLVs and a CRC32C."""
    destination = ("2001:db8::2", 443) if ":" in source[0] else ("192.0.2.200", 443)
    tlvs = (
        TLV(TLVType.AUTHORITY, b"example.com"),
        TLV(TLVType.UNIQUE_ID, b"\x01\x02\x03"),
    )
    header = ProxyHeader.from_addresses(source, destination, tlvs=tlvs)
    return encode_v2(header, crc32c=True)


def make_tls_files(directory: Path) -> dict[str, Any]:
    """A CA, a certificate for localhost/127.0.0.1 (cert, key, and both in
    one ``pem``) and a client context trusting the CA."""
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    files = {name: directory / f"{name}.pem" for name in ("cert", "key", "ca", "pem")}
    cert.private_key_pem.write_to_path(str(files["key"]))
    files["cert"].write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    files["pem"].write_bytes(files["cert"].read_bytes() + files["key"].read_bytes())
    ca.cert_pem.write_to_path(str(files["ca"]))
    client = ssl.create_default_context(cafile=str(files["ca"]))
    return {**files, "client": client}


def tls_connect(sock: socket.socket, header: bytes, context: ssl.SSLContext) -> Any:
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
            if pending := outgoing.read():
                sock.sendall(pending)
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed during the handshake") from None
            incoming.write(data)
    if pending := outgoing.read():
        sock.sendall(pending)
    return _TLSSocket(sock, obj, incoming, outgoing)


class _TLSSocket:
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


def curl_json(url: str, *extra: str) -> dict[str, Any]:
    """GET *url* with curl; the JSON it answered."""
    curl = require("curl")
    out = subprocess.run(
        [curl, "-sS", "--max-time", "10", *extra, url],
        capture_output=True,
        check=True,
        timeout=30,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@contextlib.contextmanager
def tlsedge_in_front(
    backend_port: int, tls_files: dict[str, Any], directory: Path
) -> Iterator[int]:
    """A real tlsedge terminating TLS on a free port, relaying (mode tcp) to
    *backend_port* with ``send_proxy = "v2"`` (SSL TLV included); yields its
    port."""
    port = free_port()
    config = directory / "edge.toml"
    config.write_text(
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "app"\n'
        f'[listeners.tls]\ncertificates = [{{ cert = "{tls_files["cert"]}", '
        f'key = "{tls_files["key"]}" }}]\n'
        f'[[backends]]\nname = "app"\nservers = ["127.0.0.1:{backend_port}"]\n'
        'send_proxy = "v2"\n'
    )
    with server_process(
        ["-m", "tlsedge", "run", str(config)], [port], directory / "edge.log"
    ):
        yield port
