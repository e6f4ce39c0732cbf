"""A running job's progress (progress.ProgressWriter), and the reads of it and of job graphs
(inspection.get_job, queue_status; maintenance.prune_archive)."""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import Executable, Table, bindparam, delete, func, insert, select
from sqlalchemy.dialects import mysql, postgresql, sqlite

from sqla_proletarian.dialects import ArchiveUpsert
from sqla_proletarian.models import Dependency, Progress
from sqla_proletarian.statements.base import _IDS, ARCHIVE, JOB, Statement

PROGRESS = cast(Table, Progress.__table__)
DEPENDENCY = cast(Table, Dependency.__table__)
#: ``proletarian_dependency.kind`` of a ``wait_for_result`` caller's row (not an edge of a
#: job graph: its ``job_id`` is the wait's own id).
_WAIT_KIND = "wait"
_EDGE = DEPENDENCY.c.kind != _WAIT_KIND
#: A queued job waiting for its dependencies.
WAITING = JOB.c.waiting_on > 0
_REPLACED = ("progress", "message", "updated_at")


@cache
def _upsert(form: ArchiveUpsert) -> Executable | None:
    module = {"postgresql_on_conflict": postgresql, "sqlite_on_conflict": sqlite}.get(form)
    if module is not None:
        statement = module.insert(PROGRESS)
        return cast(
            Executable,
            statement.on_conflict_do_update(
                index_elements=[PROGRESS.c.job_id],
                set_={name: statement.excluded[name] for name in _REPLACED},
            ),
        )
    if form == "mysql_on_duplicate_key":
        duplicate = mysql.insert(PROGRESS)
        return duplicate.on_duplicate_key_update(
            {name: duplicate.inserted[name] for name in _REPLACED}
        )
    return None


_DELETE_ONE = delete(PROGRESS).where(PROGRESS.c.job_id == bindparam("job_id"))


def write_progress(
    form: ArchiveUpsert, job_id: uuid.UUID, progress: float, message: str | None, now: datetime
) -> list[Statement]:
    """Replace a job's progress row: one upsert of the dialect's form (a delete and an
    insert where it has none)."""
    values = {"job_id": job_id, "progress": progress, "message": message, "updated_at": now}
    upsert = _upsert(form)
    if upsert is not None:
        return [(upsert, values)]
    return [(_DELETE_ONE, {"job_id": job_id}), (insert(PROGRESS), values)]


_PROGRESS_OF = select(PROGRESS.c.progress, PROGRESS.c.message).where(
    PROGRESS.c.job_id == bindparam("job_id")
)


def progress_of(job_id: uuid.UUID) -> Statement:
    """A job's last reported progress and message, by primary key."""
    return _PROGRESS_OF, {"job_id": job_id}


_PROGRESS_OF_MANY = select(PROGRESS.c.job_id, PROGRESS.c.progress, PROGRESS.c.message).where(
    PROGRESS.c.job_id.in_(_IDS)
)


def progress_of_many(job_ids: list[uuid.UUID]) -> Statement:
    """The last reported progress of several jobs (a page of a list), by primary key."""
    return _PROGRESS_OF_MANY, {"ids": job_ids}


_DEPENDENCIES = (
    select(DEPENDENCY.c.job_id, DEPENDENCY.c.depends_on)
    .where(DEPENDENCY.c.job_id.in_(_IDS), _EDGE)
    .order_by(DEPENDENCY.c.job_id, DEPENDENCY.c.depends_on)
)
_DEPENDENTS = (
    select(DEPENDENCY.c.depends_on, DEPENDENCY.c.job_id)
    .where(DEPENDENCY.c.depends_on.in_(_IDS), _EDGE)
    .order_by(DEPENDENCY.c.depends_on, DEPENDENCY.c.job_id)
)


def dependencies_of(job_ids: list[uuid.UUID]) -> Statement:
    """Pairs (job, the job it depends on) of ``job_ids`` (the dependency table's primary
    key); a ``wait_for_result`` caller's rows are not edges of a graph."""
    return _DEPENDENCIES, {"ids": job_ids}


def dependents_of(job_ids: list[uuid.UUID]) -> Statement:
    """Pairs (job, a job depending on it) of ``job_ids`` (the ``depends_on`` index)."""
    return _DEPENDENTS, {"ids": job_ids}


_WAITING_COUNTS = (
    select(JOB.c.queue, func.count().label("jobs")).where(WAITING).group_by(JOB.c.queue)
)


def waiting_counts() -> Statement:
    """Per queue: the jobs waiting for their dependencies (they sit at ``WAITING_AT`` in the
    poll index, counted with the scheduled ones by ``queue_counts``)."""
    return _WAITING_COUNTS, {}


#: Archived jobs whose end a queued job still waits for, or whose result it will read: a
#: dependency row of theirs names a dependent that is still in the job table.
_NEEDED = (
    select(DEPENDENCY.c.depends_on)
    .select_from(DEPENDENCY.join(JOB, JOB.c.job_id == DEPENDENCY.c.job_id))
    .where(DEPENDENCY.c.depends_on.in_(_IDS), _EDGE)
    .distinct()
)


def still_needed(job_ids: list[uuid.UUID]) -> Statement:
    """Of ``job_ids`` (archived jobs), those a queued job depends on."""
    return _NEEDED, {"ids": job_ids}


def _gone(column: Any) -> tuple[Any, ...]:
    """Of ``ids``, those neither archived nor queued now (a job archived again since its
    batch was read keeps its rows)."""
    return (
        column.in_(_IDS),
        ~select(ARCHIVE.c.job_id).where(ARCHIVE.c.job_id == column).exists(),
        ~select(JOB.c.job_id).where(JOB.c.job_id == column).exists(),
    )


_DELETE_EDGES = delete(DEPENDENCY).where(*_gone(DEPENDENCY.c.job_id))
_DELETE_PROGRESS = delete(PROGRESS).where(*_gone(PROGRESS.c.job_id))


def forget_pruned(job_ids: list[uuid.UUID]) -> list[Statement]:
    """Delete the dependency rows of pruned jobs (as dependents) and their progress rows:
    those of ``job_ids`` neither archived nor queued now."""
    return [(_DELETE_EDGES, {"ids": job_ids}), (_DELETE_PROGRESS, {"ids": job_ids})]


__all__ = [
    "DEPENDENCY",
    "PROGRESS",
    "WAITING",
    "dependencies_of",
    "dependents_of",
    "forget_pruned",
    "progress_of",
    "progress_of_many",
    "still_needed",
    "waiting_counts",
    "write_progress",
]
