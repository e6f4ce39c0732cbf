"""Housekeeping of the library's tables: installing them, pruning the archive in short
batches, and putting failed jobs back in the queue.

The worker only ever adds to the archive, so it grows without end unless someone deletes
old rows. ``prune_archive`` does that without getting in the workers' way: each batch is a
short transaction of its own at READ COMMITTED (no gap locks on InnoDB) that reads a batch
of job ids through the ``finished_at`` index and deletes them by primary key, so it never
holds a lock that an archive insert waits for.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, inspect
from sqlalchemy.orm import Session, scoped_session

from sqla_proletarian import statements as sql
from sqla_proletarian import wakeups
from sqla_proletarian.dialects import Dialect, dialect_of
from sqla_proletarian.enqueue import Transaction, _connection_of
from sqla_proletarian.errors import ConfigurationError, InvalidJobError, ProletarianError
from sqla_proletarian.logs import log_event
from sqla_proletarian.models import JOB_TABLE, UNIQUE_SLOT_INDEX, Status
from sqla_proletarian.statements import progress as graph
from sqla_proletarian.statements import workflows as wsql
from sqla_proletarian.unique import insert_or_nothing
from sqla_proletarian.values import Clock, check_name, utc_now

__all__ = [
    "DEFAULT_PRUNE_BATCH_SIZE",
    "MAX_PRUNE_BATCH_SIZE",
    "RETRY_BATCH_SIZE",
    "RetryReport",
    "install_tables",
    "prune_archive",
    "retry_failed",
    "retry_failed_report",
]

#: Rows ``prune_archive`` deletes per transaction by default.
DEFAULT_PRUNE_BATCH_SIZE = 1000
#: The largest batch allowed: longer transactions would hold their row locks for longer,
#: and each id is a bound parameter of the delete.
MAX_PRUNE_BATCH_SIZE = 10_000

_STATUSES = ("success", "failure", "cancelled")


def prune_archive(
    engine: Engine,
    *,
    older_than: timedelta,
    status: Status | None = None,
    batch_size: int = DEFAULT_PRUNE_BATCH_SIZE,
    clock: Clock = utc_now,
) -> int:
    """Delete the archived jobs that finished more than ``older_than`` ago; return how many.

    ``status`` ("success", "failure" or "cancelled") narrows it to jobs that ended that way.
    Rows go in transactions of at most ``batch_size`` that each commit on their own, oldest
    first, until a batch comes back short; workers archive meanwhile without waiting. A job
    archived again since its batch was read (its id enqueued anew) is kept. A pruned job's
    history (its earlier failures, kept by ``retry_failed``), its dependency rows (as a
    dependent) and its progress go with it. A job that a queued job (waiting, or not run
    yet) depends on is kept, its end and result still needed. If a batch fails,
    the batches before it stay deleted: call it again. Logs ``archive-pruned`` with the count.
    """
    _check_engine(engine)
    _check_older_than(older_than)
    _check_status(status)
    _check_batch_size(batch_size)
    cutoff = _cutoff(clock, older_than)
    dialect = dialect_of(engine)
    deleted = batches = 0
    after: datetime | None = None
    # The claim's connection: READ COMMITTED on the servers, and SQLite's write lock taken
    # when each batch begins (a deferred transaction could not upgrade to a writer).
    with dialect.claim_connection(engine) as conn:
        while True:
            dialect.begin_claim(conn)
            rows = conn.execute(
                *sql.archived_batch(cutoff, batch_size, status=status, after=after)
            ).all()
            # A job a queued job depends on is kept: its end or result is still needed.
            read = [row.job_id for row in rows]
            needed = set(conn.execute(*graph.still_needed(read)).scalars()) if read else set()
            job_ids = [job_id for job_id in read if job_id not in needed]
            if job_ids:
                result = conn.execute(*sql.delete_archived(job_ids, cutoff, status=status))
                deleted += result.rowcount
                if result.rowcount:
                    conn.execute(*sql.delete_history(job_ids))
                    for statement in graph.forget_pruned(job_ids):
                        conn.execute(*statement)
            conn.commit()
            batches += 1
            if len(rows) < batch_size:
                break
            # The next batch starts where this one ended: rows skipped by the status filter
            # or already deleted (dead index entries until vacuum or purge) are not read again.
            after = rows[-1].finished_at
    log_event(
        logging.INFO,
        "archive-pruned",
        deleted=deleted,
        batches=batches,
        cutoff=cutoff.isoformat(),
        status=status,
    )
    return deleted


def _check_engine(engine: object) -> None:
    if not isinstance(engine, Engine):
        raise ConfigurationError(
            f"prune_archive() needs a sqlalchemy Engine, not {type(engine).__name__}: it "
            "commits each batch itself, on a connection of its own, so it cannot run inside "
            "your transaction (pass the engine, e.g. session.get_bind())"
        )


def _check_older_than(older_than: object) -> None:
    if not isinstance(older_than, timedelta):
        raise ConfigurationError(
            f"older_than={older_than!r}: give a datetime.timedelta, e.g. "
            "older_than=timedelta(days=30) to delete what finished more than 30 days ago"
        )
    if older_than < timedelta(0):
        raise ConfigurationError(
            f"older_than={older_than!r} is negative: give how long ago the jobs to delete "
            "finished, as a timedelta of zero or more, e.g. timedelta(days=30)"
        )


def _check_status(status: object) -> None:
    if status is not None and status not in _STATUSES:
        raise ConfigurationError(
            f"status={status!r}: give 'success' or 'failure' (or 'cancelled') to delete only "
            "the jobs that ended that way, or None (the default) for all"
        )


def _check_batch_size(batch_size: object) -> None:
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or not 1 <= batch_size <= MAX_PRUNE_BATCH_SIZE
    ):
        raise ConfigurationError(
            f"batch_size={batch_size!r}: give a whole number of rows per transaction from 1 "
            f"to {MAX_PRUNE_BATCH_SIZE} (default {DEFAULT_PRUNE_BATCH_SIZE})"
        )


def _cutoff(clock: Clock, older_than: timedelta) -> datetime:
    """The instant before which archived jobs are deleted: ``clock()`` minus ``older_than``."""
    now = clock()
    if not isinstance(now, datetime) or now.tzinfo is None or now.utcoffset() is None:
        raise ConfigurationError(
            f"the clock returned {now!r}: it must return an aware datetime, "
            "e.g. datetime.now(timezone.utc)"
        )
    try:
        return now - older_than
    except OverflowError:
        raise ConfigurationError(
            f"older_than={older_than!r} reaches back before the year 1: give a shorter span"
        ) from None


# --- putting failed jobs back in the queue ---------------------------------------------------

#: Archived failures put back per statement, and per transaction when given an Engine.
RETRY_BATCH_SIZE = 500


@dataclass(frozen=True)
class RetryReport:
    """What ``retry_failed_report`` did: how many failures went back in the queue, and the
    ids of those left archived because a queued job of their queue holds their unique key."""

    put_back: int
    key_held: tuple[uuid.UUID, ...] = ()


def retry_failed(
    bind: Engine | Transaction,
    job_ids: Iterable[uuid.UUID | str] | None = None,
    *,
    queue: str | None = None,
    job_type: str | None = None,
    clock: Clock = utc_now,
) -> int:
    """Put archived failures back in the queue, due now; return how many were put back.

    Each keeps its ``job_id``, its ``unique_key`` and its ``concurrency_key``, and starts
    again from zero attempts and zero snoozes; its archive row goes in the same transaction,
    so the archive shows the job again only once it has ended anew. The failure is kept in
    the job's history (status, attempts, finished_at and error): ``get_job(...).history``
    and the dashboard's job page show it.
    A failure whose unique key another queued (or running) job of its queue holds now stays
    archived as it is, is not counted, and is logged as
    ``retry-key-held`` (``retry_failed_report`` lists them): retry it once that job is done.
    ``job_ids=None`` means every failure of ``queue`` and ``job_type`` (both optional).
    Ids that are not archived failures, or that are queued right now, are skipped.

    With a Session or Connection it joins the caller's transaction and never commits, like
    ``enqueue()``. With an Engine it commits every ``RETRY_BATCH_SIZE`` jobs, each batch a
    short transaction at READ COMMITTED (on SQLite under the write lock); if one fails,
    those before it stay put back. Idle workers of the queues wake at the commit.
    """
    report = retry_failed_report(bind, job_ids, queue=queue, job_type=job_type, clock=clock)
    return report.put_back


def retry_failed_report(
    bind: Engine | Transaction,
    job_ids: Iterable[uuid.UUID | str] | None = None,
    *,
    queue: str | None = None,
    job_type: str | None = None,
    clock: Clock = utc_now,
) -> RetryReport:
    """``retry_failed``, telling also which failures stayed archived because a queued job
    holds their unique key now."""
    ids = _retry_ids(job_ids)
    if queue is not None:
        check_name("queue", queue)
    if job_type is not None:
        check_name("job_type", job_type)
    if isinstance(bind, Engine):
        dialect = dialect_of(bind)
        with dialect.claim_connection(bind) as conn:
            return _retry_batches(conn, dialect, ids, queue, job_type, clock, commit=True)
    conn = _connection_of(bind, "retry_failed")
    session = bind() if isinstance(bind, scoped_session) else bind
    if isinstance(session, Session):
        session.flush()  # jobs the session enqueued are queued as far as the database knows
    return _retry_batches(conn, dialect_of(conn), ids, queue, job_type, clock, commit=False)


def _retry_ids(job_ids: Iterable[uuid.UUID | str] | None) -> list[uuid.UUID] | None:
    """The job ids to put back, as UUIDs without repeats; None for all."""
    if job_ids is None:
        return None
    if isinstance(job_ids, str | uuid.UUID):
        raise InvalidJobError("job_ids", f"{job_ids!r} is one id; give a list of ids")
    ids: dict[uuid.UUID, None] = {}
    for value in job_ids:
        if isinstance(value, uuid.UUID):
            ids[value] = None
            continue
        try:
            ids[uuid.UUID(value)] = None
        except (TypeError, ValueError, AttributeError):
            raise InvalidJobError(
                "job_ids", f"{value!r} is not a job id; give UUIDs as archived"
            ) from None
    return list(ids)


def _retry_batches(
    conn: Connection,
    dialect: Dialect,
    ids: list[uuid.UUID] | None,
    queue: str | None,
    job_type: str | None,
    clock: Clock,
    *,
    commit: bool,
) -> RetryReport:
    """Put failures back batch by batch: the given ids in slices, or all matching until a
    batch comes back short."""
    slices = (
        [ids[start : start + RETRY_BATCH_SIZE] for start in range(0, len(ids), RETRY_BATCH_SIZE)]
        if ids is not None
        else None
    )
    total = 0
    held: dict[uuid.UUID, None] = {}
    while slices is None or slices:
        chunk = slices.pop(0) if slices is not None else None
        if commit:
            dialect.begin_claim(conn)
        moved, found = _retry_batch(conn, dialect, chunk, queue, job_type, clock(), held)
        if commit:
            conn.commit()
        total += moved
        if slices is None and (found < RETRY_BATCH_SIZE or moved == 0):
            break
    return RetryReport(total, tuple(held))


def _retry_batch(
    conn: Connection,
    dialect: Dialect,
    ids: list[uuid.UUID] | None,
    queue: str | None,
    job_type: str | None,
    now: datetime,
    held: dict[uuid.UUID, None],
) -> tuple[int, int]:
    """One batch: read the failures to put back (no locks), move them; (moved, found).
    Those whose key a queued job holds are added to ``held``."""
    rows = conn.execute(
        *sql.failures_to_retry(RETRY_BATCH_SIZE, job_ids=ids, queue=queue, job_type=job_type)
    ).all()
    if not rows:
        return 0, 0
    moved = 0
    queues: set[str] = set()
    unkeyed = [row for row in rows if row.unique_key is None]
    if unkeyed:
        found = [row.job_id for row in unkeyed]
        kept = conn.execute(*sql.keep_failures(found)).rowcount
        statements = sql.requeue_failed(found, now, returning=dialect.deletes_runs_with_job)
        counts = [conn.execute(*statement).rowcount for statement in statements]
        _check_moved([*counts, kept])
        conn.execute(*wsql.mark_dependents(found))
        moved += counts[0]
        queues.update(row.queue for row in unkeyed)
    for row in rows:
        if row.unique_key is None:
            continue
        statement = sql.requeue_keyed(row.job_id, now, dialect.insert_or_nothing)
        if insert_or_nothing(conn, dialect, statement, UNIQUE_SLOT_INDEX):
            kept = conn.execute(*sql.keep_failures([row.job_id])).rowcount
            _check_moved([1, conn.execute(*sql.delete_failure(row.job_id)).rowcount, kept])
            conn.execute(*wsql.mark_dependents([row.job_id]))
            moved += 1
            queues.add(row.queue)
            continue
        held[row.job_id] = None
        log_event(
            logging.WARNING,
            "retry-key-held",
            job_id=row.job_id,
            queue=row.queue,
            unique_key=row.unique_key,
            hint="a queued job of the queue holds this unique key now; the failure stays "
            "archived: retry it once that job is done",
        )
    if queues:
        wakeups.enqueued(conn, queues)
    return moved, len(rows)


def _check_moved(counts: list[int]) -> None:
    """The jobs queued, the archive rows removed (where a statement of its own removes
    them) and the failures kept in the history must be as many."""
    if len(set(counts)) != 1:
        raise ProletarianError(
            f"retry_failed() queued {counts[0]} jobs but removed or kept "
            f"{', '.join(map(str, counts[1:]))} archive rows: something changed the archive "
            "meanwhile; roll back and try again"
        )


# --- installing the tables -------------------------------------------------------------------


def install_tables(engine: Engine) -> list[str]:
    """Apply the library's Alembic migrations to ``engine``'s database; return the revisions
    applied, oldest first (none when the tables are up to date).

    For a database without an Alembic project of its own. The revisions are recorded in the
    standard ``alembic_version`` table, on the library's branch, so an Alembic project that
    later lists the library's version location finds them applied (``alembic upgrade
    heads`` then runs only its own revisions). A database at an older revision of the
    library is upgraded. Refused, with nothing changed: revisions of another project in
    ``alembic_version`` (install through that project), a library revision newer than this
    package, and tables that exist with no revision recorded (``metadata.create_all``).
    Tables that a project's own history made (``sqla-proletarian alembic-revision``) and
    that have every column of this version are up to date: nothing is applied.
    """
    from alembic.config import Config
    from alembic.migration import MigrationContext
    from alembic.runtime.environment import EnvironmentContext
    from alembic.script import ScriptDirectory

    from sqla_proletarian import migrations

    if not isinstance(engine, Engine):
        raise ConfigurationError(
            f"install_tables() needs a sqlalchemy Engine, not {type(engine).__name__}: "
            "migrations run in transactions of their own"
        )
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.VERSION_LOCATION).parent))
    config.set_main_option("version_locations", migrations.VERSION_LOCATION)
    config.set_main_option("path_separator", "os")
    script = ScriptDirectory.from_config(config)
    target = f"{migrations.BRANCH_LABEL}@head"
    applied: list[str] = []

    def upgrade(revision: Any, context: Any) -> Any:
        return script._upgrade_revs(target, revision)

    def on_version_apply(ctx: Any, step: Any, heads: Any, run_args: Any) -> None:
        applied.append(str(step.up_revision_id))

    with engine.begin() as conn:
        heads = set(MigrationContext.configure(conn).get_current_heads())
        known = {revision.revision for revision in script.walk_revisions()}
        # False: the project's own history made the tables as this version has them.
        if _check_installable(conn, heads, known, migrations.HEAD_REVISION):
            with EnvironmentContext(config, script, fn=upgrade) as environment:
                environment.configure(connection=conn, on_version_apply=on_version_apply)
                with environment.begin_transaction():
                    environment.run_migrations()
    log_event(
        logging.INFO,
        "tables-installed",
        applied=",".join(applied) or None,
        revision=migrations.HEAD_REVISION,
    )
    return applied


def _check_installable(conn: Connection, heads: set[str], known: set[str], newest: str) -> bool:
    """Refuse databases whose Alembic history is not the library's alone; False when the
    project's own history made the library's tables as they are now (nothing to do)."""
    from sqla_proletarian.migrations.revision import tables_are_current

    foreign = sorted(heads - known)
    newer = [revision for revision in foreign if revision.startswith("sqlap_")]
    if newer:
        raise ProletarianError(
            f"the database is at sqla-proletarian revision {newer[0]}, which this version of "
            f"the package does not know (its newest is {newest}): upgrade the package"
        )
    if foreign and not heads & known and tables_are_current(conn):
        return False
    if foreign:
        raise ProletarianError(
            f"this database's alembic_version holds revisions of another Alembic project "
            f"({', '.join(foreign)}): install the library's tables through that project: "
            "`sqla-proletarian alembic-revision PATH/TO/alembic.ini` writes the revision "
            "that makes them, then run `alembic upgrade head`"
        )
    if not heads & known and inspect(conn).has_table(JOB_TABLE):
        raise ProletarianError(
            "the library's tables exist but alembic_version records no revision of the "
            "library (made with metadata.create_all?): drop them to install them with the "
            "migrations, or, if they match this version, record them with `alembic stamp "
            "sqla_proletarian@head` from a project that lists the library's version location"
        )
    return True
