"""Run records (the crash ledger): started, read, ended and lost."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Executable,
    bindparam,
    cast,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql

from sqla_proletarian.statements.base import _BY_ID, RUN, Statement, _delete_by

_START_RUNS = insert(RUN)


_RUN_COLUMNS = ("run_id", "job_id", "worker_id", "owner", "started_at", "batched")


def start_runs(rows: list[dict[str, Any]]) -> tuple[Executable, Any]:
    """Record the runs a claim starts (committed before its first handler runs): one row, or
    one per job of a batch, an executemany, which drivers send in one go (PostgreSQL sends a
    batch's in one statement instead: ``start_batch_runs``)."""
    if len(rows) == 1:
        return _START_RUNS, rows[0]
    return _START_RUNS, rows


#: A batch's run records on PostgreSQL: the run and job ids as two arrays, what the records
#: share (worker, owner, start, ``batched``) as one value each, not an array of copies.
_START_BATCH_RUNS = insert(RUN).from_select(
    list(_RUN_COLUMNS),
    select(
        *(
            func.unnest(bindparam(name, type_=postgresql.ARRAY(RUN.c[name].type))).label(name)
            for name in ("run_id", "job_id")
        ),
        *(
            cast(bindparam(name, type_=RUN.c[name].type), RUN.c[name].type).label(name)
            for name in ("worker_id", "owner", "started_at", "batched")
        ),
    ),
)


def start_batch_runs(
    run_ids: Mapping[uuid.UUID, uuid.UUID], worker_id: str, owner: str | None, started_at: datetime
) -> Statement:
    """The run records of a claim of several jobs, by job id, in one ``INSERT ... SELECT
    unnest(...)`` (PostgreSQL)."""
    return _START_BATCH_RUNS, {
        "run_id": list(run_ids.values()),
        "job_id": list(run_ids),
        "worker_id": worker_id,
        "owner": owner,
        "started_at": started_at,
        "batched": True,
    }


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
