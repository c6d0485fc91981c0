"""httpx transports that open every connection with a PROXY header.

For testing PROXY receivers from Python (httpx has no such option)::

    from proxyproto.httpx import ProxyHeaderTransport

    transport = ProxyHeaderTransport(source=("203.0.113.7", 5555))
    with httpx.Client(transport=transport) as client:
        client.get("https://127.0.0.1:8443/", ...)

``AsyncProxyHeaderTransport`` is the same for ``httpx.AsyncClient`` (asyncio
and trio). The header is a ``ProxyHeader`` given as ``header=``, or built per
connection like a load balancer's: ``version`` 1 or 2, ``source`` and
``destination`` (by default the connection's own local and remote address,
as ``curl --haproxy-protocol`` sends), ``tlvs``, ``crc32c``, ``pad_to``. A
request may carry its own: ``client.get(url, extensions={"proxy_header":
header})``.

Theory of operation
-------------------
httpcore opens connections through a network backend; the transports give
their httpcore pool one that writes the header as soon as the TCP connection
is up, before anything else: for ``https://`` the TLS handshake comes after
the header, as behind a load balancer passing TLS through. A header belongs
to one connection. Every connection of the transport's pool starts with the
transport's plan, so pooled connections can serve any request that names no
header of its own. A request that names one gets a pool of its own with no
keep-alive: a new connection, opened with that header, closed with the
response; it never takes, or leaves behind, a connection another request
could reuse.

Errors are httpx's: httpcore's exceptions are mapped as ``httpx.HTTPTransport``
maps them. An invalid header (arguments or extension) raises
``proxyproto.LocalProtocolError`` before anything is sent. HTTP proxies are
not supported (the header would go to the proxy): the transports take no
``proxy`` argument, and a client given a transport ignores proxy environment
variables.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

from proxyproto._client import AddressArg, HeaderPlan, plan_header
from proxyproto._errors import LocalProtocolError
from proxyproto._events import TLV, ProxyHeader
from proxyproto._extras import missing_extra

try:
    import httpcore
    import httpx
except ModuleNotFoundError as exc:
    missing_extra(exc, feature="proxyproto.httpx", package="httpx", extra="httpx")

__all__ = ["PROXY_HEADER", "AsyncProxyHeaderTransport", "ProxyHeaderTransport"]

#: The request extension naming a request's own header (a ``ProxyHeader``).
PROXY_HEADER = "proxy_header"
#: httpx's own defaults (``httpx.Limits`` as ``httpx.Client`` uses it).
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)

# httpcore's exception -> httpx's, most specific first (as httpx maps them).
_ERRORS: dict[type[Exception], type[httpx.HTTPError]] = {
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.TimeoutException: httpx.TimeoutException,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.NetworkError: httpx.NetworkError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
    httpcore.ProtocolError: httpx.ProtocolError,
    httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
    httpcore.ProxyError: httpx.ProxyError,
}
_HTTPCORE_ERRORS = tuple(_ERRORS)


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except _HTTPCORE_ERRORS as exc:
        mapped = next(_ERRORS[cls] for cls in type(exc).__mro__ if cls in _ERRORS)
        raise mapped(str(exc)) from exc


def _request_plan(request: httpx.Request) -> HeaderPlan | None:
    """The request's own plan (its header, sent as given), or ``None`` when
    it uses the transport's."""
    header = request.extensions.get(PROXY_HEADER)
    if header is None:
        return None
    if not isinstance(header, ProxyHeader):
        raise LocalProtocolError(
            f"extensions[{PROXY_HEADER!r}] must be a ProxyHeader, got "
            f"{type(header).__name__}"
        )
    return plan_header(header)


def _core_request(
    request: httpx.Request, content: Iterable[bytes] | AsyncIterable[bytes]
) -> httpcore.Request:
    extensions = {k: v for k, v in request.extensions.items() if k != PROXY_HEADER}
    return httpcore.Request(
        method=request.method,
        url=httpcore.URL(
            scheme=request.url.raw_scheme,
            host=request.url.raw_host,
            port=request.url.port,
            target=request.url.raw_path,
        ),
        headers=request.headers.raw,
        content=content,
        extensions=extensions,
    )


def _pool_options(
    *,
    verify: ssl.SSLContext | str | bool,
    cert: Any,
    trust_env: bool,
    http1: bool,
    http2: bool,
    limits: httpx.Limits,
    local_address: str | None,
    retries: int,
    socket_options: Iterable[Any] | None,
) -> dict[str, Any]:
    return {
        "ssl_context": httpx.create_ssl_context(
            verify=verify, cert=cert, trust_env=trust_env
        ),
        "max_connections": limits.max_connections,
        "max_keepalive_connections": limits.max_keepalive_connections,
        "keepalive_expiry": limits.keepalive_expiry,
        "http1": http1,
        "http2": http2,
        "local_address": local_address,
        "retries": retries,
        "socket_options": socket_options,
    }


# -- sync ---------------------------------------------------------------------


class _HeaderBackend(httpcore.NetworkBackend):
    """httpcore's blocking backend, writing the plan's header first."""

    def __init__(self, plan: HeaderPlan) -> None:
        self._plan = plan
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._backend.connect_tcp(
            host, port, timeout, local_address, socket_options
        )
        try:
            wire = self._plan.wire(
                stream.get_extra_info("client_addr"),
                stream.get_extra_info("server_addr"),
            )
            stream.write(wire, timeout)
        except BaseException:
            stream.close()
            raise
        return stream

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _ResponseStream(httpx.SyncByteStream):
    def __init__(
        self, stream: Iterable[bytes], own_pool: httpcore.ConnectionPool | None
    ) -> None:
        self._stream = stream
        self._own_pool = own_pool

    def __iter__(self) -> Iterator[bytes]:
        with _httpx_errors():
            yield from self._stream

    def close(self) -> None:
        try:
            with _httpx_errors():
                close = getattr(self._stream, "close", None)
                if close is not None:
                    close()
        finally:
            if self._own_pool is not None:
                self._own_pool.close()


class ProxyHeaderTransport(httpx.BaseTransport):
    """An ``httpx.HTTPTransport`` whose connections start with a PROXY header.

    Args:
        header: send exactly this header on every connection.
        version: 1 or 2 (built headers).
        source: the client endpoint, ``(host, port)``; default: the
            connection's local address.
        destination: the server endpoint; default: the address connected to.
        tlvs: TLVs of a built v2 header.
        crc32c: add a CRC32C TLV (v2).
        pad_to: pad v2 headers with a NOOP TLV to this many bytes.

    The other arguments are ``httpx.HTTPTransport``'s.

    Raises:
        LocalProtocolError: the header arguments contradict each other or
            describe an invalid header.
    """

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
        verify: ssl.SSLContext | str | bool = True,
        cert: Any = None,
        trust_env: bool = True,
        http1: bool = True,
        http2: bool = False,
        limits: httpx.Limits = DEFAULT_LIMITS,
        local_address: str | None = None,
        retries: int = 0,
        socket_options: Iterable[Any] | None = None,
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
        self._options = _pool_options(
            verify=verify,
            cert=cert,
            trust_env=trust_env,
            http1=http1,
            http2=http2,
            limits=limits,
            local_address=local_address,
            retries=retries,
            socket_options=socket_options,
        )
        self._pool = httpcore.ConnectionPool(
            **self._options, network_backend=_HeaderBackend(self.plan)
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        plan = _request_plan(request)
        pool = self._pool
        if plan is not None:
            options = {**self._options, "max_keepalive_connections": 0}
            pool = httpcore.ConnectionPool(
                **options, network_backend=_HeaderBackend(plan)
            )
        try:
            with _httpx_errors():
                response = pool.handle_request(_core_request(request, request.stream))
        except BaseException:
            if plan is not None:
                pool.close()
            raise
        assert isinstance(response.stream, Iterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream, None if plan is None else pool),
            extensions=response.extensions,
        )

    def close(self) -> None:
        with _httpx_errors():
            self._pool.close()


# -- async --------------------------------------------------------------------


class _AsyncHeaderBackend(httpcore.AsyncNetworkBackend):
    """httpcore's AnyIO backend (asyncio or trio), writing the header first."""

    def __init__(self, plan: HeaderPlan) -> None:
        self._plan = plan
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_tcp(
            host, port, timeout, local_address, socket_options
        )
        try:
            wire = self._plan.wire(
                stream.get_extra_info("client_addr"),
                stream.get_extra_info("server_addr"),
            )
            await stream.write(wire, timeout)
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _AsyncResponseStream(httpx.AsyncByteStream):
    def __init__(
        self,
        stream: AsyncIterable[bytes],
        own_pool: httpcore.AsyncConnectionPool | None,
    ) -> None:
        self._stream = stream
        self._own_pool = own_pool

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        try:
            with _httpx_errors():
                aclose = getattr(self._stream, "aclose", None)
                if aclose is not None:
                    await aclose()
        finally:
            if self._own_pool is not None:
                await self._own_pool.aclose()


class AsyncProxyHeaderTransport(httpx.AsyncBaseTransport):
    """``ProxyHeaderTransport`` for ``httpx.AsyncClient`` (asyncio or trio);
    the same arguments."""

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
        verify: ssl.SSLContext | str | bool = True,
        cert: Any = None,
        trust_env: bool = True,
        http1: bool = True,
        http2: bool = False,
        limits: httpx.Limits = DEFAULT_LIMITS,
        local_address: str | None = None,
        retries: int = 0,
        socket_options: Iterable[Any] | None = None,
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
        self._options = _pool_options(
            verify=verify,
            cert=cert,
            trust_env=trust_env,
            http1=http1,
            http2=http2,
            limits=limits,
            local_address=local_address,
            retries=retries,
            socket_options=socket_options,
        )
        self._pool = httpcore.AsyncConnectionPool(
            **self._options, network_backend=_AsyncHeaderBackend(self.plan)
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        plan = _request_plan(request)
        pool = self._pool
        if plan is not None:
            options = {**self._options, "max_keepalive_connections": 0}
            pool = httpcore.AsyncConnectionPool(
                **options, network_backend=_AsyncHeaderBackend(plan)
            )
        try:
            with _httpx_errors():
                response = await pool.handle_async_request(
                    _core_request(request, request.stream)
                )
        except BaseException:
            if plan is not None:
                await pool.aclose()
            raise
        assert isinstance(response.stream, AsyncIterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_AsyncResponseStream(
                response.stream, None if plan is None else pool
            ),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        with _httpx_errors():
            await self._pool.aclose()
