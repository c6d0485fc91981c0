"""The engine's state tables: complete, and progress only moves forward.

`tlsedge._pipeline.http.attempt` (an attempt's request and response progress),
`tlsedge._pipeline.http.connection` (a connection's states, per version) and
`tlsedge._pipeline.http.h2` (a stream's phases) write their legal moves as
tables; the code asserts each move against them. These tests check the
tables themselves: every state has a row, every move leads to a state of
the same table, the end is reachable from everywhere, and what is declared
forward-only has no way back.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import pytest

from tlsedge._pipeline.http.attempt import (
    DELIVERED,
    NOT_SENT,
    REQUEST_TRANSITIONS,
    RESPONSE_TRANSITIONS,
    STOPPED,
    SWITCHED,
    WAITING,
    RequestProgress,
    ResponseProgress,
)
from tlsedge._pipeline.http.connection import (
    DONE,
    HEAD,
    HTTP1_TRANSITIONS,
    HTTP2_TRANSITIONS,
    OPEN,
    ConnectionState,
)
from tlsedge._pipeline.http.h2 import STREAM_TRANSITIONS, StreamPhase

Table = Mapping[enum.Enum, frozenset[enum.Enum]]


def reachable(table: Table, start: enum.Enum) -> set[enum.Enum]:
    seen = {start}
    todo = [start]
    while todo:
        for after in table[todo.pop()]:
            if after not in seen:
                seen.add(after)
                todo.append(after)
    return seen


def has_cycle(table: Table) -> bool:
    return any(
        state in reachable(table, after) for state in table for after in table[state]
    )


@pytest.mark.parametrize(
    ("table", "members"),
    [
        (REQUEST_TRANSITIONS, set(RequestProgress)),
        (RESPONSE_TRANSITIONS, set(ResponseProgress)),
        (STREAM_TRANSITIONS, set(StreamPhase)),
    ],
)
def test_every_state_has_a_row_and_every_move_a_state(
    table: Table, members: set[enum.Enum]
) -> None:
    assert set(table) == members
    assert all(after <= members for after in table.values())


def test_connection_tables_cover_their_versions_states() -> None:
    http1 = set(HTTP1_TRANSITIONS)
    http2 = set(HTTP2_TRANSITIONS)
    assert http1 | http2 == set(ConnectionState)
    assert http1 & http2 == {DONE}
    for table, states in ((HTTP1_TRANSITIONS, http1), (HTTP2_TRANSITIONS, http2)):
        assert all(after <= states for after in table.values())


@pytest.mark.parametrize(
    ("table", "start", "ends"),
    [
        (REQUEST_TRANSITIONS, NOT_SENT, {STOPPED}),
        (RESPONSE_TRANSITIONS, WAITING, {DELIVERED, SWITCHED}),
        (STREAM_TRANSITIONS, StreamPhase.EXCHANGE, {StreamPhase.CLOSED}),
        (HTTP1_TRANSITIONS, HEAD, {DONE}),
        (HTTP2_TRANSITIONS, OPEN, {DONE}),
    ],
)
def test_everything_is_reachable_and_ends(
    table: Table, start: enum.Enum, ends: set[enum.Enum]
) -> None:
    assert reachable(table, start) == set(table)
    assert {state for state, after in table.items() if not after} == ends
    for state in table:
        assert reachable(table, state) & ends


@pytest.mark.parametrize(
    "table", [REQUEST_TRANSITIONS, RESPONSE_TRANSITIONS, HTTP2_TRANSITIONS]
)
def test_progress_only_moves_forward(table: Table) -> None:
    assert not has_cycle(table)


def test_a_connection_can_end_from_any_state() -> None:
    for table in (HTTP1_TRANSITIONS, HTTP2_TRANSITIONS):
        assert all(DONE in after for state, after in table.items() if state is not DONE)
