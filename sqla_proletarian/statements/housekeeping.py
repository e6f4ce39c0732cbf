"""Archive housekeeping: pruning finished jobs in batches."""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Executable,
    Select,
    bindparam,
    delete,
    select,
)

from sqla_proletarian.statements.base import ARCHIVE, Statement

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
