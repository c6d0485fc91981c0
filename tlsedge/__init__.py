"""tlsedge: a trio-based edge that unwraps and wraps PROXY headers and relays TCP."""

from __future__ import annotations

from tlsedge._version import __version__ as __version__

__all__ = ["__version__"]
