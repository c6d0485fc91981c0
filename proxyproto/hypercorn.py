"""Serve an ASGI app with Hypercorn behind a PROXY-protocol load balancer.

Hypercorn has no hook at the connection level (pgjones/hypercorn#174: the
header comes before TLS and before HTTP, so middleware cannot read it), so
this module runs Hypercorn's per-connection server (``TCPServer``) from its
own accept loop, with the PROXY header read first and TLS started after it::

    config = hypercorn.config.Config()
    config.bind = ["0.0.0.0:8000"]
    await proxyproto.hypercorn.serve(app, config, trusted=["10.0.0.0/8"])

``serve`` works under asyncio and trio (whichever is running). From the
command line::

    python -m proxyproto.hypercorn myapp:app --bind 0.0.0.0:8000 \\
        --proxy-trusted 10.0.0.0/8 [other hypercorn options]

The app sees the addresses from the header in ``scope["client"]`` and
``scope["server"]``, and the whole header in
``scope["extensions"]["proxyproto"] == {"header": ProxyHeader | None,
"peer": (host, port)}`` (``peer`` is the load balancer).

Under asyncio each connection starts with a ``ProxyProtocolWrapper``
(``proxyproto.asyncio``, set up for ASGI servers in ``proxyproto._asgi``,
shared with ``proxyproto.uvicorn``) that reads the header, then hands the
connection, with the bytes read past the header, to Hypercorn's stream
protocol, optionally through TLS started after the header. Under trio the
header is read with ``proxyproto.trio.read_proxy_header``. It imports
Hypercorn and trio only when used.

Checked against Hypercorn 0.17.3 and 0.18.0.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from proxyproto._asgi import (
    DEFAULT_TIMEOUT,
    DEFAULT_TRUSTED,
    EXTENSION,
    AddressSocket,
    ASGIApp,
    AsyncioSettings,
    Connection,
    ProxyInfo,
    ProxyScopeMiddleware,
    ServerProtocolWrapper,
    TrustedArg,
    header_addresses,
    make_trust_policy,
    parse_proxy_arguments,
    print_proxy_help,
    proxy_argument_parser,
    set_current_connection,
)
from proxyproto._extras import require
from proxyproto._policy import Policy, TrustPolicy

if TYPE_CHECKING:
    import trio
    from hypercorn.config import Config

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_TRUSTED",
    "EXTENSION",
    "ProxyInfo",
    "ProxyScopeMiddleware",
    "main",
    "make_trust_policy",
    "run",
    "serve",
]

LOGGER = logging.getLogger("proxyproto.hypercorn")

# --------------------------------------------------------------------------
# Hypercorn
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    trust: TrustPolicy
    header_timeout: float
    reader_options: Mapping[str, Any]


def _hypercorn_internals(flavour: str) -> tuple[Any, Any, Any]:
    """Hypercorn's per-worker pieces: ``(Lifespan, TCPServer, WorkerContext)``.

    Private API (``hypercorn.{asyncio,trio}.{lifespan,tcp_server,
    worker_context}``), checked against Hypercorn 0.17.3 and 0.18.0, where
    ``worker_serve`` builds them with these signatures::

        asyncio: Lifespan(app, config, loop, state)
                 TCPServer(app, loop, config, context, state, reader, writer)
        trio:    Lifespan(app, config, state)
                 TCPServer(app, config, context, state, stream)
        both:    WorkerContext(max_requests)

    ``tests/proxyproto/test_hypercorn.py::test_private_api`` checks them.
    """
    if flavour == "asyncio":
        from hypercorn.asyncio.lifespan import Lifespan
        from hypercorn.asyncio.tcp_server import TCPServer
        from hypercorn.asyncio.worker_context import WorkerContext
    else:
        from hypercorn.trio.lifespan import Lifespan  # type: ignore[assignment]
        from hypercorn.trio.tcp_server import TCPServer  # type: ignore[assignment]
        from hypercorn.trio.worker_context import (  # type: ignore[assignment]
            WorkerContext,
        )
    return Lifespan, TCPServer, WorkerContext


def _wrap(app: ASGIApp, config: Config) -> Any:
    from hypercorn.utils import wrap_app

    return wrap_app(ProxyScopeMiddleware(app), config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]


def _max_requests(config: Config) -> int | None:
    import random

    if config.max_requests is None:
        return None
    return config.max_requests + random.randint(0, config.max_requests_jitter)  # noqa: S311


async def _wait_first(*waits: Callable[[], Awaitable[Any]]) -> None:
    tasks = [asyncio.ensure_future(wait()) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _serve_asyncio(
    app: ASGIApp,
    config: Config,
    options: _Options,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None,
) -> None:
    lifespan_class, tcp_server_class, worker_context_class = _hypercorn_internals(
        "asyncio"
    )
    loop = asyncio.get_running_loop()
    wrapped = _wrap(app, config)
    state: dict[str, Any] = {}
    lifespan = lifespan_class(wrapped, config, loop, state)
    lifespan_task = loop.create_task(lifespan.handle_lifespan())
    await lifespan.wait_for_startup()
    if lifespan_task.done() and lifespan_task.exception() is not None:
        raise lifespan_task.exception()  # type: ignore[misc]

    if shutdown_trigger is None:
        event = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, event.set)
        shutdown_trigger = event.wait

    sockets = config.create_sockets()
    ssl_context = config.create_ssl_context() if config.ssl_enabled else None
    context = worker_context_class(_max_requests(config))
    tasks: set[asyncio.Task[Any]] = set()

    async def connected(
        connection: Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        # This task's context: the app's tasks inherit it.
        set_current_connection(connection)
        await tcp_server_class(wrapped, loop, config, context, state, reader, writer)

    def make_stream_protocol(connection: Connection) -> asyncio.Protocol:
        reader = asyncio.StreamReader(loop=loop)
        return asyncio.StreamReaderProtocol(
            reader, partial(connected, connection), loop=loop
        )

    servers = []
    for secure, group in (
        (True, sockets.secure_sockets),
        (False, sockets.insecure_sockets),
    ):
        settings = AsyncioSettings(
            trust=options.trust,
            header_timeout=options.header_timeout,
            ssl_context=ssl_context if secure else None,
            ssl_handshake_timeout=config.ssl_handshake_timeout,
            reader_options=options.reader_options,
            logger=LOGGER,
        )
        for sock in group:
            server = await loop.create_server(
                partial(ServerProtocolWrapper, settings, make_stream_protocol),
                sock=sock,
                backlog=config.backlog,
            )
            servers.append(server)
            scheme = "https" if secure else "http"
            await config.log.info(
                f"Running on {scheme}://{_repr_address(sock)} "
                "with PROXY protocol (CTRL + C to quit)"
            )
    try:
        await _wait_first(shutdown_trigger, context.terminate.wait)
    finally:
        await context.terminated.set()
        for server in servers:
            server.close()
            await server.wait_closed()
        if tasks:
            _, pending = await asyncio.wait(
                list(tasks), timeout=config.graceful_timeout
            )
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        await lifespan.wait_for_shutdown()
        lifespan_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lifespan_task


def _repr_address(sock: socket.socket) -> str:
    address = sock.getsockname()
    if sock.family == socket.AF_INET6:
        return f"[{address[0]}]:{address[1]}"
    if isinstance(address, tuple):
        return f"{address[0]}:{address[1]}"
    return str(address)


async def _serve_trio(
    app: ASGIApp,
    config: Config,
    options: _Options,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None,
    task_status: trio.TaskStatus[list[str]] | None,
) -> None:
    import trio

    from proxyproto.trio import accept_proxy_header

    lifespan_class, tcp_server_class, worker_context_class = _hypercorn_internals(
        "trio"
    )
    from hypercorn.typing import ConnectionState

    wrapped = _wrap(app, config)
    state: dict[str, Any] = {}
    lifespan = lifespan_class(wrapped, config, state)
    context = worker_context_class(_max_requests(config))

    async def handle(ssl_context: ssl.SSLContext | None, stream: Any) -> None:
        proxy_stream = await accept_proxy_header(
            stream,
            trust=options.trust,
            header_timeout=options.header_timeout,
            logger=LOGGER,
            **options.reader_options,
        )
        if proxy_stream is None:
            return
        set_current_connection(
            Connection.from_header(
                proxy_stream.header, proxy_stream.policy, proxy_stream.peer_address
            )
        )
        wrapped_stream: Any = _SocketStream(proxy_stream, proxy_stream.policy)
        if ssl_context is not None:
            wrapped_stream = trio.SSLStream(
                wrapped_stream, ssl_context, server_side=True, https_compatible=True
            )
        await tcp_server_class(
            wrapped, config, context, ConnectionState(state.copy()), wrapped_stream
        )

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            ssl_context = config.create_ssl_context() if config.ssl_enabled else None
            binds = []
            listeners: list[trio.SocketListener] = []
            async with trio.open_nursery() as accept_nursery:
                for secure, group in (
                    (True, sockets.secure_sockets),
                    (False, sockets.insecure_sockets),
                ):
                    for sock in group:
                        sock.listen(config.backlog)
                        listener = trio.SocketListener(
                            trio.socket.from_stdlib_socket(sock)
                        )
                        listeners.append(listener)
                        scheme = "https" if secure else "http"
                        binds.append(f"{scheme}://{_repr_address(sock)}")
                        await config.log.info(
                            f"Running on {binds[-1]} with PROXY protocol "
                            "(CTRL + C to quit)"
                        )
                        accept_nursery.start_soon(
                            partial(
                                trio.serve_listeners,
                                partial(handle, ssl_context if secure else None),
                                [listener],
                                handler_nursery=server_nursery,
                            )
                        )
                if task_status is not None:
                    task_status.started(binds)
                if shutdown_trigger is None:
                    with trio.open_signal_receiver(
                        signal.SIGINT, signal.SIGTERM
                    ) as signals:
                        trigger: Callable[[], Awaitable[Any]] = partial(
                            anext, signals.__aiter__()
                        )
                        await _trio_wait_first(trigger, context.terminate.wait)
                else:
                    await _trio_wait_first(shutdown_trigger, context.terminate.wait)
                accept_nursery.cancel_scope.cancel()
            for listener in listeners:
                await listener.aclose()
            await context.terminated.set()
            server_nursery.cancel_scope.deadline = (
                trio.current_time() + config.graceful_timeout
            )
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _trio_wait_first(*waits: Callable[[], Awaitable[Any]]) -> None:
    import trio

    async with trio.open_nursery() as nursery:

        async def run(wait: Callable[[], Awaitable[Any]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        for wait in waits:
            nursery.start_soon(run, wait)


def _make_socket_stream_class() -> type[Any]:
    import trio

    from proxyproto.trio import ProxyStream

    class SocketStream(trio.abc.HalfCloseableStream):
        # Hypercorn's trio TCPServer reads the addresses from ``stream.socket``
        # (or ``stream.transport_stream.socket`` under TLS): this stream is the
        # ProxyStream with a ``socket`` reporting the header's addresses.
        def __init__(self, stream: ProxyStream, policy: Policy) -> None:
            self.transport_stream = stream
            sock = getattr(stream.transport_stream, "socket", None)
            addresses = header_addresses(stream.header, policy)
            self.socket = sock if addresses is None else AddressSocket(sock, *addresses)

        async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
            return await self.transport_stream.receive_some(max_bytes)

        async def send_all(self, data: bytes | bytearray | memoryview) -> None:
            await self.transport_stream.send_all(data)

        async def wait_send_all_might_not_block(self) -> None:
            await self.transport_stream.wait_send_all_might_not_block()

        async def send_eof(self) -> None:
            await self.transport_stream.send_eof()

        async def aclose(self) -> None:
            await self.transport_stream.aclose()

    return SocketStream


class _LazySocketStream:
    _class: type[Any] | None = None

    def __call__(self, stream: Any, policy: Policy) -> Any:
        if self._class is None:
            type(self)._class = _make_socket_stream_class()
        assert self._class is not None
        return self._class(stream, policy)


_SocketStream = _LazySocketStream()


def _running_library() -> str:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return "trio"
    return "asyncio"


async def serve(
    app: ASGIApp,
    config: Config,
    *,
    trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
    untrusted: Policy = Policy.REJECT,
    header_timeout: float = DEFAULT_TIMEOUT,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    task_status: trio.TaskStatus[list[str]] | None = None,
    **reader_options: Any,
) -> None:
    """Serve *app* with Hypercorn, reading a PROXY header on every connection.

    Like ``hypercorn.asyncio.serve`` / ``hypercorn.trio.serve`` (whichever
    library is running): binds ``config.bind`` (TLS on them if
    ``config.certfile`` is set; ``config.insecure_bind`` plain), runs the
    lifespan, and serves until *shutdown_trigger* returns (default: SIGINT or
    SIGTERM). HTTP/1.1 and HTTP/2 over TCP; QUIC binds are not served.

    Args:
        app: an ASGI 3 application.
        config: a ``hypercorn.config.Config``.
        trusted: load balancer CIDRs/addresses that must send a header, or a
            ``TrustPolicy``. Default: only 127.0.0.1 and ::1.
        untrusted: policy for everyone else (``REJECT`` or ``SKIP``).
        header_timeout: seconds the complete header may take.
        shutdown_trigger: awaited; its return starts a graceful shutdown.
        task_status: trio only: ``nursery.start`` gets the bound URLs.
        **reader_options: ``HeaderReader`` options (``versions``,
            ``max_v2_length``, ``verify_crc32c``, ...).
    """
    require("hypercorn", feature="proxyproto.hypercorn", extra="hypercorn")
    options = _Options(
        trust=make_trust_policy(trusted, untrusted),
        header_timeout=header_timeout,
        reader_options=dict(reader_options),
    )
    if _running_library() == "asyncio":
        await _serve_asyncio(app, config, options, shutdown_trigger)
    else:
        await _serve_trio(app, config, options, shutdown_trigger, task_status)


def run(
    app: ASGIApp | str,
    config: Config,
    *,
    trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
    untrusted: Policy = Policy.REJECT,
    header_timeout: float = DEFAULT_TIMEOUT,
    **reader_options: Any,
) -> None:
    """Run ``serve`` in a new event loop of ``config.worker_class``
    (``asyncio``, ``uvloop`` or ``trio``) until SIGINT/SIGTERM.

    Args:
        app: the app, or ``"module:attribute"`` to import.
        config: a ``hypercorn.config.Config`` (``workers`` must be 1).
        trusted: as for ``serve``.
        untrusted: as for ``serve``.
        header_timeout: as for ``serve``.
        **reader_options: as for ``serve``.

    Raises:
        ValueError: more than one worker, an unknown worker class, or TLS
            with uvloop.
    """
    _check_config(config)
    loaded = _load_app(app, config) if isinstance(app, str) else app
    coroutine = partial(
        serve,
        loaded,
        config,
        trusted=trusted,
        untrusted=untrusted,
        header_timeout=header_timeout,
        **reader_options,
    )
    if config.worker_class == "trio":
        import trio

        trio.run(coroutine)
    else:  # asyncio or uvloop: _check_config refused anything else
        loop_factory = None
        if config.worker_class == "uvloop":
            import uvloop  # type: ignore[import-not-found]

            loop_factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(coroutine())


_WORKER_CLASSES = ("asyncio", "uvloop", "trio")


def _check_config(config: Config) -> None:
    """Refuse what ``run`` cannot do with *config*.

    Raises:
        ValueError: more than one worker, an unknown worker class, or TLS
            with uvloop; the message starts with the command-line option
            (``argument -w/--workers: ...``).
    """
    if config.workers not in (0, 1):
        raise ValueError(
            "argument -w/--workers: proxyproto.hypercorn runs one worker per "
            f"process, got {config.workers}; run several processes with "
            "SO_REUSEPORT binds instead"
        )
    if config.worker_class not in _WORKER_CLASSES:
        raise ValueError(
            "argument -k/--worker-class: expected asyncio, uvloop or trio, got "
            f"{config.worker_class!r}"
        )
    if config.worker_class == "uvloop" and config.ssl_enabled:
        raise ValueError(
            "argument -k/--worker-class: TLS after a PROXY header needs the "
            "asyncio or trio worker (uvloop's start_tls() accepts only its own "
            "transports)"
        )


def _load_app(path: str, config: Config) -> ASGIApp:
    from hypercorn.app_wrappers import ASGIWrapper
    from hypercorn.utils import load_application

    wrapper = load_application(path, config.wsgi_max_body_size)
    if not isinstance(wrapper, ASGIWrapper):
        raise ValueError(f"{path} is not an ASGI application")
    return wrapper.app  # type: ignore[return-value]


def _hypercorn_cli_config(argv: Sequence[str]) -> Config | int:
    """Hypercorn's own command line parsed into a ``Config``.

    Private API: ``hypercorn.__main__.main`` parses *argv* and ends with
    ``return run(config)`` using the module global ``run`` (checked against
    Hypercorn 0.17.3 and 0.18.0); we swap that global for the length of the
    call to capture the config. Returns the exit status if Hypercorn exits
    (``--help``, usage errors).
    """
    hypercorn_main: Any = importlib.import_module("hypercorn.__main__")

    captured: list[Config] = []

    def capture(config: Config) -> int:
        captured.append(config)
        return 0

    original = hypercorn_main.run
    hypercorn_main.run = capture
    try:
        status = hypercorn_main.main(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        hypercorn_main.run = original
    return captured[0] if captured else status


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m proxyproto.hypercorn APP [--proxy-* ...] [hypercorn options]``."""
    require(
        "hypercorn", feature="proxyproto.hypercorn", extra="hypercorn", command=True
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = proxy_argument_parser("python -m proxyproto.hypercorn")
    proxy_kwargs, rest = parse_proxy_arguments(parser, argv)
    config = _hypercorn_cli_config(rest)
    if "-h" in rest or "--help" in rest:
        print_proxy_help(parser)
    if isinstance(config, int):
        return config
    try:
        _check_config(config)
    except ValueError as exc:
        parser.error(str(exc))
    run(config.application_path, config, **proxy_kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
