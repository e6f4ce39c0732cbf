"""Finishing a claim: the outcome of one job, and every succeeded job archived in as few
statements as possible."""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import (
    Executable,
    Select,
    String,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal,
    null,
    select,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from sqla_proletarian.dialects import ArchiveUpsert
from sqla_proletarian.statements.base import (
    _IDS,
    _JOB_BY_ID,
    _OF_JOBS,
    ARCHIVE,
    JOB,
    JOB_COLUMNS,
    RUN,
    Statement,
    _any,
    _delete_by,
)
from sqla_proletarian.statements.enqueue import _KEPT_COLUMNS
from sqla_proletarian.statements.runs import end_runs_by_id
from sqla_proletarian.statements.workflows import waiting_for

#: The archive keeps a job's enqueued columns, its snoozes and its outcome (its result too:
#: a job archived again never keeps an earlier run's).
_ARCHIVE_REPLACED = (*_KEPT_COLUMNS[1:], "snoozes", "status", "finished_at", "error", "result")


@cache
def _archive(upsert: ArchiveUpsert) -> Executable:
    return _upserted(upsert)


def archive(
    job: dict[str, Any],
    *,
    status: str,
    attempts: int,
    finished_at: datetime,
    error: str | None,
    upsert: ArchiveUpsert = "none",
    result: str | None = None,
) -> Statement:
    """Copy a job into the archive with its outcome (and its handler's serialized
    ``result``), replacing an earlier row of its id."""
    return _archive(upsert), {
        "job_id": job["job_id"],
        "queue": job["queue"],
        "job_type": job["job_type"],
        "payload": job["payload"],
        "attempts": attempts,
        "enqueued_at": job["enqueued_at"],
        # A leased job's process_at is its lease's expiry; due_at is its own.
        "process_at": job.get("due_at") or job["process_at"],
        "run_order": job["run_order"],
        "unique_key": job.get("unique_key"),
        "concurrency_key": job.get("concurrency_key"),
        "snoozes": job.get("snoozes", 0),
        "status": status,
        "finished_at": finished_at,
        "error": error,
        "result": result,
    }


_DELETE_JOB = delete(JOB).where(JOB.c.job_id == bindparam("job_id"))
_END_RUNS = delete(RUN).where(RUN.c.job_id == bindparam("job_id"))
#: PostgreSQL removes the job and its run records in one statement.
_DELETE_JOB_AND_RUNS = _DELETE_JOB.add_cte(_END_RUNS.cte("ended_runs"))


def delete_job(job_id: uuid.UUID) -> Statement:
    """Remove a finished job from the queue (its run records go when the claim finishes)."""
    return _DELETE_JOB, {"job_id": job_id}


def end_runs(job_id: uuid.UUID) -> Statement:
    """Remove every run record of a job that has left the queue."""
    return _END_RUNS, {"job_id": job_id}


def delete_job_and_runs(job_id: uuid.UUID) -> Statement:
    """Remove a finished job and its run records at once (PostgreSQL)."""
    return _DELETE_JOB_AND_RUNS, {"job_id": job_id}


# --- finishing a claim: every succeeded job archived in as few statements as possible ------

_ARCHIVED_COLUMNS = [*_KEPT_COLUMNS, "snoozes", "status", "finished_at", "error", "result"]


def _as_archived(columns: Any, leased: bool = False) -> Select[Any]:
    """The archive row of a succeeded job from its queue row: one more attempt, success (a
    ``leased`` job's claim counted its run in ``attempts`` already)."""
    return select(
        columns.job_id,
        columns.queue,
        columns.job_type,
        columns.payload,
        columns.attempts if leased else columns.attempts + 1,
        columns.enqueued_at,
        func.coalesce(columns.due_at, columns.process_at),
        columns.run_order,
        columns.unique_key,
        columns.concurrency_key,
        columns.snoozes,
        literal("success", String(16)),
        bindparam("now", type_=ARCHIVE.c.finished_at.type),
        null(),
        null(),  # results are written after (set_results)
    )


def _upserted(upsert: ArchiveUpsert, rows: Select[Any] | None = None) -> Insert:
    """An archive insert (of ``rows``, else of one row's values) that replaces the earlier
    row of a job id archived already: a job enqueued again with its id (a failed job put
    back in the queue) then tells how it last ended."""
    module = {"postgresql_on_conflict": postgresql, "sqlite_on_conflict": sqlite}.get(upsert)
    if module is not None:
        conflicting = module.insert(ARCHIVE)
        if rows is not None:
            conflicting = conflicting.from_select(_ARCHIVED_COLUMNS, rows)
        upserting = conflicting.on_conflict_do_update(
            index_elements=[ARCHIVE.c.job_id],
            set_={name: conflicting.excluded[name] for name in _ARCHIVE_REPLACED},
        )
        return cast(Insert, upserting)
    if upsert == "mysql_on_duplicate_key":
        duplicate = mysql.insert(ARCHIVE)
        if rows is not None:
            duplicate = duplicate.from_select(_ARCHIVED_COLUMNS, rows)
        return duplicate.on_duplicate_key_update(
            {name: duplicate.inserted[name] for name in _ARCHIVE_REPLACED}
        )
    plain = insert(ARCHIVE)
    return plain if rows is None else plain.from_select(_ARCHIVED_COLUMNS, rows)


@cache
def _succeeded_returning(upsert: ArchiveUpsert) -> Executable:
    done = delete(JOB).where(JOB.c.job_id == _any("ids")).returning(*JOB_COLUMNS).cte("done")
    # Two deletes, each through its index: an OR of both reads the whole table where the
    # planner has no statistics (a table never analyzed).
    ended = delete(RUN).where(RUN.c.job_id == _any("ended")).cte("ended_runs")
    own = delete(RUN).where(RUN.c.run_id == _any("own")).cte("own_runs")
    statement = _upserted(upsert, _as_archived(done.c)).add_cte(done).add_cte(ended).add_cte(own)
    statement = statement.returning(waiting_for(_any("ids")))
    return statement.execution_options(preserve_rowcount=True)


@cache
def _succeeded_copy(upsert: ArchiveUpsert, force_index: bool, leased: bool = False) -> Executable:
    copied = _as_archived(JOB.c, leased).where(JOB.c.job_id.in_(_IDS))
    if force_index:
        copied = copied.with_hint(JOB, _JOB_BY_ID, "mysql").with_hint(JOB, _JOB_BY_ID, "mariadb")
    return _upserted(upsert, copied)


def end_claim_runs(
    ended: list[uuid.UUID], own_runs: dict[uuid.UUID, uuid.UUID], *, force_index: bool = False
) -> list[Statement]:
    """Remove the run records of the jobs a claim ended, and the claim's own records of the
    jobs it did not end (retried or never started; job id: run id): two deletes, each through
    the index (an OR of both would scan the table, and InnoDB would lock what it scans)."""
    statements: list[Statement] = []
    if ended:
        statements.append((_delete_by(RUN, _OF_JOBS, "ended", force_index), {"ended": ended}))
    if own_runs:
        statements.append(end_runs_by_id(own_runs.items(), force_index=force_index))
    return statements


def archive_succeeded(
    job_ids: list[uuid.UUID],
    ended: list[uuid.UUID],
    own_runs: dict[uuid.UUID, uuid.UUID],
    now: datetime,
    *,
    upsert: ArchiveUpsert,
    returning: bool,
    force_index: bool = False,
) -> list[Statement]:
    """Archive the succeeded jobs of a claim from their queue rows (their payloads never
    travel back) and remove them, then the run records of every job the claim ended
    (``ended``) and the claim's own records of the others (``own_runs``).

    One statement where ``DELETE ... RETURNING`` can feed the archive (PostgreSQL: it returns,
    for each job archived, how many rows wait for the claim's ends, ``waiting``); else an
    ``INSERT ... SELECT`` and deletes, each reading the jobs' or records' index (named, with
    ``force_index``). The first statement's row count (PostgreSQL) or the job delete's tells
    whether every job row was still there.
    """
    if returning:
        runs = {"ended": ended, "own": list(own_runs.values())}
        return [(_succeeded_returning(upsert), {"ids": job_ids, "now": now, **runs})]
    return [
        (_succeeded_copy(upsert, force_index), {"ids": job_ids, "now": now}),
        (_delete_by(JOB, ("job_id",), "ids", force_index), {"ids": job_ids}),
        *end_claim_runs(ended, own_runs, force_index=force_index),
    ]


def archive_leased_succeeded(
    job_ids: list[uuid.UUID],
    now: datetime,
    *,
    upsert: ArchiveUpsert,
    force_index: bool = False,
) -> list[Statement]:
    """Archive leased jobs that succeeded (their claim counted the run, and their rows are
    locked by the completion, which checked their tokens) from their queue rows and remove
    them, with no run records (a job that has some completes on its own): an ``INSERT ...
    SELECT`` and a delete, each reading the jobs' index (named, with ``force_index``).
    PostgreSQL ends such a group in one statement instead (``leases.complete_leases``)."""
    return [
        (_succeeded_copy(upsert, force_index, leased=True), {"ids": job_ids, "now": now}),
        (_delete_by(JOB, ("job_id",), "ids", force_index), {"ids": job_ids}),
    ]


_SET_RESULT = (
    update(ARCHIVE)
    .where(ARCHIVE.c.job_id == bindparam("id"))
    .values(result=bindparam("result", type_=ARCHIVE.c.result.type))
)


def set_results(results: dict[uuid.UUID, str]) -> tuple[Executable, Any]:
    """Store the serialized results of archived jobs (job id: result), one executemany:
    a claim whose handlers all returned None runs none."""
    return _SET_RESULT, [{"id": job_id, "result": text} for job_id, text in results.items()]


#: An expired lease taken by a transaction-mode claim is an unclean end (see leases).
_EXPIRED_LEASE = case((JOB.c.lease_token.is_(None), 0), else_=1)
#: The most snoozes a job's count keeps (its SMALLINT column's largest value): a job that
#: snoozes more goes on snoozing, its count stays there.
MAX_SNOOZES = 32_767
#: One more snooze, up to MAX_SNOOZES.
_SNOOZED = (
    JOB.c.snoozes,
    case((JOB.c.snoozes < MAX_SNOOZES, JOB.c.snoozes + 1), else_=JOB.c.snoozes),
)
#: What a retry writes besides the new due time: no lease (MySQL assigns in this order,
#: each seeing the ones before, so the count reads the token before it is cleared). A cancel
#: request stays: once committed, it ends the job at its next claim.
_NO_LEASE = (
    (JOB.c.unclean_ends, JOB.c.unclean_ends + _EXPIRED_LEASE),
    (JOB.c.lease_token, null()),
    (JOB.c.lease_owner, null()),
    (JOB.c.heartbeat_at, null()),
    (JOB.c.due_at, null()),
)


def _rescheduled(count: tuple[Any, Any]) -> Executable:
    """A job given back to the queue, due at ``:due``: no lease, and ``count`` moved."""
    return (
        update(JOB)
        .where(JOB.c.job_id == bindparam("id"))
        .ordered_values(*_NO_LEASE, count, (JOB.c.process_at, bindparam("due")))
    )


_RETRY = _rescheduled((JOB.c.attempts, JOB.c.attempts + 1))
_SNOOZE = _rescheduled(_SNOOZED)


def retry(job_id: uuid.UUID, retry_at: datetime) -> Statement:
    """Count the failed run and schedule the next one."""
    return _RETRY, {"id": job_id, "due": retry_at}


def snooze(job_id: uuid.UUID, until: datetime) -> Statement:
    """Put a snoozed job back, due at ``until``: its run takes no attempt, and counts in
    ``snoozes``."""
    return _SNOOZE, {"id": job_id, "due": until}
