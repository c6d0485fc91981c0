"""A requests adapter that opens every connection with a PROXY header.

requests has no option for it (psf/requests#5402); mount the adapter::

    from proxyproto.requests import ProxyHeaderAdapter

    session = requests.Session()
    session.mount("http://", ProxyHeaderAdapter(source=("203.0.113.7", 5555)))
    session.mount("https://", ProxyHeaderAdapter(source=("203.0.113.7", 5555)))
    session.get("https://127.0.0.1:8443/", verify="ca.pem")

The arguments are ``proxyproto.httpx.ProxyHeaderTransport``'s: ``header=`` a
``ProxyHeader`` sent as is, or a header built per connection from
``version``, ``source`` and ``destination`` (default: the connection's own
local and remote address), ``tlvs``, ``crc32c``, ``pad_to``; then
``HTTPAdapter``'s own (``max_retries``, ``pool_maxsize``...).

Theory of operation
-------------------
urllib3 opens a connection in ``HTTPConnection._new_conn`` (the hook
urllib3's own SOCKS support overrides); the connection classes here send the
header on the new socket before returning it, so for ``https://`` urllib3
starts TLS after the header. The adapter's pool manager hands every pool it
creates (``PoolManager._new_pool``, meant to be overridden) these connection
classes and the adapter's plan. One adapter, one plan: every pooled
connection was opened with it, so reusing one never sends a request under
another connection's header. For other headers mount another adapter (or use
another session).

Requests through an HTTP proxy (``proxies=`` or proxy environment variables)
are refused with ``requests.exceptions.ProxyError``: the header is for the
server, a proxy would receive it.
"""

from __future__ import annotations

import socket
from typing import Any

from proxyproto._client import AddressArg, HeaderPlan, plan_header
from proxyproto._events import TLV, ProxyHeader
from proxyproto._extras import missing_extra

try:
    import requests
    import requests.adapters
    import urllib3
    from urllib3.connection import HTTPConnection, HTTPSConnection
    from urllib3.connectionpool import HTTPConnectionPool
    from urllib3.exceptions import NewConnectionError
except ModuleNotFoundError as exc:
    missing_extra(
        exc, feature="proxyproto.requests", package="requests", extra="requests"
    )

__all__ = [
    "ProxyHeaderAdapter",
    "ProxyHeaderHTTPConnection",
    "ProxyHeaderHTTPSConnection",
]

_PLAN_KEYWORD = "proxy_header_plan"


def _send_header(
    connection: HTTPConnection, plan: HeaderPlan, sock: socket.socket
) -> socket.socket:
    """Write *plan*'s header on the new *sock* and return it (closed on
    failure)."""
    try:
        sock.sendall(plan.wire(sock.getsockname(), sock.getpeername()))
    except OSError as exc:
        sock.close()
        raise NewConnectionError(
            connection, f"Failed to send the PROXY header: {exc}"
        ) from exc
    except BaseException:
        sock.close()
        raise
    return sock


class ProxyHeaderHTTPConnection(HTTPConnection):
    """urllib3's ``HTTPConnection``, sending a PROXY header first."""

    def __init__(
        self, *args: Any, proxy_header_plan: HeaderPlan, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.proxy_header_plan = proxy_header_plan

    def _new_conn(self) -> socket.socket:
        return _send_header(self, self.proxy_header_plan, super()._new_conn())


class ProxyHeaderHTTPSConnection(HTTPSConnection):
    """urllib3's ``HTTPSConnection``, sending a PROXY header before TLS."""

    def __init__(
        self, *args: Any, proxy_header_plan: HeaderPlan, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.proxy_header_plan = proxy_header_plan

    def _new_conn(self) -> socket.socket:
        return _send_header(self, self.proxy_header_plan, super()._new_conn())


class _HeaderPoolManager(urllib3.PoolManager):
    """Pools whose connections start with *plan*'s header."""

    def __init__(self, plan: HeaderPlan, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plan = plan

    def _new_pool(
        self,
        scheme: str,
        host: str,
        port: int,
        request_context: dict[str, Any] | None = None,
    ) -> HTTPConnectionPool:
        pool = super()._new_pool(scheme, host, port, request_context)
        pool.ConnectionCls = (
            ProxyHeaderHTTPSConnection
            if scheme == "https"
            else ProxyHeaderHTTPConnection
        )
        pool.conn_kw = {**pool.conn_kw, _PLAN_KEYWORD: self.plan}
        return pool


class ProxyHeaderAdapter(requests.adapters.HTTPAdapter):
    """An ``HTTPAdapter`` whose connections start with a PROXY header.

    Raises:
        proxyproto.LocalProtocolError: the header arguments contradict each
            other or describe an invalid header.
    """

    __attrs__ = [*requests.adapters.HTTPAdapter.__attrs__, "plan"]  # noqa: RUF012 (as requests)

    def __init__(
        self,
        header: ProxyHeader | None = None,
        *,
        version: int = 2,
        source: AddressArg | None = None,
        destination: AddressArg | None = None,
        tlvs: tuple[TLV, ...] = (),
        crc32c: bool = False,
        pad_to: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.plan = plan_header(
            header,
            version=version,
            source=source,
            destination=destination,
            tlvs=tlvs,
            crc32c=crc32c,
            pad_to=pad_to,
        )
        super().__init__(**kwargs)

    def init_poolmanager(
        self,
        connections: int,
        maxsize: int,
        block: bool = requests.adapters.DEFAULT_POOLBLOCK,
        **pool_kwargs: Any,
    ) -> None:
        # What HTTPAdapter.init_poolmanager keeps (for pickling), then a pool
        # manager of our own.
        self._pool_connections = connections
        self._pool_maxsize = maxsize
        self._pool_block = block
        self.poolmanager = _HeaderPoolManager(
            self.plan,
            num_pools=connections,
            maxsize=maxsize,
            block=block,
            **pool_kwargs,
        )

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        raise requests.exceptions.ProxyError(
            f"ProxyHeaderAdapter sends its PROXY header to the server: it cannot "
            f"go through the HTTP proxy {proxy!r} (pass proxies={{}} with "
            f"trust_env=False, or name the host in NO_PROXY)"
        )
