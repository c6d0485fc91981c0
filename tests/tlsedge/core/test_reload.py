"""What a reload may change, its record and its log lines (no process)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.tlsedge.helpers import make_config
from tlsedge._core.config import Config
from tlsedge._core.reload import (
    ReloadRecord,
    ReloadResult,
    applied_record,
    edge_changes,
    keep_running_values,
    log_applied,
    report_refused,
    restart_only_changes,
)


def config(**edge: Any) -> Config:
    return make_config(
        [{"name": "in", "backend": "b", "bind": "127.0.0.1:8443"}],
        [{"name": "b", "servers": ["127.0.0.1:8080"]}],
        edge,
    )


def test_restart_only_keys_with_and_without_a_supervisor() -> None:
    running = config(workers=2, log_format="text")
    new = config(workers=3, log_format="json", admin="127.0.0.1:9901")
    supervised = restart_only_changes(running, new, supervised=True)
    assert [str(key) for key in supervised] == [
        'edge.log_format: "text" -> "json" needs a restart'
    ]
    alone = restart_only_changes(config(), new, supervised=False)
    assert [key.key for key in alone] == ["edge.log_format", "edge.workers"]
    assert restart_only_changes(new, new, supervised=False) == ()


def test_keep_running_values_keeps_only_the_pending_keys() -> None:
    running = config(workers=2, log_format="text")
    new = config(workers=3, log_format="json", admin="127.0.0.1:9901")
    pending = restart_only_changes(running, new, supervised=True)
    applied = keep_running_values(new, running, pending)
    assert applied.edge.log_format == "text"
    assert applied.edge.workers == 3
    assert str(applied.edge.admin) == "127.0.0.1:9901"
    assert applied.listeners == new.listeners
    assert keep_running_values(new, running, ()) == new


def test_edge_changes_name_every_changed_key() -> None:
    running = config(admin="127.0.0.1:9901")
    new = config(access_log="off", max_connections=5)
    assert edge_changes(running, new) == [
        "edge.max_connections: 10000 -> 5",
        'edge.admin: "127.0.0.1:9901" -> (unset)',
        'edge.access_log: "-" -> "off"',
    ]
    assert edge_changes(new, new) == []


def test_the_record_counts_by_result_and_remembers_the_last() -> None:
    record = ReloadRecord(loaded=100.0)
    assert record.successful
    assert record.time == 100.0
    assert [record.count(result) for result in ReloadResult] == [0, 0, 0]
    record = record.after(ReloadResult.REFUSED, 200.0, "bad")
    assert not record.successful
    assert (record.time, record.detail, record.refused) == (200.0, "bad", 1)
    record = record.after(ReloadResult.PARTIAL, 300.0, "edge.workers")
    assert not record.successful
    record = record.after(ReloadResult.APPLIED, 400.0)
    assert record.successful
    assert record.detail == ""
    assert (record.applied, record.partial, record.refused) == (1, 1, 1)
    assert record.loaded == 100.0


def test_the_record_travels_as_json() -> None:
    record = ReloadRecord(loaded=1.5).after(ReloadResult.REFUSED, 2.5, "why")
    assert ReloadRecord.from_json(record.to_json()) == record
    fresh = ReloadRecord(loaded=1.5)
    assert ReloadRecord.from_json(fresh.to_json()) == fresh


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"loaded": 1.0},
        {**ReloadRecord(loaded=1.0).to_json(), "last_result": "maybe"},
        {**ReloadRecord(loaded=1.0).to_json(), "applied": "many"},
        {**ReloadRecord(loaded=1.0).to_json(), "last_time": [1]},
    ],
)
def test_a_record_that_is_not_one_is_a_value_error(data: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="not a reload record"):
        ReloadRecord.from_json(data)


def test_a_refused_reload_is_one_error_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.reload")
    record = report_refused(ReloadRecord(loaded=1.0), "listeners[0].bind: taken", 2.0)
    assert record.last_result is ReloadResult.REFUSED
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.ERROR,
            "reload refused, keeping the running configuration: "
            "listeners[0].bind: taken",
        )
    ]


def test_an_applied_reload_says_what_changed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.reload")
    running = config()
    new = config(admin="127.0.0.1:9901")
    log_applied(running, new, ())
    record = applied_record(ReloadRecord(loaded=1.0), (), 2.0)
    assert (record.last_result, record.applied) == (ReloadResult.APPLIED, 1)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.INFO,
            "configuration reloaded: 1 listeners, 1 backends; "
            'edge.admin: (unset) -> "127.0.0.1:9901"',
        )
    ]


def test_a_partial_reload_warns_for_each_pending_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.reload")
    running = config()
    new = config(workers=4, log_format="json")
    pending = restart_only_changes(running, new, supervised=False)
    applied = keep_running_values(new, running, pending)
    log_applied(running, applied, pending)
    record = applied_record(ReloadRecord(loaded=1.0), pending, 2.0)
    assert (record.last_result, record.partial) == (ReloadResult.PARTIAL, 1)
    assert record.detail == (
        'edge.log_format: "text" -> "json" needs a restart; '
        "edge.workers: 1 -> 4 needs a restart"
    )
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            'reload: edge.log_format: "text" -> "json" needs a restart; the '
            "running value stays until then",
        ),
        (
            logging.WARNING,
            "reload: edge.workers: 1 -> 4 needs a restart; the running value "
            "stays until then",
        ),
        (
            logging.WARNING,
            "configuration reloaded except what needs a restart (edge.log_format, "
            "edge.workers): 1 listeners, 1 backends",
        ),
    ]
