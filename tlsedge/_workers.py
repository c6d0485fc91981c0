"""``edge.workers = N``: a supervisor process running N edge workers.

Each worker is ``python -m tlsedge run CONFIG --worker``: a complete edge that
binds the same ports with ``SO_REUSEPORT``, so the kernel spreads new
connections over the workers. The supervisor forwards SIGTERM (drain), SIGINT
(stop), SIGHUP (reload) and SIGUSR1 (reopen log files) to every worker,
restarts a worker that dies on its own (after a pause, so a crash loop does not
spin), and exits once every worker has exited after a stop signal.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from collections.abc import Sequence

import trio

from tlsedge._config import Config
from tlsedge._logging import reopen_logs
from tlsedge._metrics import multiprocess_directory, worker_exited

__all__ = ["supervise"]

LOGGER = logging.getLogger("tlsedge.workers")

#: Pause before restarting a worker that died, so a crash loop does not spin.
RESTART_DELAY = 1.0


class _Supervisor:
    def __init__(
        self, command: list[str], workers: int, metrics_dir: multiprocess_directory
    ) -> None:
        self.command = command
        self.metrics_dir = metrics_dir
        self.workers = workers
        self.stopping = False
        self.processes: dict[int, trio.Process] = {}
        self.failed = False

    def stop_requested(self) -> bool:
        """``stopping``, read through a call (mypy would narrow the attribute)."""
        return self.stopping

    async def run_worker(self, index: int) -> None:
        while True:
            if self.stop_requested():
                # A stop signal came during the restart pause: it went to the
                # live workers only, so a worker started now would run on.
                LOGGER.info("worker %d not restarted: stopping", index)
                return
            process = await trio.lowlevel.open_process(
                self.command,
                stdin=subprocess.DEVNULL,
                env=self.metrics_dir.environment,
            )
            self.processes[index] = process
            LOGGER.info("worker %d started (pid %d)", index, process.pid)
            code = await process.wait()
            worker_exited(self.metrics_dir.path, process.pid)
            if self.stopping:
                if code != 0:
                    self.failed = True
                LOGGER.info(
                    "worker %d (pid %d) exited with %d", index, process.pid, code
                )
                return
            LOGGER.error(
                "worker %d (pid %d) died with %d; restarting in %g s",
                index,
                process.pid,
                code,
                RESTART_DELAY,
            )
            await trio.sleep(RESTART_DELAY)

    async def forward_signals(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.open_signal_receiver(
            signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1
        ) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    reopen_logs()  # the workers reopen theirs when forwarded
                elif signum != signal.SIGHUP:
                    self.stopping = True
                for process in self.processes.values():
                    if process.returncode is None:
                        process.send_signal(signum)

    async def run(self) -> int:
        async with trio.open_nursery() as nursery:
            # Handlers before the first worker: an early SIGTERM must not
            # kill the supervisor and leave its workers running.
            await nursery.start(self.forward_signals)
            async with trio.open_nursery() as workers:
                for index in range(self.workers):
                    workers.start_soon(self.run_worker, index)
            nursery.cancel_scope.cancel()
        return 1 if self.failed else 0


def supervise(config: Config, config_path: str, argv: Sequence[str]) -> int:
    """Run ``config.edge.workers`` worker processes until they have drained.

    Args:
        config: the loaded configuration (checked for fixed ports).
        config_path: the file the workers load (and reload on SIGHUP).
        argv: this process's command-line arguments, passed on to workers.

    Returns:
        The exit code: 0 when every worker drained cleanly, 2 for a config
        the supervisor cannot run, 1 otherwise.
    """
    for listener in config.listeners:
        if listener.bind.port == 0:
            LOGGER.error(
                "listeners: %s binds port 0; with edge.workers > 1 every worker "
                "would get its own port: give it a fixed port",
                listener.name,
            )
            return 2
    command = [sys.executable, "-m", "tlsedge", *argv, "--worker"]
    LOGGER.info("starting %d workers for %s", config.edge.workers, config_path)
    # The workers' metrics meet in one directory (prometheus-client's
    # multiprocess mode), so any worker's /metrics reports the totals.
    with multiprocess_directory() as metrics_dir:
        return trio.run(_Supervisor(command, config.edge.workers, metrics_dir).run)
