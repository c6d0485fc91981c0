"""``proxyproto probe --diagnose``: what a port expects, in one line.

The #1 PROXY support question is a mismatch between the two ends: a load
balancer sends a header to a port that does not expect one (nginx answers
``"\\x0D\\x0A\\x0D\\x0A\\x00..." 400``), or a port expects one that never
comes (nginx logs ``broken header``). The diagnosis answers from the outside:
does the port expect a header, which versions does it take, does TLS or
plain data follow it, and does it wrongly guess (serve with and without).

How it works
------------
Six connections at once, one per (header, then) pair: no header, a v1 header
and a v2 header (each PROXY TCP naming the connection's own endpoints, as
``curl --haproxy-protocol`` does, so address-based rules see the real
client), then either plain bytes (an HTTP request, or ``--payload``) or a TLS
handshake (certificates are not checked: only whether the port speaks TLS).
Each attempt is judged:

- *served*: plain bytes were answered (anything but an HTTP 400 or a TLS
  alert) or held open for ``--wait`` seconds; a TLS handshake completed;
- *refused*: closed, reset, an HTTP 400 (the bytes were read as a malformed
  request), a TLS alert, a failed or silent handshake;
- *error*: no connection (connect or send failed).

A header mode (none, v1, v2) is *taken* when its plain or TLS attempt was
served. Then:

==================  ==============  ========================  ====
without a header    with a header   verdict                   exit
==================  ==============  ========================  ====
refused             taken (v1/v2)   requires a header         0
taken               taken           guesses (with or without) 1
(any attempt failed to connect)     unreachable               2
taken               refused         expects no header         3
refused             refused         undetermined              4
==================  ==============  ========================  ====

Exit 2 is also the CLI's code for usage errors. A verdict holds for the
address the probe connects from: a port that trusts only its load balancer's
addresses refuses everyone else's headers.
"""

from __future__ import annotations

import enum
import ipaddress
import socket
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from proxyproto._client import HeaderPlan
from proxyproto._exchange import GONE, Observation, connect, escape, exchange
from proxyproto._tls_client import TLSClient

__all__ = [
    "MODES",
    "Attempt",
    "DiagnoseConfig",
    "Diagnosis",
    "Verdict",
    "diagnose",
    "http_request",
]

#: The header modes tried: no header, v1, v2.
MODES: tuple[int | None, ...] = (None, 1, 2)
_TLS_ALERT = 0x15  # TLS record type of an alert
_SHOWN = 40  # characters of an answer quoted in the line

Then = Literal["plain", "tls"]
Judgement = Literal["served", "refused", "error"]


class Verdict(enum.IntEnum):
    """What the port expects; the value is the exit code."""

    REQUIRED = 0
    GUESSES = 1
    UNREACHABLE = 2
    NOT_EXPECTED = 3
    UNDETERMINED = 4


@dataclass(frozen=True, slots=True)
class DiagnoseConfig:
    """The target, the plain bytes sent after each header (and instead of
    one), and the timeouts (``wait``: for an answer or a handshake)."""

    host: str
    port: int
    payload: bytes
    wait: float = 1.0
    connect_timeout: float = 3.0
    sni: str | None = None


@dataclass(frozen=True, slots=True)
class Attempt:
    """One connection: which header, what followed, what the port did."""

    mode: int | None
    then: Then
    judgement: Judgement
    detail: str
    response: bytes = b""

    @property
    def mode_name(self) -> str:
        return "no header" if self.mode is None else f"v{self.mode}"

    def to_json(self) -> dict[str, Any]:
        return {
            "header": "none" if self.mode is None else f"v{self.mode}",
            "then": self.then,
            "judgement": self.judgement,
            "detail": self.detail,
            "response_escaped": escape(self.response),
        }


def http_request(host: str) -> bytes:
    """The plain bytes sent by default: a GET for ``/``."""
    name = f"[{host}]" if ":" in host else host
    return f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode()


def _header(mode: int | None) -> Callable[[socket.socket], bytes]:
    if mode is None:
        return lambda _sock: b""
    plan = HeaderPlan(version=mode)
    return lambda sock: plan.wire(sock.getsockname(), sock.getpeername())


def _judge_plain(mode: int | None, obs: Observation, wait: float) -> Attempt:
    response = obs.response
    if obs.outcome == "error":
        return Attempt(mode, "plain", "error", obs.detail)
    if obs.outcome == "held_open":
        return Attempt(mode, "plain", "served", f"held open for {wait:g} s")
    if obs.outcome in ("closed", "reset"):
        return Attempt(mode, "plain", "refused", obs.outcome)
    if response[:1] == bytes([_TLS_ALERT]) and response[1:2] == b"\x03":
        return Attempt(mode, "plain", "refused", "TLS alert", response)
    if response[:5] == b"HTTP/" and response[9:12] == b"400":
        return Attempt(mode, "plain", "refused", "HTTP 400", response)
    first_line = response.split(b"\r\n", 1)[0]
    return Attempt(
        mode, "plain", "served", f"answered {escape(first_line, _SHOWN)}", response
    )


def _plain(config: DiagnoseConfig, mode: int | None) -> Attempt:
    obs = exchange(config, _header(mode), payload=config.payload)
    return _judge_plain(mode, obs, config.wait)


def _tls_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # whether TLS is spoken, not whose
    return context


def _server_name(config: DiagnoseConfig) -> str | None:
    if config.sni is not None:
        return config.sni
    try:
        ipaddress.ip_address(config.host)
    except ValueError:
        return config.host
    return None  # no SNI for an address (RFC 6066)


def _tls(config: DiagnoseConfig, mode: int | None) -> Attempt:
    try:
        sock = connect(config)
    except OSError as exc:
        return Attempt(
            mode, "tls", "error", f"connect to {config.host}:{config.port}: {exc}"
        )
    with sock:
        sock.settimeout(config.wait)
        try:
            sock.sendall(_header(mode)(sock))
        except OSError as exc:
            if exc.errno not in GONE:
                return Attempt(mode, "tls", "error", f"send: {exc}")
        try:
            version = TLSClient(sock, _tls_context(), _server_name(config)).handshake()
        except TimeoutError:
            return Attempt(
                mode, "tls", "refused", f"no handshake within {config.wait:g} s"
            )
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            return Attempt(mode, "tls", "refused", "closed during the handshake")
        except ssl.SSLError as exc:
            reason = exc.reason or type(exc).__name__
            return Attempt(mode, "tls", "refused", f"handshake failed: {reason}")
        except OSError as exc:
            if exc.errno in GONE:
                return Attempt(mode, "tls", "refused", "reset")
            return Attempt(mode, "tls", "error", f"handshake: {exc}")
        return Attempt(mode, "tls", "served", version)


@dataclass(frozen=True, slots=True)
class Diagnosis:
    config: DiagnoseConfig
    attempts: tuple[Attempt, ...]
    elapsed: float

    def _of(self, mode: int | None) -> tuple[Attempt, Attempt]:
        plain, tls = (a for a in self.attempts if a.mode == mode)
        return (plain, tls) if plain.then == "plain" else (tls, plain)

    def taken(self, mode: int | None) -> bool:
        return any(a.judgement == "served" for a in self._of(mode))

    @property
    def versions(self) -> list[int]:
        return [m for m in MODES if m is not None and self.taken(m)]

    @property
    def verdict(self) -> Verdict:
        if any(a.judgement == "error" for a in self.attempts):
            return Verdict.UNREACHABLE
        without, versions = self.taken(None), self.versions
        if versions:
            return Verdict.GUESSES if without else Verdict.REQUIRED
        return Verdict.NOT_EXPECTED if without else Verdict.UNDETERMINED

    def _then(self, mode: int | None) -> str:
        """What the port speaks after *mode*: ``plain data (answered ...)``,
        ``TLS (TLSv1.3)`` or both."""
        served = [a for a in self._of(mode) if a.judgement == "served"]
        return " or ".join(
            f"plain data ({a.detail})" if a.then == "plain" else f"TLS ({a.detail})"
            for a in served
        )

    def _refusal(self, mode: int | None, like: int | None) -> str:
        """How *mode* was refused, in the layer *like* was served in."""
        then = next(a.then for a in self._of(like) if a.judgement == "served")
        return next(a.detail for a in self._of(mode) if a.then == then)

    def line(self) -> str:
        """The diagnosis in one line, starting with the target."""
        c = self.config
        host = f"[{c.host}]" if ":" in c.host else c.host
        target = f"{host}:{c.port}"
        verdict = self.verdict
        versions = self.versions
        if verdict is Verdict.UNREACHABLE:
            error = next(a for a in self.attempts if a.judgement == "error")
            return f"{target}: cannot tell, a connection failed: {error.detail}"
        if verdict is Verdict.UNDETERMINED:
            refusals = "; ".join(
                f"{a.mode_name} then {a.then}: {a.detail}" for a in self.attempts
            )
            return (
                f"{target}: undetermined: refused every connection, with or "
                f"without a header ({refusals})"
            )
        if verdict is Verdict.NOT_EXPECTED:
            refused = ", ".join(f"v{v}: {self._refusal(v, None)}" for v in (1, 2))
            return (
                f"{target}: expects no PROXY header: serves {self._then(None)} "
                f"without one, and refuses one ({refused}); whoever sends PROXY "
                f"headers to this port must stop, or the port must enable PROXY"
            )
        names = " and ".join(f"v{v}" for v in versions)
        if len(versions) == 1:
            other = 2 if versions[0] == 1 else 1
            names += f" only (v{other} refused: {self._refusal(other, versions[0])})"
        if verdict is Verdict.REQUIRED:
            return (
                f"{target}: requires a PROXY header: {names}, then "
                f"{self._then(versions[0])}; without one it refuses the "
                f"connection ({self._refusal(None, versions[0])})"
            )
        return (
            f"{target}: GUESSES: serves with or without a PROXY header (without: "
            f"{self._then(None)}; with {names}: {self._then(versions[0])}); the "
            f"spec forbids guessing on a port untrusted clients can reach (or "
            f"it relays bytes without reading them)"
        )

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "target": f"{c.host}:{c.port}",
            "verdict": self.verdict.name.lower(),
            "exit_code": int(self.verdict),
            "line": self.line(),
            "versions": self.versions,
            "payload_hex": c.payload.hex(),
            "wait": c.wait,
            "elapsed": round(self.elapsed, 3),
            "attempts": [a.to_json() for a in self.attempts],
        }


def diagnose(config: DiagnoseConfig) -> Diagnosis:
    """Run the six attempts at once (each bounded by its timeouts)."""
    start = time.monotonic()
    jobs = [(attempt, mode) for mode in MODES for attempt in (_plain, _tls)]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        attempts = tuple(pool.map(lambda job: job[0](config, job[1]), jobs))
    return Diagnosis(config, attempts, time.monotonic() - start)
