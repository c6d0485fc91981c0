"""What the edge meets at start beyond its configuration file, checked ahead.

`tlsedge._core.config` checks a configuration alone, without the machine: that is
``tlsedge check --config-only``. This module checks what ``tlsedge run`` would
meet on this machine, as ``nginx -t`` and ``haproxy -c`` do: every certificate
and key file opens, parses and matches (with its chain and client CA), every
backend's TLS files load, every host name in a bind address or a static
server list resolves, and the access-log file opens. Servers found by
``discovery`` are not looked up: the edge starts without them when DNS fails
and keeps trying (docs/discovery.md).

The edge runs the same functions as it starts (`Edge.run`), so ``check`` and
``run`` fail with the same message: a `ConfigError` that starts with the dotted
path of the value at fault (``listeners[0].tls.certificates[0].cert: ...``).
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from pathlib import Path

import trio

from tlsedge._backends.discovery import Found
from tlsedge._core.accesslog import ACCESS_LOG_OFF
from tlsedge._core.config import (
    Address,
    BackendConfig,
    Config,
    ConfigError,
    TlsConfig,
)
from tlsedge._tls.certs import CertificateError
from tlsedge._tls.contexts import ServerTLS, build_client_context, build_server_contexts

__all__ = [
    "access_log_error",
    "backend_tls_context",
    "check_backend",
    "check_environment",
    "load_listener_tls",
    "resolve_servers",
]


def _file_key(files: dict[str, Path | None], path: str, exc: Exception) -> str:
    """The dotted path of the key that named the file *exc* is about."""
    file = exc.file if isinstance(exc, CertificateError) else None
    if file is not None:
        for key, value in files.items():
            if value == file:
                return f"{path}.{key}"
    return path


def load_listener_tls(tls: TlsConfig, path: str) -> ServerTLS:
    """Load a listener's certificates and build its TLS contexts.

    Args:
        tls: The listener's ``tls`` table.
        path: Its dotted path, ``listeners[0].tls``.

    Raises:
        ConfigError: A certificate, key or CA file is unusable; the message
            starts with the key that names it.
    """
    try:
        return build_server_contexts(tls)
    except (CertificateError, OSError) as exc:  # ssl.SSLError is an OSError
        files: dict[str, Path | None] = {}
        for index, item in enumerate(tls.certificates):
            files.setdefault(f"certificates[{index}].cert", item.cert)
            files.setdefault(f"certificates[{index}].key", item.key)
        files["client_ca"] = tls.client_ca
        raise ConfigError(f"{_file_key(files, path, exc)}: {exc}") from exc


def backend_tls_context(backend: BackendConfig, path: str) -> ssl.SSLContext | None:
    """The client context of a ``protocol = "tls"`` backend (None otherwise).

    Args:
        backend: The ``[[backends]]`` table.
        path: Its dotted path, ``backends[0]``.

    Raises:
        ConfigError: A CA, certificate or key file is unusable; the message
            starts with the key that names it.
    """
    tls = backend.tls
    if backend.protocol != "tls" or tls is None:
        return None
    try:
        return build_client_context(tls)
    except (CertificateError, OSError) as exc:
        files = {"ca": tls.ca, "cert": tls.cert, "key": tls.key}
        raise ConfigError(f"{_file_key(files, f'{path}.tls', exc)}: {exc}") from exc


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _resolve(
    address: Address, path: str, *, passive: bool, owner: str = ""
) -> tuple[str, int]:
    """*address* as a numeric ``(ip, port)`` (the first answer for a name)."""
    if _is_ip(address.host):
        return (address.host, address.port)
    try:
        infos = await trio.socket.getaddrinfo(
            address.host,
            address.port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE if passive else 0,
        )
    except socket.gaierror as exc:
        raise ConfigError(
            f"{path}: host {address.host!r}{owner} does not resolve: {exc.strerror}"
        ) from exc
    found = infos[0][4]
    return (str(found[0]), int(found[1]))


async def resolve_servers(backend: BackendConfig, path: str) -> list[Found]:
    """The backend's ``servers`` with their names resolved, and their weights.

    Names are resolved once here, at start and reload (and by ``check``),
    never per connection.

    Raises:
        ConfigError: A name does not resolve (the message names its key).
    """
    return [
        (
            await _resolve(
                server.address,
                f"{path}.servers[{index}]",
                passive=False,
                owner=f" of backend {backend.name!r}",
            ),
            server.weight,
        )
        for index, server in enumerate(backend.servers)
    ]


async def check_backend(backend: BackendConfig, path: str) -> None:
    """Check a backend's TLS files and resolve its static server names, as
    `tlsedge._backends.upstream.BackendPool` does when the edge starts.

    Args:
        backend: The ``[[backends]]`` table.
        path: Its dotted path, ``backends[0]``.

    Raises:
        ConfigError: A file is unusable or a name does not resolve.
    """
    backend_tls_context(backend, path)
    await resolve_servers(backend, path)


def access_log_error(path: str, exc: OSError) -> ConfigError:
    """The error for an ``edge.access_log`` file at *path* that cannot be opened."""
    return ConfigError(f"edge.access_log: cannot open {path}: {exc.strerror or exc}")


def _check_access_log(path: str) -> None:
    if path in {"-", "stdout", ACCESS_LOG_OFF}:
        return
    try:
        # Append mode, as the edge opens it: an absent file is created empty.
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise access_log_error(path, exc) from exc


async def check_environment(config: Config) -> None:
    """Check everything ``tlsedge run`` would meet at start except binding.

    Ports are not bound: a check must not disturb a running edge that holds
    them. Bind host names are resolved.

    Raises:
        ConfigError: The first problem, its message starting with the dotted path.
    """
    for index, listener in enumerate(config.listeners):
        await _resolve(listener.bind, f"listeners[{index}].bind", passive=True)
        if listener.tls is not None:
            load_listener_tls(listener.tls, f"listeners[{index}].tls")
    if config.edge.admin is not None:
        await _resolve(config.edge.admin, "edge.admin", passive=True)
    _check_access_log(config.edge.access_log)
    for index, backend in enumerate(config.backends):
        await check_backend(backend, f"backends[{index}]")
