"""The engine of ``proxyproto probe``: fuzz someone else's PROXY receiver.

How it works
------------
1. **Calibrate.** Send one clearly valid header per version (then the payload)
   and a plain ``GET / HTTP/1.1`` without any header. The target must accept
   the former and refuse the latter, otherwise acceptance cannot be told from
   refusal and the probe stops (exit 2).
2. **Battery.** Built deterministically from ``--seed`` (see ``build_battery``):
   valid headers of every kind, which the target must accept, and invalid
   ones labelled with what is wrong (``proxyproto.strategies.InvalidHeader``),
   which it must refuse.
3. **Send.** One TCP connection per probe: the bytes, then the payload (for
   headers cut short: no payload, but a FIN). Then watch for ``--wait``
   seconds: bytes from the target mean *accepted (answered)*; silence with the
   connection still open means *accepted (held open)*; a close or reset
   without a byte means *refused*. A header cut short that is merely held
   open is *inconclusive* (the target may just be slow to notice the FIN).
4. **Timing.** A valid header trickled one byte every ``--trickle-ms`` ms
   (must be accepted unless slower than the target's timeout), and a
   connection that sends nothing (the target should close it after its header
   timeout; the time it takes is reported, and answering before any header
   arrived is a finding: the spec forbids processing the connection first).

The I/O is plain blocking sockets in a thread pool, with a timeout on every
connect, send and receive: the probe cannot hang, and ``--max-time`` bounds
the run (probes not started by then are reported as skipped).

The battery
-----------
Each category is drawn by running Hypothesis on a strategy from
``proxyproto.strategies`` with ``@seed(...)`` (derived from ``--seed`` and the
category name), the generate phase only, no example database and
``derandomize=False``: the same seed gives the same battery, byte for byte,
on any machine with the same proxyproto and Hypothesis versions. The
categories (``--examples N`` draws each):

- ``valid v1``, ``valid v2``: ``encoded_headers(version)`` (every address
  family and transport, LOCAL with and without dummy addresses, CRC32C, NOOP
  padding, mixed TLVs);
- ``valid v2 tlv:KIND`` for every TLV kind of ``strategies.tlv()`` (ALPN,
  AUTHORITY, SSL with sub-TLVs and client certificates, AWS/Azure/GCP, the
  custom, experimental, future and unassigned ranges...): a PROXY header
  carrying 1-3 TLVs of that kind, with and without a CRC32C;
- ``invalid KIND`` for every mutation in ``strategies.INVALID_KINDS``;
- a fixed set, whatever the seed: spec edge cases (the longest v1 lines,
  ``PROXY UNKNOWN`` with addresses, an AWS NLB header and health check, a
  4096-byte header) and CVE reproducers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from hypothesis import (
    HealthCheck,
    Phase,
    Verbosity,
    given,
    seed,
    settings,
    strategies as st,
)

from proxyproto import (
    TLV,
    V2_SIGNATURE,
    Command,
    Family,
    InetAddress,
    ProxyHeader,
    RemoteProtocolError,
    TLVType,
    UnixAddress,
    __version__,
    encode_v1,
    encode_v2,
    parse,
)
from proxyproto._exchange import Observation, escape, exchange
from proxyproto.strategies import (
    INVALID_KINDS,
    MAX_ENCODED_V2_LENGTH,
    InvalidHeader,
    encoded_headers,
    inet_addresses,
    invalid_headers,
    tlvs,
)

__all__ = [
    "HTTP_PAYLOAD",
    "KIND_RULES",
    "Observation",
    "Probe",
    "ProbeConfig",
    "ProbeReport",
    "build_battery",
    "exchange",
    "run",
]

HTTP_PAYLOAD = b"GET / HTTP/1.1\r\nHost: probe\r\n\r\n"
#: What the calibration sends instead of a header.
GARBAGE = b"GET / HTTP/1.1\r\nHost: probe\r\n\r\n"
#: The TLV kinds ``proxyproto.strategies.tlv(kinds=...)`` documents.
TLV_KINDS = (
    "alpn",
    "authority",
    "noop",
    "unique_id",
    "ssl",
    "netns",
    "aws",
    "azure",
    "gcp",
    "custom",
    "experimental",
    "future",
    "unassigned",
)
#: The spec asks receivers to wait "at least 3 seconds" for a header.
SPEC_MIN_TIMEOUT = 3.0

Expect = Literal["accept", "refuse"]
Verdict = Literal["accepted", "refused", "inconclusive", "error", "skipped"]

# kind -> (severity, the rule the target breaks by accepting it).
# "violation": the spec says the receiver must refuse this. "strict": the
# spec leaves room (a receiver that does not use the field may skip it, or
# the limit is a convention): reported, but say so in a bug report.
KIND_RULES: dict[str, tuple[str, str]] = {
    "bad_family": (
        "violation",
        "v2: the family byte must be one of the seven defined values (0x00, 0x11, "
        "0x12, 0x21, 0x22, 0x31, 0x32); other values must be rejected",
    ),
    "bad_version": (
        "violation",
        "v2: the version nibble must be 0x2; the receiver must only accept 2",
    ),
    "bad_command": (
        "violation",
        "v2: commands other than LOCAL (0x0) and PROXY (0x1) are unassigned; the "
        "receiver must drop the connection",
    ),
    "short_address_block": (
        "violation",
        "v2: the length must cover the family's address block (12/36/216 bytes); "
        "cf. CVE-2019-14243",
    ),
    "tlv_overrun": (
        "strict",
        "v2: every TLV must end inside the header (16 + len); cf. HAProxy 488ee7fb6",
    ),
    "truncated_tlv_header": (
        "strict",
        "v2: the TLVs must end exactly at 16 + len (a TLV header is 3 bytes; "
        "a receiver that never reads the TLVs does not see this)",
    ),
    "crc32c_mismatch": (
        "strict",
        "v2 CRC32C: on a mismatch the receiver MUST treat the connection as "
        "invalid (applies to receivers that support the CRC32C TLV)",
    ),
    "unique_id_too_long": (
        "strict",
        "UNIQUE_ID TLV: at most 128 bytes (a receiver that ignores the TLV may "
        "skip it)",
    ),
    "authority_not_utf8": (
        "strict",
        "AUTHORITY TLV: a UTF-8 host name (a receiver that ignores the TLV may "
        "skip it)",
    ),
    "unspec_proxy": (
        "strict",
        "v2 PROXY with UNSPEC family: the receiver may accept it (using the real "
        "endpoints) or reject it; strict receivers reject",
    ),
    "v2_too_long": (
        "strict",
        "v2 length over 4096: no spec limit below 65535, but receivers commonly "
        "cap it at 4 KiB (go-proxyproto, proxy-protocol-rs) and should refuse "
        "at once instead of waiting for 64 KiB",
    ),
    "v1_leading_zero": (
        "violation",
        "v1: IPv4 octets and ports are decimal numbers without leading zeros",
    ),
    "v1_sign": ("violation", "v1: ports are decimal digits only (no sign)"),
    "v1_double_space": (
        "violation",
        "v1: fields are separated by exactly one space",
    ),
    "v1_lowercase": (
        "violation",
        "v1: the grammar is case-sensitive ('PROXY', 'TCP4', 'TCP6', 'UNKNOWN')",
    ),
    "v1_zone_id": (
        "violation",
        "v1: TCP6 addresses are plain IPv6 addresses (no %zone id)",
    ),
    "v1_ipv4_in_tcp6": (
        "violation",
        "v1: the advertised protocol family dictates the address format (no IPv4 "
        "in TCP6; nginx emits this, hence lenient options elsewhere)",
    ),
    "v1_ipv6_in_tcp4": (
        "violation",
        "v1: the advertised protocol family dictates the address format",
    ),
    "v1_out_of_range": (
        "violation",
        "v1: IPv4 octets are 0-255 and ports 0-65535",
    ),
    "v1_field_count": (
        "violation",
        "v1: exactly 'PROXY' SP PROTO SP SRC SP DST SP SPORT SP DPORT CRLF",
    ),
    "v1_bad_protocol": (
        "violation",
        "v1: the protocol is TCP4, TCP6 or UNKNOWN",
    ),
    "v1_bare_lf": (
        "violation",
        "v1: the line ends with CRLF; a lone LF is not a terminator",
    ),
    "v1_lone_cr": (
        "violation",
        "v1: the line ends with CRLF; a lone CR is not a terminator",
    ),
    "v1_no_crlf": (
        "violation",
        "v1: no CRLF within the first 107 bytes means the header is invalid",
    ),
    "v1_too_long": (
        "violation",
        "v1: a header is at most 107 bytes including the CRLF",
    ),
    "truncated": (
        "violation",
        "a partial header must never be accepted (the receiver must not process "
        "the connection before a complete and valid header)",
    ),
}
_VALID_RULE = (
    "a receiver must accept every valid header of the versions it supports "
    "(unknown TLV types are skipped; LOCAL honours len; UNKNOWN may carry "
    "anything before the CRLF)"
)


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Probe:
    """One thing to send.

    Attributes:
        category: ``"valid v2 tlv:ssl"``, ``"invalid bad_family"``, ...
        kind: the stable slug the report groups by (an ``INVALID_KINDS``
            label for invalid headers).
        expect: what a strict receiver does with it.
        data: the header bytes (the payload is added when sending).
        why: for invalid headers what is wrong; for valid ones a summary.
        incomplete: a valid header cut short: sent with a FIN, no payload.
    """

    category: str
    kind: str
    expect: Expect
    data: bytes
    why: str
    incomplete: bool = False


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    host: str
    port: int
    seed: int | None = None
    examples: int = 5
    versions: frozenset[int] = frozenset({1, 2})
    payload: bytes = b""
    wait: float = 1.0
    max_time: float = 120.0
    concurrency: int = 8
    connect_timeout: float = 3.0
    trickle_ms: float = 50.0
    idle_max: float = 15.0
    timing: bool = True


@dataclass(frozen=True, slots=True)
class Result:
    probe: Probe
    observation: Observation

    @property
    def verdict(self) -> Verdict:
        outcome = self.observation.outcome
        if outcome == "error":
            return "error"
        if outcome == "skipped":
            return "skipped"
        if outcome == "answered":
            return "accepted"
        if outcome == "held_open":
            return "inconclusive" if self.probe.incomplete else "accepted"
        return "refused"

    @property
    def wrong(self) -> bool:
        verdict = self.verdict
        if self.probe.expect == "accept":
            return verdict == "refused"
        return verdict == "accepted"


# ---------------------------------------------------------------------------
# Building the battery
# ---------------------------------------------------------------------------

T = TypeVar("T")


def _category_seed(base: int, name: str) -> int:
    digest = hashlib.sha256(f"{base}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def draw_examples(strategy: st.SearchStrategy[T], seed_value: int, n: int) -> list[T]:
    """*n* examples of *strategy*, the same ones for the same seed.

    ``strategy.example()`` cannot be seeded; a ``@given`` run with ``@seed``,
    the generate phase only and no database can.
    """
    drawn: list[T] = []

    @seed(seed_value)
    @settings(
        max_examples=n,
        database=None,
        derandomize=False,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )
    @given(strategy)
    def collect(example: T) -> None:
        if len(drawn) < n:
            drawn.append(example)

    collect()
    return drawn


@st.composite
def _tlv_kind_headers(draw: st.DrawFn, kind: str) -> bytes:
    """A valid v2 PROXY header carrying 1-3 TLVs of one kind.

    (Not in ``proxyproto.strategies``: ``encoded_headers`` draws TLV kinds at
    random, this makes sure each kind is exercised.)
    """
    tlv_tuple = draw(tlvs(min_size=1, max_size=3, kinds=[kind]))
    header = ProxyHeader.from_addresses(
        draw(inet_addresses), draw(inet_addresses), tlvs=tlv_tuple
    )
    with_crc = draw(st.booleans())
    while len(encode_v2(header, crc32c=with_crc)) > MAX_ENCODED_V2_LENGTH:
        header = dataclasses.replace(header, tlvs=header.tlvs[:-1])
    return encode_v2(header, crc32c=with_crc)


def _addresses(header: ProxyHeader) -> str:
    def one(address: InetAddress | UnixAddress | None) -> str:
        if isinstance(address, InetAddress):
            return str(address)
        if isinstance(address, UnixAddress):
            return "unix:" + escape(address.path, 24)
        return "-"

    if header.source is None:
        return ""
    return f" {one(header.source)} -> {one(header.destination)}"


def summarize(data: bytes) -> str:
    """A one-line description of a valid header, e.g. for the report."""
    try:
        header, consumed = parse(data, max_v2_length=0xFFFF)
    except RemoteProtocolError as exc:
        return f"(does not parse: {exc})"
    if header.version == 1:
        proto = {Family.INET: "TCP4", Family.INET6: "TCP6"}.get(
            header.family, "UNKNOWN"
        )
        return f"v1 {proto}{_addresses(header)} ({consumed} bytes)"
    if header.command is Command.LOCAL:
        text = f"v2 LOCAL (family byte 0x{data[13]:02x})"
    else:
        text = f"v2 PROXY {header.family.name}/{header.transport.name}"
        text += _addresses(header)
    if header.tlvs:
        names = []
        for tlv in header.tlvs:
            try:
                names.append(TLVType(tlv.type).name)
            except ValueError:
                names.append(f"0x{tlv.type:02x}")
        text += ", TLVs " + " ".join(names)
    return f"{text} ({consumed} bytes)"


def _fixed_valid(versions: frozenset[int]) -> list[Probe]:
    ffff = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
    v1 = [
        ("v1 TCP4", b"PROXY TCP4 192.0.2.1 192.0.2.2 56324 443\r\n"),
        ("v1 TCP4 port 0", b"PROXY TCP4 0.0.0.0 255.255.255.255 0 65535\r\n"),
        ("v1 UNKNOWN", b"PROXY UNKNOWN\r\n"),
        ("v1 TCP6 longest", f"PROXY TCP6 {ffff} {ffff} 65535 65535\r\n".encode()),
        (
            "v1 UNKNOWN with addresses (107 bytes: the longest header)",
            f"PROXY UNKNOWN {ffff} {ffff} 65535 65535\r\n".encode(),
        ),
        ("v1 TCP6 compressed", b"PROXY TCP6 ::1 2001:db8::1 1 65535\r\n"),
    ]
    inet = ProxyHeader.from_addresses(("192.0.2.1", 56324), ("192.0.2.2", 443))
    nlb = dataclasses.replace(
        inet,
        tlvs=(
            TLV(TLVType.CRC32C, bytes(4)),
            TLV.aws_vpce_id("vpce-08d2bf15fac5001c9"),
            TLV.noop(0x24),
        ),
    )
    health = V2_SIGNATURE + b"\x20\x11\x00\x0c" + bytes(12)
    v2 = [
        ("v2 PROXY TCP4", encode_v2(inet)),
        ("v2 LOCAL", encode_v2(ProxyHeader.local())),
        ("v2 AWS NLB style (CRC32C, AWS VPCE id, NOOP)", encode_v2(nlb)),
        ("v2 LOCAL with dummy INET addresses (AWS NLB health check)", health),
        ("v2 padded to 1024 bytes", encode_v2(inet, pad_to=1024)),
        ("v2 padded to 4096 bytes", encode_v2(inet, pad_to=4096)),
        (
            "v2 PROXY TCP6 with ALPN and AUTHORITY",
            encode_v2(
                ProxyHeader.from_addresses(
                    ("2001:db8::1", 1),
                    ("2001:db8::2", 443),
                    tlvs=(TLV.alpn(b"h2"), TLV.authority("example.com")),
                ),
                crc32c=True,
            ),
        ),
    ]
    out = []
    if 1 in versions:
        out += [Probe("valid fixed", "fixed v1", "accept", d, n) for n, d in v1]
    if 2 in versions:
        out += [Probe("valid fixed", "fixed v2", "accept", d, n) for n, d in v2]
    return out


def _fixed_invalid(versions: frozenset[int]) -> list[Probe]:
    if 2 not in versions:
        return []
    return [
        Probe(
            "invalid fixed",
            "short_address_block",
            "refuse",
            V2_SIGNATURE + b"\x21\x12\x00\x00",
            "v2 PROXY UDP4 with length 0, no address block (CVE-2019-14243)",
        ),
        Probe(
            "invalid fixed",
            "bad_family",
            "refuse",
            V2_SIGNATURE + b"\x21\x13\x00\x0c" + bytes(12),
            "v2 family byte 0x13 (INET + transport 3) is not one of the seven "
            "(go-proxyproto 5914db8: nil address panic)",
        ),
    ]


def _invalid_version(bad: InvalidHeader) -> int:
    return 2 if bad.data[:1] == b"\r" else 1


def build_battery(
    seed_value: int, examples: int, versions: Iterable[int]
) -> list[Probe]:
    """The probes for *seed_value*: same arguments, same list (see the module
    docstring for the categories).
    """
    wanted = frozenset(versions)
    battery = _fixed_valid(wanted)
    for version in sorted(wanted):
        name = f"valid v{version}"
        for _header, wire in draw_examples(
            encoded_headers(version), _category_seed(seed_value, name), examples
        ):
            battery.append(Probe(name, f"v{version}", "accept", wire, summarize(wire)))
    if 2 in wanted:
        for kind in TLV_KINDS:
            name = f"valid v2 tlv:{kind}"
            for wire in draw_examples(
                _tlv_kind_headers(kind), _category_seed(seed_value, name), examples
            ):
                battery.append(
                    Probe(name, f"tlv:{kind}", "accept", wire, summarize(wire))
                )
    battery += _fixed_invalid(wanted)
    battery = _dedupe(battery)
    for kind in INVALID_KINDS:
        strategy = invalid_headers(kinds=[kind])
        if kind != "truncated":
            version = 1 if kind.startswith("v1_") else 2
            if version not in wanted:
                continue
        elif wanted != {1, 2}:
            strategy = strategy.filter(lambda bad: _invalid_version(bad) in wanted)
        name = f"invalid {kind}"
        for bad in draw_examples(strategy, _category_seed(seed_value, name), examples):
            battery.append(
                Probe(name, bad.kind, "refuse", bad.data, bad.why, bad.incomplete)
            )
    return _dedupe(battery)


def _dedupe(battery: list[Probe]) -> list[Probe]:
    """Drop repeated byte strings (Hypothesis may draw the same one twice)."""
    seen: set[tuple[bytes, bool]] = set()
    out = []
    for probe in battery:
        key = (probe.data, probe.incomplete)
        if key not in seen:
            seen.add(key)
            out.append(probe)
    return out


def header_context(data: bytes) -> str:
    """What the receiver sees first: version, v2 command and family byte."""
    if data[:12] == V2_SIGNATURE and len(data) >= 14:
        command = data[12] & 0x0F
        name = {0: "LOCAL", 1: "PROXY"}.get(command, f"command 0x{command:x}")
        return f"v2 {name}, family byte 0x{data[13]:02x}"
    if data[:1] == b"\r":
        return "v2 (fixed part incomplete)"
    return "v1"


# On a LOCAL header the spec tells receivers to ignore the address block and
# its family; not validating what follows is lenient rather than wrong.
_LENIENT_ON_LOCAL = frozenset(
    {
        "bad_family",
        "tlv_overrun",
        "truncated_tlv_header",
        "crc32c_mismatch",
        "unique_id_too_long",
        "authority_not_utf8",
    }
)


def rule_for(probe: Probe) -> tuple[str, str]:
    """``(severity, rule)`` for an invalid probe the target accepted."""
    severity, rule = KIND_RULES.get(probe.kind, ("violation", "(unlabelled)"))
    data = probe.data
    if (
        probe.kind in _LENIENT_ON_LOCAL
        and data[:12] == V2_SIGNATURE
        and len(data) > 12
        and data[12] == 0x20
    ):
        return (
            "strict",
            rule + "; this header is LOCAL, whose address block and family "
            "the spec tells receivers to ignore (strict receivers still "
            "validate it)",
        )
    return severity, rule


# ---------------------------------------------------------------------------
# Talking to the target
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class TimingResult:
    name: str
    description: str
    observation: Observation | None
    finding: str | None = None
    note: str | None = None
    observed_timeout: float | None = None

    def to_json(self, wait: float) -> dict[str, Any]:
        obs = self.observation
        return {
            "name": self.name,
            "description": self.description,
            "outcome": None if obs is None else obs.outcome,
            "elapsed": None if obs is None else round(obs.elapsed, 3),
            "evidence": None if obs is None else obs.describe(wait),
            "response_escaped": None if obs is None else escape(obs.response),
            "finding": self.finding,
            "note": self.note,
            "observed_timeout": self.observed_timeout,
        }


@dataclass(slots=True)
class ProbeReport:
    config: ProbeConfig
    seed: int
    calibration: list[tuple[str, Probe, Observation]] = field(default_factory=list)
    calibration_ok: bool = False
    calibration_message: str = ""
    results: list[Result] = field(default_factory=list)
    timing: list[TimingResult] = field(default_factory=list)
    elapsed: float = 0.0

    # -- derived ----------------------------------------------------------

    @property
    def wrongly_accepted(self) -> list[Result]:
        return [r for r in self.results if r.probe.expect == "refuse" and r.wrong]

    @property
    def wrongly_refused(self) -> list[Result]:
        return [r for r in self.results if r.probe.expect == "accept" and r.wrong]

    def _with_verdict(self, verdict: Verdict) -> list[Result]:
        return [r for r in self.results if r.verdict == verdict]

    @property
    def findings(self) -> int:
        timing = sum(1 for t in self.timing if t.finding)
        return len(self.wrongly_accepted) + len(self.wrongly_refused) + timing

    @property
    def complete(self) -> bool:
        return self.calibration_ok and not self._with_verdict("skipped")

    @property
    def exit_code(self) -> int:
        if not self.calibration_ok:
            return 2
        if self.findings:
            return 1
        if self._with_verdict("error"):
            return 2
        return 0

    def replay_command(self) -> str:
        c = self.config
        host = f"[{c.host}]" if ":" in c.host else c.host
        parts = [
            f"proxyproto probe {host}:{c.port}",
            f"--seed {self.seed}",
            f"--examples {c.examples}",
            f"--versions {','.join(str(v) for v in sorted(c.versions))}",
        ]
        if c.payload == HTTP_PAYLOAD:
            parts.append("--payload-http")
        elif c.payload:
            parts.append(f"--payload {c.payload.hex()}")
        parts.append(f"--wait {c.wait:g}")
        return " ".join(parts)

    def _counts(self) -> dict[str, int]:
        valid = [r for r in self.results if r.probe.expect == "accept"]
        invalid = [r for r in self.results if r.probe.expect == "refuse"]
        return {
            "probes": len(self.results),
            "valid": len(valid),
            "valid_accepted": sum(r.verdict == "accepted" for r in valid),
            "wrongly_refused": len(self.wrongly_refused),
            "invalid": len(invalid),
            "invalid_refused": sum(r.verdict == "refused" for r in invalid),
            "wrongly_accepted": len(self.wrongly_accepted),
            "wrongly_accepted_violations": sum(
                rule_for(r.probe)[0] == "violation" for r in self.wrongly_accepted
            ),
            "inconclusive": len(self._with_verdict("inconclusive")),
            "errors": len(self._with_verdict("error")),
            "skipped": len(self._with_verdict("skipped")),
            "timing_findings": sum(1 for t in self.timing if t.finding),
            "findings": self.findings,
        }

    def _by_kind(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = {}
        for r in self.results:
            row = table.setdefault(
                r.probe.kind,
                {"sent": 0, "accepted": 0, "refused": 0, "other": 0, "wrong": 0},
            )
            row["sent"] += r.verdict != "skipped"
            verdict = r.verdict
            if verdict in ("accepted", "refused"):
                row[verdict] += 1
            elif verdict != "skipped":
                row["other"] += 1
            row["wrong"] += r.wrong
        return table

    def _result_json(self, r: Result) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "category": r.probe.category,
            "kind": r.probe.kind,
            "expect": r.probe.expect,
            "verdict": r.verdict,
            "why" if r.probe.expect == "refuse" else "header": r.probe.why,
            "incomplete": r.probe.incomplete,
            "length": len(r.probe.data),
            "hex": r.probe.data.hex(),
            "outcome": r.observation.outcome,
            "evidence": r.observation.describe(self.config.wait),
            "response_escaped": escape(r.observation.response),
            "elapsed": round(r.observation.elapsed, 3),
        }
        entry["context"] = header_context(r.probe.data)
        if r.probe.expect == "refuse":
            severity, rule = rule_for(r.probe)
            entry["severity"] = severity
            entry["rule"] = rule
        else:
            entry["rule"] = _VALID_RULE
        return entry

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "tool": f"proxyproto {__version__}",
            "target": f"{c.host}:{c.port}",
            "seed": self.seed,
            "versions": sorted(c.versions),
            "examples_per_category": c.examples,
            "payload_hex": c.payload.hex(),
            "payload_escaped": escape(c.payload),
            "wait": c.wait,
            "replay": self.replay_command(),
            "elapsed": round(self.elapsed, 3),
            "complete": self.complete,
            "calibration": {
                "ok": self.calibration_ok,
                "message": self.calibration_message,
                "probes": [
                    {
                        "name": name,
                        "expect": probe.expect,
                        "hex": probe.data.hex(),
                        "outcome": obs.outcome,
                        "evidence": obs.describe(c.wait),
                    }
                    for name, probe, obs in self.calibration
                ],
            },
            "counts": self._counts(),
            "exit_code": self.exit_code,
            "wrongly_accepted": [
                self._result_json(r) for r in _sorted(self.wrongly_accepted)
            ],
            "wrongly_refused": [
                self._result_json(r) for r in _sorted(self.wrongly_refused)
            ],
            "inconclusive": [
                self._result_json(r) for r in self._with_verdict("inconclusive")
            ],
            "errors": [self._result_json(r) for r in self._with_verdict("error")],
            "timing": [t.to_json(c.wait) for t in self.timing],
            "by_kind": self._by_kind(),
        }

    # -- text -------------------------------------------------------------

    def render(self, examples_per_kind: int = 3) -> str:
        c = self.config
        lines = [
            "proxyproto probe report",
            f"  target        {c.host}:{c.port}",
            f"  tool          proxyproto {__version__}",
            f"  seed          {self.seed}",
            f"  versions      {', '.join(f'v{v}' for v in sorted(c.versions))}",
            f"  payload       {escape(c.payload, 64) if c.payload else '(none)'}",
            f"  wait          {c.wait:g} s",
            f"  elapsed       {self.elapsed:.1f} s",
            f"  replay        {self.replay_command()}",
            "",
            "calibration: " + ("ok" if self.calibration_ok else "FAILED"),
        ]
        for name, _probe, obs in self.calibration:
            lines.append(f"  {name}: {obs.describe(c.wait)}")
        if not self.calibration_ok:
            lines += ["", self.calibration_message]
            return "\n".join(lines)
        counts = self._counts()
        lines += [
            "",
            f"summary: {counts['probes']} probes; {counts['valid']} valid headers "
            f"({counts['valid_accepted']} accepted, {counts['wrongly_refused']} "
            f"wrongly refused); {counts['invalid']} invalid headers "
            f"({counts['invalid_refused']} refused, {counts['wrongly_accepted']} "
            f"wrongly accepted of which {counts['wrongly_accepted_violations']} "
            f"break a spec rule and the rest are strictness, "
            f"{counts['inconclusive']} inconclusive); "
            f"{counts['errors']} errors",
        ]
        if counts["skipped"]:
            lines.append(
                f"  INCOMPLETE RUN: {counts['skipped']} probes not sent "
                f"(--max-time {c.max_time:g} s reached)"
            )
        lines.append(f"findings: {self.findings}")
        lines += self._render_group(
            "WRONGLY ACCEPTED (invalid headers the target accepted)",
            self.wrongly_accepted,
            examples_per_kind,
        )
        lines += self._render_group(
            "WRONGLY REFUSED (valid headers the target refused)",
            self.wrongly_refused,
            examples_per_kind,
        )
        lines += self._render_group(
            "INCONCLUSIVE (headers cut short, then a FIN: the target neither "
            "answered nor closed)",
            self._with_verdict("inconclusive"),
            examples_per_kind,
        )
        lines += self._render_group(
            "ERRORS", self._with_verdict("error"), examples_per_kind
        )
        if self.timing:
            lines += ["", "TIMING"]
            for t in self.timing:
                evidence = (
                    "not run"
                    if t.observation is None
                    else t.observation.describe(c.wait)
                )
                lines.append(f"  {t.description}: {evidence}")
                if t.finding:
                    lines.append(f"    FINDING: {t.finding}")
                if t.note:
                    lines.append(f"    note: {t.note}")
        lines += ["", "PER KIND (sent / accepted / refused / other)"]
        for kind, row in sorted(self._by_kind().items()):
            mark = "  <-- wrong" if row["wrong"] else ""
            lines.append(
                f"  {kind:<28}{row['sent']:>4} {row['accepted']:>4} "
                f"{row['refused']:>4} {row['other']:>4}{mark}"
            )
        return "\n".join(lines)

    def _render_group(
        self, title: str, results: list[Result], per_kind: int
    ) -> list[str]:
        if not results:
            return []
        lines = ["", title]
        groups: dict[str, list[Result]] = {}
        for r in _sorted(results):
            groups.setdefault(r.probe.kind, []).append(r)
        by_kind = self._by_kind()
        for kind, group in groups.items():
            total = by_kind[kind]["sent"]
            lines.append(f"  [{kind}] {len(group)} of {total}")
            if group[0].probe.expect == "refuse":
                severity, rule = KIND_RULES.get(kind, ("violation", ""))
                if rule:
                    lines.append(f"    rule ({severity}): {rule}")
            for r in group[:per_kind]:
                label = "why" if r.probe.expect == "refuse" else "header"
                lines.append(f"    - {label}: {r.probe.why}")
                context = header_context(r.probe.data)
                if r.probe.expect == "refuse" and r.wrong:
                    item_severity = rule_for(r.probe)[0]
                    if item_severity != KIND_RULES.get(kind, ("", ""))[0]:
                        context += f" ({item_severity}: LOCAL header)"
                if context != "v1":
                    lines.append(f"      context: {context}")
                lines.append(
                    f"      evidence: {r.observation.describe(self.config.wait)}"
                )
                lines.append(
                    f"      sent ({len(r.probe.data)} bytes): {_hex(r.probe.data)}"
                )
            if len(group) > per_kind:
                lines.append(f"    (+{len(group) - per_kind} more; see --json)")
        return lines


def _sorted(results: Sequence[Result]) -> list[Result]:
    """Grouped by kind, shortest (the best reproducer) first."""
    return sorted(
        results, key=lambda r: (r.probe.kind, len(r.probe.data), r.probe.data)
    )


def _hex(data: bytes, limit: int = 256) -> str:
    if len(data) <= limit:
        return data.hex()
    return f"{data[:limit].hex()}... (truncated; full hex in --json)"


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


def _calibration_probes(versions: frozenset[int]) -> list[tuple[str, Probe]]:
    probes = []
    if 1 in versions:
        data = encode_v1(
            ProxyHeader.from_addresses(
                ("192.0.2.1", 56324), ("192.0.2.2", 443), version=1
            )
        )
        probes.append(
            ("valid v1 header", Probe("calibration", "v1", "accept", data, ""))
        )
    if 2 in versions:
        data = encode_v2(
            ProxyHeader.from_addresses(("192.0.2.1", 56324), ("192.0.2.2", 443))
        )
        probes.append(
            ("valid v2 header", Probe("calibration", "v2", "accept", data, ""))
        )
    probes.append(
        (
            "'GET / HTTP/1.1' without a PROXY header",
            Probe("calibration", "garbage", "refuse", GARBAGE, "no PROXY header"),
        )
    )
    return probes


def _calibrate(config: ProbeConfig, report: ProbeReport) -> None:
    for name, probe in _calibration_probes(config.versions):
        payload = config.payload if probe.expect == "accept" else b""
        obs = exchange(config, probe.data, payload=payload)
        report.calibration.append((name, probe, obs))
    errors = [obs for _, _, obs in report.calibration if obs.outcome == "error"]
    if errors:
        report.calibration_message = (
            f"cannot talk to the target: {errors[0].detail}. Is it listening?"
        )
        return
    refused_valid = [
        name
        for name, probe, obs in report.calibration
        if probe.expect == "accept" and obs.outcome in ("closed", "reset")
    ]
    garbage = report.calibration[-1][2]
    if refused_valid:
        report.calibration_message = (
            f"the target refused a clearly valid header ({', '.join(refused_valid)}): "
            f"acceptance cannot be told from refusal. Is PROXY protocol enabled "
            f"on this port, for these versions (--versions)? Does it need a "
            f"payload to answer (--payload-http, --payload)?"
        )
        return
    if garbage.outcome in ("answered", "held_open"):
        what = "answered" if garbage.outcome == "answered" else "kept open"
        report.calibration_message = (
            f"the target {what} a connection that sent no PROXY header "
            f"('GET / HTTP/1.1'): acceptance cannot be told from refusal. Either "
            f"it does not require a PROXY header on this port (guessing whether "
            f"a header is present is forbidden by the spec on ports untrusted "
            f"clients can reach), or it waits silently for more bytes (try a "
            f"shorter --wait only if it answers valid headers quickly)."
        )
        return
    report.calibration_ok = True
    report.calibration_message = "the target tells valid headers from garbage"


def _trickle_probe(config: ProbeConfig, deadline: float) -> TimingResult:
    name = "trickle"
    if 2 in config.versions:
        data = encode_v2(
            ProxyHeader.from_addresses(("192.0.2.1", 56324), ("192.0.2.2", 443))
        )
    else:
        data = b"PROXY TCP4 192.0.2.1 192.0.2.2 56324 443\r\n"
    interval = config.trickle_ms / 1000
    duration = interval * (len(data) - 1)
    description = (
        f"valid header sent one byte every {config.trickle_ms:g} ms "
        f"({len(data)} bytes over {duration:.1f} s)"
    )
    if time.monotonic() + duration + config.wait > deadline:
        return TimingResult(name, description, None, note="skipped: --max-time")
    obs = exchange(config, data, payload=config.payload, trickle=interval)
    result = TimingResult(name, description, obs)
    if obs.outcome in ("closed", "reset"):
        result.finding = (
            "a valid header arriving in small pieces was refused; the spec "
            "recommends tolerating partial headers (a header may legitimately "
            "span several segments, e.g. large v2 headers)"
        )
    return result


def _idle_probe(config: ProbeConfig, deadline: float) -> TimingResult:
    limit = min(config.idle_max, max(0.0, deadline - time.monotonic()))
    description = f"connection that sends nothing (watched for up to {limit:.0f} s)"
    if limit < 1:
        return TimingResult("no_header", description, None, note="skipped: --max-time")
    obs = exchange(config, b"", wait=limit)
    result = TimingResult("no_header", description, obs)
    if obs.outcome in ("closed", "reset"):
        result.observed_timeout = round(obs.elapsed, 2)
        result.note = f"observed header timeout: about {obs.elapsed:.1f} s"
        if obs.elapsed < SPEC_MIN_TIMEOUT:
            result.note += (
                f" (the spec suggests at least {SPEC_MIN_TIMEOUT:g} s, to cover a "
                f"TCP retransmit)"
            )
    elif obs.outcome == "held_open":
        result.note = (
            f"no header timeout observed within {limit:.0f} s (a receiver without "
            f"one can be exhausted by idle connections: CVE-2021-23409); raise "
            f"--idle-max to measure it"
        )
    elif obs.outcome == "answered":
        result.finding = (
            f"the target sent {escape(obs.response, 64)} before any PROXY header: "
            f"a receiver must not start processing the connection before a "
            f"complete and valid header"
        )
    return result


def _make_seed() -> int:
    return int.from_bytes(
        hashlib.sha256(str(time.time_ns()).encode()).digest()[:4], "big"
    )


def run(
    config: ProbeConfig,
    *,
    battery: list[Probe] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ProbeReport:
    """Calibrate, send the battery and the timing probes; never raises for
    anything the target does.
    """
    start = time.monotonic()
    deadline = start + config.max_time
    seed_value = _make_seed() if config.seed is None else config.seed
    report = ProbeReport(config=config, seed=seed_value)
    _calibrate(config, report)
    if not report.calibration_ok:
        report.elapsed = time.monotonic() - start
        return report
    if battery is None:
        battery = build_battery(seed_value, config.examples, config.versions)

    timing: list[TimingResult] = []
    timing_threads = []
    if config.timing:

        def timed(func: Callable[[ProbeConfig, float], TimingResult]) -> None:
            timing.append(func(config, deadline))

        for func in (_trickle_probe, _idle_probe):
            thread = threading.Thread(target=timed, args=(func,), daemon=True)
            thread.start()
            timing_threads.append(thread)

    done = 0
    lock = threading.Lock()

    def one(probe: Probe) -> Result:
        nonlocal done
        if time.monotonic() >= deadline:
            obs = Observation("skipped")
        else:
            obs = exchange(
                config,
                probe.data,
                payload=b"" if probe.incomplete else config.payload,
                shut_wr=probe.incomplete,
            )
        with lock:
            done += 1
            if progress is not None:
                progress(done, len(battery))
        return Result(probe, obs)

    with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
        report.results = list(pool.map(one, battery))
    for thread in timing_threads:
        # Each timing probe is bounded by its own socket timeouts.
        thread.join(config.idle_max + config.wait + config.connect_timeout * 3 + 5)
    report.timing = sorted(timing, key=lambda t: t.name, reverse=True)
    idle = next((t for t in report.timing if t.name == "no_header"), None)
    trickle = next((t for t in report.timing if t.name == "trickle"), None)
    if (
        trickle is not None
        and trickle.finding
        and idle is not None
        and idle.observed_timeout is not None
        and trickle.observation is not None
        and trickle.observation.elapsed >= idle.observed_timeout
    ):
        # Slower than the target's own timeout: refusing it is fine.
        trickle.finding = None
        trickle.note = "refused, but it was slower than the observed header timeout"
    report.elapsed = time.monotonic() - start
    return report
