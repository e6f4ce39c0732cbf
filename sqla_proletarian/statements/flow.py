"""Flow control: the reads and writes that keep a queue's limits (see ``sqla_proletarian.flow``).

A slot (``proletarian_slot``) is free when no transaction holds its row lock and it names no
live lease (its ``job_id`` still carrying its ``token`` with an expiry to come). Starts
(``proletarian_start``) are the rows a rate limit counts in its window.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    Executable,
    Integer,
    Select,
    Uuid,
    bindparam,
    case,
    column,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql

from sqla_proletarian.statements.base import (
    JOB,
    JOB_COLUMNS,
    LIMITS,
    PAUSED,
    SLOTS,
    STARTS,
    Statement,
)
from sqla_proletarian.statements.claim import _BY_POLL_INDEX, _RUNS

_QUEUE: Any = bindparam("queue")
_NOW = bindparam("now", type_=JOB.c.process_at.type)
_PAUSED = select(PAUSED.c.queue).where(PAUSED.c.queue == _QUEUE).exists()

_LIMITED_AMONG = select(LIMITS.c.queue).where(
    LIMITS.c.queue.in_(bindparam("queues", expanding=True))
)


def limited_among(queues: tuple[str, ...]) -> Statement:
    """Which of ``queues`` have limits."""
    return _LIMITED_AMONG, {"queues": list(queues)}


_LIMITS_OF = select(LIMITS).where(LIMITS.c.queue.in_(bindparam("queues", expanding=True)))


def limits_of(queues: list[str]) -> Statement:
    """The limit rows of ``queues`` (a queue without limits has none)."""
    return _LIMITS_OF, {"queues": queues}


_LOCK_LIMITS = select(LIMITS.c.queue).where(LIMITS.c.queue == _QUEUE).with_for_update()


def lock_limits(queue: str) -> Statement:
    """Lock a queue's limit row until the transaction ends: the rate-limit reservations of
    every worker of the queue take turns on it (a short transaction each)."""
    return _LOCK_LIMITS, {"queue": queue}


#: The slot names a lease that is still live: its job carries the token, unexpired.
_HELD_BY_LEASE = (
    select(JOB.c.job_id)
    .where(
        JOB.c.job_id == SLOTS.c.job_id,
        JOB.c.lease_token == SLOTS.c.token,
        JOB.c.process_at > _NOW,
    )
    .correlate(SLOTS)
    .exists()
)


#: When the queue's limits were set: the slots are taken only under the limits the claim
#: knows (a claim that finds none reads them again).
_LIMITS_SET_AT = select(LIMITS.c.updated_at).where(LIMITS.c.queue == _QUEUE).scalar_subquery()


_FREE_SLOTS = (
    select(SLOTS.c.n, SLOTS.c.job_id, SLOTS.c.token)
    .where(
        SLOTS.c.queue == _QUEUE,
        SLOTS.c.slot_key == bindparam("key"),
        SLOTS.c.n <= bindparam("most", type_=Integer()),
        SLOTS.c.n.not_in(bindparam("mine", expanding=True, type_=Integer())),
        bindparam("version", type_=LIMITS.c.updated_at.type) == _LIMITS_SET_AT,
        ~_HELD_BY_LEASE,
    )
    .order_by(SLOTS.c.n)
    .limit(bindparam("want", type_=Integer()))
    .with_for_update(skip_locked=True)
)


def free_slots(
    queue: str,
    key: str,
    most: int,
    want: int,
    now: datetime,
    mine: list[int],
    version: datetime,
) -> Statement:
    """Lock up to ``want`` free slots of ``(queue, key)`` numbered up to ``most``, skipping
    those another transaction holds (a transaction-mode run, a claim under way), those this
    claim took already (``mine``) and those naming a live lease, as this statement's
    snapshot sees them (``live_leases`` checks again once the locks are held); none unless
    the queue's limits are still those set at ``version``."""
    params = {
        "queue": queue,
        "key": key,
        "most": most,
        "now": now,
        "mine": mine,
        "version": version,
        "want": want,
    }
    return _FREE_SLOTS, params


_LIVE_LEASES = select(JOB.c.job_id, JOB.c.lease_token).where(
    JOB.c.job_id.in_(bindparam("ids", expanding=True)), JOB.c.process_at > _NOW
)


def live_leases(job_ids: list[uuid.UUID], now: datetime) -> Statement:
    """Of the jobs slots name, those leased and unexpired, with their tokens: read after the
    slots are locked, so a lease committed meanwhile is seen."""
    return _LIVE_LEASES, {"ids": job_ids, "now": now}


@cache
def _name_holders(count: int) -> Executable:
    """For up to ``count`` slots: the statement of each number of slots is compiled once per
    power of two, the unused branches given number 0, which no slot has."""
    job_id = case(
        *[
            (
                SLOTS.c.n == bindparam(f"s_n{i}", type_=Integer()),
                bindparam(f"s_job{i}", type_=Uuid()),
            )
            for i in range(count)
        ]
    )
    return (
        update(SLOTS)
        .where(SLOTS.c.queue == bindparam("s_queue"), SLOTS.c.slot_key == bindparam("s_key"))
        .where(SLOTS.c.n.in_(bindparam("s_numbers", expanding=True, type_=Integer())))
        .values(job_id=job_id, token=bindparam("s_token", type_=Uuid()))
    )


_HOLDERS = (
    func.unnest(
        bindparam("s_numbers", type_=postgresql.ARRAY(Integer())),
        bindparam("s_jobs", type_=postgresql.ARRAY(Uuid())),
    )
    .table_valued(column("n", Integer()), column("job_id", Uuid()), name="holders")
    .render_derived()
)
#: PostgreSQL: the slots' numbers and their jobs as two arrays, one statement text for any
#: number of slots.
_NAME_HOLDERS_UNNEST = (
    update(SLOTS)
    .where(
        SLOTS.c.queue == bindparam("s_queue"),
        SLOTS.c.slot_key == bindparam("s_key"),
        SLOTS.c.n == _HOLDERS.c.n,
    )
    .values(job_id=_HOLDERS.c.job_id, token=bindparam("s_token", type_=Uuid()))
)


def name_holders(
    queue: str, key: str, holders: dict[int, uuid.UUID], token: uuid.UUID, dialect_name: str
) -> Statement:
    """Lease mode: the slots of ``(queue, key)`` a claim took name their jobs (slot number:
    job id) and the claim's lease token, in one statement."""
    numbers = sorted(holders)
    params: dict[str, Any] = {
        "s_queue": queue,
        "s_key": key,
        "s_numbers": numbers,
        "s_token": token,
    }
    if dialect_name == "postgresql":
        params["s_jobs"] = [holders[n] for n in numbers]
        return _NAME_HOLDERS_UNNEST, params
    size = 1 << (len(numbers) - 1).bit_length()
    for i in range(size):
        n = numbers[i] if i < len(numbers) else 0
        params[f"s_n{i}"] = n
        params[f"s_job{i}"] = holders.get(n)
    return _name_holders(size), params


_SLOT_NUMBERS = select(SLOTS.c.slot_key, SLOTS.c.n).where(
    SLOTS.c.queue == _QUEUE, SLOTS.c.slot_key.in_(bindparam("keys", expanding=True))
)


def slot_numbers(queue: str, keys: list[str]) -> Statement:
    """The slots that exist for some keys of a queue."""
    return _SLOT_NUMBERS, {"queue": queue, "keys": keys}


@cache
def _insert_slots(dialect_name: str) -> Executable:
    if dialect_name == "postgresql":
        return postgresql.insert(SLOTS).on_conflict_do_nothing()
    if dialect_name in ("mysql", "mariadb"):
        return insert(SLOTS).prefix_with("IGNORE")
    if dialect_name == "sqlite":
        return insert(SLOTS).prefix_with("OR IGNORE")
    return insert(SLOTS)


def insert_slots(rows: list[dict[str, Any]], dialect_name: str) -> Statement:
    """Make slots (``queue``, ``slot_key``, ``n``), leaving any another worker just made."""
    return _insert_slots(dialect_name), rows  # type: ignore[return-value]


_WINDOW = STARTS.c.started_at > bindparam("since", type_=STARTS.c.started_at.type)
_STARTS_IN_WINDOW = (
    select(STARTS.c.slot_key, func.sum(STARTS.c.starts))
    .where(
        STARTS.c.queue == _QUEUE,
        STARTS.c.slot_key.in_(bindparam("keys", expanding=True)),
        _WINDOW,
    )
    .group_by(STARTS.c.slot_key)
)


def starts_since(queue: str, keys: list[str], since: datetime) -> Statement:
    """How many starts each of ``keys`` (``""``: the queue's own) has had after ``since``."""
    return _STARTS_IN_WINDOW, {"queue": queue, "keys": keys, "since": since}


_INSERT_STARTS = insert(STARTS)


def insert_starts(rows: list[dict[str, Any]]) -> Statement:
    """Reserve starts: a row each (``id``, ``queue``, ``slot_key``, ``started_at``,
    ``starts``, how many it counts)."""
    return _INSERT_STARTS, rows  # type: ignore[return-value]


_UNUSE_STARTS = (
    update(STARTS)
    .where(STARTS.c.id == bindparam("s_id"))
    .values(starts=STARTS.c.starts - bindparam("s_unused", type_=Integer()))
)
_DELETE_SPENT = delete(STARTS).where(
    STARTS.c.id.in_(bindparam("ids", expanding=True)), STARTS.c.starts <= 0
)


def give_back_starts(unused: dict[uuid.UUID, int]) -> list[Statement]:
    """Give back reserved starts no claim used (row id: how many): each row counts that many
    fewer, and a row that counts none any more is deleted."""
    rows = [{"s_id": row_id, "s_unused": n} for row_id, n in unused.items()]
    return [
        (_UNUSE_STARTS, rows),  # type: ignore[list-item]
        (_DELETE_SPENT, {"ids": list(unused)}),
    ]


_PRUNE_STARTS = delete(STARTS).where(
    STARTS.c.queue == _QUEUE,
    STARTS.c.started_at <= bindparam("before", type_=STARTS.c.started_at.type),
)


def prune_starts(queue: str, before: datetime) -> Statement:
    """Remove a queue's starts that no window counts any more."""
    return _PRUNE_STARTS, {"queue": queue, "before": before}


@cache
def _candidates(limit: int) -> Select[Any]:
    return (
        select(JOB.c.job_id, JOB.c.concurrency_key)
        .where(
            JOB.c.queue == _QUEUE,
            JOB.c.process_at <= _NOW,
            ~_PAUSED,
            JOB.c.concurrency_key.is_(None)
            | JOB.c.concurrency_key.not_in(bindparam("full", expanding=True)),
            JOB.c.job_id.not_in(bindparam("seen", expanding=True)),
        )
        .order_by(JOB.c.run_order, JOB.c.process_at, JOB.c.seq)
        .limit(limit)
        # MySQL and MariaDB would rather scan a small table (and sort it).
        .with_hint(JOB, _BY_POLL_INDEX, "mysql")
        .with_hint(JOB, _BY_POLL_INDEX, "mariadb")
    )


def candidates(
    queue: str, now: datetime, limit: int, *, full: list[str], seen: list[uuid.UUID]
) -> Statement:
    """Due jobs of a queue in claim order, with their keys, unless it is paused: a plain
    read, locking nothing, that leaves out keys at their limit and jobs looked at already."""
    params = {"queue": queue, "now": now, "full": full, "seen": seen}
    return _candidates(limit), params


@cache
def _lock_job(with_runs: bool) -> Select[Any]:
    columns = (*JOB_COLUMNS, _RUNS) if with_runs else JOB_COLUMNS
    return (
        select(*columns)
        .where(
            JOB.c.job_id == bindparam("job_id"),
            JOB.c.queue == _QUEUE,
            JOB.c.process_at <= _NOW,
            ~_PAUSED,
        )
        .with_for_update(skip_locked=True)
    )


def lock_job(job_id: uuid.UUID, queue: str, now: datetime, *, with_runs: bool) -> Statement:
    """Claim one candidate by id on the poll's terms (due, its queue not paused), unless
    another transaction holds it."""
    return _lock_job(with_runs), {"job_id": job_id, "queue": queue, "now": now}
