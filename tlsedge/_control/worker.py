"""A worker process of ``edge.workers > 1``: one edge its supervisor configures.

Theory of operation
-------------------
The supervisor (`tlsedge._control.workers`) starts ``python -m tlsedge run CONFIG
--worker FD``, FD being the worker's end of its link
(`tlsedge._control.worker_link`). The worker never reads CONFIG: the supervisor's
first message, `Start`, carries the running configuration's text (CONFIG is
only where relative paths in it start from, and the name errors give). The
worker validates it, sets up its logging, runs the edge on ``SO_REUSEPORT``
sockets and answers `Ready`, or `StartFailed` with the one-line reason
(then exits 2).

Then it follows the link, one message at a time:

- `Prepare`: validate the text and prepare the reload
  (`tlsedge._control.run.prepare_process_reload`: everything that can fail, nothing
  changed), answer `Prepared` or `PrepareFailed`;
- `Settle`: commit (answer `Committed`) or abort the prepared reload of that
  serial, and take the edge's reload record;
- `Record`: take the edge's reload record (a reload the supervisor refused
  itself).

SIGHUP sent to a worker directly is logged and ignored: the supervisor
reloads every worker at once. When the link closes (the supervisor died),
the worker drains and exits instead of serving on, unsupervised, with no one
to reload it.
"""

from __future__ import annotations

import logging
import os

import trio

from tlsedge._backends.preflight import access_log_error
from tlsedge._control.edge import Edge
from tlsedge._control.logs import setup_logging
from tlsedge._control.run import (
    ProcessReload,
    prepare_process_reload,
    run_edge,
    tune_gc,
)
from tlsedge._control.worker_link import (
    Committed,
    Link,
    Prepare,
    Prepared,
    PrepareFailed,
    Ready,
    Record,
    Settle,
    Start,
    StartFailed,
)
from tlsedge._core.config import ConfigError, parse_config

__all__ = ["run_worker"]

LOGGER = logging.getLogger("tlsedge.worker")

# Exit statuses, as ``tlsedge run``'s (`tlsedge._control.cli`).
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2


def run_worker(fd: int, config_path: str, log_level: str) -> int:
    """Run a worker on the link at descriptor *fd*; its exit status.

    Args:
        fd: The worker's end of the link (``--worker FD``).
        config_path: The configuration file's path (not read).
        log_level: ``--log-level``.
    """
    return trio.run(_worker, Link.from_fd(fd), config_path, log_level)


async def _worker(link: Link, config_path: str, log_level: str) -> int:
    async with link:
        start = await link.receive()
        if not isinstance(start, Start):
            LOGGER.error("worker: the supervisor sent no configuration: %r", start)
            return EXIT_FAILURE
        try:
            edge = _edge(start, config_path, log_level)
            await _serve(link, edge, config_path)
        except ConfigError as exc:
            await link.send(StartFailed(" ".join(str(exc).split())))
            return EXIT_CONFIG
    return EXIT_OK


def _edge(start: Start, config_path: str, log_level: str) -> Edge:
    """The edge of the `Start` message, with logging set up.

    Raises:
        ConfigError: the text is not a valid configuration, or the access log
            cannot be opened.
    """
    config = parse_config(start.text, config_path)
    try:
        setup_logging(log_level, start.log_format, config.edge.access_log)
    except OSError as exc:
        raise access_log_error(config.edge.access_log, exc) from exc
    edge = Edge(config, reuse_port=True)
    edge.metrics.reloads = start.reloads
    tune_gc()
    return edge


async def _sighup_ignored() -> None:
    LOGGER.warning(
        "SIGHUP to a worker is ignored: send it to the supervisor (pid %d), "
        "which reloads every worker",
        os.getppid(),
    )


async def _serve(link: Link, edge: Edge, config_path: str) -> None:
    """Run *edge* until it drained, following the link meanwhile.

    Raises:
        ConfigError: the edge cannot start.
    """
    try:
        async with trio.open_nursery() as nursery:

            async def run_then_stop(*, task_status: trio.TaskStatus[Edge]) -> None:
                await run_edge(edge, _sighup_ignored, task_status=task_status)
                nursery.cancel_scope.cancel()

            await nursery.start(run_then_stop)
            await link.send(Ready())
            await _follow(link, edge, config_path)
    except* ConfigError as group:
        raise group.exceptions[0] from None


async def _follow(link: Link, edge: Edge, config_path: str) -> None:
    """Answer the supervisor's messages until the link closes, then drain."""
    prepared: tuple[int, ProcessReload] | None = None
    try:
        while (message := await link.receive()) is not None:
            if isinstance(message, Prepare):
                if prepared is not None:  # never settled: the supervisor moved on
                    prepared[1].abort()
                    prepared = None
                try:
                    config = parse_config(message.text, config_path)
                    reload = await prepare_process_reload(edge, config)
                except ConfigError as exc:
                    await link.send(PrepareFailed(message.serial, str(exc)))
                else:
                    prepared = (message.serial, reload)
                    await link.send(Prepared(message.serial))
            elif isinstance(message, Settle):
                if prepared is not None and prepared[0] == message.serial:
                    if message.commit:
                        prepared[1].commit()
                        await link.send(Committed(message.serial))
                    else:
                        prepared[1].abort()
                    prepared = None
                edge.metrics.reloads = message.reloads
            elif isinstance(message, Record):
                edge.metrics.reloads = message.reloads
            else:
                LOGGER.error(
                    "worker: unexpected message from the supervisor: %r", message
                )
    finally:
        if prepared is not None:
            prepared[1].abort()
    LOGGER.warning("worker: the supervisor is gone; draining")
    edge.drain()
