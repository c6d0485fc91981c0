"""What a reload (SIGHUP) may change, and the record of the reloads so far.

Rules
-----
A reload applies every key of the new configuration file or says which it
cannot: the keys that only a restart changes (`restart_only_changes`) are
kept at their running values (`keep_running_values`) and logged, one WARNING
per key, and the reload counts as ``partial``. Which keys those are depends
on the process: ``edge.log_format`` (the process log's format, chosen when
the process started) always; ``edge.workers`` too when there is no
supervisor (an edge started with ``workers = 1`` has nobody to start more
workers). Everything else is applied: listeners, backends, certificates,
limits, ``edge.admin`` (moved) and ``edge.access_log`` (reopened), and under a
supervisor ``edge.workers`` (workers started or drained).

A reload that cannot be applied at all (a file that cannot be read, invalid
TOML, a validation error, a certificate that does not load, a name that does
not resolve, an address that cannot be bound) is ``refused``: the running
configuration stays, everywhere.

The record
----------
`ReloadRecord` is the history the metrics (``tlsedge_config_*``) and the
status page report: when the configuration was loaded at start, the last
reload's result, time and detail, and a count per result. With several
workers the supervisor keeps it and hands it to every worker with each
reload's outcome and when it starts one, so every worker reports the same
values: one record for the edge.

`report_refused` and `log_applied` log a reload's outcome the same way with
or without a supervisor (once per edge, not once per worker); the former and
`applied_record` give the record that follows it.

This module is pure (records, comparisons and log lines; no I/O framework).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tlsedge._core.config import Address, Config, EdgeConfig

__all__ = [
    "PendingKey",
    "ReloadRecord",
    "ReloadResult",
    "applied_record",
    "edge_changes",
    "keep_running_values",
    "log_applied",
    "report_refused",
    "restart_only_changes",
]

LOGGER = logging.getLogger("tlsedge.reload")


class ReloadResult(enum.StrEnum):
    """How a reload ended (the ``result`` label of ``tlsedge_config_reloads_total``)."""

    #: Every key of the file is in force.
    APPLIED = "applied"
    #: Applied, except keys that wait for a restart (one WARNING each).
    PARTIAL = "partial"
    #: Nothing changed: the running configuration stays.
    REFUSED = "refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingKey:
    """A key whose new value takes effect only at the next restart."""

    #: Its dotted path, ``edge.log_format``.
    key: str
    #: The value in force, as TOML would write it.
    running: str
    #: The value in the file.
    wanted: str

    def __str__(self) -> str:
        return f"{self.key}: {self.running} -> {self.wanted} needs a restart"


def _toml(value: object) -> str:
    """*value* as the configuration file spells it (``(unset)`` for None)."""
    if value is None:
        return "(unset)"
    if isinstance(value, str | Address):
        return f'"{value}"'
    return str(value)


def restart_only_changes(
    running: Config, new: Config, *, supervised: bool
) -> tuple[PendingKey, ...]:
    """The keys changed from *running* to *new* that a reload cannot apply.

    Args:
        running: The configuration in force.
        new: The configuration file's.
        supervised: Whether a supervisor runs the workers (it applies
            ``edge.workers``).
    """
    keys = ("log_format",) if supervised else ("log_format", "workers")
    return tuple(
        PendingKey(
            key=f"edge.{key}",
            running=_toml(getattr(running.edge, key)),
            wanted=_toml(getattr(new.edge, key)),
        )
        for key in keys
        if getattr(running.edge, key) != getattr(new.edge, key)
    )


def keep_running_values(
    new: Config, running: Config, pending: Iterable[PendingKey]
) -> Config:
    """*new* with the *pending* keys (`restart_only_changes`) at their values
    in *running*: the configuration really in force after the reload."""
    names = [item.key.removeprefix("edge.") for item in pending]
    edge = dataclasses.replace(
        new.edge, **{name: getattr(running.edge, name) for name in names}
    )
    return dataclasses.replace(new, edge=edge)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReloadRecord:
    """The reloads of one edge so far (see the module docstring)."""

    #: When the configuration was loaded at start (seconds since the epoch).
    loaded: float
    #: The last reload's result; None before the first.
    last_result: ReloadResult | None = None
    #: When the last reload ended (seconds since the epoch); None before the first.
    last_time: float | None = None
    #: The refusal's reason, or the keys that wait for a restart ("" if none).
    detail: str = ""
    #: Reloads so far, by result.
    applied: int = 0
    partial: int = 0
    refused: int = 0

    @property
    def successful(self) -> bool:
        """Whether the configuration file is in force as written: no reload
        yet (the start loaded it), or the last one applied every key."""
        return self.last_result in {None, ReloadResult.APPLIED}

    @property
    def time(self) -> float:
        """When the configuration in force was last loaded or reloaded (or a
        reload refused)."""
        return self.loaded if self.last_time is None else self.last_time

    def count(self, result: ReloadResult) -> int:
        """Reloads so far that ended with *result*."""
        count: int = getattr(self, result.value)
        return count

    def after(self, result: ReloadResult, at: float, detail: str = "") -> ReloadRecord:
        """This record with one more reload: *result* at *at* (epoch seconds)."""
        return dataclasses.replace(
            self,
            last_result=result,
            last_time=at,
            detail=detail,
            **{result.value: self.count(result) + 1},
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (`from_json` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReloadRecord:
        """The record `to_json` wrote.

        Raises:
            ValueError: *data* is not such a record.
        """
        try:
            result, last_time = data["last_result"], data["last_time"]
            return cls(
                loaded=float(data["loaded"]),
                last_result=None if result is None else ReloadResult(result),
                last_time=None if last_time is None else float(last_time),
                detail=str(data["detail"]),
                applied=int(data["applied"]),
                partial=int(data["partial"]),
                refused=int(data["refused"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a reload record: {exc!r}") from exc


def edge_changes(running: Config, new: Config) -> list[str]:
    """The ``[edge]`` keys that differ, ``"edge.admin: 127.0.0.1:9901 ->
    127.0.0.1:9902"``, in the schema's order."""
    return [
        f"edge.{field.name}: {_toml(getattr(running.edge, field.name))} -> "
        f"{_toml(getattr(new.edge, field.name))}"
        for field in dataclasses.fields(EdgeConfig)
        if getattr(running.edge, field.name) != getattr(new.edge, field.name)
    ]


def report_refused(record: ReloadRecord, reason: str, at: float) -> ReloadRecord:
    """Log a refused reload (one ERROR saying why); the record after it."""
    LOGGER.error("reload refused, keeping the running configuration: %s", reason)
    return record.after(ReloadResult.REFUSED, at, reason)


def applied_record(
    record: ReloadRecord, pending: tuple[PendingKey, ...], at: float
) -> ReloadRecord:
    """The record after an applied reload (`log_applied` logs it).

    Args:
        record: The record before this reload.
        pending: The keys that wait for a restart (`restart_only_changes`).
        at: When the reload ended (seconds since the epoch).
    """
    if not pending:
        return record.after(ReloadResult.APPLIED, at)
    return record.after(
        ReloadResult.PARTIAL, at, "; ".join(str(key) for key in pending)
    )


def log_applied(
    running: Config, applied: Config, pending: tuple[PendingKey, ...]
) -> None:
    """Log an applied reload, once it is in force (with workers: in every
    one of them).

    One WARNING per *pending* key, then one line: INFO when every key is in
    force, WARNING when some wait for a restart. It names the ``[edge]`` keys
    that changed (listeners and backends are counted).

    Args:
        running: The configuration in force before.
        applied: The one in force now (`keep_running_values`).
        pending: The keys that wait for a restart (`restart_only_changes`).
    """
    for key in pending:
        LOGGER.warning("reload: %s; the running value stays until then", key)
    summary = f"{len(applied.listeners)} listeners, {len(applied.backends)} backends"
    changes = "".join(f"; {change}" for change in edge_changes(running, applied))
    if not pending:
        LOGGER.info("configuration reloaded: %s%s", summary, changes)
        return
    keys = ", ".join(key.key for key in pending)
    LOGGER.warning(
        "configuration reloaded except what needs a restart (%s): %s%s",
        keys,
        summary,
        changes,
    )
