"""Job control in the caller's transaction: cancel a queued job, pause and resume a queue.

Like enqueue, each takes the caller's Session or Connection and never commits: a cancel or
a pause takes effect when the caller commits, and not at all if it rolls back.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime

from sqlalchemy import Connection, Engine, RowMapping
from sqlalchemy.orm import Session, scoped_session

from sqla_proletarian import statements as sql
from sqla_proletarian import wakeups, workflows
from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.enqueue import Transaction, _connection_of
from sqla_proletarian.errors import InvalidJobError, NotATransactionError
from sqla_proletarian.logs import log_event
from sqla_proletarian.statements import workflows as wsql
from sqla_proletarian.unique import PRIMARY_KEY, insert_or_nothing
from sqla_proletarian.values import Clock, check_aware, check_name, utc_now

__all__ = ["cancel_job", "pause_queue", "paused_queues", "resume_queue"]


def cancel_job(
    session_or_connection: Transaction, job_id: uuid.UUID, *, clock: Clock = utc_now
) -> bool:
    """Take a queued job out of its queue before it runs: it is archived with status
    ``"cancelled"``, and its dependents (``depends_on``) are settled: those that would not
    run after a cancelled dependency are cancelled too, down the graph. True if it was
    cancelled, or, for a job running under a live lease (lease mode), if its worker was
    asked to stop it; False if it is not in the queue
    (never enqueued, archived already) or a worker in transaction mode is running it right
    now. Never commits.

    A job running under a live lease is not archived here: ``cancel_requested_at`` is set
    (an earlier request's time is kept), the worker's next heartbeat after the caller's
    commit sets the handler's ``job.cancel_requested``, and the worker archives the job as
    ``"cancelled"`` when its handler ends (commit soon: the heartbeat skips the row while
    the caller's transaction holds it). A job whose lease expired (its worker died or
    froze) is cancelled as a queued one: a frozen worker's late completion finds the lease
    gone and writes nothing.

    A job a worker in transaction mode is running is skipped, not waited for (``FOR UPDATE
    SKIP LOCKED``). On SQLite a running job holds the database's write lock, so the cancel
    waits for the run to end (up to the connection's busy timeout), then finds the job gone
    and returns False.

    Every lock it takes is on a row it found, never on the gaps between rows (which InnoDB
    takes at REPEATABLE READ, MySQL's default): an open transaction that cancelled a job
    holds up no worker's claims. The job is read before it is locked (a lease's cancel
    request is written by primary key), and its run records are read, then deleted by
    primary key. So at REPEATABLE READ the cancel sees the transaction's snapshot, as on
    PostgreSQL: a job enqueued after it was taken is not cancelled (False), and a run
    record committed after it stays behind. Only a job with dependents takes more locks:
    its dependents' rows and the rows that name them.
    """
    if not isinstance(job_id, uuid.UUID):
        raise InvalidJobError("job_id", f"{job_id!r} is not a uuid.UUID")
    conn = _connection_of(session_or_connection, "cancel_job")
    dialect = dialect_of(conn)
    now = check_aware("clock()", clock())
    # A locking read that finds no row would lock the gap where it would be.
    found = conn.execute(*sql.queued_job(job_id)).mappings().first()
    if found is None:
        return False
    if _live_lease(found, now) and _request_cancel(conn, found, now):
        return True
    # Not leased, its lease expired, or its lease ended since it was read.
    job = conn.execute(*sql.lock_to_cancel(job_id)).mappings().first()
    if job is None:
        return False
    if _live_lease(job, now):  # leased again since it was read; now locked
        return _request_cancel(conn, found, now)
    # On SQLite the row was read without a lock: the delete takes the write lock (after a
    # running job's commit) and tells whether the job is still there.
    if dialect.deletes_runs_with_job:
        deleted = conn.execute(*sql.delete_job_and_runs(job_id)).rowcount
    else:
        deleted = conn.execute(*sql.delete_job(job_id)).rowcount
        # By primary key: a delete through the job-id index locks the gaps around it, and
        # every worker's run-record insert would wait for the caller's commit.
        for run in conn.execute(*sql.runs_of(job_id)).all():
            conn.execute(*sql.end_run(run.run_id))
    if deleted != 1:
        return False
    # An expired lease's process_at is its expiry: the archive keeps the job's own due time.
    due_at = job["due_at"] if job["lease_token"] is not None else None
    conn.execute(
        *sql.archive(
            {**job, "process_at": due_at or job["process_at"]},
            status="cancelled",
            attempts=job["attempts"],
            finished_at=now,
            error=None,
            upsert=dialect.archive_upsert,
        )
    )
    # A read without a lock first: the settle's locking reads, which would lock the index's
    # gaps at REPEATABLE READ, run only for a job that has dependents.
    if conn.execute(*wsql.any_pending_on(job_id)).first() is not None:
        workflows.settle(conn, {job_id: "cancelled"}, dialect, now)
    log_event(
        logging.INFO,
        "job-cancelled",
        job_id=job_id,
        job_type=job["job_type"],
        queue=job["queue"],
    )
    return True


def _live_lease(job: RowMapping, now: datetime) -> bool:
    """Whether a job row is under a lease that has not expired at ``now``."""
    return job["lease_token"] is not None and job["process_at"] > now


def _request_cancel(conn: Connection, job: RowMapping, now: datetime) -> bool:
    """Ask the worker holding the job's live lease to stop it; False if the lease ended."""
    if conn.execute(*sql.request_cancel(job["seq"], now)).rowcount != 1:
        return False
    log_event(
        logging.INFO,
        "job-cancel-requested",
        job_id=job["job_id"],
        job_type=job["job_type"],
        queue=job["queue"],
        lease_owner=job["lease_owner"],
    )
    return True


def pause_queue(session_or_connection: Transaction, queue: str, *, clock: Clock = utc_now) -> None:
    """Pause a queue: from the caller's commit on, its workers (in every process) claim no
    job until it is resumed; they keep polling, and the jobs they are running finish.
    Enqueueing goes on. Pausing a paused queue changes nothing. Never commits."""
    check_name("queue", queue)
    conn = _connection_of(session_or_connection, "pause_queue")
    dialect = dialect_of(conn)
    now = check_aware("clock()", clock())
    statement = sql.pause_queue(queue, now, dialect.insert_or_nothing)
    insert_or_nothing(conn, dialect, statement, PRIMARY_KEY)
    log_event(logging.INFO, "queue-paused", queue=queue)


def resume_queue(session_or_connection: Transaction, queue: str) -> None:
    """Resume a paused queue: at the caller's commit its workers are woken (as by an
    enqueue) and claim again. Resuming a queue that is not paused changes nothing. Never
    commits."""
    check_name("queue", queue)
    conn = _connection_of(session_or_connection, "resume_queue")
    if conn.execute(*sql.resume_queue(queue)).rowcount == 0:
        return
    if dialect_of(conn).notifies:
        conn.execute(*sql.notify_queue(queue))
    wakeups.enqueued(conn, {queue})
    log_event(logging.INFO, "queue-resumed", queue=queue)


def paused_queues(bind: Engine | Transaction) -> set[str]:
    """The names of the paused queues (read in the caller's transaction, or on a connection
    of an Engine's own)."""
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return _paused(conn)
    if not isinstance(bind, Session | scoped_session | Connection):
        raise NotATransactionError(
            f"paused_queues() needs a sqlalchemy Engine, Session or Connection, not "
            f"{type(bind).__name__}"
        )
    return _paused(_connection_of(bind, "paused_queues"))


def _paused(conn: Connection) -> set[str]:
    return set(conn.execute(*sql.paused_queues()).scalars())
