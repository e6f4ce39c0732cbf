"""Wake-ups: idle workers poll at once when a job is committed, instead of at their next poll.

Two ways, both on top of polling, which stays the fallback:

- **PostgreSQL**: a statement-level trigger on the job table (migration ``sqlap_0002``, or
  ``metadata.create_all``) NOTIFYs each queue that got jobs. The server sends one
  notification per transaction and queue (NOTIFY serialises committing transactions, so
  never one per job), at the commit, never for a rollback, whoever inserted the rows, and
  costs the enqueue no round trip. Each worker holds one listening connection: a thread
  (``Listener``, psycopg 3 and psycopg2) or, for the asyncio worker, a task
  (``AsyncListener``, asyncpg and psycopg's async side). ``poll_only=True`` turns it off,
  e.g. behind a transaction-pooling proxy, where LISTEN does not work.
- **In the same process** (every backend): the enqueue marks its connection, and the
  connection's commit wakes this process's idle workers of that queue; a rollback, or the
  pool's reset of a connection returned inside its transaction, clears the mark. The commit
  event comes just before the database commits, so a woken worker polls again a few times
  over the next ~50 ms until it sees the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.pool import ConnectionPoolEntry

from sqla_proletarian.logs import Outage

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

#: The NOTIFY channel; the payload is the queue name.
CHANNEL = "sqla_proletarian"
#: The channel a job's end is announced on when someone waits for it (``wait_for_result``);
#: the payload is the job id.
DONE_CHANNEL = "sqla_proletarian_done"

#: Waits after an in-process wake-up, before the worker goes back to its polling interval.
BURST = (0.005, 0.01, 0.02, 0.04)

Wake = Callable[[bool], None]

_LOCK = threading.Lock()
#: Idle-worker wake-ups of this process, by database and queue.
_WORKERS: dict[tuple[str, str], weakref.WeakSet[Any]] = {}
#: Engines whose commits and rollbacks are watched for enqueues.
_WATCHED: weakref.WeakSet[Engine] = weakref.WeakSet()
_PENDING = "sqla_proletarian.enqueued_queues"


_KEYS: weakref.WeakKeyDictionary[Engine, str] = weakref.WeakKeyDictionary()


def database_key(engine: Engine) -> str:
    """Which database an engine reaches (for matching enqueues to workers)."""
    key = _KEYS.get(engine)
    if key is None:
        key = _KEYS[engine] = engine.url.render_as_string(hide_password=True)
    return key


def register(engine: Engine, queues: tuple[str, ...], waker: Any) -> None:
    """Let enqueues in this process wake ``waker.wake_for_enqueue()`` for each of ``queues``."""
    with _LOCK:
        for queue in queues:
            _WORKERS.setdefault((database_key(engine), queue), weakref.WeakSet()).add(waker)


def unregister(engine: Engine, queues: tuple[str, ...], waker: Any) -> None:
    with _LOCK:
        for queue in queues:
            workers = _WORKERS.get((database_key(engine), queue))
            if workers is not None:
                workers.discard(waker)


def enqueued(conn: Connection, queues: set[str]) -> None:
    """Jobs of ``queues`` were written in ``conn``'s transaction: wake this process's workers
    of those queues at its commit."""
    engine = conn.engine
    key = database_key(engine)
    with _LOCK:
        local = any(_WORKERS.get((key, queue)) for queue in queues)
        if local and engine not in _WATCHED:
            event.listen(engine, "commit", _on_commit)
            event.listen(engine, "rollback", _on_rollback)
            # The pool rolls back a connection it gets back inside a transaction (a
            # Connection dropped without close()) behind the rollback event.
            event.listen(engine, "reset", _on_reset)
            _WATCHED.add(engine)
    if local:
        conn.info.setdefault(_PENDING, set()).update(queues)


def _on_commit(conn: Connection) -> None:
    queues = conn.info.pop(_PENDING, None)
    if queues:
        wake_local(database_key(conn.engine), queues, committing=True)


def _on_rollback(conn: Connection) -> None:
    conn.info.pop(_PENDING, None)


def _on_reset(dbapi_connection: Any, record: ConnectionPoolEntry, state: Any) -> None:
    """A connection back in the pool: its transaction is over, so its enqueues wake nobody."""
    record.info.pop(_PENDING, None)


def wake_local(database: str, queues: set[str], *, committing: bool) -> None:
    """Wake this process's idle workers of ``queues`` on ``database``."""
    with _LOCK:
        wakers = [w for q in queues for w in list(_WORKERS.get((database, q), ()))]
    for waker in wakers:
        waker.wake_for_enqueue(committing)


class _Listening:
    """What both listeners keep: the queues whose notifications wake the worker, and whether
    LISTEN is in effect."""

    def __init__(
        self,
        queues: tuple[str, ...],
        wake: Callable[[], None],
        notified: Callable[[], None] | None = None,
    ) -> None:
        self.queues = frozenset(queues)
        #: The queues, in the worker's order, as logs and thread names show them.
        self.name = ",".join(queues)
        #: Wakes every idle poller (LISTEN began or ended); ``notify``, one (a job committed).
        self.wake = wake
        self.notify = notified or wake
        #: Its connection's failures, logged as one outage until it listens again (a
        #: read-only server, where LISTEN fails too, is the pollers' to report).
        self.outage = Outage("listen-error", report_read_only=False, queue=self.name)
        #: True while LISTEN is in effect: a commit then wakes the worker (see ``_listening``).
        self.listening = False

    def _notified(self, payload: str) -> None:
        """A notification for ``payload``'s queue: wake the worker if it serves it."""
        if payload in self.queues:
            self.notify()

    def _listening(self, listening: bool) -> None:
        """Note whether LISTEN is in effect, waking the worker at each change: it polls once
        for what was committed while nobody listened, and paces its polls to match."""
        if listening:
            self.outage.ended()
        if listening != self.listening:
            self.listening = listening
            self.wake()


class Listener(_Listening):
    """A thread that LISTENs on PostgreSQL and wakes a worker when one of its queues gets a job.

    Works with psycopg 3 and psycopg2; with other drivers it does not start (polling goes on).
    Reconnects after errors, backing off up to 5 s; ``listening`` says whether it is
    listening now, and each change wakes the worker, whose poll then finds a job committed
    while it was not.
    """

    def __init__(
        self,
        engine: Engine,
        queues: tuple[str, ...],
        wake: Callable[[], None],
        notified: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(queues, wake, notified)
        self.engine = engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-listener", daemon=True)

    @staticmethod
    def supported(engine: Engine) -> bool:
        return engine.dialect.name == "postgresql" and engine.dialect.driver in (
            "psycopg",
            "psycopg2",
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (within half a second; it closes its connection itself)."""
        self._stop.set()

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                self._listen()
                backoff = 0.05
            except Exception as exc:
                if self._stop.is_set():
                    return
                self.outage.failed(exc)
                self._stop.wait(backoff)
                backoff = min(5.0, backoff * 2)

    def _listen(self) -> None:
        raw = self.engine.raw_connection()
        driver: Any = raw.driver_connection
        raw.detach()  # the worker's own, not counted against the pool
        try:
            if self.engine.dialect.driver == "psycopg":
                driver.autocommit = True
                driver.execute(f"LISTEN {CHANNEL}")
                self._listening(True)
                while not self._stop.is_set():
                    for note in driver.notifies(timeout=0.5, stop_after=1):
                        self._notified(note.payload)
            else:
                driver.autocommit = True
                driver.cursor().execute(f"LISTEN {CHANNEL}")
                self._listening(True)
                while not self._stop.is_set():
                    if select.select([driver], [], [], 0.5)[0]:
                        driver.poll()
                        notes, driver.notifies[:] = list(driver.notifies), []
                        if any(note.payload in self.queues for note in notes):
                            self.notify()
        finally:
            self._listening(False)
            driver.close()


class AsyncListener(_Listening):
    """The asyncio worker's ``Listener``: a task that LISTENs on PostgreSQL through the
    engine's own asyncio driver (asyncpg's ``add_listener``, or psycopg's ``notifies()``),
    on a connection of its own outside the pool, and wakes the worker when one of its queues
    gets a job. Reconnects after errors, backing off up to 5 s; ``listening`` says whether
    it is listening now, and each change wakes the worker, whose poll then finds a job
    committed while it was not.
    """

    def __init__(
        self, engine: AsyncEngine, queues: tuple[str, ...], wake: Callable[[], None]
    ) -> None:
        super().__init__(queues, wake)
        self.engine = engine
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def supported(engine: AsyncEngine) -> bool:
        dialect = engine.sync_engine.dialect
        return dialect.name == "postgresql" and dialect.driver in ("asyncpg", "psycopg")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{self.name}-listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                await self._listen()
            except Exception as exc:
                self.outage.failed(exc)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    async def _listen(self) -> None:
        from sqlalchemy.util import greenlet_spawn  # the asyncio worker has greenlet

        raw = await greenlet_spawn(self.engine.sync_engine.raw_connection)
        driver: Any = raw.driver_connection
        raw.detach()  # the worker's own, not counted against the pool
        try:
            if self.engine.sync_engine.dialect.driver == "asyncpg":
                await self._listen_asyncpg(driver)
            else:
                await driver.set_autocommit(True)
                await driver.execute(f"LISTEN {CHANNEL}")
                self._listening(True)
                async for note in driver.notifies():
                    self._notified(note.payload)
        finally:
            self._listening(False)
            with contextlib.suppress(Exception):
                await driver.close()

    async def _listen_asyncpg(self, driver: Any) -> None:
        lost = asyncio.Event()

        def notified(conn: object, pid: int, channel: str, payload: str) -> None:
            self._notified(payload)

        driver.add_termination_listener(lambda conn: lost.set())
        await driver.add_listener(CHANNEL, notified)
        self._listening(True)
        await lost.wait()
        raise ConnectionError("the LISTEN connection was closed")
