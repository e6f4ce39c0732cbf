"""Crash accounting: which job each claim is running, so that only a dead worker is charged.

A claim has at most one run record, written (and committed at once) just before a handler
starts, naming that handler's job. Its states, and who moves it between them:

- **no record**: the job is queued, or its run ended with a recorded outcome.
- **running**: the record names the job whose handler runs now, and its ``owner`` is alive
  (a session lock of the worker's database connection; on SQLite, its process). Before the
  next handler of a batch starts, the worker moves the record to that job, so a batch-mate
  that finished or has not started is never named.
- The worker removes the record in the job's own transaction when it records the outcome,
  and by itself (``forget``) when it gives the run up while alive: a lost claim, a lock
  conflict, a lost connection, an interrupt, or a shutdown that could not wait for it.
- **unclean end**: the owner is gone (the process died, or its session ended with it) while
  the record still names a job, or the worker disowned it because the handler ended the
  worker (``SystemExit``). Only the job it names is charged.

A claim counts the records of its job whose owner is gone; a record whose owner lives is
never counted, since its run is still in flight or being cleaned up. Records of a job leave
with the job, so the tally is per job and survives any number of crashes.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import Connection

from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import Dialect, OwnerLock
from sqla_proletarian.logs import log_event

#: SQLite's owner of every record this process writes: the process itself, on one machine.
_process_owner: tuple[int, str] | None = None
#: Run records this process gave up but could not remove yet, by database; removed before
#: the next claim on that database.
_ORPHANS: dict[str, list[uuid.UUID]] = {}
_LOCK = threading.Lock()


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


def add_orphan(database: str, run_id: uuid.UUID) -> None:
    """Remember a record to remove before the next claim on ``database``."""
    with _LOCK:
        _ORPHANS.setdefault(database, []).append(run_id)


def take_orphans(database: str) -> list[uuid.UUID]:
    """The records waiting to be removed on ``database`` (put back with add_orphan on failure)."""
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


def owner_gone(kind: OwnerLock, owner: str | None, conn: Connection) -> bool:
    """Whether the worker that wrote a record is gone (so the record is an unclean end)."""
    if owner is None or kind == "none":
        return True
    if kind == "process":
        pid_text, _, _ = owner.partition(":")
        if not pid_text.isdigit():
            return True
        if int(pid_text) == os.getpid():
            # This process: its own token lives; another is a dead process's reused pid.
            return owner != process_owner()
        return not _process_alive(int(pid_text))
    return bool(conn.execute(*sql.owner_gone(kind, owner)).scalar())


def unclean_ends(dialect: Dialect, conn: Connection, job_id: uuid.UUID, records: int) -> int:
    """How many runs of a claimed job ended with their worker; ``records`` came with the poll."""
    if records == 0:
        return 0
    rows = conn.execute(*sql.runs_of(job_id)).all()
    return sum(1 for row in rows if owner_gone(dialect.owner_lock, row.owner, conn))


class RunRecord:
    """One claim's run record, moved from job to job and removed by its own worker.

    ``conn`` is the connection records are written on: the ledger's own autocommit one, or
    (SQLite) the claim's, whose caller commits. ``worker`` names the thread in the record.
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
        self.run_id: uuid.UUID | None = None
        self.job_id: uuid.UUID | None = None

    def begin(self, conn: Connection, job_id: uuid.UUID) -> None:
        """Name ``job_id`` as the job whose handler starts now (committed by the caller on
        SQLite, at once elsewhere)."""
        now = self.clock()
        if self.run_id is None:
            self.run_id = uuid.uuid4()
            conn.execute(*sql.start_run(self.run_id, job_id, self.worker, self.owner, now))
        else:
            conn.execute(*sql.move_run(self.run_id, job_id, now))
        self.job_id = job_id

    def ended(self) -> None:
        """The outcome's commit removed the record."""
        self.run_id = self.job_id = None

    def disown(self, conn: Connection) -> None:
        """Count the run as an unclean end at once: its handler ended the worker (a
        ``SystemExit``), as a dying process would, but the process may live on."""
        if self.run_id is None or self.job_id is None:
            return
        try:
            # Replaced by an ownerless record (INSERT and DELETE: the grants the ledger has).
            conn.execute(*sql.end_run(self.run_id))
            conn.execute(*sql.start_run(uuid.uuid4(), self.job_id, self.worker, None, self.clock()))
            if conn.in_transaction():
                conn.commit()
        except Exception as exc:
            log_event(logging.WARNING, "run-record-cleanup-error", error=repr(exc))
        self.ended()

    def forget(self, conn: Connection) -> bool:
        """Remove the record of a run this live worker gives up; True if it is gone."""
        if self.run_id is None:
            return True
        try:
            conn.execute(*sql.end_run(self.run_id))
            if conn.in_transaction():
                conn.commit()
        except Exception as exc:
            log_event(
                logging.WARNING,
                "run-record-cleanup-error",
                job_id=self.job_id,
                error=repr(exc),
                hint="the record stays; it counts as an unclean end only once this worker is gone",
            )
            return False
        self.ended()
        return True
