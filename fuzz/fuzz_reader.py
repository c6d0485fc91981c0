"""Fuzz harness for proxyproto's HeaderReader and parse().

The invariant
-------------
No matter what bytes arrive, the reader either returns a header or raises
RemoteProtocolError -- nothing else, ever. More precisely, for every input and
for each reader configuration below:

1. Feeding the input in one piece (then EOF) ends in a ProxyHeader, NO_HEADER
   (optional readers only) or RemoteProtocolError; any other exception is a bug.
2. Feeding it byte by byte, and in the chunks ``bytes_needed`` asks for, gives
   the same outcome: the same header and the same ``trailing_data``, or an
   error with the same ``reason``.
3. Once the reader has failed it keeps failing with the same error.
4. The reader never waits for more than the limits allow: it has decided after
   at most 107 bytes of a v1 header or 16 + max_v2_length bytes of a v2 one.
5. Reading ``bytes_needed`` at a time never reads past the header.
6. ``parse()`` agrees with the reader.
7. A returned header is usable: its accessors raise nothing but
   RemoteProtocolError (and that only for the cloud vendors' TLVs, which are
   checked on access), and it re-encodes to bytes that parse back to an equal
   header (CRC32C values aside, since they are recomputed).

Running it
----------
With atheris installed this is a libFuzzer target::

    python fuzz/fuzz_reader.py -max_total_time=600 /tmp/fuzz_work fuzz/corpus

Without atheris (or with ``--replay``) it replays files or directories given
on the command line, by default ``fuzz/corpus``::

    python fuzz/fuzz_reader.py --replay [PATH ...]

``--splits`` checks invariant 2 with three cut points derived from each input
instead of every byte (plus the ``bytes_needed`` chunks, as always): about 4x
the executions per second, for campaigns of millions of executions.

See fuzz/README.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path

try:
    import atheris
except ImportError:  # replay mode only
    atheris = None

# Instrument proxyproto for coverage feedback, but only when fuzzing for real:
# tests import this module to replay the corpus.
_fuzzing = atheris is not None and __name__ == "__main__" and "--replay" not in sys.argv
_splits_only = __name__ == "__main__" and "--splits" in sys.argv
with (
    atheris.instrument_imports(include=["proxyproto"])
    if _fuzzing
    else contextlib.nullcontext()
):
    from proxyproto import (
        NEED_DATA,
        NO_HEADER,
        TLV,
        HeaderReader,
        ProxyHeader,
        RemoteProtocolError,
        TLVType,
        encode_v1,
        encode_v2,
        parse,
    )

CORPUS = Path(__file__).parent / "corpus"

# The reader configurations: every input is checked with the strict default,
# and with one other configuration picked by its length: every lenient option
# at once (optional header, PROXY+UNSPEC, IPv4 in TCP6, no CRC check, small v2
# limit), v2 only, or v1 only.
DEFAULT_CONFIG: dict[str, object] = {}
OTHER_CONFIGS: tuple[dict[str, object], ...] = (
    {
        "optional": True,
        "accept_unspec_proxy": True,
        "accept_ipv4_in_tcp6": True,
        "verify_crc32c": False,
        "max_v2_length": 300,
    },
    {"versions": (2,)},
    {"versions": (1,), "max_v2_length": 0},
)
V1_MAX = 107
DEFAULT_MAX_V2_LENGTH = 4096

# An outcome: ("header", header, trailing) | ("no_header", trailing)
#            | ("error", reason)
Outcome = tuple[object, ...]


def _reader(config: dict[str, object]) -> HeaderReader:
    return HeaderReader(**config)  # type: ignore[arg-type]


def _finish(reader: HeaderReader, event: object) -> Outcome:
    if event is NO_HEADER:
        return ("no_header", reader.trailing_data)
    assert isinstance(event, ProxyHeader), event
    return ("header", event, reader.trailing_data)


def _error(reader: HeaderReader, exc: RemoteProtocolError) -> Outcome:
    # Once in ERROR, always ERROR, with the same error.
    for _ in range(2):
        again: RemoteProtocolError | None = None
        try:
            reader.next_event()
        except RemoteProtocolError as raised:
            again = raised
        assert again is not None, "reader recovered from an error"
        assert again.reason == exc.reason, (again, exc)
    reader.receive_data(b"more")  # ignored once in ERROR
    assert reader.bytes_needed == 0
    return ("error", exc.reason)


def _whole(data: bytes, config: dict[str, object]) -> Outcome:
    reader = _reader(config)
    try:
        reader.receive_data(data)
        event = reader.next_event()
        if event is NEED_DATA:
            reader.receive_data(b"")
            event = reader.next_event()
            assert event is not NEED_DATA, "NEED_DATA after EOF"
    except RemoteProtocolError as exc:
        return _error(reader, exc)
    return _finish(reader, event)


def _limit(data: bytes, config: dict[str, object]) -> int:
    """How many bytes the reader may hold while still answering NEED_DATA."""
    max_v2 = config.get("max_v2_length", DEFAULT_MAX_V2_LENGTH)
    assert isinstance(max_v2, int)
    return V1_MAX - 1 if data[:1] == b"P" else 16 + max_v2 - 1


def _cut_points(data: bytes) -> range | list[int]:
    """Where to split *data*: after every byte, or (``--splits``) three places."""
    if not _splits_only:
        return range(1, len(data))
    size = len(data) + 1
    return sorted({zlib.crc32(data) % size, zlib.adler32(data) % size, size // 2})


def _in_pieces(data: bytes, config: dict[str, object]) -> Outcome:
    reader = _reader(config)
    limit = _limit(data, config)
    start = 0
    try:
        for end in [*_cut_points(data), len(data)]:
            if end <= start:
                continue
            reader.receive_data(data[start:end])
            start = end
            event = reader.next_event()
            if event is not NEED_DATA:
                outcome = _finish(reader, event)
                return (*outcome[:-1], outcome[-1] + data[end:])  # type: ignore[operator]
            # The reader only keeps waiting while a valid header can still come.
            assert end <= limit, f"still NEED_DATA after {end} bytes"
        reader.receive_data(b"")
        event = reader.next_event()
    except RemoteProtocolError as exc:
        return _error(reader, exc)
    return _finish(reader, event)


def _by_bytes_needed(data: bytes, config: dict[str, object]) -> Outcome:
    reader = _reader(config)
    pos = 0
    try:
        while True:
            wanted = reader.bytes_needed
            assert wanted >= 1
            chunk = data[pos : pos + wanted]
            pos += len(chunk)
            reader.receive_data(chunk)
            event = reader.next_event()
            if event is not NEED_DATA:
                break
            assert chunk, "NEED_DATA after EOF"
    except RemoteProtocolError as exc:
        return _error(reader, exc)
    outcome = _finish(reader, event)
    if outcome[0] == "header":
        # Reading what bytes_needed asks for never reads past the header.
        assert outcome[2] == b"", "bytes_needed read past the header"
    return (*outcome[:-1], outcome[-1] + data[pos:])  # type: ignore[operator]


def _use_header(header: ProxyHeader) -> None:
    """Touch everything a receiver may look at."""
    hash(header)
    repr(header)
    str(header.source)
    str(header.destination)
    for name in ("alpn", "authority", "unique_id", "crc32c", "netns", "ssl"):
        getattr(header, name)
    for name in ("aws_vpce_id", "azure_link_id", "gcp_psc_id"):
        with contextlib.suppress(RemoteProtocolError):
            getattr(header, name)


def _without_crc_values(header: ProxyHeader) -> ProxyHeader:
    return dataclasses.replace(
        header,
        tlvs=tuple(
            TLV(t.type, b"") if t.type == TLVType.CRC32C else t for t in header.tlvs
        ),
    )


def _check_reencode(header: ProxyHeader, config: dict[str, object]) -> None:
    # encode_v2 recomputes a CRC32C TLV if there is one.
    wire = encode_v1(header) if header.version == 1 else encode_v2(header)
    options = {k: v for k, v in config.items() if k != "optional"}
    again, consumed = parse(wire, **options)  # type: ignore[arg-type]
    assert consumed == len(wire)
    assert _without_crc_values(again) == _without_crc_values(header), (again, header)


def check(data: bytes, config: dict[str, object]) -> None:
    """Check the invariant for one input and one reader configuration."""
    whole = _whole(data, config)
    pieces = _in_pieces(data, config)
    assert pieces == whole, (pieces, whole)
    assert _by_bytes_needed(data, config) == whole
    options = {k: v for k, v in config.items() if k != "optional"}
    try:
        parsed: Outcome = ("parsed", *parse(data, **options))  # type: ignore[arg-type]
    except RemoteProtocolError:
        parsed = ("refused",)
    if whole[0] == "header":
        header, trailing = whole[1], whole[2]
        assert isinstance(header, ProxyHeader)
        assert isinstance(trailing, bytes)
        assert parsed == ("parsed", header, len(data) - len(trailing))
        _use_header(header)
        _check_reencode(header, config)
    elif whole[0] == "error":
        assert parsed == ("refused",)


def TestOneInput(data: bytes) -> None:
    """The fuzz target: check *data* with two reader configurations."""
    check(data, DEFAULT_CONFIG)
    check(data, OTHER_CONFIGS[len(data) % len(OTHER_CONFIGS)])


def replay(paths: Sequence[str]) -> int:
    """Run every file under *paths* through the target; return the count."""
    count = 0
    for path in map(Path, paths or [str(CORPUS)]):
        files = (
            sorted(p for p in path.rglob("*") if p.is_file())
            if path.is_dir()
            else [path]
        )
        for file in files:
            TestOneInput(file.read_bytes())
            count += 1
    return count


def main(argv: list[str]) -> None:
    argv = [a for a in argv if a != "--splits"]
    if _fuzzing:
        atheris.Setup(argv, TestOneInput)
        atheris.Fuzz()
    else:
        paths = [a for a in argv[1:] if not a.startswith("-")]
        print(f"replayed {replay(paths)} inputs: OK")


if __name__ == "__main__":
    main(sys.argv)
