"""Inspection and putting failures back (inspection.py, maintenance.retry_failed)."""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Executable,
    Integer,
    Select,
    String,
    bindparam,
    case,
    delete,
    exists,
    false,
    func,
    insert,
    literal,
    null,
    select,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite

from sqla_proletarian.dialects import InsertOrNothing
from sqla_proletarian.statements.base import (
    ARCHIVE,
    HISTORY,
    JOB,
    PAUSED,
    RUN,
    Statement,
    _any,
)
from sqla_proletarian.statements.claim import _DUE_RUN_ORDERS
from sqla_proletarian.statements.housekeeping import _BY_FINISHED_AT
from sqla_proletarian.statements.leased import _LEASED, _LEASED_DUE_AT, _UNLEASED

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


#: How the archive's error of a job whose type no handler knew begins (``running.describe``).
UNKNOWN_TYPE_ERROR = "sqla_proletarian.errors.UnknownJobTypeError: %"
_UNKNOWN = (ARCHIVE.c.status == literal("failure", String(16))) & ARCHIVE.c.error.like(
    literal(UNKNOWN_TYPE_ERROR)
)
_SUCCESS = ARCHIVE.c.status == literal("success", String(16))
_TYPE_ENDS = (
    select(
        ARCHIVE.c.queue,
        ARCHIVE.c.job_type,
        func.max(case((_UNKNOWN, ARCHIVE.c.finished_at), else_=null())).label("unknown_at"),
        func.max(case((_SUCCESS, ARCHIVE.c.finished_at), else_=null())).label("handled_at"),
    )
    .where(ARCHIVE.c.finished_at >= bindparam("since", type_=ARCHIVE.c.finished_at.type))
    .group_by(ARCHIVE.c.queue, ARCHIVE.c.job_type)
)


def type_ends(since: datetime) -> Statement:
    """Per queue and job type archived since ``since``: the last failure because no handler
    knew the type, and the last success (a range of the ``finished_at`` index)."""
    return _TYPE_ENDS, {"since": since}


_QUEUED_OF_TYPE = (
    select(JOB.c.job_id)
    .where(JOB.c.queue == bindparam("queue"), JOB.c.job_type == bindparam("job_type"))
    .limit(1)
)


def queued_of_type(queue: str, job_type: str) -> Statement:
    """A row when a job of the type is queued in the queue."""
    return _QUEUED_OF_TYPE, {"queue": queue, "job_type": job_type}


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


#: What a job put back in the queue is made of: its archived identity, priority and
#: concurrency key, attempts (and snoozes) from zero, enqueued and due now.
_REQUEUED_COLUMNS = (
    "job_id",
    "queue",
    "job_type",
    "payload",
    "run_order",
    "concurrency_key",
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
        columns.concurrency_key,
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
        ARCHIVE.c.concurrency_key,
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


_DUE_JOB = _DUE_RUN_ORDERS.limit(1)


def due_job(queue: str, now: datetime) -> Statement:
    """A row when a job of the queue is due at ``now``, running or not, unless the queue is
    paused (probes of the poll index, as ``due_run_orders``)."""
    return _DUE_JOB, {"queue": queue, "now": now}


_DATA_VERSION = text("PRAGMA data_version")


def data_version() -> Statement:
    """SQLite's counter of the commits other connections made to the database file."""
    return _DATA_VERSION, {}


def probe_tables() -> list[Statement]:
    """Read no row of each library table, naming every column the models know: fails
    when a table or a column is missing (tables never installed, or not upgraded)."""
    tables = (JOB, ARCHIVE, RUN, PAUSED, HISTORY)
    return [(select(table).where(false()), {}) for table in tables]


# --- replication: how far the server a view reads from lags (replicas.replica_lag) ---------

_IN_RECOVERY = select(func.pg_is_in_recovery().label("standby"))
_RECEIVED = func.pg_last_wal_receive_lsn()
_REPLAYED = func.pg_last_wal_replay_lsn()
_STANDBY_LAG = select(
    func.greatest(func.pg_wal_lsn_diff(_RECEIVED, _REPLAYED), 0).label("bytes"),
    # The last replayed commit's age is the lag only while WAL waits to be replayed: a
    # standby that has replayed all it received is current, however idle the primary is.
    case(
        (_RECEIVED == _REPLAYED, literal(0.0)),
        else_=func.extract("epoch", func.now() - func.pg_last_xact_replay_timestamp()),
    ).label("seconds"),
)
_WSREP_ON = text("SHOW VARIABLES LIKE 'wsrep_on'")
_WSREP_RECV_QUEUE = text("SHOW STATUS LIKE 'wsrep_local_recv_queue'")
_REPLICA_STATUS = text("SHOW REPLICA STATUS")
_SLAVE_STATUS = text("SHOW SLAVE STATUS")


def in_recovery() -> Statement:
    """PostgreSQL: whether the server is a standby (``pg_is_in_recovery()``)."""
    return _IN_RECOVERY, {}


def standby_lag() -> Statement:
    """PostgreSQL standby: the bytes of WAL received and not replayed yet, and the seconds
    since the last replayed commit while some wait (0 when all is replayed)."""
    return _STANDBY_LAG, {}


def wsrep_on() -> Statement:
    """MySQL/MariaDB: the ``wsrep_on`` variable, ON on a Galera node (no row elsewhere)."""
    return _WSREP_ON, {}


def wsrep_recv_queue() -> Statement:
    """Galera: the write sets this node received and has not applied yet."""
    return _WSREP_RECV_QUEUE, {}


def replica_status(older: bool = False) -> Statement:
    """MySQL/MariaDB: the replica's status, no row on a server that replicates from none;
    ``older``: the spelling of servers before MariaDB 10.5 and MySQL 8.0.22."""
    return (_SLAVE_STATUS if older else _REPLICA_STATUS), {}
