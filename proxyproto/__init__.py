"""proxyproto: a strict, fast, sans-IO PROXY protocol v1/v2 codec."""

from __future__ import annotations
