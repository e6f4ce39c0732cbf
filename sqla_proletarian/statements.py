"""Every statement the worker runs, each built by a named function.

Statements are SQLAlchemy Core, built once and cached, so they stay portable and no
identifier is ever formatted into SQL text. Where servers differ, the function takes the
fact from ``dialects`` that decides the form.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Executable,
    Integer,
    Select,
    String,
    Table,
    Uuid,
    any_,
    bindparam,
    case,
    column,
    delete,
    exists,
    false,
    func,
    insert,
    literal,
    null,
    select,
    table,
    text,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.selectable import Alias

from sqla_proletarian.dialects import ArchiveUpsert, InsertOrNothing, OwnerLock, PriorityScan
from sqla_proletarian.models import ArchivedJob, Job, JobRun, PausedQueue, PeriodicSchedule
from sqla_proletarian.wakeups import CHANNEL

JOB = Job.__table__
ARCHIVE = cast(Table, ArchivedJob.__table__)
RUN = cast(Table, JobRun.__table__)
PERIODIC = cast(Table, PeriodicSchedule.__table__)
PAUSED = cast(Table, PausedQueue.__table__)

#: The columns a claimed job is read with, in order.
JOB_COLUMNS = (
    JOB.c.job_id,
    JOB.c.queue,
    JOB.c.job_type,
    JOB.c.payload,
    JOB.c.attempts,
    JOB.c.enqueued_at,
    JOB.c.process_at,
    JOB.c.trace_context,
    JOB.c.run_order,
    JOB.c.unique_key,
    JOB.c.lease_token,
    JOB.c.due_at,
    JOB.c.unclean_ends,
    JOB.c.cancel_requested_at,
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


#: Whether the queue is paused: one primary-key lookup, evaluated once per poll.
_PAUSED = select(PAUSED.c.queue).where(PAUSED.c.queue == bindparam("queue")).exists()


@cache
def _poll(limit: int, with_runs: bool, excluding: bool = False, first: bool = False) -> Select[Any]:
    columns = (*JOB_COLUMNS, _RUNS) if with_runs else JOB_COLUMNS
    statement = (
        select(*columns)
        .where(
            JOB.c.queue == bindparam("queue"),
            JOB.c.run_order == (_FIRST_DUE_RUN_ORDER if first else bindparam("run_order")),
            JOB.c.process_at <= bindparam("now"),
            ~_PAUSED,
        )
        .order_by(JOB.c.run_order, JOB.c.process_at, JOB.c.seq)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    if excluding:
        statement = statement.where(JOB.c.job_id.not_in(bindparam("held", expanding=True)))
    return statement


def poll(
    queue: str,
    now: datetime,
    limit: int = 1,
    *,
    run_order: int,
    with_runs: bool = False,
    excluding: list[uuid.UUID] | None = None,
) -> Statement:
    """Claim up to ``limit`` due jobs of one priority (``run_order``) of a queue unless it
    is paused, oldest first, skipping locked ones: one range of the poll index, due jobs only.

    ``with_runs`` adds ``runs``: the job's run records, for counting unclean ends.
    ``excluding`` leaves out jobs whose earlier run may still be going (``ledger``).
    """
    params: dict[str, Any] = {"queue": queue, "now": now, "run_order": run_order}
    if excluding:
        params["held"] = excluding
    return _poll(limit, with_runs, bool(excluding)), params


def poll_first(
    queue: str,
    now: datetime,
    limit: int = 1,
    *,
    with_runs: bool = False,
    excluding: list[uuid.UUID] | None = None,
) -> Statement:
    """As ``poll``, of the queue's highest priority that has a due job, found inside the
    statement (probes of the poll index, evaluated once): a busy claim in one round trip."""
    params: dict[str, Any] = {"queue": queue, "now": now}
    if excluding:
        params["held"] = excluding
    return _poll(limit, with_runs, bool(excluding), first=True), params


def _first_run_order(after: Any = None) -> Any:
    """The queue's smallest ``run_order`` (above ``after``): the first entry of a range of
    the poll index."""
    conditions = [JOB.c.queue == bindparam("queue")]
    if after is not None:
        conditions.append(JOB.c.run_order > after)
    first = select(JOB.c.run_order).where(*conditions).order_by(JOB.c.run_order).limit(1)
    return first.scalar_subquery()


#: The queue's priorities, one index probe each (a loose index scan), none when it is paused.
_RUN_ORDERS = (
    select(_first_run_order().label("run_order")).where(~_PAUSED).cte("run_orders", recursive=True)
)
_PREVIOUS = _RUN_ORDERS.alias("previous")
_RUN_ORDERS = _RUN_ORDERS.union_all(
    select(_first_run_order(_PREVIOUS.c.run_order)).where(_PREVIOUS.c.run_order.is_not(None))
)


def _earliest(run_order: Any) -> Any:
    """A priority's earliest ``process_at``: the first index entry of its range."""
    earliest = select(JOB.c.process_at).where(
        JOB.c.queue == bindparam("queue"), JOB.c.run_order == run_order
    )
    return earliest.order_by(JOB.c.process_at).limit(1).scalar_subquery()


_EARLIEST = _earliest(_RUN_ORDERS.c.run_order)
_DUE_AT = bindparam("now", type_=JOB.c.process_at.type)

#: The queue's priorities from the first up to the first that has a due job, and no further:
#: one hop through the poll index each (as ``_RUN_ORDERS``).
_UNTIL_DUE = select(_first_run_order().label("run_order")).cte("until_due", recursive=True)
_BEFORE = _UNTIL_DUE.alias("before")
_UNTIL_DUE = _UNTIL_DUE.union_all(
    select(_first_run_order(_BEFORE.c.run_order)).where(
        _BEFORE.c.run_order.is_not(None), _earliest(_BEFORE.c.run_order) > _DUE_AT
    )
)
#: The queue's highest priority that has a due job (NULL if none): the last hop, if due.
_FIRST_DUE_RUN_ORDER = (
    select(_UNTIL_DUE.c.run_order)
    .where(_UNTIL_DUE.c.run_order.is_not(None), _earliest(_UNTIL_DUE.c.run_order) <= _DUE_AT)
    .scalar_subquery()
)
_DUE_RUN_ORDERS = {
    "recursive": select(_RUN_ORDERS.c.run_order).where(
        _RUN_ORDERS.c.run_order.is_not(None), _EARLIEST <= _DUE_AT
    ),
    # A loose index scan: per priority, one probe for its first due entry (MIN of the next
    # index column, bounded by the range); grouped by the queue too, as the index starts.
    "group_by": select(JOB.c.run_order, func.min(JOB.c.process_at))
    .where(JOB.c.queue == bindparam("queue"), JOB.c.process_at <= _DUE_AT, ~_PAUSED)
    .group_by(JOB.c.queue, JOB.c.run_order),
}


def due_run_orders(queue: str, now: datetime, scan: PriorityScan) -> Statement:
    """The priorities (as ``run_order``, the first column) of a queue that have a job due at
    ``now``, running or not, unless the queue is paused: a probe or two of the poll index per
    priority, however many jobs are scheduled for later; a plain read, locking nothing."""
    return _DUE_RUN_ORDERS[scan], {"queue": queue, "now": now}


_NEXT_DUE = {
    "recursive": select(_EARLIEST).where(_RUN_ORDERS.c.run_order.is_not(None)),
    # A loose index scan, as in ``_DUE_RUN_ORDERS``: per priority, its first index entry.
    "group_by": select(func.min(JOB.c.process_at))
    .where(JOB.c.queue == bindparam("queue"), ~_PAUSED)
    .group_by(JOB.c.queue, JOB.c.run_order),
}


def next_due(queue: str, scan: PriorityScan) -> Statement:
    """Each priority's earliest ``process_at`` (the first column) in a queue, unless it is
    paused: the first entry of each priority's range of the poll index, whether due or
    scheduled for later, so an idle worker can sleep until then; a plain read."""
    return _NEXT_DUE[scan], {"queue": queue}


#: Inline: ``seq`` comes from the server's default, with no ``nextval()`` round trip first
#: and nothing read back (an enqueue-only role needs no SELECT).
_INSERT_JOB = insert(JOB).inline()

#: The columns an enqueue writes, in order: those a claim reads (``seq`` is the server's).
#: The columns an enqueue writes: a claimed job's, less its lease's.
_LEASE_STATE = ("lease_token", "due_at", "unclean_ends", "cancel_requested_at")
ENQUEUED_COLUMNS = tuple(column.name for column in JOB_COLUMNS if column.name not in _LEASE_STATE)
#: The enqueued columns the archive keeps: all but the enqueuer's trace context.
_KEPT_COLUMNS = tuple(name for name in ENQUEUED_COLUMNS if name in ARCHIVE.c)


def insert_job(values: dict[str, Any]) -> Statement:
    """Enqueue one job (the caller's transaction commits it)."""
    return _INSERT_JOB, values


@cache
def _insert_or_nothing(table: Table, key: tuple[str, ...], form: InsertOrNothing) -> Executable:
    module = {"postgresql_on_conflict": postgresql, "sqlite_on_conflict": sqlite}.get(form)
    if module is None:
        return insert(table).inline()
    columns = [table.c[name] for name in key]
    return cast(
        Executable, module.insert(table).inline().on_conflict_do_nothing(index_elements=columns)
    )


def insert_job_or_nothing(values: dict[str, Any], form: InsertOrNothing) -> Statement:
    """Enqueue one job with a unique key, unless a job of its queue holds the key: then
    nothing is added (row count 0) or, where the form is a plain INSERT, the duplicate-key
    error says so."""
    return _insert_or_nothing(JOB, ("queue", "unique_key"), form), values


_KEY_HOLDER = select(JOB.c.job_id).where(
    JOB.c.queue == bindparam("queue"), JOB.c.unique_key == bindparam("unique_key")
)


def key_holder(queue: str, unique_key: str) -> Statement:
    """The id of the queued (or running) job holding a unique key in its queue."""
    return _KEY_HOLDER, {"queue": queue, "unique_key": unique_key}


@cache
def _insert_unnest(table: Table, columns: tuple[str, ...]) -> Executable:
    arrays = [
        func.unnest(bindparam(name, type_=postgresql.ARRAY(table.c[name].type))).label(name)
        for name in columns
    ]
    return insert(table).from_select(list(columns), select(*arrays))


def _as_arrays(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> dict[str, list[Any]]:
    return {name: [row.get(name) for row in rows] for name in columns}


def insert_jobs(rows: list[dict[str, Any]], *, unnest: bool) -> tuple[Executable, Any]:
    """Enqueue many jobs in one statement: ``INSERT ... SELECT unnest(...)`` of one array per
    column (PostgreSQL), or an executemany that the driver sends as multi-row INSERTs."""
    if unnest:
        return _insert_unnest(JOB, ENQUEUED_COLUMNS), _as_arrays(rows, ENQUEUED_COLUMNS)
    return _INSERT_JOB, rows


_RELOCK = (
    select(*JOB_COLUMNS)
    .where(JOB.c.job_id == bindparam("job_id"))
    .with_for_update(skip_locked=True)
)


def relock(job_id: uuid.UUID) -> Statement:
    """Claim one known job again by id, skipping it if another worker holds it (any server
    after an outcome could not be written)."""
    return _RELOCK, {"job_id": job_id}


_RECLAIM = _RELOCK.where(
    JOB.c.queue == bindparam("queue"), JOB.c.process_at <= bindparam("now"), ~_PAUSED
)


def reclaim(job_id: uuid.UUID, queue: str, now: datetime) -> Statement:
    """Claim one known job again by id on the poll's terms: due at ``now``, its queue not
    paused, not held by another worker (SQLite, after the run was recorded)."""
    return _RECLAIM, {"job_id": job_id, "queue": queue, "now": now}


#: The archive columns an outcome replaces when the job id is archived already.
_ARCHIVE_REPLACED = (*_KEPT_COLUMNS[1:], "status", "finished_at", "error")


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
) -> Statement:
    """Copy a job into the archive with its outcome, replacing an earlier row of its id."""
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
        "status": status,
        "finished_at": finished_at,
        "error": error,
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

_IDS: BindParameter[Any] = bindparam("ids", expanding=True)
_ARCHIVED_COLUMNS = [*_KEPT_COLUMNS, "status", "finished_at", "error"]


def _as_archived(columns: Any) -> Select[Any]:
    """The archive row of a succeeded job from its queue row: one more attempt, success."""
    return select(
        columns.job_id,
        columns.queue,
        columns.job_type,
        columns.payload,
        columns.attempts + 1,
        columns.enqueued_at,
        func.coalesce(columns.due_at, columns.process_at),
        columns.run_order,
        columns.unique_key,
        literal("success", String(16)),
        bindparam("now", type_=ARCHIVE.c.finished_at.type),
        null(),
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


#: The indexes that statements reading many rows by key name where the dialect forces them
#: (``force_index``): on a small table MySQL and MariaDB plan ``WHERE key IN (...)`` as a
#: scan, and InnoDB locks every row a locking statement reads, rows other claims hold included.
#: Run records go by the job-id index, even those known by id: on a small table MariaDB plans
#: a delete by a list of primary keys as a scan, hinted or not.
_JOB_BY_ID = "FORCE INDEX (uq_proletarian_job_job_id)"
_RUN_BY_JOB = "FORCE INDEX (ix_proletarian_job_run_job_id)"
#: The table's name in a delete that names its index (no identifier of the user's).
_TARGET = "target"
#: ``job_id IN (:ended)``: every record of the jobs; ``(job_id, run_id) IN (:runs)``: the
#: records of those ids (one IN of pairs: two IN lists make MariaDB scan, hint or not).
_OF_JOBS = ("job_id",)
_BY_ID = ("job_id", "run_id")


@cache
def _delete_by(table: Table, keys: tuple[str, ...], ids: str, force_index: bool) -> Executable:
    """``DELETE ... WHERE key IN (:ids)`` (or ``(key, ...) IN``); with ``force_index``,
    MySQL's multi-table form ``DELETE target FROM table AS target FORCE INDEX (...)``, the
    only DELETE that takes an index hint (other servers get the plain form)."""
    target = cast(Alias, table.alias(_TARGET)) if force_index else table
    key = target.c[keys[0]] if len(keys) == 1 else tuple_(*(target.c[name] for name in keys))
    statement = delete(target).where(key.in_(bindparam(ids, expanding=True)))
    if not force_index:
        return statement
    hint = _JOB_BY_ID if table is JOB else _RUN_BY_JOB
    for name in ("mysql", "mariadb"):
        statement = statement.prefix_with(_TARGET, dialect=name)
        statement = statement.with_hint(hint, dialect_name=name)
    return statement


def _any(name: str) -> Any:
    """``= ANY(:name)`` with one array parameter: the same SQL text for any number of ids,
    so PostgreSQL drivers can prepare it once."""
    return any_(bindparam(name, type_=postgresql.ARRAY(Uuid())))


@cache
def _succeeded_returning(upsert: ArchiveUpsert) -> Executable:
    done = delete(JOB).where(JOB.c.job_id == _any("ids")).returning(*JOB_COLUMNS).cte("done")
    runs = delete(RUN).where((RUN.c.job_id == _any("ended")) | (RUN.c.run_id == _any("own")))
    statement = _upserted(upsert, _as_archived(done.c)).add_cte(done).add_cte(runs.cte("runs"))
    return statement.execution_options(preserve_rowcount=True)


@cache
def _succeeded_copy(upsert: ArchiveUpsert, force_index: bool) -> Executable:
    copied = _as_archived(JOB.c).where(JOB.c.job_id.in_(_IDS))
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

    One statement where ``DELETE ... RETURNING`` can feed the archive (PostgreSQL); else an
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


#: An expired lease taken by a transaction-mode claim is an unclean end (see leases).
_EXPIRED_LEASE = case((JOB.c.lease_token.is_(None), 0), else_=1)
#: What a retry writes besides the new due time: no lease (MySQL assigns in this order,
#: each seeing the ones before, so the count reads the token before it is cleared).
_NO_LEASE = (
    (JOB.c.unclean_ends, JOB.c.unclean_ends + _EXPIRED_LEASE),
    (JOB.c.lease_token, null()),
    (JOB.c.lease_owner, null()),
    (JOB.c.heartbeat_at, null()),
    (JOB.c.due_at, null()),
    (JOB.c.cancel_requested_at, null()),
)
_RETRY = (
    update(JOB)
    .where(JOB.c.job_id == bindparam("id"))
    .ordered_values(
        *_NO_LEASE,
        (JOB.c.attempts, JOB.c.attempts + 1),
        (JOB.c.process_at, bindparam("retry_at")),
    )
)


def retry(job_id: uuid.UUID, retry_at: datetime) -> Statement:
    """Count the failed run and schedule the next one."""
    return _RETRY, {"id": job_id, "retry_at": retry_at}


# --- lease mode: claims that commit a lease, renewals, fenced ends ------------------------

_TOKEN = bindparam("token", type_=Uuid())
_LEASE_IDS: BindParameter[Any] = bindparam("ids", expanding=True)
_LEASE_TOKENS: BindParameter[Any] = bindparam("tokens", expanding=True, type_=Uuid())
#: The rows of a worker's leases: its job ids, still carrying one of its tokens.
_HELD = (JOB.c.job_id.in_(_LEASE_IDS), JOB.c.lease_token.in_(_LEASE_TOKENS))

_LEASE = (
    update(JOB)
    .where(JOB.c.job_id.in_(_LEASE_IDS))
    .ordered_values(
        # In this order (MySQL assigns left to right): the count reads the old token, due_at
        # the old process_at.
        (JOB.c.unclean_ends, JOB.c.unclean_ends + _EXPIRED_LEASE),
        (JOB.c.due_at, func.coalesce(JOB.c.due_at, JOB.c.process_at)),
        (JOB.c.attempts, JOB.c.attempts + 1),
        (JOB.c.lease_token, _TOKEN),
        (JOB.c.lease_owner, bindparam("owner")),
        (JOB.c.heartbeat_at, bindparam("now", type_=JOB.c.process_at.type)),
        (JOB.c.process_at, bindparam("expiry", type_=JOB.c.process_at.type)),
    )
)


def lease(
    job_ids: list[uuid.UUID], token: uuid.UUID, owner: str, now: datetime, expiry: datetime
) -> Statement:
    """Lease the jobs a claim locked, under one fresh token: count the run (and an expired
    lease as an unclean end), keep their own due time, and make ``process_at`` the expiry."""
    return _LEASE, {"ids": job_ids, "token": token, "owner": owner, "now": now, "expiry": expiry}


_LOCK_LEASES = select(JOB.c.job_id).where(*_HELD).with_for_update(skip_locked=True)
_RENEW = (
    update(JOB)
    .where(*_HELD)
    .values(
        heartbeat_at=bindparam("now", type_=JOB.c.process_at.type),
        process_at=bindparam("expiry", type_=JOB.c.process_at.type),
    )
)
_STILL_HELD = select(JOB.c.job_id, JOB.c.cancel_requested_at).where(*_HELD)


def lock_leases(job_ids: list[uuid.UUID], tokens: list[uuid.UUID]) -> Statement:
    """Lock the worker's leases it can renew now, skipping rows another transaction holds
    (a cancel request being written, a claim of an expired lease): a heartbeat never waits."""
    return _LOCK_LEASES, {"ids": job_ids, "tokens": tokens}


def renew_leases(
    job_ids: list[uuid.UUID], tokens: list[uuid.UUID], now: datetime, expiry: datetime
) -> Statement:
    """Move the expiry of leases the heartbeat locked on (a lease another run took is left)."""
    return _RENEW, {"ids": job_ids, "tokens": tokens, "now": now, "expiry": expiry}


def leases_held(job_ids: list[uuid.UUID], tokens: list[uuid.UUID]) -> Statement:
    """Which of the worker's leases it still holds, and whether a cancel was requested."""
    return _STILL_HELD, {"ids": job_ids, "tokens": tokens}


_END_LEASE = delete(JOB).where(JOB.c.job_id == bindparam("job_id"), JOB.c.lease_token == _TOKEN)


@cache
def _archive_lease(upsert: ArchiveUpsert) -> Executable:
    done = (
        delete(JOB)
        .where(JOB.c.job_id == bindparam("job_id"), JOB.c.lease_token == _TOKEN)
        .returning(*JOB_COLUMNS)
        .cte("done")
    )
    rows = select(
        done.c.job_id,
        done.c.queue,
        done.c.job_type,
        done.c.payload,
        bindparam("attempts", type_=ARCHIVE.c.attempts.type),
        done.c.enqueued_at,
        func.coalesce(done.c.due_at, done.c.process_at),
        done.c.run_order,
        done.c.unique_key,
        bindparam("status", type_=ARCHIVE.c.status.type),
        bindparam("now", type_=ARCHIVE.c.finished_at.type),
        bindparam("error", type_=ARCHIVE.c.error.type),
    )
    statement = _upserted(upsert, rows).add_cte(done)
    return statement.execution_options(preserve_rowcount=True)


def archive_lease(
    job_id: uuid.UUID,
    token: uuid.UUID,
    *,
    status: str,
    attempts: int,
    finished_at: datetime,
    error: str | None,
    upsert: ArchiveUpsert,
) -> Statement:
    """Remove a leased job where it still carries the run's token and archive it, in one
    statement (PostgreSQL's DML CTE); its rowcount is 0 when the run was fenced off."""
    return _archive_lease(upsert), {
        "job_id": job_id,
        "token": token,
        "attempts": attempts,
        "status": status,
        "now": finished_at,
        "error": error,
    }


_STILL_LEASED = (
    select(JOB.c.job_id)
    .where(*_HELD)
    .with_for_update()
    .with_hint(JOB, _JOB_BY_ID, "mysql")
    .with_hint(JOB, _JOB_BY_ID, "mariadb")
)


def end_leases(
    job_ids: list[uuid.UUID], tokens: list[uuid.UUID], *, force_index: bool = False
) -> tuple[Statement, Any]:
    """A claim's succeeded jobs, ended together: the lock of those that still carry one
    of its tokens (the fence; the job-id index named on MySQL), and the delete of a list of
    ids (give it the locked ones)."""
    return (_STILL_LEASED, {"ids": job_ids, "tokens": tokens}), _delete_by(
        JOB, ("job_id",), "ids", force_index
    )


def end_lease(job_id: uuid.UUID, token: uuid.UUID) -> Statement:
    """Remove a leased job that ended, only if it still carries the run's token (the fence:
    a run whose lease another run took removes nothing)."""
    return _END_LEASE, {"job_id": job_id, "token": token}


_RETRY_LEASE = (
    update(JOB)
    .where(JOB.c.job_id == bindparam("id"), JOB.c.lease_token == _TOKEN)
    .ordered_values(*_NO_LEASE[1:], (JOB.c.process_at, bindparam("retry_at")))
)


def retry_lease(job_id: uuid.UUID, token: uuid.UUID, retry_at: datetime) -> Statement:
    """Schedule a leased job's next run (its claim counted this one), fenced by the token."""
    return _RETRY_LEASE, {"id": job_id, "token": token, "retry_at": retry_at}


_RELEASE_LEASES = (
    update(JOB)
    .where(*_HELD)
    .ordered_values(
        # process_at first: MySQL would read the due_at cleared after it.
        (JOB.c.process_at, func.coalesce(JOB.c.due_at, JOB.c.process_at)),
        (JOB.c.attempts, JOB.c.attempts - 1),
        *_NO_LEASE[1:],
    )
)


def release_leases(job_ids: list[uuid.UUID], tokens: list[uuid.UUID]) -> Statement:
    """Give leases back unrun (a stop that gave up): due again at their own time at once,
    their run not counted, and no unclean end."""
    return _RELEASE_LEASES, {"ids": job_ids, "tokens": tokens}


_EXPIRE = (
    update(JOB)
    .where(JOB.c.job_id == bindparam("id"), JOB.c.lease_token == _TOKEN)
    .values(process_at=bindparam("now", type_=JOB.c.process_at.type))
)


def expire_lease(job_id: uuid.UUID, token: uuid.UUID, now: datetime) -> Statement:
    """End a lease now with its token kept, so that the next claim counts an unclean end
    (a run whose session was lost, or that ended its worker)."""
    return _EXPIRE, {"id": job_id, "token": token, "now": now}


_START_RUNS = insert(RUN)


_RUN_COLUMNS = ("run_id", "job_id", "worker_id", "owner", "started_at", "batched")


def start_runs(rows: list[dict[str, Any]], *, unnest: bool = False) -> tuple[Executable, Any]:
    """Record the runs a claim starts (committed before its first handler runs): one row, or
    one per job of a batch (one ``INSERT ... SELECT unnest(...)`` on PostgreSQL, else an
    executemany, which drivers send in one go)."""
    if len(rows) == 1:
        return _START_RUNS, rows[0]
    if unnest:
        return _insert_unnest(RUN, _RUN_COLUMNS), _as_arrays(rows, _RUN_COLUMNS)
    return _START_RUNS, rows


_RUNS_OF = select(RUN.c.run_id, RUN.c.owner, RUN.c.batched, RUN.c.worker_id).where(
    RUN.c.job_id == bindparam("job_id")
)


def runs_of(job_id: uuid.UUID) -> Statement:
    """The run records of a job, with their owners (read when a claim finds any)."""
    return _RUNS_OF, {"job_id": job_id}


_END_RUN = delete(RUN).where(RUN.c.run_id == bindparam("run_id"))


def end_run(run_id: uuid.UUID) -> Statement:
    """Remove one run record by primary key: an equality on a unique key locks the record
    only, never a gap beside it, at any isolation level (job control)."""
    return _END_RUN, {"run_id": run_id}


def end_runs_by_id(
    runs: Iterable[tuple[uuid.UUID, uuid.UUID]], *, force_index: bool = False
) -> Statement:
    """Remove run records by id, given as (job id, run id) pairs (their live worker gave their
    runs up), through the job-id index (named with ``force_index``)."""
    return _delete_by(RUN, _BY_ID, "runs", force_index), {"runs": list(runs)}


_LOSE_RUNS = (
    update(RUN)
    .where(RUN.c.run_id.in_(bindparam("ids", expanding=True)))
    .values(owner=None, worker_id=bindparam("why"))
)


def lose_runs(run_ids: list[uuid.UUID], why: str) -> Statement:
    """Take the owner off run records whose run lost its connection while the handler ran,
    so that they count as a dead worker's (``why`` replaces the worker's name)."""
    return _LOSE_RUNS, {"ids": run_ids, "why": why}


# --- owners of run records: locks that live as long as the worker's session ----------------

_PG_LOCKS = table(
    "pg_locks",
    column("locktype"),
    column("database"),
    column("classid"),
    column("objid"),
    column("objsubid"),
    column("granted"),
)
_PG_DATABASE = table("pg_database", column("oid"), column("datname"))
#: An advisory lock on a bigint key, held in this database (pg_locks shows its two halves).
_ADVISORY_HERE = (
    _PG_LOCKS.c.locktype == literal("advisory"),
    _PG_LOCKS.c.objsubid == literal(1),
    _PG_LOCKS.c.granted.is_(true()),
    _PG_LOCKS.c.database
    == select(_PG_DATABASE.c.oid)
    .where(_PG_DATABASE.c.datname == func.current_database())
    .scalar_subquery(),
)
_ADVISORY_LOCKS_HELD = select(_PG_LOCKS.c.classid, _PG_LOCKS.c.objid).where(*_ADVISORY_HERE)

_KEY = bindparam("key", type_=BigInteger)
_NAME = bindparam("name", type_=String(64))
_HOLD = {"advisory": select(func.pg_advisory_lock(_KEY)), "named": select(func.get_lock(_NAME, 0))}
_RELEASE = {
    "advisory": select(func.pg_advisory_unlock(_KEY)),
    "named": select(func.release_lock(_NAME)),
}
_HI = bindparam("hi", type_=BigInteger)
_LO = bindparam("lo", type_=BigInteger)
#: True (PostgreSQL) or 1 (MySQL) when nobody holds the lock: its owner's session is gone.
#: Both only look: taking the lock to test it (pg_try_advisory_xact_lock) would make a dead
#: owner look alive to every other claim until the testing one ends.
_FREE = {
    "advisory": select(
        ~exists().where(*_ADVISORY_HERE, _PG_LOCKS.c.classid == _HI, _PG_LOCKS.c.objid == _LO)
    ),
    "named": select(func.is_free_lock(_NAME)),
}


def _owner_params(kind: OwnerLock, owner: str) -> dict[str, Any]:
    if kind == "advisory":
        # The first 64 bits of the owner's random hex, as PostgreSQL's signed bigint key.
        return {"key": int(owner[:16], 16) - (1 << 63)}
    return {"name": owner}


def _free_params(kind: OwnerLock, owner: str) -> dict[str, Any]:
    if kind == "advisory":
        high, low = advisory_lock_tag(owner)
        return {"hi": high, "lo": low}
    return {"name": owner}


def hold_owner(kind: OwnerLock, owner: str) -> Statement:
    """Take the session lock that marks ``owner``'s run records as belonging to a live worker."""
    return _HOLD[kind], _owner_params(kind, owner)


def release_owner(kind: OwnerLock, owner: str) -> Statement:
    """Give the owner's session lock back (before its connection returns to the pool)."""
    return _RELEASE[kind], _owner_params(kind, owner)


def owner_gone(kind: OwnerLock, owner: str) -> Statement:
    """Whether the owner's lock is free, i.e. the session that held it has ended; read
    without taking the lock."""
    return _FREE[kind], _free_params(kind, owner)


# --- periodic jobs: each schedule's last enqueued occurrence --------------------------------

_SCHEDULES = select(PERIODIC.c.name, PERIODIC.c.last_occurrence).where(
    PERIODIC.c.name.in_(bindparam("names", expanding=True))
)


def schedules(names: list[str]) -> Statement:
    """The last enqueued occurrence of each named schedule that has a record."""
    return _SCHEDULES, {"names": names}


def start_schedule(name: str, occurrence: datetime, form: InsertOrNothing) -> Statement:
    """Record a schedule seen for the first time, unless another worker just did."""
    statement = _insert_or_nothing(PERIODIC, ("name",), form)
    return statement, {"name": name, "last_occurrence": occurrence}


_ADVANCE_SCHEDULE = (
    update(PERIODIC)
    .where(PERIODIC.c.name == bindparam("key"), PERIODIC.c.last_occurrence < bindparam("due"))
    .values(last_occurrence=bindparam("due"))
)


def advance_schedule(name: str, occurrence: datetime) -> Statement:
    """Compare-and-set: move a schedule on to ``occurrence`` unless it is there already (row
    count 0: another worker enqueued it). It never moves back, whatever a clock says."""
    return _ADVANCE_SCHEDULE, {"key": name, "due": occurrence}


# --- pausing queues -------------------------------------------------------------------------


def pause_queue(queue: str, now: datetime, form: InsertOrNothing) -> Statement:
    """Mark a queue paused, unless it is paused already."""
    statement = _insert_or_nothing(PAUSED, ("queue",), form)
    return statement, {"queue": queue, "paused_at": now}


_RESUME_QUEUE = delete(PAUSED).where(PAUSED.c.queue == bindparam("queue"))


def resume_queue(queue: str) -> Statement:
    """Let a paused queue's workers claim again."""
    return _RESUME_QUEUE, {"queue": queue}


_PAUSED_QUEUES = select(PAUSED.c.queue)


def paused_queues() -> Statement:
    """Every paused queue."""
    return _PAUSED_QUEUES, {}


_NOTIFY = select(func.pg_notify(literal(CHANNEL), bindparam("queue", type_=String)))


def notify_queue(queue: str) -> Statement:
    """PostgreSQL: wake the queue's listening workers when the transaction commits."""
    return _NOTIFY, {"queue": queue}


# --- archive housekeeping ---


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


# --- jobs under a lease, seen from outside (inspection.py, control.cancel_job) -------------

# While a job is leased its ``process_at`` is the lease's expiry (so no poll reads it before
# the lease expires) and ``due_at`` its own due time: the reads of the queue tell leased
# rows apart before they take ``process_at`` for a due time.
_LEASED = JOB.c.lease_token.is_not(None)
_UNLEASED = JOB.c.lease_token.is_(None)
#: A leased job's own due time.
_LEASED_DUE_AT = func.coalesce(JOB.c.due_at, JOB.c.process_at)
#: A queued job's own due time, leased or not.
DUE_AT = case((_LEASED, _LEASED_DUE_AT), else_=JOB.c.process_at)
_LEASE_NOW = bindparam("now", type_=JOB.c.process_at.type)
_LIVE_LEASE = (_LEASED, JOB.c.process_at > _LEASE_NOW)


@cache
def _leased_jobs(by_queue: bool, by_type: bool) -> Select[Any]:
    conditions: list[Any] = [*_LIVE_LEASE]
    if by_queue:
        conditions.append(JOB.c.queue == bindparam("queue"))
    if by_type:
        conditions.append(JOB.c.job_type == bindparam("job_type"))
    return select(*_LISTED_QUEUED).where(*conditions)


def leased_jobs(
    now: datetime, *, queue: str | None = None, job_type: str | None = None
) -> Statement:
    """The jobs under a lease still live at ``now`` (running in lease mode), optionally of
    one queue and job type; no index names leases, so this reads the job table."""
    params: dict[str, Any] = {"now": now}
    if queue is not None:
        params["queue"] = queue
    if job_type is not None:
        params["job_type"] = job_type
    return _leased_jobs(queue is not None, job_type is not None), params


_REQUEST_CANCEL = (
    update(JOB)
    .where(JOB.c.seq == bindparam("job_seq"), *_LIVE_LEASE)
    .values(cancel_requested_at=func.coalesce(JOB.c.cancel_requested_at, _LEASE_NOW))
)


def request_cancel(seq: int, now: datetime) -> Statement:
    """Ask the worker holding a job's live lease to stop it (by primary key; its heartbeat
    carries the request to the handler); an earlier request's time is kept."""
    return _REQUEST_CANCEL, {"job_seq": seq, "now": now}


_LOCK_TO_CANCEL = (
    select(*JOB_COLUMNS, JOB.c.lease_token, JOB.c.due_at)
    .where(JOB.c.job_id == bindparam("job_id"))
    .with_for_update(skip_locked=True)
)


def lock_to_cancel(job_id: uuid.UUID) -> Statement:
    """Lock a queued job by id to cancel it, with its lease, skipping it if a worker in
    transaction mode is running it."""
    return _LOCK_TO_CANCEL, {"job_id": job_id}


# --- inspection and putting failures back (inspection.py, maintenance.retry_failed) --------

_NOW = bindparam("now", type_=JOB.c.process_at.type)
_DUE = JOB.c.process_at <= _NOW
_FAILURE = ARCHIVE.c.status == literal("failure", String(16))


def _count_if(condition: Any) -> Any:
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


_QUEUE_COUNTS = select(
    JOB.c.queue,
    JOB.c.run_order,
    _count_if(_UNLEASED & _DUE).label("due"),
    _count_if(_UNLEASED & ~_DUE).label("scheduled"),
    _count_if(_LEASED & ~_DUE).label("leased"),
    _count_if(_LEASED & _DUE).label("expired"),
    func.min(case((_UNLEASED & _DUE, JOB.c.process_at), else_=null())).label("oldest_due"),
    func.min(case((_LEASED & _DUE, _LEASED_DUE_AT), else_=null())).label("oldest_expired"),
).group_by(JOB.c.queue, JOB.c.run_order)


def queue_counts(now: datetime) -> Statement:
    """Per queue and priority (as its ``run_order``): jobs due at ``now``, jobs scheduled
    later, jobs under a live lease and under an expired one, the oldest due ``process_at``
    and the oldest own due time of the expired leases (one pass over the job table)."""
    return _QUEUE_COUNTS, {"now": now}


_PAUSED_NAMES = select(PAUSED.c.queue)


def paused_names() -> Statement:
    """The names of the paused queues."""
    return _PAUSED_NAMES, {}


_FINISHED_COUNTS = (
    select(
        ARCHIVE.c.queue,
        _count_if(ARCHIVE.c.status == literal("success", String(16))).label("succeeded"),
        _count_if(ARCHIVE.c.status == literal("failure", String(16))).label("failed"),
    )
    .where(ARCHIVE.c.finished_at >= bindparam("since", type_=ARCHIVE.c.finished_at.type))
    .group_by(ARCHIVE.c.queue)
)


def finished_counts(since: datetime) -> Statement:
    """Per queue: archived successes and failures since ``since`` (a range of the
    ``finished_at`` index)."""
    return _FINISHED_COUNTS, {"since": since}


#: Each run record's job, owner and queue, read from the ledger's side (a small table: one
#: row per claimed job, plus dead workers' rows until their jobs are claimed again), each
#: queue looked up by the job's unique id, so no planner starts from the job table.
_CLAIMED = (
    select(
        RUN.c.job_id,
        RUN.c.owner,
        select(JOB.c.queue)
        .where(JOB.c.job_id == RUN.c.job_id, _UNLEASED)
        .correlate(RUN)
        .scalar_subquery()
        .label("queue"),
    )
    .distinct()
    .subquery("claimed")
)
_CLAIMED_RUNS = (
    select(_CLAIMED.c.queue, _CLAIMED.c.owner, func.count().label("jobs"))
    .where(_CLAIMED.c.queue.is_not(None))
    .group_by(_CLAIMED.c.queue, _CLAIMED.c.owner)
)


def claimed_runs() -> Statement:
    """Per queue and run-record owner: how many queued jobs have a run record (a leased
    job counts by its lease, not by a record)."""
    return _CLAIMED_RUNS, {}


_OLDEST_UNCLAIMED = (
    select(JOB.c.process_at)
    .where(
        JOB.c.queue == bindparam("queue"),
        _DUE,
        _UNLEASED,
        ~exists()
        .where(RUN.c.job_id == JOB.c.job_id, RUN.c.owner.in_(bindparam("live", expanding=True)))
        .correlate(JOB),
    )
    .order_by(JOB.c.process_at, JOB.c.seq)
    .limit(1)
)


def oldest_unclaimed(queue: str, now: datetime, live_owners: list[str]) -> Statement:
    """The ``process_at`` of a queue's oldest due job that no live worker holds and no
    lease names: the poll's own index order, stopping at the first such job."""
    return _OLDEST_UNCLAIMED, {"queue": queue, "now": now, "live": live_owners}


def advisory_locks_held() -> Statement:
    """PostgreSQL: the bigint advisory locks held in this database, as (classid, objid)
    halves; reading ``pg_locks`` takes no lock a worker could wait for."""
    return _ADVISORY_LOCKS_HELD, {}


def advisory_lock_tag(owner: str) -> tuple[int, int]:
    """The (classid, objid) under which ``pg_locks`` shows an owner's advisory lock: the high
    and low 32 bits of its bigint key."""
    key: int = _owner_params("advisory", owner)["key"]
    return (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF


def used_locks(owners: list[str]) -> Statement:
    """MySQL/MariaDB: for each owner, the connection holding its named lock, or NULL (the
    lock is only looked at, never taken)."""
    names = [bindparam(f"owner_{index}", type_=String(64)) for index in range(len(owners))]
    statement = select(*(func.is_used_lock(name) for name in names))
    return statement, {f"owner_{index}": owner for index, owner in enumerate(owners)}


@cache
def _failed_jobs(by_queue: bool, by_type: bool) -> Select[Any]:
    conditions = [_FAILURE]
    if by_queue:
        conditions.append(ARCHIVE.c.queue == bindparam("queue"))
    if by_type:
        conditions.append(ARCHIVE.c.job_type == bindparam("job_type"))
    return (
        select(ARCHIVE)
        .where(*conditions)
        .order_by(ARCHIVE.c.finished_at.desc(), ARCHIVE.c.job_id.desc())
        .limit(bindparam("limit", type_=BigInteger))
    )


def failed_jobs(limit: int, *, queue: str | None = None, job_type: str | None = None) -> Statement:
    """The newest archived failures, read backwards through the ``finished_at`` index."""
    params: dict[str, Any] = {"limit": limit}
    if queue is not None:
        params["queue"] = queue
    if job_type is not None:
        params["job_type"] = job_type
    return _failed_jobs(queue is not None, job_type is not None), params


@cache
def _failures_to_retry(by_ids: bool, by_queue: bool, by_type: bool) -> Select[Any]:
    conditions = [
        _FAILURE,
        ~exists().where(JOB.c.job_id == ARCHIVE.c.job_id).correlate(ARCHIVE),
    ]
    if by_ids:
        conditions.append(ARCHIVE.c.job_id.in_(bindparam("job_ids", expanding=True)))
    if by_queue:
        conditions.append(ARCHIVE.c.queue == bindparam("queue"))
    if by_type:
        conditions.append(ARCHIVE.c.job_type == bindparam("job_type"))
    statement = select(ARCHIVE.c.job_id, ARCHIVE.c.queue, ARCHIVE.c.unique_key)
    if not by_ids:
        statement = statement.with_hint(ARCHIVE, _BY_FINISHED_AT, "mysql").with_hint(
            ARCHIVE, _BY_FINISHED_AT, "mariadb"
        )
    return (
        statement.where(*conditions)
        .order_by(ARCHIVE.c.finished_at)
        .limit(bindparam("batch_size", type_=BigInteger))
    )


def failures_to_retry(
    batch_size: int,
    *,
    job_ids: list[uuid.UUID] | None = None,
    queue: str | None = None,
    job_type: str | None = None,
) -> Statement:
    """The oldest archived failures (of ``job_ids``, by primary key, else through the
    ``finished_at`` index) whose id is not queued right now; a plain read, locking nothing."""
    params: dict[str, Any] = {"batch_size": batch_size}
    if job_ids is not None:
        params["job_ids"] = job_ids
    if queue is not None:
        params["queue"] = queue
    if job_type is not None:
        params["job_type"] = job_type
    statement = _failures_to_retry(job_ids is not None, queue is not None, job_type is not None)
    return statement, params


#: What a job put back in the queue is made of: its archived identity and priority, attempts
#: from zero, enqueued and due now.
_REQUEUED_COLUMNS = (
    "job_id",
    "queue",
    "job_type",
    "payload",
    "run_order",
    "attempts",
    "enqueued_at",
    "process_at",
)
_ENQUEUE_NOW = bindparam("now", type_=JOB.c.enqueued_at.type)


def _requeued(columns: Any) -> Select[Any]:
    return select(
        columns.job_id,
        columns.queue,
        columns.job_type,
        columns.payload,
        columns.run_order,
        literal(0, Integer()),
        _ENQUEUE_NOW,
        _ENQUEUE_NOW,
    )


#: The bulk moves take failures without a unique key only: a keyed one goes back on its own,
#: unless a queued job holds its key (``requeue_keyed``).
_UNKEYED = ARCHIVE.c.unique_key.is_(None)
_MOVED = (
    delete(ARCHIVE)
    .where(ARCHIVE.c.job_id == _any("job_ids"), _FAILURE, _UNKEYED)
    .returning(
        ARCHIVE.c.job_id,
        ARCHIVE.c.queue,
        ARCHIVE.c.job_type,
        ARCHIVE.c.payload,
        ARCHIVE.c.run_order,
    )
    .cte("moved")
)
_REQUEUE_RETURNING = (
    insert(JOB)
    .from_select(list(_REQUEUED_COLUMNS), _requeued(_MOVED.c))
    .add_cte(_MOVED)
    .execution_options(preserve_rowcount=True)
)
_FAILED_BY_ID = (ARCHIVE.c.job_id.in_(bindparam("job_ids", expanding=True)), _FAILURE, _UNKEYED)
_REQUEUE_COPY = insert(JOB).from_select(
    list(_REQUEUED_COLUMNS), _requeued(ARCHIVE.c).where(*_FAILED_BY_ID)
)
_DELETE_FAILED = delete(ARCHIVE).where(*_FAILED_BY_ID)


def requeue_failed(job_ids: list[uuid.UUID], now: datetime, *, returning: bool) -> list[Statement]:
    """Move archived failures that have no unique key back into the queue: one statement
    where ``DELETE ... RETURNING`` can feed the insert (PostgreSQL), else an ``INSERT ...
    SELECT`` and a ``DELETE`` by primary key. Each statement's row count is the number moved."""
    if returning:
        return [(_REQUEUE_RETURNING, {"job_ids": job_ids, "now": now})]
    return [
        (_REQUEUE_COPY, {"job_ids": job_ids, "now": now}),
        (_DELETE_FAILED, {"job_ids": job_ids}),
    ]


_FAILED_ONE = (ARCHIVE.c.job_id == bindparam("job_id"), _FAILURE)


@cache
def _requeue_keyed(form: InsertOrNothing) -> Executable:
    rows = _requeued(ARCHIVE.c).add_columns(ARCHIVE.c.unique_key).where(*_FAILED_ONE)
    columns = [*_REQUEUED_COLUMNS, "unique_key"]
    module = {"postgresql_on_conflict": postgresql, "sqlite_on_conflict": sqlite}.get(form)
    # The row count says whether the job went back (PostgreSQL drivers keep it on request).
    if module is None:
        return insert(JOB).from_select(columns, rows).execution_options(preserve_rowcount=True)
    keyed = module.insert(JOB).from_select(columns, rows)
    conflict = keyed.on_conflict_do_nothing(index_elements=[JOB.c.queue, JOB.c.unique_key])
    return cast(Executable, conflict.execution_options(preserve_rowcount=True))


def requeue_keyed(job_id: uuid.UUID, now: datetime, form: InsertOrNothing) -> Statement:
    """Put one archived failure back in the queue with its unique key, unless a job of its
    queue holds the key now (insert-or-nothing of the dialect's form)."""
    return _requeue_keyed(form), {"job_id": job_id, "now": now}


_DELETE_FAILED_ONE = delete(ARCHIVE).where(*_FAILED_ONE)


def delete_failure(job_id: uuid.UUID) -> Statement:
    """Remove one archived failure (put back in the queue by ``requeue_keyed``)."""
    return _DELETE_FAILED_ONE, {"job_id": job_id}


_DUE_JOB = {scan: statement.limit(1) for scan, statement in _DUE_RUN_ORDERS.items()}


def due_job(queue: str, now: datetime, scan: PriorityScan) -> Statement:
    """A row when a job of the queue is due at ``now``, running or not, unless the queue is
    paused (probes of the poll index, as ``due_run_orders``)."""
    return _DUE_JOB[scan], {"queue": queue, "now": now}


_DATA_VERSION = text("PRAGMA data_version")


def data_version() -> Statement:
    """SQLite's counter of the commits other connections made to the database file."""
    return _DATA_VERSION, {}


def probe_tables() -> list[Statement]:
    """Read no row of each library table, naming every column the models know: fails
    when a table or a column is missing (tables never installed, or not upgraded)."""
    return [(select(table).where(false()), {}) for table in (JOB, ARCHIVE, RUN, PAUSED)]


# --- the dashboard's reads (inspection.list_jobs, get_job, finished_per_minute) -------------

#: The columns a list of queued jobs shows (no payload: a page never loads them all).
_LISTED_QUEUED = (
    JOB.c.seq,
    JOB.c.job_id,
    JOB.c.queue,
    JOB.c.job_type,
    JOB.c.attempts,
    JOB.c.enqueued_at,
    JOB.c.process_at,
    JOB.c.run_order,
    JOB.c.lease_token,
    JOB.c.lease_owner,
    JOB.c.heartbeat_at,
    JOB.c.due_at,
    JOB.c.cancel_requested_at,
)
_AFTER_AT = bindparam("after_at", type_=JOB.c.process_at.type)


@cache
def _queued_jobs(due: bool, after: str | None, by_type: bool, free: bool) -> Select[Any]:
    # Due later and leased is running under a live lease, not scheduled.
    conditions: list[Any] = [JOB.c.queue == bindparam("queue"), _DUE if due else ~_DUE]
    if not due:
        conditions.append(_UNLEASED)
    order = bindparam("after_order", type_=JOB.c.run_order.type)
    if after == "within":
        # One priority from the cursor on: an equality on it, then a range of the index's
        # next column (the rest of the key filters the few rows of the cursor's time).
        conditions.append(JOB.c.run_order == order)
        conditions.append(JOB.c.process_at >= _AFTER_AT)
        conditions.append((JOB.c.process_at > _AFTER_AT) | (JOB.c.seq > bindparam("after_seq")))
    elif after == "beyond":
        conditions.append(JOB.c.run_order > order)
    if by_type:
        conditions.append(JOB.c.job_type == bindparam("job_type"))
    if free:
        conditions.append(
            ~exists()
            .where(
                RUN.c.job_id == JOB.c.job_id,
                RUN.c.owner.in_(bindparam("live", expanding=True)),
            )
            .correlate(JOB)
        )
    return (
        select(*_LISTED_QUEUED)
        .where(*conditions)
        .order_by(JOB.c.run_order, JOB.c.process_at, JOB.c.seq)
        .limit(bindparam("limit", type_=BigInteger))
    )


def queued_jobs(
    queue: str,
    now: datetime,
    limit: int,
    *,
    due: bool,
    after: tuple[int, datetime, int] | None = None,
    beyond: int | None = None,
    job_type: str | None = None,
    live_owners: list[str] | None = None,
) -> Statement:
    """One queue's jobs due at ``now`` (``due``, expired leases included) or later (live
    leases left out), in poll order, through the poll index: all of them, those of the
    cursor's priority after the key ``after`` (``run_order``, ``process_at``, ``seq``), or
    those of the priorities after ``beyond`` (a ``run_order``); ``live_owners`` leaves out
    the jobs whose run records they own."""
    params: dict[str, Any] = {"queue": queue, "now": now, "limit": limit}
    mode = None
    if after is not None:
        params["after_order"], params["after_at"], params["after_seq"] = after
        mode = "within"
    elif beyond is not None:
        params["after_order"] = beyond
        mode = "beyond"
    if job_type is not None:
        params["job_type"] = job_type
    if live_owners:
        params["live"] = live_owners
    return _queued_jobs(due, mode, job_type is not None, bool(live_owners)), params


_FIRST_QUEUE = select(JOB.c.queue).order_by(JOB.c.queue).limit(1)
_NEXT_QUEUE = (
    select(JOB.c.queue).where(JOB.c.queue > bindparam("queue")).order_by(JOB.c.queue).limit(1)
)


def next_queue(after: str | None) -> Statement:
    """The first queue name that has jobs, after ``after`` (a probe of the poll index)."""
    if after is None:
        return _FIRST_QUEUE, {}
    return _NEXT_QUEUE, {"queue": after}


_HELD_JOBS = (
    select(RUN.c.job_id).where(RUN.c.owner.in_(bindparam("live", expanding=True))).distinct()
)


def held_jobs(live_owners: list[str]) -> Statement:
    """The ids of the jobs whose run records live workers own: the running jobs."""
    return _HELD_JOBS, {"live": live_owners}


@cache
def _jobs_by_id(by_queue: bool, by_type: bool) -> Select[Any]:
    conditions: list[Any] = [JOB.c.job_id.in_(_IDS)]
    if by_queue:
        conditions.append(JOB.c.queue == bindparam("queue"))
    if by_type:
        conditions.append(JOB.c.job_type == bindparam("job_type"))
    return select(*_LISTED_QUEUED).where(*conditions)


def jobs_by_id(
    job_ids: list[uuid.UUID], *, queue: str | None = None, job_type: str | None = None
) -> Statement:
    """Queued jobs by id (their unique index), optionally of one queue and job type."""
    params: dict[str, Any] = {"ids": job_ids}
    if queue is not None:
        params["queue"] = queue
    if job_type is not None:
        params["job_type"] = job_type
    return _jobs_by_id(queue is not None, job_type is not None), params


_ARCHIVE_AFTER_AT = bindparam("after_at", type_=ARCHIVE.c.finished_at.type)


@cache
def _archived_jobs(by_queue: bool, by_type: bool, after: bool) -> Select[Any]:
    conditions: list[Any] = [ARCHIVE.c.status == bindparam("status", type_=String(16))]
    if by_queue:
        conditions.append(ARCHIVE.c.queue == bindparam("queue"))
    if by_type:
        conditions.append(ARCHIVE.c.job_type == bindparam("job_type"))
    if after:
        conditions.append(ARCHIVE.c.finished_at <= _ARCHIVE_AFTER_AT)
        conditions.append(
            (ARCHIVE.c.finished_at < _ARCHIVE_AFTER_AT)
            | (ARCHIVE.c.job_id < bindparam("after_id", type_=ARCHIVE.c.job_id.type))
        )
    return (
        select(*(c for c in ARCHIVE.c if c.name != "payload"))
        .with_hint(ARCHIVE, _BY_FINISHED_AT, "mysql")
        .with_hint(ARCHIVE, _BY_FINISHED_AT, "mariadb")
        .where(*conditions)
        .order_by(ARCHIVE.c.finished_at.desc(), ARCHIVE.c.job_id.desc())
        .limit(bindparam("limit", type_=BigInteger))
    )


def archived_jobs(
    status: str,
    limit: int,
    *,
    queue: str | None = None,
    job_type: str | None = None,
    after: tuple[datetime, uuid.UUID] | None = None,
) -> Statement:
    """Archived jobs of one status, newest first from the key ``after`` (``finished_at``,
    ``job_id``) on, read backwards through the ``finished_at`` index; no payloads."""
    params: dict[str, Any] = {"status": status, "limit": limit}
    if queue is not None:
        params["queue"] = queue
    if job_type is not None:
        params["job_type"] = job_type
    if after is not None:
        params["after_at"], params["after_id"] = after
    return _archived_jobs(queue is not None, job_type is not None, after is not None), params


_QUEUED_JOB = select(*_LISTED_QUEUED, JOB.c.payload).where(JOB.c.job_id == bindparam("job_id"))
_ARCHIVED_JOB = select(ARCHIVE).where(ARCHIVE.c.job_id == bindparam("job_id"))


def queued_job(job_id: uuid.UUID) -> Statement:
    """One queued job by id, with its payload."""
    return _QUEUED_JOB, {"job_id": job_id}


def archived_job(job_id: uuid.UUID) -> Statement:
    """One archived job by id, with its payload and error."""
    return _ARCHIVED_JOB, {"job_id": job_id}


@cache
def _finished_by_minute(minutes: int) -> Select[Any]:
    bounds = [
        (ARCHIVE.c.finished_at < bindparam(f"end_{index}", type_=ARCHIVE.c.finished_at.type), index)
        for index in range(minutes - 1)
    ]
    minute = case(*bounds, else_=minutes - 1) if bounds else literal(0, Integer())
    finished = (
        select(ARCHIVE.c.queue, ARCHIVE.c.status, minute.label("minute"))
        .where(
            ARCHIVE.c.finished_at >= bindparam("since", type_=ARCHIVE.c.finished_at.type),
            ARCHIVE.c.status.in_([literal("success", String(16)), literal("failure", String(16))]),
        )
        .subquery("finished")
    )
    return select(
        finished.c.queue, finished.c.status, finished.c.minute, func.count().label("jobs")
    ).group_by(finished.c.queue, finished.c.status, finished.c.minute)


def finished_by_minute(since: datetime, ends: list[datetime]) -> Statement:
    """Archived successes and failures per queue and minute from ``since`` on (a range of
    the ``finished_at`` index); minute ``i`` ends at ``ends[i]``, the last one is open."""
    params: dict[str, Any] = {"since": since}
    params.update({f"end_{index}": end for index, end in enumerate(ends[:-1])})
    return _finished_by_minute(len(ends)), params
