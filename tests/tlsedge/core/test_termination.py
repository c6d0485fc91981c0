"""The one vocabulary of termination causes."""

from __future__ import annotations

import json

from tlsedge._core.termination import Refused, Termination


def test_members_are_their_values_in_logs_and_labels() -> None:
    assert json.dumps({"t": Termination.HEALTH_CHECK}) == '{"t": "health_check"}'
    assert f"{Termination.DRAINED}" == "drained"
    assert str(Termination.CLIENT_CLOSED) == "client_closed"
    assert {"client_closed": 1}[Termination.CLIENT_CLOSED] == 1  # same hash


def test_values_are_unique_and_lower_snake_case() -> None:
    values = [member.value for member in Termination]
    assert len(values) == len(set(values))
    assert all(value.replace("_", "").isalpha() for value in values)
    assert all(value == value.lower() for value in values)


def test_refused_carries_its_cause() -> None:
    refused = Refused(Termination.HEADER_ERROR, "bad signature", reason="signature")
    assert refused.termination is Termination.HEADER_ERROR
    assert refused.detail == "bad signature"
    assert refused.reason == "signature"
    assert str(refused) == "header_error: bad signature"
    assert Refused(Termination.NO_SERVER, "x").reason is None
