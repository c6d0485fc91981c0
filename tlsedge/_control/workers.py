"""``edge.workers = N``: a supervisor process running N edge workers.

Theory of operation
-------------------
The supervisor owns the *running configuration*: the text of the
configuration file as it was when last loaded (at start, or by a reload that
was applied), never the file as it is now. Each worker is ``python -m
tlsedge run CONFIG --worker FD`` (`tlsedge._control.worker`): a complete edge that
binds the same ports with ``SO_REUSEPORT``, so the kernel spreads new
connections over the workers. FD is the worker's end of a socket pair, its
*link* (`tlsedge._control.worker_link`): the supervisor's first message hands the
worker the running configuration's text, and the worker answers ``Ready``
once its listeners are bound, or ``StartFailed`` with the reason. A worker
started later (after one died, or one more after a reload raised
``workers``) gets the running configuration too: a file edited without
SIGHUP changes nothing, and a file with an error cannot stop a restart. (A
starting worker still reads from disk the certificate, key and CA files the
configuration names, and opens its access-log file.)

Signals: SIGTERM (drain), SIGINT (stop) and SIGUSR1 (reopen log files) are
forwarded to every worker. SIGHUP is the supervisor's own: it reads and
validates the file once, then reloads in two phases over the links. Every
worker prepares the reload (everything that can fail: certificates, names,
binding new listeners and a moved ``edge.admin``) and answers; if every
worker prepared it, every worker commits it, otherwise every worker aborts
it and the reload is refused with the first worker's reason. So workers
never serve with different configurations, nor listen on different admin
ports. The keys no worker applies are the supervisor's: ``edge.workers``
starts or drains workers after the commit; ``edge.log_format`` waits for a
restart (`tlsedge._core.reload`). The edge's one `ReloadRecord` goes to every
worker with the commit or abort (and in ``Start``), so every worker's
``/metrics`` and ``/status`` report the same reloads; the reload is logged
once every worker answered that it committed it (``Committed``). A stop
signal that comes while the workers prepare abandons the reload (every
worker aborts it, one INFO line): their failing to answer because they exit
is not a refusal.

One lock orders reloads and worker starts: a worker is started, and handed
the running configuration, either before a reload (it takes part in it) or
after it (it gets the result), never in between.

Start-up errors: a worker that cannot start while the edge starts (a
certificate file, a port in use, a name that does not resolve) stops the
whole edge: the supervisor stops the other workers and exits with that one
message (status 2), instead of restarting a worker that would fail again
every second (Gunicorn's arbiter does the same with a worker that fails to
boot). Once every worker was ready, a worker that dies is restarted after
`RESTART_DELAY`; one that then cannot start (a certificate file deleted
since) is tried again after a pause that doubles up to `MAX_RESTART_DELAY`,
while the other workers go on serving: stopping them would turn one worker's
trouble into an outage.
"""

from __future__ import annotations

import logging
import math
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from tlsedge._control.logs import reopen_logs
from tlsedge._control.worker_link import (
    Committed,
    Link,
    Message,
    Prepare,
    Prepared,
    PrepareFailed,
    Ready,
    Record,
    Settle,
    Start,
    StartFailed,
)
from tlsedge._core.config import Config, ConfigError, parse_config, read_config_text
from tlsedge._core.metrics import multiprocess_directory, worker_exited
from tlsedge._core.reload import (
    ReloadRecord,
    applied_record,
    keep_running_values,
    log_applied,
    report_refused,
    restart_only_changes,
)

__all__ = ["MAX_RESTART_DELAY", "RELOAD_TIMEOUT", "RESTART_DELAY", "supervise"]

LOGGER = logging.getLogger("tlsedge.workers")

#: Pause before restarting a worker that died, so a crash loop does not spin.
RESTART_DELAY = 1.0
#: The longest pause between two tries of a worker that cannot start.
MAX_RESTART_DELAY = 30.0
#: Seconds the workers have to prepare a reload; beyond, it is refused.
RELOAD_TIMEOUT = 60.0


@dataclass(eq=False)
class _Worker:
    """One worker's place: the process in it now, its link and its answers."""

    index: int
    process: trio.Process | None = None
    link: Link | None = None
    #: The current process's answers to reloads (`Prepared`, `PrepareFailed`,
    #: `Committed`);
    #: closed when its link closes.
    answers: trio.MemoryReceiveChannel[Message] | None = None
    #: A reload lowered ``workers`` below this one: drain, do not restart.
    retired: bool = False


class _Supervisor:
    def __init__(
        self,
        command: list[str],
        *,
        config_path: str,
        text: str,
        config: Config,
        log_format: str,
        metrics_dir: multiprocess_directory,
    ) -> None:
        self.command = command
        self.config_path = config_path
        self.text = text  # the running configuration, as handed to workers
        self.config = config
        self.log_format = log_format
        self.metrics_dir = metrics_dir
        self.reloads = ReloadRecord(loaded=time.time())
        self.workers: dict[int, _Worker] = {}  # by index, 0 .. edge.workers - 1
        self.running: set[_Worker] = set()  # with a live process (retired too)
        self.lock = trio.Lock()  # reloads and worker starts, one at a time
        self.starting = set(range(config.edge.workers))  # not ready yet, ever
        self.stopping = False
        self.failed = False
        self.start_error: str | None = None  # a worker's, when it cannot start
        self.serial = 0  # of the last reload sent to the workers
        self.nursery: trio.Nursery | None = None  # where the workers run

    def stop_requested(self, worker: _Worker | None = None) -> bool:
        """Whether the edge stops (or *worker* must not start again): read
        through a call, as mypy would narrow the attributes across awaits."""
        return self.stopping or (worker is not None and worker.retired)

    # -- one worker -------------------------------------------------------

    async def run_worker(self, worker: _Worker) -> None:
        delay = RESTART_DELAY
        while True:
            async with self.lock:
                if self.stop_requested(worker):
                    # A stop signal (or a reload that lowered ``workers``)
                    # came during the restart pause: it went to the live
                    # workers only, so a worker started now would run on.
                    LOGGER.info(
                        "worker %d not restarted: %s",
                        worker.index,
                        "retired" if worker.retired else "stopping",
                    )
                    return
                process, link, answers = await self._spawn(worker)
            async with link:
                failure = await self._follow(worker, link, answers)
            code = await process.wait()
            self.running.discard(worker)
            worker.link = worker.answers = None
            worker_exited(self.metrics_dir.path, process.pid)
            if failure is not None:
                if worker.index in self.starting:
                    LOGGER.info(
                        "worker %d (pid %d) cannot start", worker.index, process.pid
                    )
                    self.stop_all(failure)
                    return
                LOGGER.error(
                    "worker %d (pid %d) cannot start: %s; trying again in %g s",
                    worker.index,
                    process.pid,
                    failure,
                    delay,
                )
                await trio.sleep(delay)
                delay = min(2 * delay, MAX_RESTART_DELAY)
                continue
            delay = RESTART_DELAY
            if self.stop_requested(worker):
                if code != 0:
                    self.failed = True
                LOGGER.info(
                    "worker %d (pid %d) exited with %d", worker.index, process.pid, code
                )
                return
            LOGGER.error(
                "worker %d (pid %d) died with %d; restarting in %g s",
                worker.index,
                process.pid,
                code,
                RESTART_DELAY,
            )
            await trio.sleep(RESTART_DELAY)

    async def _spawn(
        self, worker: _Worker
    ) -> tuple[trio.Process, Link, trio.MemorySendChannel[Message]]:
        """Start *worker*'s process and hand it the running configuration
        (under the lock)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = await trio.lowlevel.open_process(
                [*self.command, str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                env=self.metrics_dir.environment,
                pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        link = Link(ours)
        send, receive = trio.open_memory_channel[Message](math.inf)
        worker.process, worker.link, worker.answers = process, link, receive
        self.running.add(worker)
        LOGGER.info("worker %d started (pid %d)", worker.index, process.pid)
        # Not delivered: the worker died already; `_follow` sees its link close.
        await link.send(Start(self.text, self.log_format, self.reloads))
        return process, link, send

    async def _follow(
        self,
        worker: _Worker,
        link: Link,
        answers: trio.MemorySendChannel[Message],
    ) -> str | None:
        """Read *worker*'s messages until its link closes; the reason it gave
        if it could not start."""
        failure = None
        async with answers:
            while (message := await link.receive()) is not None:
                if isinstance(message, Ready):
                    LOGGER.info("worker %d ready", worker.index)
                    self.starting.discard(worker.index)
                elif isinstance(message, StartFailed):
                    failure = message.message
                elif isinstance(message, Prepared | PrepareFailed | Committed):
                    answers.send_nowait(message)
                else:
                    LOGGER.error(
                        "worker %d: unexpected message %r", worker.index, message
                    )
        return failure

    def stop_all(self, error: str) -> None:
        """A worker cannot start: stop the others, exit with *error*."""
        if self.start_error is None:
            self.start_error = error
        self.stopping = True
        self._signal_all(signal.SIGTERM)  # a worker still starting exits at once

    def _signal_all(self, signum: int) -> None:
        for worker in self.running:
            if worker.retired and signum == signal.SIGTERM:
                continue  # draining already: a second SIGTERM would cut it short
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signum)

    # -- signals and reloads ----------------------------------------------

    async def forward_signals(
        self,
        nursery: trio.Nursery,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with trio.open_signal_receiver(
            signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1
        ) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    # In a task: a SIGTERM must not wait for a reload.
                    nursery.start_soon(self.reload)
                    continue
                if signum == signal.SIGUSR1:
                    reopen_logs()  # the workers reopen theirs when forwarded
                else:
                    self.stopping = True
                self._signal_all(signum)

    async def reload(self) -> None:
        """SIGHUP: apply the configuration file to every worker, or to none."""
        async with self.lock:
            if self.stopping:
                LOGGER.info("SIGHUP ignored: stopping")
                return
            try:
                text = read_config_text(self.config_path)
                new = parse_config(text, self.config_path)
            except ConfigError as exc:
                await self._refuse(str(exc))
                return
            pending = restart_only_changes(self.config, new, supervised=True)
            applied = keep_running_values(new, self.config, pending)
            self.serial += 1
            taking_part = [w for w in self.running if not w.retired]
            failure = await self._prepare(taking_part, text)
            if failure is not None and self.stop_requested():
                # A SIGTERM or SIGINT came while the workers prepared, and
                # they failed to answer because they are exiting: nothing
                # was refused, so the record and the ERROR line stay clean.
                LOGGER.info("reload abandoned: stopping")
                await self._settle(taking_part, commit=False)
                return
            if failure is not None:
                await self._refuse(failure, taking_part)
                return
            running, self.config, self.text = self.config, applied, text
            self.reloads = applied_record(self.reloads, pending, time.time())
            await self._settle(taking_part, commit=True)
            await self._committed(taking_part)
            log_applied(running, applied, pending)
            self._resize(applied.edge.workers)

    async def _settle(self, prepared: Sequence[_Worker], *, commit: bool) -> None:
        """Have the workers that *prepared* reload `serial` commit or abort it."""
        for worker in prepared:
            if worker.link is not None:
                await worker.link.send(Settle(self.serial, commit, self.reloads))

    async def _committed(self, workers: Sequence[_Worker]) -> None:
        """Wait until *workers* (those still running) committed reload
        `serial`, so that it is logged once in force (for at most
        `RELOAD_TIMEOUT`: a commit cannot fail)."""
        with trio.move_on_after(RELOAD_TIMEOUT):
            for worker in workers:
                if worker.answers is not None:
                    await self._answer(worker.answers, (Committed,))

    async def _prepare(self, workers: list[_Worker], text: str) -> str | None:
        """Have *workers* prepare reload `serial` to *text*; why it cannot be
        applied, or None if every worker still running prepared it."""
        asked = []
        for worker in workers:
            link, answers = worker.link, worker.answers
            if (
                link is not None
                and answers is not None
                and await link.send(Prepare(self.serial, text))
            ):
                asked.append(answers)
        prepared = 0
        with trio.move_on_after(RELOAD_TIMEOUT):
            for answers in asked:
                answer = await self._answer(answers, (Prepared, PrepareFailed))
                if isinstance(answer, PrepareFailed):
                    return answer.message
                if answer is not None:  # None: the worker died meanwhile
                    prepared += 1
            if prepared == 0:
                return "no worker is running to apply it"
            return None
        return f"the workers did not prepare it within {RELOAD_TIMEOUT:g} s"

    async def _answer(
        self,
        answers: trio.MemoryReceiveChannel[Message],
        kinds: tuple[type[Prepared | PrepareFailed | Committed], ...],
    ) -> Message | None:
        """A worker's answer of one of *kinds* to reload `serial` (older ones
        are dropped: a reload that timed out); None if its process ended
        first."""
        try:
            while True:
                answer = await answers.receive()
                if isinstance(answer, kinds) and answer.serial == self.serial:
                    return answer
        except trio.EndOfChannel:
            return None

    async def _refuse(self, reason: str, prepared: Sequence[_Worker] = ()) -> None:
        """Log a refused reload; abort it in the workers that *prepared* it
        and hand every worker the record."""
        self.reloads = report_refused(self.reloads, reason, time.time())
        for worker in self.running:
            if worker.link is not None:
                message = (
                    Settle(self.serial, False, self.reloads)
                    if worker in prepared
                    else Record(self.reloads)
                )
                await worker.link.send(message)

    def _resize(self, count: int) -> None:
        """Start or retire workers to run *count* (after a reload)."""
        assert self.nursery is not None
        before = len(self.workers)
        for index in range(before, count):
            worker = self.workers[index] = _Worker(index)
            self.nursery.start_soon(self.run_worker, worker)
        for index in range(count, before):
            worker = self.workers.pop(index)
            worker.retired = True
            if worker.process is not None and worker.process.returncode is None:
                LOGGER.info(
                    "worker %d (pid %d) retired: draining",
                    index,
                    worker.process.pid,
                )
                worker.process.send_signal(signal.SIGTERM)
        if count != before:
            LOGGER.info("workers: %d -> %d", before, count)

    async def run(self) -> int:
        async with trio.open_nursery() as nursery:
            # Handlers before the first worker: an early SIGTERM must not
            # kill the supervisor and leave its workers running.
            await nursery.start(self.forward_signals, nursery)
            async with trio.open_nursery() as workers:
                self.nursery = workers
                for index in range(self.config.edge.workers):
                    worker = self.workers[index] = _Worker(index)
                    workers.start_soon(self.run_worker, worker)
            nursery.cancel_scope.cancel()
        if self.start_error is not None:
            raise ConfigError(self.start_error)
        return 1 if self.failed else 0


def supervise(
    config: Config,
    text: str,
    config_path: str,
    argv: Sequence[str],
    *,
    log_format: str,
) -> int:
    """Run ``config.edge.workers`` worker processes until they have drained.

    Args:
        config: the loaded configuration.
        text: the configuration file's text it was loaded from: what the
            workers run, until a SIGHUP applies the file again.
        config_path: the configuration file (read again on SIGHUP only).
        argv: this process's command-line arguments, passed on to workers.
        log_format: the process log's format, the workers' too.

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
        supervisor = _Supervisor(
            command,
            config_path=config_path,
            text=text,
            config=config,
            log_format=log_format,
            metrics_dir=metrics_dir,
        )
        return trio.run(supervisor.run)
