"""``proxyproto probe``: the battery, the verdicts, and real targets.

Fake targets (threads with blocking sockets) check each verdict; our own trio
adapter must come out with zero findings; real nginx and HAProxy must give a
complete, structured report (their findings are documented in docs/probe.md,
not asserted here).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio

from proxyproto import (
    NEED_DATA,
    HeaderReader,
    Policy,
    RemoteProtocolError,
    TrustPolicy,
    parse,
)
from proxyproto._probe import (
    HTTP_PAYLOAD,
    KIND_RULES,
    TLV_KINDS,
    Probe,
    ProbeConfig,
    ProbeReport,
    build_battery,
    exchange,
    header_context,
    run,
)
from proxyproto.strategies import INVALID_KINDS
from proxyproto.trio import open_proxy_listener
from tests.peers import free_port
from tests.proxyproto.probe_peers import running_peer

Behaviour = Callable[[socket.socket], None]


@contextlib.contextmanager
def fake_target(behaviour: Behaviour) -> Iterator[int]:
    """A TCP server on 127.0.0.1 running *behaviour* per connection."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()
    handlers: list[threading.Thread] = []
    connections: list[socket.socket] = []

    def handle(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            with contextlib.suppress(OSError):
                behaviour(conn)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connections.append(conn)
            handler = threading.Thread(target=handle, args=(conn,), daemon=True)
            handlers.append(handler)
            handler.start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        server.close()
        # Handlers that hold their connection open (sleeping behaviours) must
        # not outlive the test: wake them by shutting their sockets down.
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for handler in handlers:
            handler.join(15)


def reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def recv_then_reset(conn: socket.socket) -> None:
    conn.recv(10)
    reset(conn)


def strict_receiver(conn: socket.socket) -> None:
    """Reads a header with proxyproto's reader; "OK" if valid, else close."""
    reader = HeaderReader()
    while True:
        try:
            event = reader.next_event()
        except RemoteProtocolError:
            return
        if event is not NEED_DATA:
            conn.sendall(b"OK\n")
            return
        reader.receive_data(conn.recv(reader.bytes_needed))


def lenient_receiver(conn: socket.socket) -> None:
    """Accepts anything that starts like a header (a deliberately bad one)."""
    data = conn.recv(16)
    if data.startswith((b"PROXY", b"\r\n\r\n")):
        conn.sendall(b"OK\n")


def answer_everything(conn: socket.socket) -> None:
    conn.recv(100)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")


def close_at_once(conn: socket.socket) -> None:
    pass


def hold_open(conn: socket.socket) -> None:
    conn.recv(100)
    time.sleep(3)


def hold_v1_unknown(conn: socket.socket) -> None:
    """Answers v1 TCP4 and closes on 'GET'; holds everything else open."""
    data = conn.recv(100)
    if data.startswith(b"PROXY TCP4"):
        conn.sendall(b"OK\n")
    elif not data.startswith(b"GET"):
        time.sleep(3)


def config(port: int, **kwargs: Any) -> ProbeConfig:
    defaults: dict[str, Any] = {
        "seed": 1,
        "examples": 1,
        "wait": 0.3,
        "timing": False,
        "idle_max": 0.0,
        "max_time": 60.0,
    }
    return ProbeConfig(host="127.0.0.1", port=port, **{**defaults, **kwargs})


# -- the battery -----------------------------------------------------------------


def digest(battery: list[Probe]) -> str:
    h = hashlib.sha256()
    for probe in battery:
        h.update(probe.kind.encode() + b"\0" + probe.data + b"\0")
    return h.hexdigest()


def _battery_digest_in_new_process(hash_seed: str) -> str:
    code = (
        "import hashlib; from proxyproto._probe import build_battery\n"
        "h = hashlib.sha256()\n"
        "for p in build_battery(7, 2, {1, 2}):\n"
        "    h.update(p.kind.encode() + b'\\0' + p.data + b'\\0')\n"
        "print(h.hexdigest())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
    )
    return proc.stdout.decode().strip()


def test_battery_is_deterministic() -> None:
    first = build_battery(7, 2, {1, 2})
    assert build_battery(7, 2, {1, 2}) == first
    assert digest(build_battery(8, 2, {1, 2})) != digest(first)
    # What `proxyproto probe --seed 7` promises: every new process, whatever
    # its hash seed, builds the same battery. (A process that already ran
    # other hypothesis tests, like this one, may draw differently.)
    assert _battery_digest_in_new_process("1") == _battery_digest_in_new_process(
        "12345"
    )


def test_battery_covers_every_kind_and_agrees_with_the_codec() -> None:
    battery = build_battery(3, 3, {1, 2})
    kinds = {p.kind for p in battery}
    for kind in INVALID_KINDS:
        if kind == "v1_wrong_family":
            assert kinds & {"v1_ipv4_in_tcp6", "v1_ipv6_in_tcp4"}
        else:
            assert kind in kinds
    for kind in TLV_KINDS:
        assert f"tlv:{kind}" in kinds
    assert {"v1", "v2", "fixed v1", "fixed v2"} <= kinds
    assert len({(p.data, p.incomplete) for p in battery}) == len(battery)
    for probe in battery:
        if probe.expect == "accept":
            _header, consumed = parse(probe.data)
            assert consumed == len(probe.data), probe
        else:
            with pytest.raises(RemoteProtocolError) as info:
                parse(probe.data)
            assert (info.value.reason == "incomplete") == probe.incomplete, probe
            assert probe.kind in KIND_RULES, probe.kind


@pytest.mark.parametrize("versions", [{1}, {2}])
def test_battery_respects_versions(versions: set[int]) -> None:
    battery = build_battery(5, 2, versions)
    assert battery
    for probe in battery:
        version = 2 if probe.data[:1] == b"\r" else 1
        assert version in versions, probe


def test_header_context() -> None:
    assert header_context(b"PROXY UNKNOWN\r\n") == "v1"
    assert header_context(b"\r\n\r\n\0\r\nQUIT\n\x20\x11") == (
        "v2 LOCAL, family byte 0x11"
    )
    assert header_context(b"\r\n\r\n\0\r\nQUIT\n\x2e\x11") == (
        "v2 command 0xe, family byte 0x11"
    )


# -- verdicts against fake targets -------------------------------------------------


@pytest.mark.parametrize(
    ("behaviour", "outcome"),
    [
        (strict_receiver, "answered"),
        # Closed before our bytes arrive, the kernel answers them with a reset.
        (close_at_once, "closed reset"),
        (hold_open, "held_open"),
        (recv_then_reset, "reset"),
    ],
)
def test_exchange_outcomes(behaviour: Behaviour, outcome: str) -> None:
    with fake_target(behaviour) as port:
        obs = exchange(config(port), b"PROXY UNKNOWN\r\n")
    assert obs.outcome in outcome.split()
    if outcome == "answered":
        assert obs.response == b"OK\n"


def test_exchange_connection_refused_is_an_error() -> None:
    obs = exchange(config(free_port(), connect_timeout=0.5), b"PROXY UNKNOWN\r\n")
    assert obs.outcome == "error"
    assert "connect to 127.0.0.1" in obs.detail


def test_strict_target_has_no_findings() -> None:
    with fake_target(strict_receiver) as port:
        report = run(config(port, examples=2))
    assert report.calibration_ok, report.calibration_message
    assert report.findings == 0, report.render()
    assert report.exit_code == 0
    counts = report.to_json()["counts"]
    assert counts["invalid_refused"] + counts["inconclusive"] == counts["invalid"]


def test_lenient_target_is_reported() -> None:
    with fake_target(lenient_receiver) as port:
        report = run(config(port, examples=2))
    assert report.exit_code == 1
    result = report.to_json()
    kinds = {entry["kind"] for entry in result["wrongly_accepted"]}
    assert {"bad_family", "v1_leading_zero", "v1_sign", "tlv_overrun"} <= kinds
    for entry in result["wrongly_accepted"]:
        assert entry["why"]
        assert bytes.fromhex(entry["hex"])
        assert entry["evidence"].startswith("answered 'OK\\n'")
        assert entry["severity"] in ("violation", "strict")
        assert entry["rule"]
    # Cut-short headers are sent with a FIN and nothing after: the lenient
    # target reads "PROXY" and answers, which is caught too.
    text = report.render()
    assert "WRONGLY ACCEPTED" in text
    assert "rule (violation)" in text
    assert f"--seed {report.seed}" in text


def test_calibration_stops_when_garbage_is_answered() -> None:
    with fake_target(answer_everything) as port:
        report = run(config(port))
    assert not report.calibration_ok
    assert report.exit_code == 2
    assert "does not require a PROXY header" in report.calibration_message
    assert report.results == []
    assert "calibration: FAILED" in report.render()


def test_calibration_stops_when_valid_headers_are_refused() -> None:
    with fake_target(close_at_once) as port:
        report = run(config(port))
    assert report.exit_code == 2
    assert "refused a clearly valid header" in report.calibration_message


def test_unreachable_target_exits_2() -> None:
    report = run(config(free_port(), connect_timeout=0.5))
    assert report.exit_code == 2
    assert "cannot talk to the target" in report.calibration_message


def test_max_time_bounds_the_run() -> None:
    battery = [
        Probe("test", "fixed v1", "accept", b"PROXY UNKNOWN\r\n" + bytes([i]), "x")
        for i in range(40)
    ]
    with fake_target(hold_v1_unknown) as port:
        report = run(
            config(port, versions=frozenset({1}), concurrency=1, max_time=1.0),
            battery=battery,
        )
    assert report.calibration_ok
    # Held 3 s each, 40 probes would take 2 minutes: most were skipped.
    counts = report.to_json()["counts"]
    assert counts["skipped"] > 20
    assert not report.complete
    assert report.to_json()["complete"] is False
    assert "INCOMPLETE RUN" in report.render()


def test_timing_probes_against_a_fake_target() -> None:
    def slow_strict(conn: socket.socket) -> None:
        conn.settimeout(1.5)  # the "header timeout"
        strict_receiver(conn)

    with fake_target(slow_strict) as port:
        report = run(
            config(port, timing=True, idle_max=4.0, trickle_ms=10.0, examples=1)
        )
    timing = {t["name"]: t for t in report.to_json()["timing"]}
    assert timing["trickle"]["outcome"] == "answered"
    assert timing["trickle"]["finding"] is None
    assert timing["no_header"]["outcome"] in ("closed", "reset")
    assert 1.0 < timing["no_header"]["observed_timeout"] < 3.0
    assert "at least 3 s" in timing["no_header"]["note"]
    assert report.exit_code == 0


def test_cli_probe_json() -> None:
    with fake_target(strict_receiver) as port:
        proc = subprocess.run(
            [
                sys.executable, "-m", "proxyproto", "probe", f"127.0.0.1:{port}",
                "--seed", "5", "--examples", "1", "--wait", "2", "--no-timing",
                "--json",
            ],
            capture_output=True,
            check=False,
            timeout=120,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    check_report_structure(result, port)
    assert result["seed"] == 5
    assert result["counts"]["findings"] == 0


# -- our own adapter, nginx, HAProxy ------------------------------------------------


def check_report_structure(result: dict[str, Any], port: int) -> None:
    assert result["target"] == f"127.0.0.1:{port}"
    assert result["calibration"]["ok"] is True
    assert result["complete"] is True
    assert result["exit_code"] in (0, 1)
    assert result["replay"].startswith("proxyproto probe 127.0.0.1:")
    counts = result["counts"]
    assert counts["probes"] == counts["valid"] + counts["invalid"] > 50
    assert counts["errors"] == 0
    assert counts["findings"] == (
        counts["wrongly_accepted"]
        + counts["wrongly_refused"]
        + counts["timing_findings"]
    )
    assert len(result["wrongly_accepted"]) == counts["wrongly_accepted"]
    assert len(result["wrongly_refused"]) == counts["wrongly_refused"]
    for entry in result["wrongly_accepted"] + result["wrongly_refused"]:
        assert set(entry) >= {"kind", "hex", "evidence", "rule", "context"}
    assert sum(row["sent"] for row in result["by_kind"].values()) == counts["probes"]


async def test_probe_our_trio_adapter() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def handler(stream: trio.abc.Stream) -> None:
        async with stream:
            with contextlib.suppress(
                trio.BrokenResourceError, trio.ClosedResourceError
            ):
                await stream.send_all(b"OK\n")

    probe_config = config(
        port, examples=3, wait=0.5, timing=True, idle_max=6.0, seed=11
    )
    async with (
        open_proxy_listener(
            listeners[0], trust=TrustPolicy.everyone(Policy.REQUIRE), header_timeout=3.5
        ) as listener,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(trio.serve_listeners, handler, [listener])
        report: ProbeReport = await trio.to_thread.run_sync(run, probe_config)
        nursery.cancel_scope.cancel()
    assert report.findings == 0, report.render()
    assert report.exit_code == 0
    result = report.to_json()
    check_report_structure(result, port)
    timing = {t["name"]: t for t in result["timing"]}
    assert timing["trickle"]["outcome"] == "answered"
    assert 3.0 < timing["no_header"]["observed_timeout"] < 5.0


def probe_cli(port: int, *extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable, "-m", "proxyproto", "probe", f"127.0.0.1:{port}",
            "--seed", "1", "--examples", "2", "--wait", "0.5", "--idle-max", "6",
            "--json", *extra,
        ],
        capture_output=True,
        check=False,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr + proc.stdout
    result: dict[str, Any] = json.loads(proc.stdout)
    assert result["exit_code"] == proc.returncode
    return result


def check_timing(result: dict[str, Any]) -> None:
    timing = {t["name"]: t for t in result["timing"]}
    assert set(timing) == {"trickle", "no_header"}
    # Both peers are configured with 3 s header timeouts below.
    assert 2.5 < timing["no_header"]["observed_timeout"] < 5.0


@pytest.mark.peers
def test_probe_nginx() -> None:
    with running_peer("nginx") as port:
        result = probe_cli(port, "--payload-http")
    check_report_structure(result, port)
    check_timing(result)
    assert result["payload_hex"] == HTTP_PAYLOAD.hex()


@pytest.mark.peers
def test_probe_haproxy() -> None:
    with running_peer("haproxy") as port:
        result = probe_cli(port, "--payload-http")
    check_report_structure(result, port)
    check_timing(result)
