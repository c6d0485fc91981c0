"""tlsedge: a trio-based edge that unwraps and wraps PROXY headers and relays TCP.

Use it as the ``tlsedge`` command, or inside a trio program::

    config = tlsedge.load_config("edge.toml")
    edge = await nursery.start(tlsedge.serve, config)
    ...
    edge.drain()
"""

from __future__ import annotations

from tlsedge._control.edge import Edge as Edge, serve as serve
from tlsedge._core.config import (
    Config as Config,
    ConfigError as ConfigError,
    config_from_mapping as config_from_mapping,
    load_config as load_config,
)
from tlsedge._version import __version__ as __version__

__all__ = [
    "Config",
    "ConfigError",
    "Edge",
    "__version__",
    "config_from_mapping",
    "load_config",
    "serve",
]
