"""Parser options shared by HeaderReader and parse()."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxyproto._errors import LocalProtocolError

# v1: "PROXY UNKNOWN ffff:...:ffff ffff:...:ffff 65535 65535\r\n" is the longest
# line the spec allows, 107 bytes including CRLF.
V1_MAX_LENGTH = 107
# v2: 16 fixed bytes then up to 65535 more. We cap the length field lower by
# default, as go-proxyproto, proxy-protocol-rs and nginx do: 4 KiB leaves room
# for a client certificate TLV and refuses a 64 KiB allocation per connection.
DEFAULT_MAX_V2_LENGTH = 4096
V2_MAX_LENGTH_FIELD = 0xFFFF


@dataclass(frozen=True, slots=True)
class Options:
    versions: frozenset[int] = frozenset({1, 2})
    max_v2_length: int = DEFAULT_MAX_V2_LENGTH
    verify_crc32c: bool = True
    accept_unspec_proxy: bool = False
    accept_ipv4_in_tcp6: bool = False
    # HeaderReader's: NO_HEADER for a stream without a header (parse() has
    # no use for it).
    optional: bool = False
    # ``1 in versions`` and ``2 in versions``, for the reader's per-header
    # dispatch: an attribute load instead of a set lookup.
    accepts_v1: bool = field(init=False, repr=False, compare=False)
    accepts_v2: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.versions or not self.versions <= {1, 2}:
            raise LocalProtocolError(
                f"versions must be a non-empty subset of {{1, 2}}, "
                f"got {set(self.versions)}"
            )
        if not 0 <= self.max_v2_length <= V2_MAX_LENGTH_FIELD:
            raise LocalProtocolError(
                f"max_v2_length must be 0..65535, got {self.max_v2_length}"
            )
        object.__setattr__(self, "accepts_v1", 1 in self.versions)
        object.__setattr__(self, "accepts_v2", 2 in self.versions)


DEFAULT_OPTIONS = Options()
