"""Every statement the worker runs, each built by a named function.

Statements are SQLAlchemy Core, built once and cached, so they stay portable and no
identifier is ever formatted into SQL text. Where servers differ, the function takes the
fact from ``dialects`` that decides the form.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Executable,
    Select,
    String,
    Table,
    bindparam,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite

from sqla_proletarian.dialects import ArchiveUpsert, OwnerLock
from sqla_proletarian.models import ArchivedJob, Job, JobRun

JOB = Job.__table__
ARCHIVE = cast(Table, ArchivedJob.__table__)
RUN = cast(Table, JobRun.__table__)

#: The columns a claimed job is read with, in order.
JOB_COLUMNS = (
    JOB.c.job_id,
    JOB.c.queue,
    JOB.c.job_type,
    JOB.c.payload,
    JOB.c.attempts,
    JOB.c.enqueued_at,
    JOB.c.process_at,
)


Statement = tuple[Executable, dict[str, Any]]


#: How many run records a job has; read with the claim, locking nothing in the ledger.
_RUNS = (
    select(func.count())
    .where(RUN.c.job_id == JOB.c.job_id)
    .correlate(JOB)
    .scalar_subquery()
    .label("runs")
)


@cache
def _poll(limit: int, with_runs: bool) -> Select[Any]:
    columns = (*JOB_COLUMNS, _RUNS) if with_runs else JOB_COLUMNS
    return (
        select(*columns)
        .where(JOB.c.queue == bindparam("queue"), JOB.c.process_at <= bindparam("now"))
        .order_by(JOB.c.process_at, JOB.c.seq)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def poll(queue: str, now: datetime, limit: int = 1, *, with_runs: bool = False) -> Statement:
    """Claim up to ``limit`` due jobs of a queue, oldest first, skipping locked ones.

    ``with_runs`` adds ``runs``: the job's run records, for counting unclean ends.
    """
    return _poll(limit, with_runs), {"queue": queue, "now": now}


#: Inline: ``seq`` comes from the server's default, with no ``nextval()`` round trip first
#: and nothing read back (an enqueue-only role needs no SELECT).
_INSERT_JOB = insert(JOB).inline()

#: The columns an enqueue writes, in order (``seq`` is the server's).
ENQUEUED_COLUMNS = (
    "job_id",
    "queue",
    "job_type",
    "payload",
    "attempts",
    "enqueued_at",
    "process_at",
)


def insert_job(values: dict[str, Any]) -> Statement:
    """Enqueue one job (the caller's transaction commits it)."""
    return _INSERT_JOB, values


@cache
def _insert_jobs_unnest() -> Executable:
    arrays = [
        func.unnest(bindparam(name, type_=postgresql.ARRAY(JOB.c[name].type))).label(name)
        for name in ENQUEUED_COLUMNS
    ]
    return insert(JOB).from_select(list(ENQUEUED_COLUMNS), select(*arrays))


def insert_jobs(rows: list[dict[str, Any]], *, unnest: bool) -> tuple[Executable, Any]:
    """Enqueue many jobs in one statement: ``INSERT ... SELECT unnest(...)`` of one array per
    column (PostgreSQL), or an executemany that the driver sends as multi-row INSERTs."""
    if unnest:
        return _insert_jobs_unnest(), {
            name: [row[name] for row in rows] for name in ENQUEUED_COLUMNS
        }
    return _INSERT_JOB, rows


_RELOCK = (
    select(*JOB_COLUMNS)
    .where(JOB.c.job_id == bindparam("job_id"))
    .with_for_update(skip_locked=True)
)


def relock(job_id: uuid.UUID) -> Statement:
    """Claim one known job again by id, skipping it if another worker holds it (SQLite after
    the run was recorded; any server after an outcome could not be written)."""
    return _RELOCK, {"job_id": job_id}


#: The archive columns an outcome replaces when the job id is archived already.
_ARCHIVE_REPLACED = (
    "queue",
    "job_type",
    "payload",
    "attempts",
    "enqueued_at",
    "process_at",
    "status",
    "finished_at",
    "error",
)


@cache
def _archive(upsert: ArchiveUpsert) -> Executable:
    # A job enqueued again with an archived job_id (a failed job put back in the queue)
    # replaces its earlier archive row, so the archive tells how the job last ended.
    if upsert == "postgresql_on_conflict":
        pg = postgresql.insert(ARCHIVE)
        return pg.on_conflict_do_update(
            index_elements=[ARCHIVE.c.job_id],
            set_={name: pg.excluded[name] for name in _ARCHIVE_REPLACED},
        )
    if upsert == "sqlite_on_conflict":
        lite = sqlite.insert(ARCHIVE)
        return lite.on_conflict_do_update(
            index_elements=[ARCHIVE.c.job_id],
            set_={name: lite.excluded[name] for name in _ARCHIVE_REPLACED},
        )
    if upsert == "mysql_on_duplicate_key":
        my = mysql.insert(ARCHIVE)
        return my.on_duplicate_key_update({name: my.inserted[name] for name in _ARCHIVE_REPLACED})
    return insert(ARCHIVE)


def archive(
    job: dict[str, Any],
    *,
    status: str,
    attempts: int,
    finished_at: datetime,
    error: str | None,
    upsert: ArchiveUpsert = "none",
) -> Statement:
    """Copy a job into the archive with its outcome, replacing an earlier row of its id."""
    return _archive(upsert), {
        "job_id": job["job_id"],
        "queue": job["queue"],
        "job_type": job["job_type"],
        "payload": job["payload"],
        "attempts": attempts,
        "enqueued_at": job["enqueued_at"],
        "process_at": job["process_at"],
        "status": status,
        "finished_at": finished_at,
        "error": error,
    }


_DELETE_JOB = delete(JOB).where(JOB.c.job_id == bindparam("job_id"))
_END_RUNS = delete(RUN).where(RUN.c.job_id == bindparam("job_id"))
#: PostgreSQL removes the job and its run records in one statement.
_DELETE_JOB_AND_RUNS = _DELETE_JOB.add_cte(_END_RUNS.cte("ended_runs"))


def delete_job(job_id: uuid.UUID) -> Statement:
    """Remove a finished job from the queue."""
    return _DELETE_JOB, {"job_id": job_id}


def end_runs(job_id: uuid.UUID) -> Statement:
    """Remove every run record of a job that has left the queue."""
    return _END_RUNS, {"job_id": job_id}


def delete_job_and_runs(job_id: uuid.UUID) -> Statement:
    """Remove a finished job and its run records at once (PostgreSQL)."""
    return _DELETE_JOB_AND_RUNS, {"job_id": job_id}


_RETRY = (
    update(JOB)
    .where(JOB.c.job_id == bindparam("id"))
    .values(attempts=JOB.c.attempts + 1, process_at=bindparam("retry_at"))
)


def retry(job_id: uuid.UUID, retry_at: datetime) -> Statement:
    """Count the failed run and schedule the next one."""
    return _RETRY, {"id": job_id, "retry_at": retry_at}


_START_RUN = insert(RUN)


def start_run(
    run_id: uuid.UUID, job_id: uuid.UUID, worker_id: str, owner: str | None, now: datetime
) -> Statement:
    """Record that a run of a job has started (committed before the handler runs)."""
    return _START_RUN, {
        "run_id": run_id,
        "job_id": job_id,
        "worker_id": worker_id,
        "owner": owner,
        "started_at": now,
    }


_MOVE_RUN = (
    update(RUN)
    .where(RUN.c.run_id == bindparam("id"))
    .values(job_id=bindparam("job_id"), started_at=bindparam("now"))
)


def move_run(run_id: uuid.UUID, job_id: uuid.UUID, now: datetime) -> Statement:
    """Point a claim's run record at the next job of its batch, whose handler starts now."""
    return _MOVE_RUN, {"id": run_id, "job_id": job_id, "now": now}


_RUNS_OF = select(RUN.c.run_id, RUN.c.owner).where(RUN.c.job_id == bindparam("job_id"))


def runs_of(job_id: uuid.UUID) -> Statement:
    """The run records of a job, with their owners (read when a claim finds any)."""
    return _RUNS_OF, {"job_id": job_id}


_END_RUN = delete(RUN).where(RUN.c.run_id == bindparam("run_id"))


def end_run(run_id: uuid.UUID) -> Statement:
    """Remove one run's record: its outcome is recorded, or its live worker gave it up."""
    return _END_RUN, {"run_id": run_id}


# --- owners of run records: locks that live as long as the worker's session ----------------

_KEY = bindparam("key", type_=BigInteger)
_NAME = bindparam("name", type_=String(64))
_HOLD = {"advisory": select(func.pg_advisory_lock(_KEY)), "named": select(func.get_lock(_NAME, 0))}
_RELEASE = {
    "advisory": select(func.pg_advisory_unlock(_KEY)),
    "named": select(func.release_lock(_NAME)),
}
#: True (PostgreSQL) or 1 (MySQL) when nobody holds the lock: its owner's session is gone.
_FREE = {
    "advisory": select(func.pg_try_advisory_xact_lock(_KEY)),
    "named": select(func.is_free_lock(_NAME)),
}


def _owner_params(kind: OwnerLock, owner: str) -> dict[str, Any]:
    if kind == "advisory":
        # The first 64 bits of the owner's random hex, as PostgreSQL's signed bigint key.
        return {"key": int(owner[:16], 16) - (1 << 63)}
    return {"name": owner}


def hold_owner(kind: OwnerLock, owner: str) -> Statement:
    """Take the session lock that marks ``owner``'s run records as belonging to a live worker."""
    return _HOLD[kind], _owner_params(kind, owner)


def release_owner(kind: OwnerLock, owner: str) -> Statement:
    """Give the owner's session lock back (before its connection returns to the pool)."""
    return _RELEASE[kind], _owner_params(kind, owner)


def owner_gone(kind: OwnerLock, owner: str) -> Statement:
    """Whether the owner's lock is free, i.e. the session that held it has ended."""
    return _FREE[kind], _owner_params(kind, owner)
