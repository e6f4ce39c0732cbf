"""Crash accounting: which jobs each claim is running, so that only a dead worker is charged.

Just before a claim's first handler starts, the worker writes the claim's **run records**
(committed at once): one for a claim of a single job, or one per job for a batch, marked
``batched``. Their states, and who moves them:

- **no record**: the job is queued, or its run ended with a recorded outcome.
- **running**: the record's ``owner`` is alive (a session lock of the worker's database
  connection; on SQLite, its process).
- The worker removes the records in the claim's own transaction when it records the
  outcomes, and by itself (``forget``) when it gives the claim up while alive: a lost claim,
  a lock conflict, a lost connection, an interrupt, or a shutdown that could not wait.
- **owner gone**: the process died (or its session ended with it) with the records still
  there. A **solo** record is then an **unclean end** of its job. A batch's records charge
  nobody, since which handler was running is not known: the claim that finds one runs that
  job **alone** (a solo record), so a job that crashes its worker is charged from its solo
  runs on, and its batch-mates, finished or not started, never are.

A claim counts the solo records of its job whose owner is gone, and only once the owner has
**stayed gone** for ``OWNER_GRACE`` seconds (seen from this process): a server restart, a
failover or killed sessions end the owner's session while its worker lives, and the worker's
``OwnerKeeper`` takes the owner lock back within ``KEEPER_INTERVAL``. Until then, and for as
long as the owner lives, the job is **held**: its earlier run may still be going, so the claim
leaves the job alone (it neither counts nor runs it). Each runner has one owner, held on a
connection of the keeper's own.

A live worker whose claim lost its connection while a handler ran, while its owner stayed
held throughout (so the server ended that one session: an idle-transaction limit), **loses**
the claim's records: they lose their owner and count like a dead worker's (a solo record is
an unclean end, a batch's make its jobs run alone), so a job longer than the limit ends
archived as failed instead of looping. Losses while polling or committing, and losses that
took the owner's session too (a restart), are not counted. Records of a job
leave with the job, so the tally is per job and survives any number of crashes. A batch
costs one record write, not one per job.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Connection, Engine

from sqla_proletarian import direct
from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import Dialect, OwnerLock
from sqla_proletarian.logs import log_event

#: SQLite's owner of every record this process writes: the process itself, on one machine.
_process_owner: tuple[int, str] | None = None
#: Run records this process gave up but could not remove yet, as (job id, run id), by
#: database; removed before the next claim on that database.
_ORPHANS: dict[str, list[tuple[uuid.UUID, uuid.UUID]]] = {}
_LOCK = threading.Lock()
#: Seconds a record's owner must stay gone before its run counts as an unclean end: longer
#: than a live worker takes to notice that its owner's session ended and take it back.
OWNER_GRACE = 5.0
#: Seconds between a keeper's checks of its owner's session.
KEEPER_INTERVAL = 1.0
#: When this process first saw each owner gone (monotonic), by owner token.
_GONE_SINCE: dict[str, float] = {}
#: The runs of this process in progress, by the owner token their records carry (an owner
#: once seen stays, with no runs): a record of one of these owners whose run is not among them
#: has ended, though the database shows it still. A failover to an asynchronous standby that
#: missed its removal brings such a record back, and with its owner alive it would hold its
#: job until the worker stopped.
_RUNNING: dict[str, set[uuid.UUID]] = {}
#: ``worker_id`` of the records a live worker lost with its connection while a handler ran.
LOST_CONNECTION = "(connection lost while the handler ran)"


def _new_run_ids(count: int) -> list[uuid.UUID]:
    """``count`` random (version 4) UUIDs, from one read of the OS's randomness rather than
    one a UUID."""
    random = os.urandom(16 * count)
    return [uuid.UUID(bytes=random[at : at + 16], version=4) for at in range(0, 16 * count, 16)]


def new_owner(kind: OwnerLock) -> str | None:
    """The owner token for a new ledger connection (None: owners are not tracked)."""
    if kind == "none":
        return None
    if kind == "process":
        return process_owner()
    token = uuid.uuid4().hex
    return f"sqlap-{token}" if kind == "named" else token


def process_owner() -> str:
    """This process's owner token (a new one after a fork)."""
    global _process_owner
    with _LOCK:
        if _process_owner is None or _process_owner[0] != os.getpid():
            _process_owner = (os.getpid(), f"{os.getpid()}:{uuid.uuid4().hex}")
        return _process_owner[1]


def hold(kind: OwnerLock, owner: str | None, conn: Connection) -> None:
    """Start vouching for ``owner``: take its session lock on ``conn``."""
    if owner is not None and kind in ("advisory", "named"):
        conn.execute(*sql.hold_owner(kind, owner))


def release(kind: OwnerLock, owner: str | None, conn: Connection) -> None:
    """Stop vouching for ``owner``: its remaining records become unclean ends."""
    if owner is None or kind not in ("advisory", "named"):
        return
    if not conn.invalidated and not conn.closed:
        conn.execute(*sql.release_owner(kind, owner))


#: Seconds a poll leaves out a job found held before looking at its records again.
HELD_RECHECK = 1.0
#: Most held jobs one poll leaves out.
MAX_HELD = 100
#: Jobs found held, by database: job id -> when to look again (monotonic).
_HELD: dict[str, dict[uuid.UUID, float]] = {}


def hold_jobs(database: str, job_ids: list[uuid.UUID]) -> None:
    """Leave these jobs out of this process's polls for ``HELD_RECHECK`` seconds."""
    until = time.monotonic() + HELD_RECHECK
    with _LOCK:
        held = _HELD.setdefault(database, {})
        for job_id in job_ids:
            held[job_id] = until


def held_jobs(database: str) -> list[uuid.UUID]:
    """The jobs this process's polls leave out now (their earlier runs may still be going)."""
    now = time.monotonic()
    with _LOCK:
        held = _HELD.get(database)
        if not held:
            return []
        for job_id in [job_id for job_id, until in held.items() if until <= now]:
            del held[job_id]
        return list(held)[:MAX_HELD]


def add_orphan(database: str, job_id: uuid.UUID, run_id: uuid.UUID) -> None:
    """Remember a record (of ``job_id``) to remove before the next claim on ``database``."""
    with _LOCK:
        _ORPHANS.setdefault(database, []).append((job_id, run_id))


def has_orphans(database: str) -> bool:
    """Whether records given up on ``database`` wait to be removed (their owner must live)."""
    with _LOCK:
        return bool(_ORPHANS.get(database))


def take_orphans(database: str) -> list[tuple[uuid.UUID, uuid.UUID]]:
    """The records waiting to be removed on ``database``, as (job id, run id) (put back with
    add_orphan on failure)."""
    with _LOCK:
        return _ORPHANS.pop(database, [])


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # A zombie has exited but was not reaped yet.
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


OwnerState = Literal["alive", "away", "gone"]


def owner_state(
    kind: OwnerLock, owner: str | None, conn: Connection, grace: float = OWNER_GRACE
) -> OwnerState:
    """Whether the worker that wrote a record lives (``alive``), is gone for good (``gone``:
    its record is an unclean end), or has lost its session for less than ``grace`` seconds
    (``away``: it may be reconnecting; its run may still be going)."""
    if owner is None or kind == "none":
        return "gone"
    if kind == "process":
        pid_text, _, _ = owner.partition(":")
        if not pid_text.isdigit():
            return "gone"
        if int(pid_text) == os.getpid():
            # This process: its own token lives; another is a dead process's reused pid.
            return "alive" if owner == process_owner() else "gone"
        return "alive" if _process_alive(int(pid_text)) else "gone"
    now = time.monotonic()
    if not conn.execute(*sql.owner_gone(kind, owner)).scalar():
        with _LOCK:
            _GONE_SINCE.pop(owner, None)
        return "alive"
    with _LOCK:
        for token, since in list(_GONE_SINCE.items()):
            if now - since > 3600:  # long gone owners' sightings: forgotten
                del _GONE_SINCE[token]
        first = _GONE_SINCE.setdefault(owner, now)
    return "gone" if now - first >= grace else "away"


class OwnerKeeper:
    """A runner's owner: the session lock that marks its run records as a live worker's, held
    on a connection of the keeper's own, and taken back on a new one when that session ends
    (a restart, a failover, a killed session) while the worker lives.

    ``epoch`` counts the sessions the owner was held by: a claim that saw it unchanged from
    its handler's start to its end knows the owner was never away.
    """

    def __init__(
        self,
        engine: Engine,
        dialect: Dialect,
        new_lock: Callable[[], AbstractContextManager[Any]] = threading.Lock,
    ) -> None:
        self.engine = engine
        self.dialect = dialect
        self.kind = dialect.owner_lock
        self.owner = new_owner(self.kind)
        self.epoch = 0
        self._lock = new_lock()
        self._conn: Connection | None = None
        self._stack = ExitStack()
        self._checker: threading.Thread | None = None
        #: Whether the owner is to be held (from the first ``ensure()`` to ``close()``).
        self._wanted = False
        self._closed = threading.Event()

    def ensure(self) -> None:
        """Hold the owner lock now (before records are written under it)."""
        with self._lock:
            self._wanted = True
            if self._conn is None or self._conn.invalidated:
                self._connect()

    def check(self) -> bool:
        """See that the owner's session lives, taking the owner back on a new one if it
        ended; True if it was held all along (since the last check)."""
        with self._lock:
            if not self._wanted:
                return False
            if self._conn is not None:
                try:
                    self._conn.exec_driver_sql("SELECT 1").scalar()
                    return True
                except Exception as exc:
                    log_event(logging.WARNING, "run-owner-lost", owner=self.owner, error=repr(exc))
            for _ in range(2):  # the first may meet a pooled connection the server ended
                try:
                    self._connect()
                    break
                except Exception as exc:
                    log_event(logging.DEBUG, "run-owner-reconnect-error", error=repr(exc))
            return False

    def start_checking(self, needed: Callable[[], bool] = lambda: True) -> None:
        """Check the owner every ``KEEPER_INTERVAL`` from a thread of its own, until
        ``close()`` (the asyncio worker checks from a task instead), each time ``needed()``
        says records may be under it: an owner with no record vouches for nothing, and
        checking an idle worker's would cost a query a second."""
        if self._checker is not None:
            return
        stopped = self._closed = threading.Event()

        def check_until_closed() -> None:
            while not stopped.wait(KEEPER_INTERVAL):
                if needed():
                    self.check()

        self._checker = threading.Thread(
            target=check_until_closed, name="sqla-proletarian-owner", daemon=True
        )
        self._checker.start()

    def close(self) -> None:
        """Give the owner lock up: records still under it count once it stays gone."""
        self._closed.set()
        self._checker = None
        with self._lock:
            self._wanted = False
            self._disconnect(release=True)

    def _connect(self) -> None:
        self._disconnect(release=False)
        stack = ExitStack()
        with stack:
            conn = stack.enter_context(self.dialect.ledger_connection(self.engine))
            hold(self.kind, self.owner, conn)
            stack.callback(release, self.kind, self.owner, conn)
            self._stack = stack.pop_all()
        self._conn = conn
        self.epoch += 1
        if self.epoch > 1:
            log_event(logging.INFO, "run-owner-taken-back", owner=self.owner)

    def _disconnect(self, *, release: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if not release and not conn.invalidated:
            conn.invalidate()  # its lock may live on the server: let the session end
        try:
            self._stack.close()
        except Exception as exc:
            log_event(logging.DEBUG, "connection-close-error", error=repr(exc))


@dataclass(frozen=True)
class Past:
    """What a claim learns from a job's run records: its unclean ends (of which
    ``connection_losses`` lost the job's connection while the handler ran), whether a batch
    it was in died (then it runs alone), and whether an earlier run may still be going
    (``held``: the claim leaves the job alone)."""

    unclean_ends: int = 0
    suspect: bool = False
    held: bool = False
    connection_losses: int = 0


CLEAN = Past()


def past_runs(
    dialect: Dialect, conn: Connection, job_id: uuid.UUID, records: int, grace: float
) -> Past:
    """The dead records of a claimed job; ``records`` (all of them) came with the poll;
    ``grace``: how long an owner must stay gone."""
    if records == 0:
        return CLEAN
    dead = []
    for row in conn.execute(*sql.runs_of(job_id)).all():
        if _ended_here(row.owner, row.run_id):
            continue  # its end was lost with the server that had it: no unclean end either
        if owner_state(dialect.owner_lock, row.owner, conn, grace) != "gone":
            return Past(held=True)
        dead.append(row)
    solo = [row for row in dead if not row.batched]
    return Past(
        unclean_ends=len(solo),
        suspect=any(row.batched for row in dead),
        connection_losses=sum(1 for row in solo if row.worker_id == LOST_CONNECTION),
    )


def _ended_here(owner: str | None, run_id: uuid.UUID) -> bool:
    """Whether a record is of a run of this process that is no longer in progress."""
    with _LOCK:
        running = _RUNNING.get(owner) if owner is not None else None
        return running is not None and run_id not in running


class ClaimRecords:
    """A claim's run records, written before its first handler and removed by its own worker.

    ``worker`` names the thread in the records; ``owner`` vouches for them.
    """

    def __init__(
        self,
        dialect: Dialect,
        owner: str | None,
        worker: str,
        clock: Callable[[], datetime],
    ) -> None:
        self.dialect = dialect
        self.owner = owner
        self.worker = worker[:255]
        self.clock = clock
        #: The claim's records, by job id.
        self.run_ids: dict[uuid.UUID, uuid.UUID] = {}

    def begin(self, conn: Connection, job_ids: list[uuid.UUID]) -> None:
        """Record the claim's runs (committed by the caller on SQLite, at once elsewhere)."""
        now = self.clock()
        batched = len(job_ids) > 1
        self.run_ids = dict(zip(job_ids, _new_run_ids(len(job_ids)), strict=True))
        if self.owner is not None:
            with _LOCK:
                _RUNNING.setdefault(self.owner, set()).update(self.run_ids.values())
        if batched and self.dialect.bulk_insert_unnest:
            statement = sql.start_batch_runs(self.run_ids, self.worker, self.owner, now)
            direct.execute(conn, *statement)
            return
        rows = [
            {
                "run_id": run_id,
                "job_id": job_id,
                "worker_id": self.worker,
                "owner": self.owner,
                "started_at": now,
                "batched": batched,
            }
            for job_id, run_id in self.run_ids.items()
        ]
        direct.execute(conn, *sql.start_runs(rows))

    def _end_runs(self) -> sql.Statement:
        """The delete of the claim's records, by id."""
        return sql.end_runs_by_id(self.run_ids.items(), force_index=self.dialect.force_index)

    def ended(self) -> None:
        """The outcomes' commit removed the records."""
        if self.owner is not None and self.run_ids:
            with _LOCK:
                _RUNNING.get(self.owner, set()).difference_update(self.run_ids.values())
        self.run_ids = {}

    def disown(self, conn: Connection, job_id: uuid.UUID) -> None:
        """Count ``job_id``'s run as an unclean end at once (its handler ended the worker with
        ``SystemExit``, as a dying process would, but the process may live on); the claim's
        other records go."""
        if not self.run_ids:
            return
        try:
            conn.execute(*self._end_runs())
            self.ended()
            self.run_ids = {job_id: uuid.uuid4()}
            self.owner, owner = None, self.owner
            try:
                self.begin(conn, [job_id])
            finally:
                self.owner = owner
            if conn.in_transaction():
                conn.commit()
        except Exception as exc:
            log_event(logging.WARNING, "run-record-cleanup-error", error=repr(exc))
        self.ended()

    def lose(self, conn: Connection) -> bool:
        """The claim's connection was lost while a handler ran and this worker lives on:
        its records lose their owner, and count as a dead worker's would; True if done."""
        return self._settle(
            conn, lambda: sql.lose_runs(list(self.run_ids.values()), LOST_CONNECTION)
        )

    def forget(self, conn: Connection) -> bool:
        """Remove the records of a claim this live worker gives up; True if they are gone."""
        return self._settle(conn, self._end_runs)

    def _settle(self, conn: Connection, statement: Callable[[], sql.Statement]) -> bool:
        """Commit ``statement`` over the claim's records, after which they are no longer
        the claim's; False (the records stay as they were) if it fails."""
        if not self.run_ids:
            return True
        try:
            conn.execute(*statement())
            if conn.in_transaction():
                conn.commit()
        except Exception as exc:
            log_event(
                logging.WARNING,
                "run-record-cleanup-error",
                runs=len(self.run_ids),
                error=repr(exc),
                hint="the records stay; they count only once this worker is gone",
            )
            return False
        self.ended()
        return True
