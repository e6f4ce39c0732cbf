"""Pausing queues, and the notification that wakes a queue's workers."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    String,
    bindparam,
    delete,
    func,
    literal,
    select,
)

from sqla_proletarian.dialects import InsertOrNothing
from sqla_proletarian.statements.base import PAUSED, Statement
from sqla_proletarian.statements.enqueue import _insert_or_nothing
from sqla_proletarian.wakeups import CHANNEL


def pause_queue(queue: str, now: datetime, form: InsertOrNothing) -> Statement:
    """Mark a queue paused, unless it is paused already."""
    statement = _insert_or_nothing(PAUSED, ("queue",), form)
    return statement, {"queue": queue, "paused_at": now}


_RESUME_QUEUE = delete(PAUSED).where(PAUSED.c.queue == bindparam("queue"))


def resume_queue(queue: str) -> Statement:
    """Let a paused queue's workers claim again."""
    return _RESUME_QUEUE, {"queue": queue}


_PAUSED_QUEUES = select(PAUSED.c.queue)


def paused_queues() -> Statement:
    """Every paused queue."""
    return _PAUSED_QUEUES, {}


_NOTIFY = select(func.pg_notify(literal(CHANNEL), bindparam("queue", type_=String)))


def notify_queue(queue: str) -> Statement:
    """PostgreSQL: wake the queue's listening workers when the transaction commits."""
    return _NOTIFY, {"queue": queue}
