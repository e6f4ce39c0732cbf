"""Async applications on the command line: the sync twin of an async database URL (what the
commands that read and write the tables connect with), the async twin of a sync one, whether
a handler is ``async def``, and the asyncio worker run in the foreground until SIGTERM or
SIGINT, by itself, or, with ``burst``, until its queues are drained."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL

from sqla_proletarian import statements as sql
from sqla_proletarian.errors import ConfigurationError
from sqla_proletarian.exits import exit_after_stop, write_stderr
from sqla_proletarian.handlers import JobHandlers
from sqla_proletarian.supervisor import (
    BURST_CHECK_INTERVAL,
    Report,
    drained,
    log_burst_done,
    stopped_event,
)
from sqla_proletarian.worker import SIGNAL_RELEASE_TIMEOUT

if TYPE_CHECKING:  # imported when a worker runs: asyncio needs greenlet
    from sqlalchemy.ext.asyncio import AsyncEngine

    from sqla_proletarian.aio import AsyncQueueWorker

#: Each async driver's sync twin, by backend: the same database, the same URL otherwise.
SYNC_DRIVERS = {
    "postgresql": {"asyncpg": "psycopg", "psycopg_async": "psycopg"},
    "mysql": {"aiomysql": "pymysql", "asyncmy": "pymysql"},
    "mariadb": {"aiomysql": "pymysql", "asyncmy": "pymysql"},
    "sqlite": {"aiosqlite": "pysqlite"},
}
#: Each sync driver's async twin, by backend (for ``async def`` handlers given a sync URL).
ASYNC_DRIVERS = {
    "postgresql": {"psycopg": "psycopg_async", "psycopg2": "asyncpg"},
    "mysql": {"pymysql": "aiomysql", "mysqldb": "aiomysql"},
    "mariadb": {"pymysql": "aiomysql", "mysqldb": "aiomysql"},
    "sqlite": {"pysqlite": "aiosqlite"},
}


def is_async_url(url: URL) -> bool:
    """Whether ``url`` names an asyncio driver (asyncpg, psycopg_async, aiomysql, ...)."""
    try:
        return bool(url.get_dialect().is_async)
    except (sa_exc.NoSuchModuleError, ImportError):
        return False  # connecting says what is wrong


def sync_url(url: URL) -> URL:
    """``url``, or for an asyncio driver the same database through its sync twin
    (postgresql+asyncpg -> postgresql+psycopg, mysql+aiomysql -> mysql+pymysql, ...)."""
    return _twin(url, SYNC_DRIVERS, "sync") if is_async_url(url) else url


def async_url(url: URL) -> URL:
    """``url`` for an asyncio driver, or the same database through the async twin of its
    sync driver (postgresql+psycopg -> postgresql+psycopg_async, sqlite -> sqlite+aiosqlite)."""
    return url if is_async_url(url) else _twin(url, ASYNC_DRIVERS, "asyncio")


def _twin(url: URL, drivers: dict[str, dict[str, str]], kind: str) -> URL:
    backend, driver = url.get_backend_name(), url.get_driver_name()
    twin = drivers.get(backend, {}).get(driver)
    if twin is None:
        known = ", ".join(
            f"{name}+{each}" for name, of in drivers.items() for each in of if name != "mariadb"
        )
        raise ConfigurationError(
            f"the database URL's driver {url.drivername} has no {kind} twin here: give the "
            f"URL with a driver that has one ({known})"
        )
    return url.set(drivername=f"{backend}+{twin}")


def is_async_handler(handler: Callable[..., Any]) -> bool:
    """Whether ``handler`` is an ``async def`` (or an object whose ``__call__`` is), or a
    JobHandlers table with such a function among its own."""
    if isinstance(handler, JobHandlers):
        return any(is_async_handler(function) for function in handler.functions())
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        type(handler).__call__
    )


def run_async_worker(
    url: URL,
    handler: Callable[..., Any],
    *,
    burst: bool = False,
    report: Report | None = None,
    concurrency: int = 1,
    engine_options: dict[str, Any] | None = None,
    before_start: Callable[[Engine], object] | None = None,
    **options: Any,
) -> AsyncQueueWorker:
    """Run the asyncio worker on ``url`` (an asyncio driver's) in a new event loop until it
    stops; return it, stopped.

    Options are those of ``create_async_queue_worker``. It stops on SIGTERM or SIGINT (then
    running jobs finish, the summary is printed and the process ends by the signal; a
    second signal ends it at once), by itself (``worker.exception`` says why), or with
    ``burst`` once no job of its queues is due. ``report`` gets ``started`` and ``stopped``
    (see ``supervisor.Report``). The library's tables are checked first; then
    ``before_start`` is called with the engine's sync side (in a greenlet: it may use it as
    a plain Engine).
    """
    if importlib.util.find_spec("greenlet") is None:
        raise ConfigurationError(
            "async handlers run in the asyncio worker, which needs greenlet: pip install "
            "'sqla-proletarian[asyncio]'"
        )
    received: list[int] = []
    worker = asyncio.run(
        _run(
            url,
            handler,
            burst,
            report,
            concurrency,
            engine_options or {},
            options,
            received,
            before_start,
        )
    )
    if received:
        signal.signal(received[0], signal.SIG_DFL)
        print(f"{worker.worker_id} stopped: {worker.summary_text()}", file=sys.stderr, flush=True)
        exit_after_stop(worker, received[0])
    return worker


async def _run(
    url: URL,
    handler: Callable[..., Any],
    burst: bool,
    report: Report | None,
    concurrency: int,
    engine_options: dict[str, Any],
    options: dict[str, Any],
    received: list[int],
    before_start: Callable[[Engine], object] | None,
) -> AsyncQueueWorker:
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.util import greenlet_spawn

    engine = create_async_engine(url, **engine_options)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_probe_tables)
        if before_start is not None:
            await greenlet_spawn(before_start, engine.sync_engine)
        worker = _worker(engine, handler, report, concurrency, options)
        stopping = _stop_on_signals(worker, received)
        await worker.start()
        try:
            if report is not None:
                report({"event": "started"})
            if burst:
                await _until_drained(engine, worker)
                if worker.running:
                    await greenlet_spawn(log_burst_done, engine.sync_engine, worker)
            else:
                await worker.wait()
        finally:
            await worker.stop()
            for signum in stopping:
                asyncio.get_running_loop().remove_signal_handler(signum)
        return worker
    finally:
        await engine.dispose()


def _worker(
    engine: AsyncEngine,
    handler: Callable[..., Any],
    report: Report | None,
    concurrency: int,
    options: dict[str, Any],
) -> AsyncQueueWorker:
    """The worker, reporting ``stopped`` with its summary before its own on_shutdown."""
    from sqla_proletarian.aio import create_async_queue_worker

    started: list[AsyncQueueWorker] = []
    on_shutdown = options.pop("on_shutdown", None)

    async def shut_down() -> None:
        if report is not None:
            report(stopped_event(started[0]))
        if on_shutdown is not None:
            result = on_shutdown()
            if inspect.isawaitable(result):
                await result

    worker = create_async_queue_worker(
        engine, handler, concurrency=concurrency, on_shutdown=shut_down, **options
    )
    started.append(worker)
    return worker


def _stop_on_signals(worker: AsyncQueueWorker, received: list[int]) -> list[int]:
    """SIGTERM and SIGINT stop the worker gracefully; the same again ends the process now."""
    loop = asyncio.get_running_loop()
    stops: list[asyncio.Task[None]] = []

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if received:
            signal.signal(signum, signal.SIG_DFL)  # a third one ends the process at once
            if worker.options.lease_seconds is not None:
                write_stderr(
                    f"{worker.worker_id}: {name} again, giving the running jobs back and "
                    "exiting at once\n"
                )
                stops.append(loop.create_task(_release_and_exit(worker, signum)))
                return
            write_stderr(f"{worker.worker_id}: {name} again, exiting at once\n")
            os.kill(os.getpid(), signum)
            return
        received.append(signum)
        write_stderr(f"{worker.worker_id}: {name} received, finishing running jobs...\n")
        stops.append(loop.create_task(worker.stop()))

    signals: list[int] = [signal.SIGINT, signal.SIGTERM]
    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    return signals


async def _release_and_exit(worker: AsyncQueueWorker, signum: int) -> None:
    """Lease mode, a second signal: give the running jobs' leases back (they are due again
    at once, without an unclean end), where the database answers within
    ``SIGNAL_RELEASE_TIMEOUT``; then end the process by the signal."""
    try:
        # The database may be what is wrong: the process ends regardless.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(SIGNAL_RELEASE_TIMEOUT):
                await worker.abandon_running()
    finally:
        # The stop may have ended meanwhile and put asyncio's SIGINT handler back.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


async def _until_drained(engine: AsyncEngine, worker: AsyncQueueWorker) -> None:
    """Wait while the worker runs and has not drained its queues (``supervisor.drained``:
    the jobs it claimed and still runs count)."""
    from sqlalchemy.util import greenlet_spawn

    interval = max(worker.options.polling_interval, BURST_CHECK_INTERVAL)
    while worker.running and not await greenlet_spawn(drained, engine.sync_engine, worker):
        await worker.wait(interval)


def _probe_tables(conn: Connection) -> None:
    """Fail now if the library's tables are missing or not upgraded."""
    for statement in sql.probe_tables():
        conn.execute(*statement)
