"""Serve an ASGI app with Uvicorn behind a PROXY-protocol load balancer.

The header is read at the transport level, before TLS and HTTP
(Kludex/uvicorn#777): every connection starts with a ``ProxyProtocolWrapper``
(``proxyproto.asyncio``, set up for ASGI servers in ``proxyproto._asgi``) that
reads it, then hands the connection to Uvicorn's HTTP protocol with a
transport reporting the header's addresses, so ``scope["client"]``,
``scope["server"]`` and Uvicorn's access log show the real client. The whole
header is in ``scope["extensions"]["proxyproto"] == {"header": ProxyHeader |
None, "peer": (host, port)}`` (``peer`` is the load balancer)::

    proxyproto.uvicorn.run(app, host="0.0.0.0", port=8000, trusted=["10.0.0.0/8"])

or ``ProxyConfig(app, trusted=[...], **uvicorn_config_kwargs)`` with
``uvicorn.Server``, or from the command line::

    python -m proxyproto.uvicorn myapp:app --host 0.0.0.0 --port 8000 \\
        --proxy-trusted 10.0.0.0/8 [other uvicorn options]

TLS (``ssl_certfile``/``--ssl-certfile`` ...): Uvicorn would put asyncio's
TLS below the HTTP protocol, where the PROXY header would be taken for a
ClientHello. ``ProxyConfig`` takes the ``SSLContext`` Uvicorn builds, serves
a plain socket, and starts TLS (asyncio's own SSL protocol) after the header,
fed with the bytes that followed it. That needs the asyncio loop: with TLS,
``loop="auto"`` means asyncio, and ``loop="uvloop"`` is refused.

Checked against Uvicorn 0.54.0.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxyproto._asgi import (
    DEFAULT_SSL_HANDSHAKE_TIMEOUT,
    DEFAULT_TIMEOUT,
    DEFAULT_TRUSTED,
    EXTENSION,
    AsyncioSettings,
    Connection,
    ProxyInfo,
    ProxyScopeMiddleware,
    ServerProtocolWrapper,
    TrustedArg,
    make_trust_policy,
    parse_proxy_arguments,
    print_proxy_help,
    proxy_argument_parser,
)
from proxyproto._extras import missing_extra
from proxyproto._policy import Policy, TrustPolicy

try:
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE
except ModuleNotFoundError as exc:
    missing_extra(
        exc,
        feature="proxyproto.uvicorn",
        package="uvicorn",
        extra="uvicorn",
        command=__name__ == "__main__",
    )

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_TRUSTED",
    "EXTENSION",
    "ProxyConfig",
    "ProxyInfo",
    "main",
    "run",
]

LOGGER = logging.getLogger("proxyproto.uvicorn")

# The per-connection Connection rides in the protocol's app_state copy under
# this key (so it survives ``reset_contextvars``); the middleware moves it to
# scope["extensions"]["proxyproto"] and removes it from scope["state"].
_STATE_KEY = "proxyproto.connection"


def _lookup_state(scope: Mapping[str, Any]) -> Connection | None:
    state = scope.get("state")
    if isinstance(state, dict):
        connection: Connection | None = state.pop(_STATE_KEY, None)
        return connection
    return None


class _ProtocolFactory:
    """Stands in for ``config.http_protocol_class``: makes a
    ``ServerProtocolWrapper`` that builds the real HTTP protocol once the
    header is read.

    Private API: ``uvicorn.Server.startup`` calls
    ``config.http_protocol_class(config=, server_state=, app_state=, _loop=)``
    (checked against Uvicorn 0.54.0; ``test_private_api`` checks it).
    """

    def __init__(self, protocol_class: Any, settings: AsyncioSettings) -> None:
        self.protocol_class = protocol_class
        self.settings = settings
        self.alpn_protocols = getattr(protocol_class, "alpn_protocols", None)

    def __call__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> asyncio.Protocol:
        def make_protocol(connection: Connection) -> asyncio.Protocol:
            state = dict(app_state)
            state[_STATE_KEY] = connection
            protocol: asyncio.Protocol = self.protocol_class(
                config=config, server_state=server_state, app_state=state, _loop=_loop
            )
            return protocol

        return ServerProtocolWrapper(self.settings, make_protocol)


def _tls(kwargs: Mapping[str, Any]) -> bool:
    return bool(kwargs.get("ssl_certfile") or kwargs.get("ssl_context_factory"))


def _check_loop(kwargs: Mapping[str, Any]) -> None:
    """Refuse TLS with ``loop="uvloop"`` (ValueError naming ``--loop``)."""
    if _tls(kwargs) and kwargs.get("loop") == "uvloop":
        raise ValueError(
            "argument --loop: TLS after a PROXY header needs the asyncio loop "
            "(uvloop's start_tls() accepts only its own transports)"
        )


class ProxyConfig(uvicorn.Config):
    """A ``uvicorn.Config`` whose server reads a PROXY header on every connection.

    Use it like ``uvicorn.Config`` (``uvicorn.Server(ProxyConfig(...)).run()``).

    Args:
        app: as for ``uvicorn.Config``.
        trusted: load balancer CIDRs/addresses that must send a header, or a
            ``TrustPolicy``. Default: only 127.0.0.1 and ::1.
        untrusted: policy for everyone else (``REJECT`` closes, ``SKIP``
            serves them directly without a header).
        header_timeout: seconds the complete header may take.
        ssl_handshake_timeout: seconds the TLS handshake may take.
        proxy_options: ``HeaderReader`` options (``versions``,
            ``max_v2_length``, ``verify_crc32c``, ...).
        **kwargs: ``uvicorn.Config`` options. ``proxy_headers`` defaults to
            False here: the PROXY header already gives the client address.

    Raises:
        ValueError: TLS with ``loop="uvloop"``.
    """

    def __init__(
        self,
        app: Any,
        *,
        trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
        untrusted: Policy = Policy.REJECT,
        header_timeout: float = DEFAULT_TIMEOUT,
        ssl_handshake_timeout: float = DEFAULT_SSL_HANDSHAKE_TIMEOUT,
        proxy_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("proxy_headers", False)
        _check_loop(kwargs)
        if _tls(kwargs) and kwargs.get("loop", "auto") == "auto":
            kwargs["loop"] = "asyncio"
        super().__init__(app, **kwargs)
        self.proxy_trust = make_trust_policy(trusted, untrusted)
        self.proxy_header_timeout = header_timeout
        self.proxy_ssl_handshake_timeout = ssl_handshake_timeout
        self.proxy_options = dict(proxy_options or {})
        self.proxy_ssl: Any = None

    def load(self) -> None:
        """Load as Uvicorn does, then put the PROXY layer in place."""
        super().load()
        _install(self)


def _install(config: ProxyConfig) -> None:
    """Put the PROXY layer into a loaded config.

    Private API (checked against Uvicorn 0.54.0): ``Config.load()`` sets
    ``http_protocol_class`` (what ``Server`` instantiates per connection),
    ``ssl`` (the ``SSLContext`` ``Server`` passes to ``create_server``) and
    ``loaded_app`` (the app protocols call). We replace the first with a
    factory for ``ServerProtocolWrapper``, move the second to ``proxy_ssl`` (TLS
    is started by the wrapper after the header), and wrap the third.
    ``tests/proxyproto/test_uvicorn.py::test_private_api`` checks them.
    """
    config.proxy_ssl = config.ssl
    config.ssl = None
    settings = AsyncioSettings(
        trust=config.proxy_trust,
        header_timeout=config.proxy_header_timeout,
        ssl_context=config.proxy_ssl,
        ssl_handshake_timeout=config.proxy_ssl_handshake_timeout,
        reader_options=config.proxy_options,
        logger=LOGGER,
    )
    config.http_protocol_class = _ProtocolFactory(  # type: ignore[assignment]
        config.http_protocol_class, settings
    )
    config.loaded_app = ProxyScopeMiddleware(config.loaded_app, _lookup_state)


def run(
    app: Any,
    *,
    trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
    untrusted: Policy = Policy.REJECT,
    header_timeout: float = DEFAULT_TIMEOUT,
    ssl_handshake_timeout: float = DEFAULT_SSL_HANDSHAKE_TIMEOUT,
    proxy_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> None:
    """Like ``uvicorn.run``, with a PROXY header read on every connection.

    Args:
        app: the ASGI app, or ``"module:attribute"`` (required for
            ``reload`` and ``workers``).
        trusted: as for ``ProxyConfig``.
        untrusted: as for ``ProxyConfig``.
        header_timeout: as for ``ProxyConfig``.
        ssl_handshake_timeout: as for ``ProxyConfig``.
        proxy_options: as for ``ProxyConfig``.
        **kwargs: ``uvicorn.run`` options.
    """
    app_dir = kwargs.pop("app_dir", None)
    if app_dir is not None:
        sys.path.insert(0, app_dir)
    config = ProxyConfig(
        app,
        trusted=trusted,
        untrusted=untrusted,
        header_timeout=header_timeout,
        ssl_handshake_timeout=ssl_handshake_timeout,
        proxy_options=proxy_options,
        **kwargs,
    )
    server = uvicorn.Server(config=config)
    if (config.reload or config.workers > 1) and not isinstance(app, str):
        LOGGER.warning(
            "You must pass the application as an import string to enable "
            "'reload' or 'workers'."
        )
        sys.exit(STARTUP_FAILURE)
    try:
        if config.should_reload:
            from uvicorn.supervisors import ChangeReload

            sock = config.bind_socket()
            ChangeReload(config, target=server.run, sockets=[sock]).run()
        elif config.workers > 1:
            from uvicorn.supervisors import Multiprocess

            sock = config.bind_socket()
            if "target" in inspect.signature(Multiprocess).parameters:
                Multiprocess(config, target=server.run, sockets=[sock]).run()  # type: ignore[call-arg]
            else:
                Multiprocess(config, sockets=[sock]).run()
        else:
            server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if config.uds and os.path.exists(config.uds):
            os.remove(config.uds)
    if not server.started and not config.should_reload and config.workers == 1:
        sys.exit(STARTUP_FAILURE)


def _uvicorn_cli_kwargs(argv: Sequence[str]) -> tuple[Any, dict[str, Any]] | int:
    """Uvicorn's own command line parsed into ``uvicorn.run`` arguments.

    Private API: the ``uvicorn.main.main`` click command ends by calling the
    module global ``uvicorn.main.run(app, **options)`` (checked against
    Uvicorn 0.54.0); we swap that global for the length of the call to
    capture the arguments, so every Uvicorn option (and ``UVICORN_*``
    environment variable) works unchanged. Returns the exit status if
    Uvicorn exits (``--help``, ``--version``, usage errors).
    """
    import importlib

    import click

    # ``uvicorn.main`` the attribute is the click command; we need the module.
    uvicorn_main: Any = importlib.import_module("uvicorn.main")

    captured: list[tuple[Any, dict[str, Any]]] = []

    def capture(app: Any, **kwargs: Any) -> None:
        captured.append((app, kwargs))

    original: Callable[..., Any] = uvicorn_main.run
    uvicorn_main.run = capture
    try:
        uvicorn_main.main.main(
            args=list(argv),
            prog_name="python -m proxyproto.uvicorn",
            standalone_mode=False,
        )
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        return 1
    finally:
        uvicorn_main.run = original
    return captured[0] if captured else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m proxyproto.uvicorn APP [--proxy-* ...] [uvicorn options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = proxy_argument_parser("python -m proxyproto.uvicorn")
    proxy_kwargs, rest = parse_proxy_arguments(parser, argv)
    if "--help" in rest:
        result = _uvicorn_cli_kwargs(rest)
        print_proxy_help(parser)
        return result if isinstance(result, int) else 0
    result = _uvicorn_cli_kwargs(rest)
    if isinstance(result, int):
        return result
    app, kwargs = result
    versions = proxy_kwargs.pop("versions", None)
    if versions is not None:
        proxy_kwargs["proxy_options"] = {"versions": versions}
    if kwargs.get("proxy_headers") is True and "--proxy-headers" not in rest:
        kwargs["proxy_headers"] = False  # the PROXY header gives the client
    try:
        _check_loop(kwargs)
    except ValueError as exc:
        parser.error(str(exc))
    run(app, **proxy_kwargs, **kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
