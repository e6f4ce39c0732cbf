"""Results: a handler's return value, stored with its archived job (serialized by the
worker's serializer; None stores nothing), read back by ``get_result``, waited for by
``wait_for_result`` (LISTEN on PostgreSQL, polling elsewhere), and the results of a job's
dependencies (``job.dependency_results``)."""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine

from sqla_proletarian.enqueue import Transaction, _connection_of
from sqla_proletarian.errors import (
    ConfigurationError,
    JobFailedError,
    JobNotFoundError,
    PayloadSerializationError,
    ResultNotReady,
    ResultSerializationError,
    ResultTooLargeError,
)
from sqla_proletarian.serialization import DEFAULT_SERIALIZER, Serializer
from sqla_proletarian.statements import results as sql
from sqla_proletarian.wakeups import DONE_CHANNEL, AsyncListener, Listener

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

#: The longest result a worker stores, in bytes of its serialized text (``max_result_bytes``).
DEFAULT_MAX_RESULT_BYTES = 1024 * 1024
#: Seconds between looks at a job's end while a LISTEN waits for it (a safety net: a
#: notification sent while the listening connection was away is not lost for longer).
RECHECK_INTERVAL = 1.0
#: Polling for a job's end (no LISTEN): the first pause, and the longest.
POLL_FIRST = 0.02
POLL_MAX = 0.5


def stored_result(
    job_id: object, value: Any, serializer: Serializer, limit: int | None
) -> str | None:
    """A handler's return value as the archive keeps it: None for None, else its serialized
    text; ResultSerializationError if it cannot be serialized, ResultTooLargeError if its
    text is longer than ``limit`` bytes."""
    if value is None:
        return None
    try:
        text = serializer.dumps(value)
    except PayloadSerializationError as exc:
        message = str(exc)
        if message.startswith("payload"):
            message = "the value" + message[len("payload") :]
        raise ResultSerializationError(job_id, message) from None
    except Exception as exc:
        raise ResultSerializationError(job_id, repr(exc)) from exc
    if limit is not None:
        size = len(text.encode())
        if size > limit:
            raise ResultTooLargeError(job_id, size, limit)
    return text


def check_max_result_bytes(value: object) -> None:
    """The ``max_result_bytes`` option: a whole number of bytes >= 1, or None (no limit)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"max_result_bytes is {value!r}; give the longest result to store in bytes (a "
            f"whole number >= 1; default {DEFAULT_MAX_RESULT_BYTES:,}), or None for no limit"
        )


# --- reading a result ------------------------------------------------------------------------


def get_result(
    session_or_connection: Transaction,
    job_id: uuid.UUID | str,
    *,
    serializer: Serializer = DEFAULT_SERIALIZER,
) -> Any:
    """The result job ``job_id``'s handler returned (None if it returned None), read in the
    caller's transaction (a Session, scoped_session or Connection; never commits).

    Raises ResultNotReady while the job is queued, waiting for its dependencies or running;
    JobFailedError (``status``, ``error``) when it failed or was cancelled; JobNotFoundError
    (a LookupError) when no job of that id is queued or archived. ``serializer``: the
    worker's, if it is not the default JSON one.
    """
    wanted = _job_id(job_id)
    conn = _connection_of(session_or_connection, "get_result")
    return _result_on(conn, wanted, serializer)


def _result_on(conn: Connection, job_id: uuid.UUID, serializer: Serializer) -> Any:
    # The queue first: a job put back there (retry_failed) keeps its archive row until it
    # ends again, and has no result until then.
    queued = conn.execute(*sql.queued_state(job_id)).first()
    if queued is not None:
        waiting_on, lease_token, recorded = queued
        status = (
            "waiting for its dependencies"
            if waiting_on > 0
            else "running"
            if lease_token is not None or recorded
            else "queued"
        )
        raise ResultNotReady(job_id, status)
    ended = conn.execute(*sql.ended_job(job_id)).first()
    if ended is None:
        raise JobNotFoundError(job_id)
    status, error, text = ended
    if status != "success":
        raise JobFailedError(job_id, status, error)
    return None if text is None else serializer.loads(text)


def read_dependency_results(
    conn: Connection, job_id: uuid.UUID, serializer: Serializer
) -> dict[uuid.UUID, Any]:
    """Each dependency of job ``job_id`` with its result (None when it stored none or did
    not succeed)."""
    return {
        depends_on: serializer.loads(text) if status == "success" and text is not None else None
        for depends_on, status, text in conn.execute(*sql.dependency_results(job_id))
    }


def _job_id(job_id: object) -> uuid.UUID:
    try:
        return job_id if isinstance(job_id, uuid.UUID) else uuid.UUID(str(job_id))
    except ValueError:
        raise ConfigurationError(f"{job_id!r} is not a job id; give a UUID") from None


def _check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise ConfigurationError(
            f"timeout is {timeout!r}; give the seconds to wait (>= 0), or None to wait "
            "until the job ends"
        )
    return float(timeout)


def _timed_out(job_id: uuid.UUID, timeout: float | None) -> TimeoutError:
    return TimeoutError(
        f"job {job_id} did not end within {timeout:g} s; its result can still be read "
        "later (get_result, wait_for_result)"
    )


# --- waiting for a result (threads) ----------------------------------------------------------


def wait_for_result(
    engine: Engine,
    job_id: uuid.UUID | str,
    *,
    timeout: float | None = None,
    serializer: Serializer = DEFAULT_SERIALIZER,
) -> Any:
    """Block until job ``job_id`` has ended, then return its result as ``get_result`` does
    (JobFailedError if it failed or was cancelled, JobNotFoundError for an unknown id);
    TimeoutError once ``timeout`` seconds have passed (None: no limit).

    On PostgreSQL (psycopg 3 or psycopg2) it LISTENs on a connection of its own, outside the
    pool, and the job's end wakes it at once; elsewhere it polls, every 20 ms at first, then
    less often, up to every 0.5 s.
    """
    wanted = _job_id(job_id)
    seconds = _check_timeout(timeout)
    deadline = None if seconds is None else time.monotonic() + seconds

    def result() -> Any:
        with engine.connect() as conn:
            return _result_on(conn, wanted, serializer)

    if not Listener.supported(engine):
        pauses = _poll_pauses()
        return _until_ended(
            result, wanted, seconds, deadline, lambda left: time.sleep(_within(next(pauses), left))
        )
    with _listening(engine) as notified, _waiting(engine, wanted):
        return _until_ended(
            result,
            wanted,
            seconds,
            deadline,
            lambda left: notified(str(wanted), _within(RECHECK_INTERVAL, left)),
        )


def _until_ended(
    result: Callable[[], Any],
    job_id: uuid.UUID,
    timeout: float | None,
    deadline: float | None,
    wait: Callable[[float | None], object],
) -> Any:
    """``result()`` once the job has ended: between tries, ``wait(seconds left)``."""
    while True:
        with contextlib.suppress(ResultNotReady):
            return result()
        left = _left(deadline)
        if left is not None and left <= 0:
            raise _timed_out(job_id, timeout)
        wait(left)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _within(seconds: float, left: float | None) -> float:
    """``seconds``, but no more than ``left`` (None: no deadline)."""
    return seconds if left is None else min(seconds, left)


def _poll_pauses() -> Iterator[float]:
    """A poll's pauses: ``POLL_FIRST``, doubling up to ``POLL_MAX``."""
    pause = POLL_FIRST
    while True:
        yield pause
        pause = min(POLL_MAX, pause * 2)


@contextlib.contextmanager
def _waiting(engine: Engine, job_id: uuid.UUID) -> Iterator[None]:
    """A wait row for ``job_id`` while the block runs (the job's end deletes it and NOTIFYs);
    removed at the end, however the block ends."""
    wait_id = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(*sql.add_wait(wait_id, job_id))
    try:
        yield
    finally:
        with contextlib.suppress(Exception), engine.begin() as conn:
            conn.execute(*sql.end_wait(wait_id, job_id))


@contextlib.contextmanager
def _listening(engine: Engine) -> Iterator[Callable[[str, float], bool]]:
    """LISTEN on ``DONE_CHANNEL`` on a connection of its own (psycopg 3 or psycopg2); yields
    ``notified(payload, seconds)``: whether a notification of ``payload`` came within
    ``seconds``."""
    raw = engine.raw_connection()
    driver: Any = raw.driver_connection
    raw.detach()  # the wait's own, not counted against the pool
    try:
        driver.autocommit = True
        if engine.dialect.driver == "psycopg":
            driver.execute(f"LISTEN {DONE_CHANNEL}")

            def heard(seconds: float) -> list[str]:
                return [note.payload for note in driver.notifies(timeout=seconds, stop_after=1)]
        else:
            driver.cursor().execute(f"LISTEN {DONE_CHANNEL}")

            def heard(seconds: float) -> list[str]:
                if select.select([driver], [], [], seconds)[0]:
                    driver.poll()
                notes, driver.notifies[:] = list(driver.notifies), []
                return [note.payload for note in notes]

        def notified(payload: str, seconds: float) -> bool:
            # Other jobs' ends are heard too: wait on until this one's, or the time is up.
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0:
                if payload in heard(left):
                    return True
            return False

        yield notified
    finally:
        with contextlib.suppress(Exception):
            driver.close()


# --- waiting for a result (asyncio) ----------------------------------------------------------


async def wait_for_result_async(
    engine: AsyncEngine,
    job_id: uuid.UUID | str,
    *,
    timeout: float | None = None,
    serializer: Serializer = DEFAULT_SERIALIZER,
) -> Any:
    """``wait_for_result`` for an AsyncEngine: LISTEN on PostgreSQL (asyncpg or psycopg),
    polling elsewhere, without blocking the event loop."""
    wanted = _job_id(job_id)
    seconds = _check_timeout(timeout)
    deadline = None if seconds is None else time.monotonic() + seconds

    async def result() -> Any:
        async with engine.connect() as conn:
            return await conn.run_sync(_result_on, wanted, serializer)

    if not AsyncListener.supported(engine):
        pauses = _poll_pauses()

        async def sleep(left: float | None) -> None:
            await asyncio.sleep(_within(next(pauses), left))

        return await _until_ended_async(result, wanted, seconds, deadline, sleep)
    done = asyncio.Event()

    async def heard_of(left: float | None) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_within(RECHECK_INTERVAL, left)):
                await done.wait()

    async def cleared_then_result() -> Any:
        done.clear()  # before the read: a notification during it is kept
        return await result()

    async with _async_listening(engine, str(wanted), done), _async_waiting(engine, wanted):
        return await _until_ended_async(cleared_then_result, wanted, seconds, deadline, heard_of)


async def _until_ended_async(
    result: Callable[[], Awaitable[Any]],
    job_id: uuid.UUID,
    timeout: float | None,
    deadline: float | None,
    wait: Callable[[float | None], Awaitable[None]],
) -> Any:
    """``_until_ended`` for asyncio."""
    while True:
        with contextlib.suppress(ResultNotReady):
            return await result()
        left = _left(deadline)
        if left is not None and left <= 0:
            raise _timed_out(job_id, timeout)
        await wait(left)


@contextlib.asynccontextmanager
async def _async_waiting(engine: AsyncEngine, job_id: uuid.UUID) -> Any:
    wait_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(*sql.add_wait(wait_id, job_id))
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            async with engine.begin() as conn:
                await conn.execute(*sql.end_wait(wait_id, job_id))


@contextlib.asynccontextmanager
async def _async_listening(engine: AsyncEngine, payload: str, done: asyncio.Event) -> Any:
    """LISTEN on ``DONE_CHANNEL`` on a connection of its own (asyncpg, psycopg); ``done`` is
    set when a notification of ``payload`` comes."""
    from sqlalchemy.util import greenlet_spawn

    raw = await greenlet_spawn(engine.sync_engine.raw_connection)
    driver: Any = raw.driver_connection
    raw.detach()  # the wait's own, not counted against the pool
    reader: asyncio.Task[None] | None = None
    try:
        if engine.sync_engine.dialect.driver == "asyncpg":

            def heard(conn: object, pid: int, channel: str, note: str) -> None:
                if note == payload:
                    done.set()

            await driver.add_listener(DONE_CHANNEL, heard)
        else:
            await driver.set_autocommit(True)
            await driver.execute(f"LISTEN {DONE_CHANNEL}")

            async def read() -> None:
                async for note in driver.notifies():
                    if note.payload == payload:
                        done.set()

            reader = asyncio.create_task(read())
        yield
    finally:
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
        with contextlib.suppress(Exception):
            await driver.close()
