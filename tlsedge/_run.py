"""Running an edge in a process: signal handling, shared by ``tlsedge run``
and ``tlsedge demo``.

Signals while running: SIGTERM drains (stop accepting, let connections finish
until ``drain_timeout``, exit 0); a second SIGTERM, or SIGINT, exits at once;
SIGHUP reloads the configuration file (a bad new file is refused with a log
line and the old configuration stays); SIGUSR1 reopens the access-log file
(after log rotation).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import trio

from tlsedge._config import ConfigError, load_config
from tlsedge._logging import reopen_logs
from tlsedge._server import Edge

__all__ = ["run_edge"]

LOGGER = logging.getLogger("tlsedge")


async def _handle_signals(
    edge: Edge,
    config_path: str | None,
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
                if config_path is None:
                    LOGGER.info("SIGHUP ignored: no configuration file to reload")
                    continue
                try:
                    await edge.reload(load_config(config_path))
                except ConfigError as exc:
                    LOGGER.error(
                        "reload refused, keeping the running configuration: %s", exc
                    )
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
    config_path: str | None,
    *,
    on_ready: Callable[[], None] | None = None,
    task_status: trio.TaskStatus[Edge] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run *edge* with signal handling until it has drained.

    Without a *config_path*, SIGHUP is not handled (nothing to reload from).
    *on_ready* is called once every listener is bound.

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
            await nursery.start(_handle_signals, edge, config_path)
            await nursery.start(run_then_stop)
            if on_ready is not None:
                on_ready()
            task_status.started(edge)
    except* ConfigError as group:
        # Only a failed start raises one (a failed reload is logged), so
        # there is exactly one: give it to the caller as nursery.start would.
        raise group.exceptions[0] from None
