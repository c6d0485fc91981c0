"""Suite-wide settings: hypothesis profiles and the leak checks.

Leak checks (every test, autouse):

- **file descriptors**: the fds open after a test (and its function-scoped
  fixtures) must be the ones open before it. Higher-scoped fixtures are set up
  before and torn down after function-scoped ones, so what they hold is in
  both snapshots. Before failing, the check runs ``gc.collect()`` and retries
  for up to ``_SETTLE`` seconds (a subprocess' pipes, a socket whose last
  reference is in a traceback). An fd closed by a later collection of an
  earlier test's garbage is never reported: only fds that are new count.
- **threads**: no thread started during the test may still be running, except
  trio's idle thread-cache workers (``Trio thread N``), which trio reuses.
- **trio system tasks** (trio tests only): when the test's main task ends, no
  system task spawned during the test (``trio.lowlevel.spawn_system_task``) may
  still be alive; trio would cancel it silently at the end of the run.
  Children of nurseries cannot outlive their nursery, and pytest-trio already
  fails a test whose fixtures' tasks crash; tasks left in the ``nursery``
  fixture are cancelled at teardown by design (Backend servers live there).

A test that legitimately keeps something opts out with
``@pytest.mark.allow_leaks(reason="...")``.
"""

from __future__ import annotations

import functools
import gc
import os
import re
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, settings
from pytest_trio.plugin import TrioFixture  # type: ignore[import-untyped]

# "ci" is deterministic so a failure in CI replays the same way on a laptop.
settings.register_profile(
    "ci",
    max_examples=500,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
# "deep" is opt-in, for bug hunts: many fresh random examples per run (pass
# --hypothesis-seed=N to replay one).
settings.register_profile(
    "deep",
    max_examples=20_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

_SETTLE = 2.0
_FD_DIR = "/proc/self/fd"
_TRIO_WORKER = re.compile(r"Trio thread \d+")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "allow_leaks(reason): the test may leave file descriptors, threads or "
        "trio system tasks behind (say why)",
    )


# -- file descriptors ----------------------------------------------------------


def open_fds() -> dict[int, str]:
    """The open file descriptors of this process and what they point to."""
    fds: dict[int, str] = {}
    for name in os.listdir(_FD_DIR):
        fd = int(name)
        try:
            fds[fd] = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed meanwhile, e.g. listdir's own directory fd
            continue
    return fds


def _ignorable(target: str) -> bool:
    # pytest's capture and hypothesis' example database use regular files
    # under these directories; /dev/null and /dev/urandom are opened lazily by
    # libraries and kept for the process' life on purpose.
    return target in {"/dev/null", "/dev/urandom"} or "/.hypothesis/" in target


_TCP_STATES = {
    "01": "ESTABLISHED",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "0A": "LISTEN",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "09": "LAST_ACK",
}


def _sockets_by_inode() -> dict[str, str]:
    """``socket:[inode]`` -> "tcp 127.0.0.1:port -> ... STATE", for messages."""
    found: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{table}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            ports = f"{int(local.split(':')[1], 16)} -> {int(remote.split(':')[1], 16)}"
            found[f"socket:[{inode}]"] = (
                f"{table} port {ports} {_TCP_STATES.get(state, state)}"
            )
    return found


def _describe(fds: dict[int, str]) -> str:
    sockets = _sockets_by_inode()
    return ", ".join(
        f"{fd} -> {target}" + (f" ({sockets[target]})" if target in sockets else "")
        for fd, target in sorted(fds.items())
    )


def _new_fds(before: dict[int, str]) -> dict[int, str]:
    return {
        fd: target
        for fd, target in open_fds().items()
        if before.get(fd) != target and not _ignorable(target)
    }


# -- threads ---------------------------------------------------------------------


def _busy_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t not in before and t.is_alive() and not _TRIO_WORKER.fullmatch(t.name)
    ]


def _settle(check: Callable[[], Any]) -> Any:
    """Call *check* until it returns nothing or time runs out.

    The first call comes without a GC: almost every test is clean, and a full
    collection per test (hundreds of ms with hypothesis' objects alive) was a
    third of the suite's time. Later calls collect first, so that an fd whose
    last reference is in a reference cycle (a traceback) is closed.
    """
    found = check()
    if not found:
        return found
    deadline = time.monotonic() + _SETTLE
    while True:
        gc.collect()
        found = check()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves file descriptors or running threads behind."""
    if request.node.get_closest_marker("allow_leaks") is not None:
        yield
        return
    fds_before = open_fds()
    threads_before = set(threading.enumerate())
    yield
    fds = _settle(lambda: _new_fds(fds_before))
    threads = _settle(lambda: _busy_threads(threads_before))
    problems = []
    if fds:
        listing = _describe(fds)
        problems.append(f"{len(fds)} file descriptor(s) left open: {listing}")
    if threads:
        problems.append(f"thread(s) still running: {[t.name for t in threads]}")
    if problems:
        pytest.fail(
            "leak check: "
            + "; ".join(problems)
            + " (opt out with @pytest.mark.allow_leaks(reason=...))",
            pytrace=False,
        )


# -- trio system tasks ---------------------------------------------------------


# A system task meant to live as long as the run (besides trio's own, named
# "<...>"): tlsedge's reactor (`tlsedge._reactor.loop.current_reactor`); a relay
# ends by unregistering from it, not by stopping it.
_RUN_SERVICE = "tlsedge reactor"


class _SystemTaskTracker(trio.abc.Instrument):
    """Remembers the system tasks spawned while the test's main task runs and
    reports those still alive when it ends."""

    def __init__(self) -> None:
        self.main: trio.lowlevel.Task | None = None
        self.system: set[trio.lowlevel.Task] = set()
        self.leaked: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        root = trio.lowlevel.current_root_task()
        if root is None or task is root or task.parent_nursery is None:
            return
        if task.parent_nursery.parent_task is not root:
            return  # an ordinary task in some nursery
        if self.main is None and task.name.endswith("_bootstrap_fixtures_and_run_test"):
            self.main = task
        elif (
            self.main is not None
            and not task.name.startswith("<")
            and task.name != _RUN_SERVICE
        ):
            self.system.add(task)

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        if task is self.main:
            self.leaked = [t.name for t in self.system]
            self.main = None
        self.system.discard(task)


def _checked_run(
    afn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:  # the signature pytest-trio calls trio.run with
    tracker = _SystemTaskTracker()
    kwargs["instruments"] = (*kwargs.get("instruments", ()), tracker)
    result = trio.run(afn, *args, **kwargs)
    if tracker.leaked:
        pytest.fail(
            f"leak check: trio system task(s) still alive after the test: "
            f"{tracker.leaked}",
            pytrace=False,
        )
    return result


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run every trio test (marked by pytest-trio's trio_mode before this hook)
    under ``_checked_run``."""
    for item in items:
        marker = item.get_closest_marker("trio")
        if marker is None or item.get_closest_marker("allow_leaks") is not None:
            continue
        if marker.kwargs.get("run", trio.run) is trio.run:
            item.add_marker(pytest.mark.trio(run=_checked_run), append=False)


# -- autouse async fixtures ----------------------------------------------------
#
# pytest-trio only runs the trio fixtures it finds among the test function's
# own arguments: an autouse (or usefixtures) async fixture is set up as a
# placeholder and never run (its setup and teardown are silently skipped). The
# two hooks below pass such fixtures to pytest-trio as extra arguments of a
# wrapper that drops them before calling the test.


def _hidden_trio_fixtures(item: pytest.Function) -> list[str]:
    argnames = item._fixtureinfo.argnames
    return [
        name
        for name in item.fixturenames
        if name not in argnames and isinstance(item.funcargs.get(name), TrioFixture)
    ]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    if (
        isinstance(item, pytest.Function)
        and item.get_closest_marker("trio") is not None
        and not hasattr(item.obj, "hypothesis")
        and (hidden := _hidden_trio_fixtures(item))
    ):
        test = item.obj

        @functools.wraps(test)
        async def run_with_hidden_fixtures(**kwargs: Any) -> Any:
            for name in hidden:
                kwargs.pop(name, None)
            return await test(**kwargs)

        item.obj = run_with_hidden_fixtures
        item.stash[_HIDDEN] = hidden
    yield


_HIDDEN = pytest.StashKey[list[str]]()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    hidden = pyfuncitem.stash.get(_HIDDEN, None)
    if not hidden:
        return None
    names = (*pyfuncitem._fixtureinfo.argnames, *hidden)
    pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in names})
    return True
