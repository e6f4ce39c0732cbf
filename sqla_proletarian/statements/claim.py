"""Claiming: the polls that lock due jobs in claim order, and the locks taken again after
a run record commits."""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    CompoundSelect,
    Select,
    bindparam,
    func,
    literal_column,
    select,
    union_all,
)

from sqla_proletarian.statements.base import JOB, JOB_COLUMNS, LIMITS, PAUSED, RUN, Statement

#: How many run records a job has; read with the claim, locking nothing in the ledger.
_RUNS = (
    select(func.count())
    .where(RUN.c.job_id == JOB.c.job_id)
    .correlate(JOB)
    .scalar_subquery()
    .label("runs")
)


#: Whether the queue is paused: one primary-key lookup, evaluated once per poll.
_PAUSED = select(PAUSED.c.queue).where(PAUSED.c.queue == bindparam("queue")).exists()
#: Whether the queue has limits: its jobs are claimed through ``flow`` only.
_LIMITED = select(LIMITS.c.queue).where(LIMITS.c.queue == bindparam("queue")).exists()


@cache
def _poll(
    limit: int,
    with_runs: bool,
    excluding: bool = False,
    first: bool = False,
    limited: bool = False,
) -> Select[Any]:
    columns = (*JOB_COLUMNS, _RUNS) if with_runs else JOB_COLUMNS
    statement = (
        select(*columns)
        .where(
            JOB.c.queue == bindparam("queue"),
            JOB.c.run_order == (_FIRST_DUE_RUN_ORDER if first else bindparam("run_order")),
            JOB.c.process_at <= bindparam("now"),
            ~_PAUSED,
            # The limited path claims a limited queue's jobs; the ordinary poll skips them.
            *(() if limited else (~_LIMITED,)),
        )
        .order_by(JOB.c.run_order, JOB.c.process_at, JOB.c.seq)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    if excluding:
        statement = statement.where(JOB.c.job_id.not_in(bindparam("held", expanding=True)))
    return statement


def poll(
    queue: str,
    now: datetime,
    limit: int = 1,
    *,
    run_order: int,
    with_runs: bool = False,
    excluding: list[uuid.UUID] | None = None,
    limited: bool = False,
) -> Statement:
    """Claim up to ``limit`` due jobs of one priority (``run_order``) of a queue unless it
    is paused, oldest first, skipping locked ones: one range of the poll index, due jobs only.

    ``with_runs`` adds ``runs``: the job's run records, for counting unclean ends.
    ``excluding`` leaves out jobs whose earlier run may still be going (``ledger``).
    A queue with limits has none claimed, unless ``limited`` (``flow`` has taken the slots).
    """
    params: dict[str, Any] = {"queue": queue, "now": now, "run_order": run_order}
    if excluding:
        params["held"] = excluding
    return _poll(limit, with_runs, bool(excluding), limited=limited), params


def poll_first(
    queue: str,
    now: datetime,
    limit: int = 1,
    *,
    with_runs: bool = False,
    excluding: list[uuid.UUID] | None = None,
    limited: bool = False,
) -> Statement:
    """As ``poll``, of the queue's highest priority that has a due job, found inside the
    statement (probes of the poll index, evaluated once): a busy claim in one round trip."""
    params: dict[str, Any] = {"queue": queue, "now": now}
    if excluding:
        params["held"] = excluding
    return _poll(limit, with_runs, bool(excluding), first=True, limited=limited), params


def _first_run_order(after: Any = None) -> Any:
    """The queue's smallest ``run_order`` (above ``after``): the first entry of a range of
    the poll index."""
    conditions = [JOB.c.queue == bindparam("queue")]
    if after is not None:
        conditions.append(JOB.c.run_order > after)
    first = select(JOB.c.run_order).where(*conditions).order_by(JOB.c.run_order).limit(1)
    return first.scalar_subquery()


#: The queue's priorities, one index probe each (a loose index scan), none when it is paused.
_RUN_ORDERS = (
    select(_first_run_order().label("run_order")).where(~_PAUSED).cte("run_orders", recursive=True)
)
_PREVIOUS = _RUN_ORDERS.alias("previous")
_RUN_ORDERS = _RUN_ORDERS.union_all(
    select(_first_run_order(_PREVIOUS.c.run_order)).where(_PREVIOUS.c.run_order.is_not(None))
)


def _earliest(run_order: Any) -> Any:
    """A priority's earliest ``process_at``: the first index entry of its range."""
    earliest = select(JOB.c.process_at).where(
        JOB.c.queue == bindparam("queue"), JOB.c.run_order == run_order
    )
    return earliest.order_by(JOB.c.process_at).limit(1).scalar_subquery()


_EARLIEST = _earliest(_RUN_ORDERS.c.run_order)
_DUE_AT = bindparam("now", type_=JOB.c.process_at.type)

#: The queue's priorities from the first up to the first that has a due job, and no further:
#: one hop through the poll index each (as ``_RUN_ORDERS``).
_UNTIL_DUE = select(_first_run_order().label("run_order")).cte("until_due", recursive=True)
_BEFORE = _UNTIL_DUE.alias("before")
_UNTIL_DUE = _UNTIL_DUE.union_all(
    select(_first_run_order(_BEFORE.c.run_order)).where(
        _BEFORE.c.run_order.is_not(None), _earliest(_BEFORE.c.run_order) > _DUE_AT
    )
)
#: The queue's highest priority that has a due job (NULL if none): the last hop, if due.
_FIRST_DUE_RUN_ORDER = (
    select(_UNTIL_DUE.c.run_order)
    .where(_UNTIL_DUE.c.run_order.is_not(None), _earliest(_UNTIL_DUE.c.run_order) <= _DUE_AT)
    .scalar_subquery()
)
#: The queue's priorities that have a due job, unless it is paused.
_DUE_RUN_ORDERS = select(_RUN_ORDERS.c.run_order).where(
    _RUN_ORDERS.c.run_order.is_not(None), _EARLIEST <= _DUE_AT
)


def due_run_orders(queue: str, now: datetime) -> Statement:
    """The priorities (as ``run_order``, the first column) of a queue that have a job due at
    ``now``, running or not, unless the queue is paused: a probe or two of the poll index per
    priority, however many jobs are scheduled for later; a plain read, locking nothing
    (``Dialect.priority_scan`` "recursive"; see ``first_entry`` for "hops")."""
    return _DUE_RUN_ORDERS, {"queue": queue, "now": now}


_NEXT_DUE = select(_EARLIEST).where(_RUN_ORDERS.c.run_order.is_not(None))


def next_due(queue: str) -> Statement:
    """Each priority's earliest ``process_at`` (the first column) in a queue, unless it is
    paused: the first entry of each priority's range of the poll index, whether due or
    scheduled for later, so an idle worker can sleep until then; a plain read (as
    ``due_run_orders``)."""
    return _NEXT_DUE, {"queue": queue}


#: MySQL and MariaDB are told which index to read, whatever their statistics say.
_BY_POLL_INDEX = "FORCE INDEX (ix_proletarian_job_poll)"


def _first_entry(after: bool) -> Select[Any]:
    statement = select(JOB.c.run_order, JOB.c.process_at).where(JOB.c.queue == bindparam("queue"))
    # The pause is checked by the first hop: the polls that follow check it again.
    statement = statement.where(JOB.c.run_order > bindparam("after") if after else ~_PAUSED)
    return (
        statement.order_by(JOB.c.run_order, JOB.c.process_at)
        .limit(1)
        .with_hint(JOB, _BY_POLL_INDEX, "mysql")
        .with_hint(JOB, _BY_POLL_INDEX, "mariadb")
    )


_FIRST_ENTRY = _first_entry(after=False)
_ENTRY_AFTER = _first_entry(after=True)


def first_entry(queue: str, after: int | None = None) -> Statement:
    """The first entry of a queue's range of the poll index, or of its part past the priority
    ``after``: the next priority (``run_order``) and its earliest ``process_at``, due or not.
    One entry read, whatever the server's statistics say, where a priority's jobs scheduled
    for later lie past it; no row when the queue is paused (checked with the first) or no
    priority follows. The hops of ``Dialect.priority_scan`` "hops", one a statement."""
    if after is None:
        return _FIRST_ENTRY, {"queue": queue}
    return _ENTRY_AFTER, {"queue": queue, "after": after}


@cache
def _queue_ends(count: int) -> CompoundSelect[Any]:
    branches = []
    for index in range(count):
        queue = bindparam(f"queue_{index}", type_=JOB.c.queue.type)
        for last in (False, True):
            order = (JOB.c.run_order, JOB.c.process_at)
            end = (
                select(*order)
                .where(JOB.c.queue == queue)
                .order_by(*(column.desc() for column in order) if last else order)
                .limit(1)
                .with_hint(JOB, _BY_POLL_INDEX, "mysql")
                .with_hint(JOB, _BY_POLL_INDEX, "mariadb")
                .subquery(f"end_{index}_{int(last)}")
            )
            # The queue's place and the end read: numbers of the code's own, not input.
            branch = select(
                literal_column(str(index)).label("place"),
                literal_column(str(int(last))).label("last"),
                end.c.run_order,
                end.c.process_at,
            )
            if not last:
                # Checked on the entry read, not inside its read: a paused queue's range
                # would be read whole for an entry that passes.
                paused = select(PAUSED.c.queue).where(PAUSED.c.queue == queue).exists()
                branch = branch.where(~paused)
            branches.append(branch)
    return union_all(*branches)


def queue_ends(queues: tuple[str, ...]) -> Statement:
    """The two ends of each queue's range of the poll index, in one statement for all the
    queues: its first entry (its highest priority and that priority's earliest
    ``process_at``; no row when the queue is paused) and its last (its lowest priority), as
    rows of (the queue's place in ``queues``, 0 or 1 for the last, ``run_order``,
    ``process_at``). Two entries a queue, read whatever the server's statistics say,
    however many jobs are scheduled for later; a plain read, locking nothing. An idle
    worker's look at all its queues at once (``running.QueueEnds``)."""
    return _queue_ends(len(queues)), {f"queue_{i}": queue for i, queue in enumerate(queues)}


#: Inline: ``seq`` comes from the server's default, with no ``nextval()`` round trip first
#: and nothing read back (an enqueue-only role needs no SELECT).
_RELOCK = (
    select(*JOB_COLUMNS)
    .where(JOB.c.job_id == bindparam("job_id"))
    .with_for_update(skip_locked=True)
)


def relock(job_id: uuid.UUID) -> Statement:
    """Claim one known job again by id, skipping it if another worker holds it (any server
    after an outcome could not be written)."""
    return _RELOCK, {"job_id": job_id}


_RECLAIM = _RELOCK.where(
    JOB.c.queue == bindparam("queue"), JOB.c.process_at <= bindparam("now"), ~_PAUSED
)


def reclaim(job_id: uuid.UUID, queue: str, now: datetime) -> Statement:
    """Claim one known job again by id on the poll's terms: due at ``now``, its queue not
    paused, not held by another worker (SQLite, after the run was recorded)."""
    return _RECLAIM, {"job_id": job_id, "queue": queue, "now": now}


#: The archive columns an outcome replaces when the job id is archived already.
