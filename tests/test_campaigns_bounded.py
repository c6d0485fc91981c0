"""The reliability campaigns (campaigns/*.py) in their ``--quick`` form.

Each runs as its own process, as a user would run it, and writes its figures
as JSON. Only correctness is asserted here: every answer right, nothing
smuggled, nothing closed before its timeout, fds back, no traceback. The
campaigns' timing goals (a normal client's loaded latency against its unloaded
one, closes within timeout + 3 s) depend on how loaded the machine is: the
campaigns print them and check them in their full runs, never a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.peers import require

ROOT = Path(__file__).resolve().parents[1]
CAMPAIGNS = ROOT / "campaigns"

pytestmark = pytest.mark.peers


def _python_path() -> list[str]:
    given = os.environ.get("PYTHONPATH")
    return [str(ROOT), *([given] if given else [])]


def run_campaign(name: str, tmp_path: Path, *args: str) -> dict[str, Any]:
    result_file = tmp_path / f"{name}.json"
    completed = subprocess.run(
        [
            sys.executable,
            str(CAMPAIGNS / f"{name}.py"),
            "--quick",
            "--json",
            str(result_file),
            *args,
        ],
        cwd=ROOT,
        # This checkout's tlsedge, not whichever one is installed: a script's
        # own folder, not the working directory, starts its sys.path.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(_python_path())},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    print(completed.stdout)  # the figures, shown with -s or on failure
    assert result_file.exists(), completed.stdout + completed.stderr
    data: dict[str, Any] = json.loads(result_file.read_text())
    data["returncode"] = completed.returncode
    data["stdout"] = completed.stdout
    return data


def test_load_quick(tmp_path: Path) -> None:
    require("haproxy")
    data = run_campaign("load", tmp_path)
    assert data["phases"], data["stdout"]
    for phase in data["phases"]:
        name = f"{phase['proxy']} {phase['kind']}"
        assert phase["error_count"] == 0, (name, phase["errors"])
        assert phase["connections"] == 200, name
        assert phase["fds_back"], (name, phase["fds_base"], phase["fds_after"])
    assert {(p["proxy"], p["kind"]) for p in data["phases"]} == {
        ("tlsedge", "plain"),
        ("tlsedge", "tls"),
        ("haproxy", "plain"),
        ("haproxy", "tls"),
    }
    assert data["ok"], data["stdout"]


def test_slow_clients_quick(tmp_path: Path) -> None:
    data = run_campaign("slow_clients", tmp_path)
    for name, kind in data["kinds"].items():
        assert kind["closed"] > 0, name
        assert kind["early"] == 0, name
        assert kind["errors"] == 0, name
    assert data["closed_ok"], data["stdout"]
    assert data["early_edge"] == 0, data["stdout"]
    assert data["edge_timeouts"] > 0, data["stdout"]
    assert data["fds_after"] <= data["fds_base"] + 4


def test_faults_quick(tmp_path: Path) -> None:
    data = run_campaign("faults", tmp_path)
    failed = [r for r in data["results"] if not r["ok"]]
    assert failed == [], data["stdout"]
    assert {r["scenario"] for r in data["results"]} == {
        "refuse",
        "reset",
        "blackhole",
        "stall",
        "flap",
        "emfile",
    }


def test_http_clients_quick(tmp_path: Path) -> None:
    data = run_campaign("http_clients", tmp_path)
    shares = data["shares"]
    for name, status in (
        ("slowloris", 408),
        ("stalled-body", 408),
        ("slow-body", 408),
        ("oversized", 431),
    ):
        share = shares[name]
        assert share["total"] > 0, name
        assert share["statuses"] == {str(status): share["total"]}, (name, share)
        assert share["not_closed"] == share["early"] == share["errors"] == 0, name
    assert data["edge_header_timeouts"] == shares["slowloris"]["total"]
    assert data["vectors"], data["stdout"]
    for name, vector in data["vectors"].items():
        assert vector["sent"] > 0, name
        assert vector["wrong"] == {}, (name, vector["wrong"])
    assert data["backend_smuggled"] == 0, data["stdout"]
    assert data["probe_errors"] == [], data["stdout"]
    assert data["fds_after"] <= data["fds_base"], data["stdout"]
    goals = data["goals"]
    for name in ("smuggling", "backend", "fds", "edge log"):
        assert goals[name], (name, data["stdout"])
