"""Archive housekeeping: pruning finished jobs in batches, and the history of the failures
put back in the queue (kept by ``retry_failed``, read by ``get_job``, pruned with the job)."""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Executable,
    Select,
    String,
    bindparam,
    delete,
    insert,
    literal,
    select,
)

from sqla_proletarian.statements.base import ARCHIVE, HISTORY, JOB, Statement

#: MySQL and MariaDB would rather scan the table and sort when a status filter matches many
#: rows; batch after batch, the index reads each old row once.
_BY_FINISHED_AT = "FORCE INDEX (ix_proletarian_archived_job_finished_at)"


@cache
def _archived_batch(by_status: bool, after: bool) -> Select[Any]:
    conditions = [ARCHIVE.c.finished_at < bindparam("cutoff")]
    if after:
        conditions.append(ARCHIVE.c.finished_at >= bindparam("after"))
    if by_status:
        conditions.append(ARCHIVE.c.status == bindparam("status"))
    return (
        select(ARCHIVE.c.job_id, ARCHIVE.c.finished_at)
        .with_hint(ARCHIVE, _BY_FINISHED_AT, "mysql")
        .with_hint(ARCHIVE, _BY_FINISHED_AT, "mariadb")
        .where(*conditions)
        .order_by(ARCHIVE.c.finished_at)
        .limit(bindparam("batch_size", type_=BigInteger))
    )


def archived_batch(
    cutoff: datetime,
    batch_size: int,
    *,
    status: str | None = None,
    after: datetime | None = None,
) -> Statement:
    """The oldest archived jobs finished before ``cutoff`` (from ``after`` on), by index."""
    params: dict[str, Any] = {"cutoff": cutoff, "batch_size": batch_size}
    if status is not None:
        params["status"] = status
    if after is not None:
        params["after"] = after
    return _archived_batch(status is not None, after is not None), params


@cache
def _delete_archived(by_status: bool) -> Executable:
    conditions = [
        ARCHIVE.c.job_id.in_(bindparam("job_ids", expanding=True)),
        ARCHIVE.c.finished_at < bindparam("cutoff"),
    ]
    if by_status:
        conditions.append(ARCHIVE.c.status == bindparam("status"))
    return delete(ARCHIVE).where(*conditions)


def delete_archived(
    job_ids: list[uuid.UUID], cutoff: datetime, *, status: str | None = None
) -> Statement:
    """Delete archived jobs by id, unless archived again since (finished after ``cutoff``)."""
    params: dict[str, Any] = {"job_ids": job_ids, "cutoff": cutoff}
    if status is not None:
        params["status"] = status
    return _delete_archived(status is not None), params


#: What the history keeps of an archive row.
_KEPT = ("job_id", "status", "attempts", "finished_at", "error")
_KEEP_FAILURES = (
    insert(HISTORY)
    .from_select(
        _KEPT,
        select(*(ARCHIVE.c[name] for name in _KEPT)).where(
            ARCHIVE.c.job_id.in_(bindparam("job_ids", expanding=True)),
            ARCHIVE.c.status == literal("failure", String(16)),
        ),
    )
    .execution_options(preserve_rowcount=True)
)


def keep_failures(job_ids: list[uuid.UUID]) -> Statement:
    """Copy the archived failures of ``job_ids`` into the history, before ``retry_failed``
    removes their archive rows; the row count is the number kept."""
    return _KEEP_FAILURES, {"job_ids": job_ids}


_HISTORY_OF = (
    select(HISTORY.c.status, HISTORY.c.attempts, HISTORY.c.finished_at, HISTORY.c.error)
    .where(HISTORY.c.job_id == bindparam("job_id"))
    .order_by(HISTORY.c.seq)
)


def history_of(job_id: uuid.UUID) -> Statement:
    """The earlier ends of a job, oldest first (by the history's job-id index)."""
    return _HISTORY_OF, {"job_id": job_id}


_DELETE_HISTORY = delete(HISTORY).where(
    HISTORY.c.job_id.in_(bindparam("job_ids", expanding=True)),
    ~select(ARCHIVE.c.job_id).where(ARCHIVE.c.job_id == HISTORY.c.job_id).exists(),
    ~select(JOB.c.job_id).where(JOB.c.job_id == HISTORY.c.job_id).exists(),
)


def delete_history(job_ids: list[uuid.UUID]) -> Statement:
    """Delete the history of pruned jobs: those of ``job_ids`` neither archived nor queued
    now (one put back or archived again since its batch was read keeps its history)."""
    return _DELETE_HISTORY, {"job_ids": job_ids}
