"""The ``proxyproto:`` endpoint string for Twisted (``serverFromString``,
``daphne -e``, ``twistd --listen``): see ``proxyproto.twisted``.

Twisted finds plugins in every ``twisted/plugins`` directory on ``sys.path``
that has no ``__init__.py``; the wheel installs this file into Twisted's own.
"""

from __future__ import annotations

from proxyproto.twisted import ProxyEndpointParser

proxyproto_endpoint = ProxyEndpointParser()
