"""A gunicorn backend behind a PROXY-speaking load balancer: config and app.

Run:  gunicorn -c examples/gunicorn_backend.py --chdir examples gunicorn_backend:app
Then: haproxy -f examples/haproxy-in-front.cfg   and   curl http://127.0.0.1:8080/

This file is both a gunicorn config file (the lower-case settings below) and
the WSGI app. ``proxyproto.gunicorn.ThreadWorker`` reads the PROXY header of
every connection strictly; ``proxy_allow_ips`` are the load balancers that
must send one (everyone else is refused); ``environ["REMOTE_ADDR"]`` is the
real client and ``environ["proxyproto.header"]`` the whole header.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

bind = "127.0.0.1:8000"
worker_class = "proxyproto.gunicorn.ThreadWorker"
threads = 4
proxy_allow_ips = "127.0.0.1"  # the load balancers, comma-separated CIDRs
proxy_protocol = "v2"  # accept only v2 headers ("v1"; unset: both)


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    header = environ.get("proxyproto.header")
    lines = [
        f"client: {environ['REMOTE_ADDR']} {environ.get('REMOTE_PORT')}",
        f"scheme: {environ['wsgi.url_scheme']}",  # https if TLS at the LB
        f"proxy:  {environ.get('proxyproto.peer')}",  # the load balancer
    ]
    if header is not None:
        lines.append(f"header: v{header.version} {header.command.name}")
        lines.extend(f"tlv:    0x{t.type:02x} {t.value!r}" for t in header.tlvs)
    body = ("\n".join(lines) + "\n").encode()
    start_response(
        "200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))]
    )
    return [body]
