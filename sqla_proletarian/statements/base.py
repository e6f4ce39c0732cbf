"""Tables, the columns a claimed job is read with, and the statement type every builder returns."""

from __future__ import annotations

from functools import cache
from typing import Any, cast

from sqlalchemy import (
    Executable,
    Table,
    Uuid,
    any_,
    bindparam,
    delete,
    tuple_,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.selectable import Alias

from sqla_proletarian.models import (
    ArchivedJob,
    Job,
    JobHistory,
    JobRun,
    PausedQueue,
    PeriodicSchedule,
    QueueLimit,
    Slot,
    Start,
)

JOB = Job.__table__
ARCHIVE = cast(Table, ArchivedJob.__table__)
RUN = cast(Table, JobRun.__table__)
PERIODIC = cast(Table, PeriodicSchedule.__table__)
PAUSED = cast(Table, PausedQueue.__table__)
HISTORY = cast(Table, JobHistory.__table__)
LIMITS = cast(Table, QueueLimit.__table__)
SLOTS = cast(Table, Slot.__table__)
STARTS = cast(Table, Start.__table__)

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
    JOB.c.concurrency_key,
    JOB.c.lease_token,
    JOB.c.due_at,
    JOB.c.unclean_ends,
    JOB.c.cancel_requested_at,
    JOB.c.uncharged_runs,
    # Above 0: the job waits; -1: it has dependencies, all ended (``workflows``).
    JOB.c.waiting_on,
    JOB.c.snoozes,
)


Statement = tuple[Executable, dict[str, Any]]

_IDS: BindParameter[Any] = bindparam("ids", expanding=True)
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
