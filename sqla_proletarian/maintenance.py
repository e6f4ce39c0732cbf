"""Housekeeping of the library's tables: pruning the archive, in short batches.

The worker only ever adds to the archive, so it grows without end unless someone deletes
old rows. ``prune_archive`` does that without getting in the workers' way: each batch is a
short transaction of its own at READ COMMITTED (no gap locks on InnoDB) that reads a batch
of job ids through the ``finished_at`` index and deletes them by primary key, so it never
holds a lock that an archive insert waits for.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import Engine

from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.errors import ConfigurationError
from sqla_proletarian.logs import log_event
from sqla_proletarian.models import Status
from sqla_proletarian.values import Clock, utc_now

__all__ = ["DEFAULT_PRUNE_BATCH_SIZE", "MAX_PRUNE_BATCH_SIZE", "prune_archive"]

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
    archived again since its batch was read (its id enqueued anew) is kept. If a batch fails,
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
            if rows:
                job_ids = [row.job_id for row in rows]
                result = conn.execute(*sql.delete_archived(job_ids, cutoff, status=status))
                deleted += result.rowcount
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
