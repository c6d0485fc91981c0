"""``edge.workers = N``: a supervisor process running N edge workers.

Each worker is ``python -m tlsedge run CONFIG --worker FD``: a complete edge
that binds the same ports with ``SO_REUSEPORT``, so the kernel spreads new
connections over the workers. The supervisor forwards SIGTERM (drain), SIGINT
(stop), SIGHUP (reload) and SIGUSR1 (reopen log files) to every worker,
restarts a worker that dies on its own (after a pause, so a crash loop does not
spin), and exits once every worker has exited after a stop signal.

FD is the write end of a pipe from the supervisor: the worker writes
``ready`` once its listeners are bound, or ``error MESSAGE`` when it cannot
start (a certificate file, a port in use, a name that does not resolve), then
closes it. A worker that cannot start stops the whole edge: the supervisor
stops the other workers and exits with that one message (status 2), instead
of restarting a worker that would fail again every second. Gunicorn's arbiter
does the same with a worker that fails to boot.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

import trio

from tlsedge._config import Config, ConfigError
from tlsedge._logging import reopen_logs
from tlsedge._metrics import multiprocess_directory, worker_exited

__all__ = ["report_failure", "report_ready", "supervise"]

LOGGER = logging.getLogger("tlsedge.workers")

#: Pause before restarting a worker that died, so a crash loop does not spin.
RESTART_DELAY = 1.0

_READY = b"ready\n"
_ERROR = b"error "


def _report(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def report_ready(fd: int) -> None:
    """In a worker: tell the supervisor that every listener is bound."""
    _report(fd, _READY)


def report_failure(fd: int, message: str) -> None:
    """In a worker: tell the supervisor why the edge cannot start."""
    _report(fd, _ERROR + " ".join(message.split()).encode() + b"\n")


async def _read_report(fd: int) -> bytes:
    """Everything the worker wrote on its report pipe, until it closed it."""
    chunks = []
    async with trio.lowlevel.FdStream(fd) as pipe:
        while chunk := await pipe.receive_some():
            chunks.append(chunk)
    return b"".join(chunks)


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
        self.start_error: str | None = None  # a worker's, when it cannot start

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
            report_fd, worker_fd = os.pipe()
            try:
                process = await trio.lowlevel.open_process(
                    [*self.command, str(worker_fd)],
                    stdin=subprocess.DEVNULL,
                    env=self.metrics_dir.environment,
                    pass_fds=(worker_fd,),
                )
            except BaseException:
                os.close(report_fd)
                raise
            finally:
                os.close(worker_fd)
            self.processes[index] = process
            LOGGER.info("worker %d started (pid %d)", index, process.pid)
            report = await _read_report(report_fd)
            if report == _READY:
                LOGGER.info("worker %d ready", index)
            code = await process.wait()
            worker_exited(self.metrics_dir.path, process.pid)
            if report.startswith(_ERROR):
                LOGGER.info("worker %d (pid %d) cannot start", index, process.pid)
                self.stop_all(report.removeprefix(_ERROR).decode().strip())
                return
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

    def stop_all(self, error: str) -> None:
        """A worker cannot start: stop the others, exit with *error*."""
        if self.start_error is None:
            self.start_error = error
        self.stopping = True
        for process in self.processes.values():
            if process.returncode is None:
                # SIGTERM: a worker still starting exits at once; one that
                # serves drains its connections.
                process.send_signal(signal.SIGTERM)

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
        if self.start_error is not None:
            raise ConfigError(self.start_error)
        return 1 if self.failed else 0


def supervise(config: Config, config_path: str, argv: Sequence[str]) -> int:
    """Run ``config.edge.workers`` worker processes until they have drained.

    Args:
        config: the loaded configuration (checked for fixed ports).
        config_path: the file the workers load (and reload on SIGHUP).
        argv: this process's command-line arguments, passed on to workers.

    Returns:
        The exit code: 0 when every worker drained cleanly, 1 otherwise.

    Raises:
        ConfigError: a worker could not start (after the others stopped); the
            message is the worker's.
    """
    command = [sys.executable, "-m", "tlsedge", *argv, "--worker"]
    LOGGER.info("starting %d workers for %s", config.edge.workers, config_path)
    # The workers' metrics meet in one directory (prometheus-client's
    # multiprocess mode), so any worker's /metrics reports the totals.
    with multiprocess_directory() as metrics_dir:
        return trio.run(_Supervisor(command, config.edge.workers, metrics_dir).run)
