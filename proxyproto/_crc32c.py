"""CRC32C (Castagnoli), the checksum of the PROXY v2 CRC32C TLV.

The standard library only has the IEEE CRC-32 (``zlib.crc32``), which uses a
different polynomial. We use an accelerated implementation when a well-kept one
is installed (``google-crc32c``, then ``crc32c``) and otherwise a pure-Python
"slicing-by-8" table implementation: eight 256-entry tables let one loop
iteration fold in eight bytes read with a single ``struct`` unpack, which is
about 2.5x faster than the classic byte-at-a-time loop in CPython. Both paths
give identical results (tested against each other and the RFC 3720 vectors).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

__all__ = ["ACCELERATED", "crc32c", "crc32c_pure"]

# Reflected Castagnoli polynomial (RFC 4960 appendix B / RFC 3720 appendix B.4).
_POLY = 0x82F63B78


def _make_tables() -> tuple[list[int], ...]:
    t0 = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t0.append(c)
    tables = [t0]
    for _ in range(7):
        prev = tables[-1]
        tables.append([(prev[i] >> 8) ^ t0[prev[i] & 0xFF] for i in range(256)])
    return tuple(tables)


_T0, _T1, _T2, _T3, _T4, _T5, _T6, _T7 = _make_tables()
_UNPACKERS: dict[int, Callable[[bytes | bytearray | memoryview], tuple[int, ...]]] = {}


def crc32c_pure(data: bytes | bytearray | memoryview) -> int:
    """Return the CRC32C of *data*, computed in pure Python."""
    crc = 0xFFFFFFFF
    words = len(data) >> 3
    if words:
        unpack = _UNPACKERS.get(words)
        if unpack is None:
            unpack = _UNPACKERS[words] = struct.Struct(f"<{words}Q").unpack_from
        t0, t1, t2, t3, t4, t5, t6, t7 = _T0, _T1, _T2, _T3, _T4, _T5, _T6, _T7
        for word in unpack(data):
            x = word ^ crc
            crc = (
                t7[x & 0xFF]
                ^ t6[(x >> 8) & 0xFF]
                ^ t5[(x >> 16) & 0xFF]
                ^ t4[(x >> 24) & 0xFF]
                ^ t3[(x >> 32) & 0xFF]
                ^ t2[(x >> 40) & 0xFF]
                ^ t1[(x >> 48) & 0xFF]
                ^ t0[x >> 56]
            )
    t0 = _T0
    for byte in data[words << 3 :]:
        crc = t0[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _find_accelerated() -> Callable[[bytes], int] | None:
    try:
        import google_crc32c

        if google_crc32c.implementation == "c":
            value: Callable[[bytes], int] = google_crc32c.value
            return value
    except ImportError:
        pass
    try:
        import crc32c as _crc32c_pkg

        fast: Callable[[bytes], int] = _crc32c_pkg.crc32c
    except ImportError:
        return None
    return fast


_accelerated = _find_accelerated()

#: The name of the accelerated implementation in use, or None for pure Python.
ACCELERATED: str | None = (
    None if _accelerated is None else _accelerated.__module__.split(".")[0]
)


def crc32c(data: bytes) -> int:
    """Return the CRC32C of *data* (accelerated when a C implementation exists)."""
    if _accelerated is not None:
        return _accelerated(data)
    return crc32c_pure(data)
