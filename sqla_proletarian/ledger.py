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

A claim counts the solo records of its job whose owner is gone; a record whose owner lives
is never counted, since its run is still in flight or being cleaned up. Records of a job
leave with the job, so the tally is per job and survives any number of crashes. A batch
costs one record write, not one per job.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection

from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import Dialect, OwnerLock
from sqla_proletarian.logs import log_event

#: SQLite's owner of every record this process writes: the process itself, on one machine.
_process_owner: tuple[int, str] | None = None
#: Run records this process gave up but could not remove yet, as (job id, run id), by
#: database; removed before the next claim on that database.
_ORPHANS: dict[str, list[tuple[uuid.UUID, uuid.UUID]]] = {}
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


def add_orphan(database: str, job_id: uuid.UUID, run_id: uuid.UUID) -> None:
    """Remember a record (of ``job_id``) to remove before the next claim on ``database``."""
    with _LOCK:
        _ORPHANS.setdefault(database, []).append((job_id, run_id))


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


@dataclass(frozen=True)
class Past:
    """What a claim learns from a job's run records: its unclean ends, and whether a batch
    it was in died (then it runs alone)."""

    unclean_ends: int = 0
    suspect: bool = False


CLEAN = Past()


def past_runs(dialect: Dialect, conn: Connection, job_id: uuid.UUID, records: int) -> Past:
    """The dead records of a claimed job; ``records`` (all of them) came with the poll."""
    if records == 0:
        return CLEAN
    dead = [
        row
        for row in conn.execute(*sql.runs_of(job_id)).all()
        if owner_gone(dialect.owner_lock, row.owner, conn)
    ]
    return Past(
        unclean_ends=sum(1 for row in dead if not row.batched),
        suspect=any(row.batched for row in dead),
    )


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
        self.run_ids = {job_id: uuid.uuid4() for job_id in job_ids}
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
        conn.execute(*sql.start_runs(rows, unnest=self.dialect.bulk_insert_unnest))

    def _end_runs(self) -> sql.Statement:
        """The delete of the claim's records, by id."""
        return sql.end_runs_by_id(self.run_ids.items(), force_index=self.dialect.force_index)

    def ended(self) -> None:
        """The outcomes' commit removed the records."""
        self.run_ids = {}

    def disown(self, conn: Connection, job_id: uuid.UUID) -> None:
        """Count ``job_id``'s run as an unclean end at once (its handler ended the worker with
        ``SystemExit``, as a dying process would, but the process may live on); the claim's
        other records go."""
        if not self.run_ids:
            return
        try:
            conn.execute(*self._end_runs())
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

    def forget(self, conn: Connection) -> bool:
        """Remove the records of a claim this live worker gives up; True if they are gone."""
        if not self.run_ids:
            return True
        try:
            conn.execute(*self._end_runs())
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
