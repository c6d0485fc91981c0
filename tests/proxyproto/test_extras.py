"""Optional dependencies: each missing one is one line naming its extra, exit 2.

Every test runs Python in a subprocess with the dependency made unimportable
(``sys.modules[name] = None``, which is how a missing package fails:
``ModuleNotFoundError`` with ``name`` set), so the modules of this process
are left alone.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_without(package: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run *code* in a fresh interpreter where *package* cannot be imported."""
    return subprocess.run(
        [sys.executable, "-c", f"import sys\nsys.modules[{package!r}] = None\n{code}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def run_command_without(
    package: str, module: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` with *package* unimportable."""
    code = (
        "import runpy\n"
        f"sys.argv = [{module!r}, *{list(args)!r}]\n"
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    )
    return run_without(package, code)


@pytest.mark.parametrize(
    ("package", "module", "args", "message"),
    [
        pytest.param(
            "hypothesis",
            "proxyproto",
            ["probe", "127.0.0.1:9"],
            "proxyproto probe needs hypothesis: pip install 'tlsedge[probe]'",
            id="probe",
        ),
        pytest.param(
            "uvicorn",
            "proxyproto.uvicorn",
            ["app:app"],
            "proxyproto.uvicorn needs uvicorn: pip install 'tlsedge[uvicorn]'",
            id="uvicorn",
        ),
        pytest.param(
            "hypercorn",
            "proxyproto.hypercorn",
            ["app:app"],
            "proxyproto.hypercorn needs hypercorn: pip install 'tlsedge[hypercorn]'",
            id="hypercorn",
        ),
    ],
)
def test_command_names_the_missing_extra(
    package: str, module: str, args: list[str], message: str
) -> None:
    result = run_command_without(package, module, *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr == message + "\n"
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("package", "module", "message"),
    [
        (
            "hypothesis",
            "proxyproto.strategies",
            "proxyproto.strategies needs hypothesis: pip install 'tlsedge[probe]'",
        ),
        (
            "uvicorn",
            "proxyproto.uvicorn",
            "proxyproto.uvicorn needs uvicorn: pip install 'tlsedge[uvicorn]'",
        ),
        (
            "aiohttp",
            "proxyproto.aiohttp",
            "proxyproto.aiohttp needs aiohttp: pip install 'tlsedge[aiohttp]'",
        ),
        (
            "tornado",
            "proxyproto.tornado",
            "proxyproto.tornado needs tornado: pip install 'tlsedge[tornado]'",
        ),
        (
            "twisted",
            "proxyproto.twisted",
            "proxyproto.twisted needs twisted: pip install 'tlsedge[twisted]'",
        ),
        (
            "gunicorn",
            "proxyproto.gunicorn",
            "proxyproto.gunicorn needs gunicorn: pip install 'tlsedge[gunicorn]'",
        ),
        (
            "httpx",
            "proxyproto.httpx",
            "proxyproto.httpx needs httpx: pip install 'tlsedge[httpx]'",
        ),
        (
            "requests",
            "proxyproto.requests",
            "proxyproto.requests needs requests: pip install 'tlsedge[requests]'",
        ),
    ],
)
def test_import_names_the_missing_extra(
    package: str, module: str, message: str
) -> None:
    code = (
        "try:\n"
        f"    import {module}\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(type(exc).__name__, exc.name, exc, sep='|')\n"
    )
    result = run_without(package, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"MissingExtraError|{package}|{message}\n"


def test_hypercorn_serve_names_the_missing_extra() -> None:
    code = (
        "import asyncio\n"
        "from proxyproto.hypercorn import serve\n"
        "try:\n"
        "    asyncio.run(serve(None, None))\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
    )
    result = run_without("hypercorn", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "proxyproto.hypercorn needs hypercorn: pip install 'tlsedge[hypercorn]'\n"
    )


def test_the_codec_and_other_commands_need_no_extra() -> None:
    code = (
        "import runpy\n"
        "sys.modules['uvicorn'] = sys.modules['hypercorn'] = None\n"
        "sys.argv = ['proxyproto', 'encode', '--local']\n"
        "runpy.run_module('proxyproto', run_name='__main__', alter_sys=True)\n"
    )
    result = run_without("hypothesis", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "0d0a0d0a000d0a515549540a20000000\n"


def test_diagnose_and_send_need_no_extra() -> None:
    # Nothing listens on port 9 here: both fail to connect, without a hint.
    diagnose = run_command_without(
        "hypothesis", "proxyproto", "probe", "--diagnose", "127.0.0.1:9"
    )
    assert diagnose.returncode == 2, diagnose.stderr
    assert diagnose.stdout.startswith("127.0.0.1:9: cannot tell, a connection failed")
    send = run_command_without("hypothesis", "proxyproto", "send", "127.0.0.1:9")
    assert send.returncode == 2
    assert send.stderr.startswith("proxyproto send: error: connect to 127.0.0.1:9")


def test_extras_pin_what_the_tests_run() -> None:
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for name in (
        "probe",
        "uvicorn",
        "hypercorn",
        "aiohttp",
        "tornado",
        "twisted",
        "gunicorn",
        "httpx",
        "requests",
    ):
        assert extras[name], name
        assert set(extras[name]) <= set(extras["test"]), name
