"""Running an edge in a process: signal handling and the process's reloads,
shared by ``tlsedge run``, its workers and ``tlsedge demo``; the collector
settings of ``tlsedge run`` (`tune_gc`).

Signals while running: SIGTERM drains (stop accepting, let connections finish
until ``drain_timeout``, exit 0); a second SIGTERM, or SIGINT, exits at once;
SIGHUP calls the *reload* its runner gave (`reload_from_file` for ``tlsedge
run`` without workers; a worker leaves reloads to its supervisor); SIGUSR1
reopens the access-log file (after log rotation).

A reload of one process is the edge's (`Edge.prepare_reload`) plus its
access log: `prepare_process_reload` opens a changed ``edge.access_log``
along with the rest, `ProcessReload.commit` switches to it. Both the
single-process SIGHUP and a worker asked by its supervisor
(`tlsedge._control.worker`) go through them.
"""

from __future__ import annotations

import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import trio

from tlsedge._backends.preflight import access_log_error
from tlsedge._control.edge import Edge, PreparedReload
from tlsedge._control.logs import reopen_logs, switch_access_log
from tlsedge._core.accesslog import ACCESS_LOG_OFF, AccessLogWriter
from tlsedge._core.config import Config, ConfigError, load_config
from tlsedge._core.reload import (
    applied_record,
    keep_running_values,
    log_applied,
    report_refused,
    restart_only_changes,
)

__all__ = [
    "GC_YOUNG_THRESHOLD",
    "ProcessReload",
    "prepare_process_reload",
    "reload_from_file",
    "run_edge",
    "tune_gc",
]

LOGGER = logging.getLogger("tlsedge")

#: Allocations between two young-generation collections (CPython's default is
#: 700): a connection allocates a few hundred objects, most freed by reference
#: counting, so the default collects several times per connection for little.
GC_YOUNG_THRESHOLD = 20000


def tune_gc() -> None:
    """The collector settings of a running edge (``tlsedge run`` only, never
    the library): what startup allocated (modules, configuration) is frozen
    out of every later collection, and young collections run less often."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


class ProcessReload:
    """A reload of this process, prepared (`prepare_process_reload`): the
    edge's `PreparedReload` and, when ``edge.access_log`` changed, the new
    access-log destination, already open. Call `commit` or `abort` once."""

    def __init__(
        self,
        edge: Edge,
        prepared: PreparedReload,
        access_log: AccessLogWriter | None,
        *,
        switch_access_log: bool,
    ) -> None:
        self._edge = edge
        self._prepared = prepared
        self._access_log = access_log
        self._switch = switch_access_log

    def commit(self) -> None:
        """Switch the access log (if it changed), then the edge. On an edge
        that started draining since, abort instead."""
        if self._edge.draining:
            self.abort()
            return
        if self._switch:
            switch_access_log(self._access_log)
        self._prepared.commit()

    def abort(self) -> None:
        """Close what was opened; everything stays as it runs."""
        if self._switch and self._access_log is not None:
            self._access_log.close()
        self._prepared.abort()


async def prepare_process_reload(edge: Edge, config: Config) -> ProcessReload:
    """Prepare *config* for this process: the edge's reload, and a changed
    ``edge.access_log`` opened.

    Raises:
        ConfigError: something cannot be used (the edge's reasons, or an
            access-log file that cannot be opened); nothing changed.
    """
    destination = config.edge.access_log
    switch = destination != edge.config.edge.access_log
    writer = None
    if switch and destination != ACCESS_LOG_OFF:
        try:
            writer = AccessLogWriter(destination)
        except OSError as exc:
            raise access_log_error(destination, exc) from exc
    try:
        prepared = await edge.prepare_reload(config)
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    return ProcessReload(edge, prepared, writer, switch_access_log=switch)


async def reload_from_file(edge: Edge, config_path: str) -> None:
    """SIGHUP without a supervisor: apply the configuration file at
    *config_path* to this process, every key or a WARNING for each key that
    needs a restart (`tlsedge._core.reload`); refused as a whole (one ERROR) if
    anything cannot be applied. The edge's reload record follows."""
    metrics = edge.metrics
    running = edge.config
    try:
        new = load_config(config_path)
        pending = restart_only_changes(running, new, supervised=False)
        applied = keep_running_values(new, running, pending)
        reload = await prepare_process_reload(edge, applied)
    except ConfigError as exc:
        metrics.reloads = report_refused(metrics.reloads, str(exc), time.time())
        return
    reload.commit()
    log_applied(running, applied, pending)
    metrics.reloads = applied_record(metrics.reloads, pending, time.time())


async def _handle_signals(
    edge: Edge,
    reload: Callable[[], Awaitable[None]] | None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.open_signal_receiver(
        signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1
    ) as signals:
        task_status.started()
        async for signum in signals:
            if signum == signal.SIGUSR1:
                reopen_logs()  # log rotation
            elif signum == signal.SIGHUP:
                if reload is None:
                    LOGGER.info("SIGHUP ignored: no configuration file to reload")
                elif edge.draining:
                    LOGGER.info("SIGHUP ignored: draining")
                else:
                    await reload()
            elif signum == signal.SIGTERM and not edge.draining:
                LOGGER.info("SIGTERM: draining (send it again, or SIGINT, to exit now)")
                edge.drain()
            else:
                LOGGER.info(
                    "%s: closing every connection now", signal.Signals(signum).name
                )
                edge.stop()


async def run_edge(
    edge: Edge,
    reload: Callable[[], Awaitable[None]] | None,
    *,
    task_status: trio.TaskStatus[Edge] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run *edge* with signal handling until it has drained.

    SIGHUP awaits *reload* (None: SIGHUP is only logged, nothing to reload
    from). Reports the edge once every listener is bound.

    Raises:
        ConfigError: the edge cannot start (raised as it is, not in a group).
    """
    try:
        async with trio.open_nursery() as nursery:

            async def run_then_stop(*, task_status: trio.TaskStatus[Edge]) -> None:
                await edge.run(task_status=task_status)
                nursery.cancel_scope.cancel()

            # Handlers first: a signal sent as soon as the port answers must
            # not meet the default action (SIGHUP and SIGTERM would kill the
            # process).
            await nursery.start(_handle_signals, edge, reload)
            await nursery.start(run_then_stop)
            task_status.started(edge)
    except* ConfigError as group:
        # Only a failed start raises one (a failed reload is logged), so
        # there is exactly one: give it to the caller as nursery.start would.
        raise group.exceptions[0] from None
