"""Queue limits: how many jobs of a queue (and of each ``concurrency_key``) may run at once,
and how many may start in a time window. Stored in the database, so every worker obeys them
from its next claim after the caller's commit; ``sqla_proletarian.flow`` keeps them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, delete, func, insert, select
from sqlalchemy.orm import Session, scoped_session

from sqla_proletarian.dialects import check_rate_limits
from sqla_proletarian.enqueue import Transaction, _connection_of
from sqla_proletarian.errors import ConfigurationError, NotATransactionError
from sqla_proletarian.statements.base import LIMITS, SLOTS
from sqla_proletarian.values import Clock, check_aware, check_name, utc_now

__all__ = [
    "MAX_LIMIT",
    "MAX_RATE_COUNT",
    "MAX_RATE_SECONDS",
    "QueueLimits",
    "clear_queue_limits",
    "queue_limits",
    "set_queue_limits",
]

#: The largest ``max_running`` and ``max_running_per_key`` (each is a row per slot).
MAX_LIMIT = 10_000
#: The largest count of a rate limit (its window keeps a row per start).
MAX_RATE_COUNT = 1_000_000
#: The longest rate-limit window: a week, in seconds.
MAX_RATE_SECONDS = 604_800.0

#: A rate limit: at most ``count`` starts in any window of ``seconds``.
Rate = tuple[int, float]


@dataclass(frozen=True)
class QueueLimits:
    """A queue's limits; None is no such limit.

    ``max_running``: jobs of the queue running at once, across every worker;
    ``max_running_per_key``: the same for each ``concurrency_key``; ``rate_limit``:
    ``(count, seconds)``, at most ``count`` jobs of the queue start in any window of
    ``seconds``; ``rate_limit_per_key``: the same for each key.
    """

    max_running: int | None = None
    max_running_per_key: int | None = None
    rate_limit: Rate | None = None
    rate_limit_per_key: Rate | None = None

    @property
    def per_key(self) -> bool:
        """Whether a limit counts by ``concurrency_key``."""
        return self.max_running_per_key is not None or self.rate_limit_per_key is not None

    def as_dict(self) -> dict[str, Any]:
        """The four limits as JSON-ready values (a rate as ``[count, seconds]``)."""
        return {
            "max_running": self.max_running,
            "max_running_per_key": self.max_running_per_key,
            "rate_limit": list(self.rate_limit) if self.rate_limit else None,
            "rate_limit_per_key": list(self.rate_limit_per_key)
            if self.rate_limit_per_key
            else None,
        }

    def describe(self) -> str:
        """One line for a person: ``max_running=2 rate_limit=10/1s``; ``none`` for none."""
        parts = []
        for name, value in (
            ("max_running", self.max_running),
            ("max_running_per_key", self.max_running_per_key),
        ):
            if value is not None:
                parts.append(f"{name}={value}")
        for name, rate in (
            ("rate_limit", self.rate_limit),
            ("rate_limit_per_key", self.rate_limit_per_key),
        ):
            if rate is not None:
                parts.append(f"{name}={rate[0]}/{rate[1]:g}s")
        return " ".join(parts) or "none"


def check_running(name: str, value: object) -> int | None:
    """None, or a whole number of jobs from 1 to MAX_LIMIT."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name}: {value!r} is not a whole number; give 1 to {MAX_LIMIT}")
    if not 1 <= value <= MAX_LIMIT:
        raise ConfigurationError(
            f"{name}: {value} is out of range; give 1 to {MAX_LIMIT} (pause_queue stops a "
            "queue's claims altogether)"
        )
    return value


def check_rate(name: str, value: object) -> Rate | None:
    """None, or ``(count, seconds)``: count 1 to MAX_RATE_COUNT, seconds more than 0, up to a
    week."""
    if value is None:
        return None
    count: Any
    seconds: Any
    try:
        count, seconds = value  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"{name}: {value!r} is not a (count, seconds) pair; give e.g. (10, 1.0) for at "
            "most 10 starts in any second"
        ) from None
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_RATE_COUNT:
        raise ConfigurationError(
            f"{name}'s count: {count!r} is not a whole number from 1 to {MAX_RATE_COUNT:,}"
        )
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ConfigurationError(f"{name}'s seconds: {seconds!r} is not a number of seconds")
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_RATE_SECONDS:
        raise ConfigurationError(
            f"{name}'s seconds: {seconds!r} is out of range; give more than 0, up to "
            f"{MAX_RATE_SECONDS:g} (a week)"
        )
    return int(count), float(seconds)


def set_queue_limits(
    session_or_connection: Transaction,
    queue: str,
    *,
    max_running: int | None = None,
    max_running_per_key: int | None = None,
    rate_limit: Rate | None = None,
    rate_limit_per_key: Rate | None = None,
    clock: Clock = utc_now,
) -> QueueLimits:
    """Set a queue's limits, all four at once (None: no such limit; all None clears them), in
    the caller's transaction; never commits. From the commit on, every worker's next claim
    obeys them. Bad values raise ``ConfigurationError`` before anything is written.

    ``max_running``: at most N jobs of the queue run at once, across every worker and
    process; ``max_running_per_key``: at most N of each ``concurrency_key``;
    ``rate_limit=(count, seconds)``: at most ``count`` jobs of the queue start in any window
    of ``seconds``; ``rate_limit_per_key``: the same per key. Jobs held back wait in the
    queue: they are never failed, dropped or charged an attempt. Rate limits are refused on
    a MariaDB Galera cluster (they would not hold across its nodes; ``max_running`` does).
    """
    check_name("queue", queue)
    limits = QueueLimits(
        check_running("max_running", max_running),
        check_running("max_running_per_key", max_running_per_key),
        check_rate("rate_limit", rate_limit),
        check_rate("rate_limit_per_key", rate_limit_per_key),
    )
    conn = _connection_of(session_or_connection, "set_queue_limits")
    if limits == QueueLimits():
        _clear(conn, queue)
        return limits
    now = check_aware("clock()", clock())
    if limits.rate_limit is not None or limits.rate_limit_per_key is not None:
        check_rate_limits(conn)
    conn.execute(delete(LIMITS).where(LIMITS.c.queue == queue))
    conn.execute(
        insert(LIMITS).values(
            queue=queue,
            max_running=limits.max_running,
            max_running_per_key=limits.max_running_per_key,
            rate_count=limits.rate_limit[0] if limits.rate_limit else None,
            rate_seconds=limits.rate_limit[1] if limits.rate_limit else None,
            key_rate_count=limits.rate_limit_per_key[0] if limits.rate_limit_per_key else None,
            key_rate_seconds=limits.rate_limit_per_key[1] if limits.rate_limit_per_key else None,
            updated_at=now,
        )
    )
    if limits.max_running is not None:
        # The queue's slots: rows 1..N; rows past a lower limit stay, unused (a running job
        # may hold one).
        made = conn.execute(
            select(func.max(SLOTS.c.n)).where(SLOTS.c.queue == queue, SLOTS.c.slot_key == "")
        ).scalar()
        first = int(made or 0) + 1
        if first <= limits.max_running:
            conn.execute(
                insert(SLOTS),
                [
                    {"queue": queue, "slot_key": "", "n": n}
                    for n in range(first, limits.max_running + 1)
                ],
            )
    return limits


def clear_queue_limits(session_or_connection: Transaction, queue: str) -> bool:
    """Remove a queue's limits, in the caller's transaction (never commits): from the
    commit on, its jobs are claimed as fast as the workers go. True if it had limits."""
    check_name("queue", queue)
    return _clear(_connection_of(session_or_connection, "clear_queue_limits"), queue)


def _clear(conn: Connection, queue: str) -> bool:
    return bool(conn.execute(delete(LIMITS).where(LIMITS.c.queue == queue)).rowcount)


def queue_limits(bind: Engine | Transaction) -> dict[str, QueueLimits]:
    """Every queue's limits, by queue name; a queue without limits is absent. Read in the
    caller's transaction, or on a connection of an Engine's own."""
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return read_limits(conn)
    if not isinstance(bind, Session | scoped_session | Connection):
        raise NotATransactionError(
            f"queue_limits() needs a sqlalchemy Engine, Session or Connection, not "
            f"{type(bind).__name__}"
        )
    return read_limits(_connection_of(bind, "queue_limits"))


def read_limits(conn: Connection, queues: tuple[str, ...] | None = None) -> dict[str, QueueLimits]:
    """The limits of ``queues`` (all queues: None) that have any, read on ``conn``."""
    return {queue: limits for queue, (limits, _) in read_versions(conn, queues).items()}


def read_versions(
    conn: Connection, queues: tuple[str, ...] | None = None
) -> dict[str, tuple[QueueLimits, Any]]:
    """The limits of ``queues`` (all queues: None) that have any, each with the time they
    were set (their version: a claim that finds it unchanged may use the limits it read
    before)."""
    statement = select(LIMITS)
    if queues is not None:
        statement = statement.where(LIMITS.c.queue.in_(queues))
    return {row.queue: (limits_of(row), row.updated_at) for row in conn.execute(statement)}


def limits_of(row: Any) -> QueueLimits:
    """The limits a ``proletarian_queue_limit`` row holds."""

    def rate(count: int | None, seconds: float | None) -> Rate | None:
        return None if count is None or seconds is None else (int(count), float(seconds))

    return QueueLimits(
        row.max_running,
        row.max_running_per_key,
        rate(row.rate_count, row.rate_seconds),
        rate(row.key_rate_count, row.key_rate_seconds),
    )
