"""Periodic jobs: each schedule's last enqueued occurrence."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    bindparam,
    select,
    update,
)

from sqla_proletarian.dialects import InsertOrNothing
from sqla_proletarian.statements.base import PERIODIC, Statement
from sqla_proletarian.statements.enqueue import _insert_or_nothing

_SCHEDULES = select(PERIODIC.c.name, PERIODIC.c.last_occurrence).where(
    PERIODIC.c.name.in_(bindparam("names", expanding=True))
)


def schedules(names: list[str]) -> Statement:
    """The last enqueued occurrence of each named schedule that has a record."""
    return _SCHEDULES, {"names": names}


def start_schedule(name: str, occurrence: datetime, form: InsertOrNothing) -> Statement:
    """Record a schedule seen for the first time, unless another worker just did."""
    statement = _insert_or_nothing(PERIODIC, ("name",), form)
    return statement, {"name": name, "last_occurrence": occurrence}


_ADVANCE_SCHEDULE = (
    update(PERIODIC)
    .where(PERIODIC.c.name == bindparam("key"), PERIODIC.c.last_occurrence < bindparam("due"))
    .values(last_occurrence=bindparam("due"))
)


def advance_schedule(name: str, occurrence: datetime) -> Statement:
    """Compare-and-set: move a schedule on to ``occurrence`` unless it is there already (row
    count 0: another worker enqueued it). It never moves back, whatever a clock says."""
    return _ADVANCE_SCHEDULE, {"key": name, "due": occurrence}
