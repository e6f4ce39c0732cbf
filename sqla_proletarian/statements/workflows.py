"""Workflows: a dependent job's rows, the settling of its dependencies' ends, the sweep.

See ``sqla_proletarian.workflows`` for how they fit together.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import (
    Executable,
    String,
    Table,
    and_,
    bindparam,
    delete,
    exists,
    false,
    func,
    insert,
    literal,
    select,
    true,
    update,
)

from sqla_proletarian.models import WAIT_KIND, WAITING_AT, Dependency
from sqla_proletarian.statements.base import _JOB_BY_ID, ARCHIVE, JOB, JOB_COLUMNS, Statement
from sqla_proletarian.wakeups import DONE_CHANNEL

DEPENDENCY = cast(Table, Dependency.__table__)

#: A statement and its rows of parameters: an executemany.
Many = tuple[Executable, list[dict[str, Any]]]

#: ``waiting_on`` of a job whose dependencies have all ended: not waiting (not above 0), and
#: a claim of it knows to read its dependencies' results.
HAD_DEPENDENCIES = -1

_IDS = bindparam("ids", expanding=True, type_=JOB.c.job_id.type)

# --- enqueueing a dependent ----------------------------------------------------------------

_LIVE = select(JOB.c.job_id).where(JOB.c.job_id.in_(_IDS))
_ENDED = select(ARCHIVE.c.job_id, ARCHIVE.c.status).where(ARCHIVE.c.job_id.in_(_IDS))


def live_jobs(job_ids: Sequence[uuid.UUID]) -> Statement:
    """Which of ``job_ids`` are in the queue (queued, waiting or running)."""
    return _LIVE, {"ids": list(job_ids)}


def ended_jobs(job_ids: Sequence[uuid.UUID]) -> Statement:
    """The archive's status of those of ``job_ids`` that have ended."""
    return _ENDED, {"ids": list(job_ids)}


_INSERT_JOB = insert(JOB)
_INSERT_DEPENDENCY = insert(DEPENDENCY)


def insert_dependents(rows: list[dict[str, Any]]) -> Many:
    """Enqueue jobs with dependencies (their rows carry ``waiting_on`` and ``due_at``)."""
    return _INSERT_JOB, rows


def insert_dependencies(rows: list[dict[str, Any]]) -> Many:
    """A dependent's edges: ``job_id``, ``depends_on``, ``kind``, ``pending``."""
    return _INSERT_DEPENDENCY, rows


# --- settling the ends of jobs --------------------------------------------------------------


def waiting_for(ids: Any) -> Any:
    """How many rows wait for the end of the jobs ``ids`` (what ``depends_on =`` compares
    with: an id's bind parameter, or ``ANY`` of an array's): PostgreSQL's archive
    statements return it, so that an end with nothing waiting for it settles nothing, in no
    statement of its own."""
    return (
        select(func.count())
        .select_from(DEPENDENCY)
        .where(DEPENDENCY.c.depends_on == ids, DEPENDENCY.c.pending == true())
        .scalar_subquery()
        .label("waiting")
    )


# MySQL and MariaDB would rather scan a small table for ``IN (...)``, and lock every row it
# reads: the locking reads name their index.
_BY_DEPENDS_ON = "FORCE INDEX (ix_proletarian_dependency_depends_on)"
_PENDING_ON = (
    select(DEPENDENCY.c.job_id, DEPENDENCY.c.depends_on, DEPENDENCY.c.kind)
    .where(DEPENDENCY.c.depends_on.in_(_IDS), DEPENDENCY.c.pending == true())
    .order_by(DEPENDENCY.c.job_id, DEPENDENCY.c.depends_on)
    .with_for_update()
    .with_hint(DEPENDENCY, _BY_DEPENDS_ON, "mysql")
    .with_hint(DEPENDENCY, _BY_DEPENDS_ON, "mariadb")
)


_ANY_PENDING_ON = (
    select(DEPENDENCY.c.job_id)
    .where(DEPENDENCY.c.depends_on == bindparam("job_id"), DEPENDENCY.c.pending == true())
    .limit(1)
)


def any_pending_on(job_id: uuid.UUID) -> Statement:
    """Whether a row waits for the job's end: read without a lock."""
    return _ANY_PENDING_ON, {"job_id": job_id}


def pending_on(job_ids: Sequence[uuid.UUID]) -> Statement:
    """The rows still waiting for the end of one of ``job_ids``, locked (in the order of
    their key, so that two ends settling the same dependent take its locks in turn)."""
    return _PENDING_ON, {"ids": list(job_ids)}


_LOCKED_EDGES = _PENDING_ON.cte("locked_edges")
# The rows it marks are those the locking CTE holds: the same range of the depends_on index,
# read once the lock is taken (the EXISTS is evaluated first, once).
_SETTLED_EDGES = (
    update(DEPENDENCY)
    .where(
        DEPENDENCY.c.depends_on.in_(_IDS),
        DEPENDENCY.c.pending == true(),
        DEPENDENCY.c.kind != WAIT_KIND,
        exists(select(_LOCKED_EDGES.c.job_id)),
    )
    .values(pending=false())
    .cte("settled_edges")
)
# Each row's dependent's next row still pending that no transaction holds (as
# ``unlocked_pending_of`` after it), the ended jobs' own rows left out: the statement reads
# them as they were before its UPDATE.
_NEXT = DEPENDENCY.alias("next_edge")
_NEXT_PENDING = (
    select(_NEXT.c.depends_on)
    .where(
        _NEXT.c.job_id == _LOCKED_EDGES.c.job_id,
        _NEXT.c.pending == true(),
        _NEXT.c.kind != WAIT_KIND,
        _NEXT.c.depends_on > _LOCKED_EDGES.c.depends_on,
        _NEXT.c.depends_on.not_in(_IDS),
    )
    .order_by(_NEXT.c.depends_on)
    .limit(1)
    .with_for_update(read=True, skip_locked=True)
    .correlate(_LOCKED_EDGES)
    .scalar_subquery()
)
_SETTLE_PENDING_ON = select(
    _LOCKED_EDGES.c.job_id,
    _LOCKED_EDGES.c.depends_on,
    _LOCKED_EDGES.c.kind,
    _NEXT_PENDING.label("next_pending"),
).add_cte(_SETTLED_EDGES)


def settle_pending_on(job_ids: Sequence[uuid.UUID]) -> Statement:
    """PostgreSQL: ``pending_on`` and ``settle_edges`` of what it found, in one statement
    (the rows locked in the same order; a waiter's row is left for ``drop_waits``), and for
    each, ``unlocked_pending_of`` its dependent after it (``next_pending``)."""
    return _SETTLE_PENDING_ON, {"ids": list(job_ids)}


_EDGE = and_(
    DEPENDENCY.c.job_id == bindparam("b_job_id"),
    DEPENDENCY.c.depends_on == bindparam("b_depends_on"),
)
_SETTLE = update(DEPENDENCY).where(_EDGE).values(pending=false())
_DROP_WAIT = delete(DEPENDENCY).where(_EDGE)


def _edges(edges: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> list[dict[str, Any]]:
    return [{"b_job_id": job_id, "b_depends_on": depends_on} for job_id, depends_on in edges]


def settle_edges(edges: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> Many:
    """Mark rows ``(job_id, depends_on)`` settled: their end is counted."""
    return _SETTLE, _edges(edges)


def drop_waits(edges: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> Many:
    """Delete the rows of ``wait_for_result`` callers whose job has ended."""
    return _DROP_WAIT, _edges(edges)


_DONE = select(func.pg_notify(literal(DONE_CHANNEL), bindparam("job_id", type_=String)))


def notify_done(job_id: uuid.UUID) -> Statement:
    """PostgreSQL: tell the job's waiters it has ended, when the transaction commits."""
    return _DONE, {"job_id": str(job_id)}


# A dependent that runs already (put back by retry_failed) has waiting_on 0: not locked.
_DEPENDENTS = (
    select(*JOB_COLUMNS)
    .where(JOB.c.job_id.in_(_IDS), JOB.c.waiting_on > 0)
    .order_by(JOB.c.job_id)
    .with_for_update()
    .with_hint(JOB, _JOB_BY_ID, "mysql")
    .with_hint(JOB, _JOB_BY_ID, "mariadb")
)


def lock_dependents(job_ids: Sequence[uuid.UUID]) -> Statement:
    """The waiting ones of ``job_ids``, locked in id order."""
    return _DEPENDENTS, {"ids": sorted(job_ids)}


# ``process_at`` is set from ``due_at`` before ``due_at`` is cleared: MySQL applies a single
# table UPDATE's assignments in order, the others all from the row as it was.
_RELEASE = (
    update(JOB)
    .where(
        JOB.c.job_id == bindparam("b_job_id"),
        JOB.c.waiting_on > 0,
        JOB.c.lease_token.is_(None),
        JOB.c.process_at == bindparam("waiting_at", type_=JOB.c.process_at.type),
    )
    .ordered_values(
        (JOB.c.process_at, JOB.c.due_at), (JOB.c.due_at, None), (JOB.c.waiting_on, HAD_DEPENDENCIES)
    )
)


def release(job_ids: Sequence[uuid.UUID]) -> Many:
    """Make waiting jobs whose dependencies have all ended due at their own time (their
    ``waiting_on`` ``HAD_DEPENDENCIES``)."""
    return _RELEASE, [{"b_job_id": job_id, "waiting_at": WAITING_AT} for job_id in job_ids]


# --- a fan-in: whether an end is the last of a dependent's ------------------------------------

# A dependent's rows still pending but for waiters' (read by the key: MySQL and MariaDB
# would rather scan a small table, and lock every row they read).
_BY_KEY = "FORCE INDEX (PRIMARY)"
_PENDING_OF = and_(
    DEPENDENCY.c.job_id == bindparam("job_id"),
    DEPENDENCY.c.pending == true(),
    DEPENDENCY.c.kind != WAIT_KIND,
)


def _of_dependent(*columns: Any) -> Any:
    return (
        select(*columns)
        .where(_PENDING_OF)
        .order_by(DEPENDENCY.c.depends_on)
        .with_hint(DEPENDENCY, _BY_KEY, "mysql")
        .with_hint(DEPENDENCY, _BY_KEY, "mariadb")
    )


# Read from the ended dependency's own row on, so that the ends of a fan-in's parts read all
# over the dependent's range, each past the few rows counted after its own (read from the
# range's start, each would pass every row counted so far).
_FROM = bindparam("b_from", type_=DEPENDENCY.c.depends_on.type)
_UNLOCKED_PENDING_AFTER = (
    _of_dependent(DEPENDENCY.c.depends_on)
    .where(DEPENDENCY.c.depends_on > _FROM)
    .limit(1)
    .with_for_update(read=True, skip_locked=True)
)
_UNLOCKED_PENDING_BEFORE = (
    _of_dependent(DEPENDENCY.c.depends_on)
    .where(DEPENDENCY.c.depends_on < _FROM)
    .limit(1)
    .with_for_update(read=True, skip_locked=True)
)
_ANY_PENDING_OF = _of_dependent(DEPENDENCY.c.depends_on).limit(1)
_LOCK_PENDING_OF = _of_dependent(DEPENDENCY.c.depends_on).with_for_update()


def unlocked_pending_of(job_id: uuid.UUID, own: uuid.UUID, *, after: bool) -> Statement:
    """One of the dependent's rows still pending that no transaction holds (a dependency
    not ending right now), the first ``after`` (else before) the row ``(job_id, own)`` of
    an ended dependency, share-locked: that dependency's end, if it comes now, waits for
    this transaction's commit, and then sees its end counted."""
    statement = _UNLOCKED_PENDING_AFTER if after else _UNLOCKED_PENDING_BEFORE
    return statement, {"job_id": job_id, "b_from": own}


def any_pending_of(job_id: uuid.UUID) -> Statement:
    """One of the dependent's rows still pending, read without a lock (rows that other ends
    are marking, not committed yet, read as pending)."""
    return _ANY_PENDING_OF, {"job_id": job_id}


def lock_pending_of(job_id: uuid.UUID) -> Statement:
    """All of the dependent's rows still pending, locked in key order (waiting for the ends
    that are marking them)."""
    return _LOCK_PENDING_OF, {"job_id": job_id}


_UNSETTLE = update(DEPENDENCY).where(_EDGE).values(pending=true())


def unsettle_edges(edges: Sequence[tuple[uuid.UUID, uuid.UUID]]) -> Many:
    """Mark rows ``(job_id, depends_on)`` pending again: their end is counted after its
    commit, by a look of its own."""
    return _UNSETTLE, _edges(edges)


_WAITING_ON = (
    select(DEPENDENCY.c.job_id, DEPENDENCY.c.depends_on, DEPENDENCY.c.kind)
    .where(DEPENDENCY.c.depends_on.in_(_IDS), DEPENDENCY.c.pending == true())
    .with_hint(DEPENDENCY, _BY_DEPENDS_ON, "mysql")
    .with_hint(DEPENDENCY, _BY_DEPENDS_ON, "mariadb")
)


def waiting_on(job_ids: Sequence[uuid.UUID]) -> Statement:
    """The rows still waiting for the end of one of ``job_ids``, read without a lock."""
    return _WAITING_ON, {"ids": list(job_ids)}


# --- the sweep: ends that no settle counted --------------------------------------------------

#: Whether the job a row waits for is still in the queue: a probe of the job-id index per
#: row (a subquery with a LIMIT, which PostgreSQL does not turn into a join: as NOT EXISTS it
#: would hash the whole job table, statistics fresh or not).
_STILL_QUEUED = (
    select(literal(1))
    .where(JOB.c.job_id == DEPENDENCY.c.depends_on)
    .correlate(DEPENDENCY)
    .limit(1)
    .scalar_subquery()
)
_STRANDED = (
    select(DEPENDENCY.c.depends_on)
    .where(DEPENDENCY.c.pending == true(), _STILL_QUEUED.is_(None))
    .distinct()
    .limit(500)
)


def stranded() -> Statement:
    """Ended jobs that still have rows waiting for their end: a dependent enqueued while its
    dependency was ending, whose end could not see it (or a waiter's row that outlived it)."""
    return _STRANDED, {}


_WAITING_KINDS = DEPENDENCY.c.kind != WAIT_KIND
_DEPENDENCIES_OF = (
    select(DEPENDENCY.c.depends_on)
    .where(DEPENDENCY.c.job_id == bindparam("job_id"), _WAITING_KINDS)
    .order_by(DEPENDENCY.c.depends_on)
)


_MARK = (
    update(JOB)
    .where(
        JOB.c.job_id == bindparam("b_job_id"),
        exists().where(DEPENDENCY.c.job_id == JOB.c.job_id, _WAITING_KINDS),
    )
    .values(waiting_on=HAD_DEPENDENCIES)
)


def mark_dependents(job_ids: Sequence[uuid.UUID]) -> Many:
    """Jobs put back in the queue (``retry_failed``): those with dependencies say so."""
    return _MARK, [{"b_job_id": job_id} for job_id in job_ids]


def dependencies_of(job_id: uuid.UUID) -> Statement:
    """The ids a job depends on."""
    return _DEPENDENCIES_OF, {"job_id": job_id}


__all__ = [
    "DEPENDENCY",
    "any_pending_of",
    "any_pending_on",
    "dependencies_of",
    "drop_waits",
    "ended_jobs",
    "insert_dependencies",
    "insert_dependents",
    "live_jobs",
    "lock_dependents",
    "lock_pending_of",
    "mark_dependents",
    "notify_done",
    "pending_on",
    "release",
    "settle_edges",
    "settle_pending_on",
    "stranded",
    "unlocked_pending_of",
    "unsettle_edges",
    "waiting_for",
    "waiting_on",
]
