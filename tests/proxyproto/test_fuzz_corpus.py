"""Replay the fuzz corpus through the fuzz harness, so the harness cannot rot,
plus regression tests for what the fuzzer found."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from proxyproto import V2_SIGNATURE, HeaderReader, RemoteProtocolError, parse

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"
CORPUS = FUZZ / "corpus"


def _load_target() -> Callable[[bytes], None]:
    spec = importlib.util.spec_from_file_location(
        "fuzz_reader", FUZZ / "fuzz_reader.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target: Callable[[bytes], None] = module.TestOneInput
    return target


one_input = _load_target()
CORPUS_FILES = sorted(p for p in CORPUS.iterdir() if p.is_file())


def test_corpus_is_there() -> None:
    assert len(CORPUS_FILES) >= 30
    names = {p.name for p in CORPUS_FILES}
    assert "v2_aws_nlb_crc32c_vpce_noop.bin" in names
    assert any(n.startswith("nm_") for n in names)  # near misses


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.name for p in CORPUS_FILES])
def test_corpus_file(path: Path) -> None:
    one_input(path.read_bytes())


def test_random_inputs() -> None:
    rng = random.Random(20260427)
    seeds = [p.read_bytes() for p in CORPUS_FILES]
    for _ in range(150):
        one_input(rng.randbytes(rng.randrange(0, 200)))
    prefixes = [b"PROXY ", b"PROXY TCP4 ", b"PROXY UNKNOWN", V2_SIGNATURE]
    for _ in range(100):
        one_input(rng.choice(prefixes) + rng.randbytes(rng.randrange(0, 120)))
    for _ in range(150):  # corpus files with a few random edits
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(0, len(data) + 1)
            op = rng.randrange(3)
            if op == 0 and i < len(data):
                data[i] ^= 1 << rng.randrange(8)
            elif op == 1:
                data[i:i] = rng.randbytes(rng.randrange(1, 4))
            else:
                del data[i:]
        one_input(bytes(data))


# -- regressions: inputs whose outcome depended on how the bytes were split ---


def _reason(chunks: list[bytes], **options: object) -> str:
    reader = HeaderReader(**options)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError) as info:  # noqa: PT012
        for chunk in [*chunks, b""]:
            reader.receive_data(chunk)
            reader.next_event()
    return info.value.reason


@pytest.mark.parametrize(
    ("data", "options", "reason"),
    [
        # A final CR was judged as part of the protocol token.
        (b"PROXY TCP4\r\n", {}, "bad_v1"),
        # The length check ran before the bad-byte check.
        (b"PROXY TCP6 2001:db8:" + b"\xe0" * 100, {}, "bad_v1"),
        # "UNKNOWN" glued to other bytes was let through by the prefix check.
        (b"PROXY UNKNOWN\x00\x00T\n!\r\n", {}, "bad_v1_protocol"),
        # v2-only readers called any "P..." a v1 header after one byte.
        (b"PSOXY TCP4 0.0.0.0 0.0.0.0 0 0\r\n", {"versions": (2,)}, "bad_signature"),
        (
            b"PROXY TCP4 0.0.0.0 0.0.0.0 0 0\r\n",
            {"versions": (2,)},
            "version_not_allowed",
        ),
    ],
)
def test_whole_and_byte_by_byte_agree(
    data: bytes, options: dict[str, object], reason: str
) -> None:
    assert _reason([data], **options) == reason
    assert _reason([data[i : i + 1] for i in range(len(data))], **options) == reason
    with pytest.raises(RemoteProtocolError):
        parse(data, **options)  # type: ignore[arg-type]
