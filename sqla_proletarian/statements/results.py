"""Results: a job's end as its archive row tells it, its state while queued, its
dependencies' results, and the rows of ``wait_for_result`` callers."""

from __future__ import annotations

import uuid
from typing import cast

from sqlalchemy import Table, and_, bindparam, delete, exists, insert, select, true

from sqla_proletarian.models import WAIT_KIND, Dependency
from sqla_proletarian.statements.base import ARCHIVE, JOB, RUN, Statement

DEPENDENCY = cast(Table, Dependency.__table__)

_ENDED = select(ARCHIVE.c.status, ARCHIVE.c.error, ARCHIVE.c.result).where(
    ARCHIVE.c.job_id == bindparam("id")
)
_QUEUED = select(
    JOB.c.waiting_on,
    JOB.c.lease_token,
    exists().where(RUN.c.job_id == JOB.c.job_id).label("recorded"),
).where(JOB.c.job_id == bindparam("id"))
_OF_DEPENDENCIES = (
    select(DEPENDENCY.c.depends_on, ARCHIVE.c.status, ARCHIVE.c.result)
    .select_from(DEPENDENCY.outerjoin(ARCHIVE, ARCHIVE.c.job_id == DEPENDENCY.c.depends_on))
    .where(DEPENDENCY.c.job_id == bindparam("id"), DEPENDENCY.c.kind != WAIT_KIND)
)
_WAIT = insert(DEPENDENCY).values(
    job_id=bindparam("wait"), depends_on=bindparam("id"), kind=WAIT_KIND, pending=true()
)
_END_WAIT = delete(DEPENDENCY).where(
    and_(DEPENDENCY.c.job_id == bindparam("wait"), DEPENDENCY.c.depends_on == bindparam("id"))
)


def ended_job(job_id: uuid.UUID) -> Statement:
    """A job's archive row: its status, error and serialized result."""
    return _ENDED, {"id": job_id}


def queued_state(job_id: uuid.UUID) -> Statement:
    """A queued job's dependencies not yet ended, its lease, and whether a run of it is
    recorded (a transaction-mode run)."""
    return _QUEUED, {"id": job_id}


def dependency_results(job_id: uuid.UUID) -> Statement:
    """Each dependency of a job, with its archive status and serialized result (None while
    it has not ended)."""
    return _OF_DEPENDENCIES, {"id": job_id}


def add_wait(wait_id: uuid.UUID, job_id: uuid.UUID) -> Statement:
    """A ``wait_for_result`` caller's row: whatever ends the job deletes it and, on
    PostgreSQL, NOTIFYs ``workflows.DONE_CHANNEL``."""
    return _WAIT, {"wait": wait_id, "id": job_id}


def end_wait(wait_id: uuid.UUID, job_id: uuid.UUID) -> Statement:
    """Remove a ``wait_for_result`` caller's row (if the job's end has not)."""
    return _END_WAIT, {"wait": wait_id, "id": job_id}
