"""Optional dependencies: one clear message naming the extra to install (private).

``proxyproto probe`` and ``proxyproto.strategies`` need Hypothesis,
``proxyproto.uvicorn`` Uvicorn, ``proxyproto.hypercorn`` Hypercorn,
``proxyproto.twisted`` Twisted, ``proxyproto.gunicorn`` gunicorn; a plain
``pip install tlsedge`` has none of them. The extras in pyproject.toml
(``probe``, ``uvicorn``, ``hypercorn``, ``twisted``, ``gunicorn``) install
each with the versions the adapters are tested against.
"""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

__all__ = [
    "EXIT_USAGE",
    "MissingExtraError",
    "exit_missing",
    "missing_extra",
    "require",
]

#: The exit status of a command whose optional dependency is missing.
EXIT_USAGE = 2


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message says which extra
    installs it (``pip install 'tlsedge[EXTRA]'``)."""


def _is_missing(exc: ModuleNotFoundError, package: str) -> bool:
    name = exc.name or ""
    return name == package or name.startswith(package + ".")


def missing_extra(
    exc: ModuleNotFoundError,
    *,
    feature: str,
    package: str,
    extra: str,
    command: bool = False,
) -> NoReturn:
    """Re-raise *exc*, the failed import of *package*, as a
    ``MissingExtraError`` saying ``FEATURE needs PACKAGE: pip install
    'tlsedge[EXTRA]'``; any other missing module is re-raised unchanged.

    With *command* (a module run as ``python -m``), print that line instead
    and exit 2: a usage problem, not a traceback.
    """
    if not _is_missing(exc, package):
        raise exc
    message = f"{feature} needs {package}: pip install 'tlsedge[{extra}]'"
    error = MissingExtraError(message, name=exc.name)
    if command:
        exit_missing(error)
    raise error from exc


def require(package: str, *, feature: str, extra: str, command: bool = False) -> None:
    """Import *package*, or fail as ``missing_extra`` says."""
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as exc:
        missing_extra(
            exc, feature=feature, package=package, extra=extra, command=command
        )


def exit_missing(exc: MissingExtraError) -> NoReturn:
    """For command lines: print the message on one line and exit 2."""
    sys.stderr.write(f"{exc}\n")
    raise SystemExit(EXIT_USAGE)
