"""Run ``proxyproto probe`` against a real nginx or HAProxy (docs/probe.md).

The configurations are the ones ``test_probe.py`` uses, so the figures in
docs/probe.md come from the same setup the tests check::

    python -m tests.proxyproto.probe_peers haproxy
    python -m tests.proxyproto.probe_peers nginx --json

Each starts the server on a free port (``tests.peers``), runs
``proxyproto probe 127.0.0.1:PORT --seed 1 --examples 10 --wait 0.5
--payload-http`` plus any further arguments, prints the report and exits with
the probe's exit code.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence

from tests.peers import free_port, haproxy, nginx

#: The probe arguments the figures in docs/probe.md were made with.
DOC_ARGUMENTS = ("--seed", "1", "--examples", "10", "--wait", "0.5", "--payload-http")


def nginx_config(port: int) -> str:
    """nginx's http module with ``proxy_protocol`` on *port*, 3 s header timeout."""
    return (
        "http {\n    access_log off;\n    client_header_timeout 3s;\n"
        f"    server {{ listen 127.0.0.1:{port} proxy_protocol; "
        'return 200 "ok\\n"; }\n}\n'
    )


def haproxy_config(port: int) -> str:
    """HAProxy in mode http with ``accept-proxy`` on *port*, 3 s header timeout."""
    return (
        "global\n    maxconn 4096\n"
        "defaults\n    mode http\n    timeout connect 5s\n    timeout client 3s\n"
        "    timeout server 30s\n    timeout http-request 3s\n"
        f"frontend fe\n    bind 127.0.0.1:{port} accept-proxy\n"
        "    http-request return status 200 content-type text/plain string ok\n"
    )


@contextlib.contextmanager
def running_peer(name: str) -> Iterator[int]:
    """Run *name* (``nginx`` or ``haproxy``) with its probe configuration;
    yield the port it listens on."""
    port = free_port()
    start: Callable[[str, list[int]], contextlib.AbstractContextManager[object]]
    if name == "nginx":
        config, start = nginx_config(port), nginx
    elif name == "haproxy":
        config, start = haproxy_config(port), haproxy
    else:
        raise ValueError(f"expected nginx or haproxy, got {name!r}")
    with start(config, [port]):
        yield port


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.proxyproto.probe_peers nginx|haproxy [probe options]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("nginx", "haproxy"):
        sys.stderr.write(
            "usage: python -m tests.proxyproto.probe_peers nginx|haproxy "
            "[proxyproto probe options]\n"
        )
        return 2
    with running_peer(args[0]) as port:
        command = [
            sys.executable,
            "-m",
            "proxyproto",
            "probe",
            f"127.0.0.1:{port}",
            *DOC_ARGUMENTS,
            *args[1:],
        ]
        return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
