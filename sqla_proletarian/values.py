"""What a new job is made of: validated names and times, the clock, and job ids.

Below both the models and enqueue, so ``Job(...)`` and ``enqueue()`` validate the same way.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from sqla_proletarian import telemetry
from sqla_proletarian.errors import InvalidJobError, PayloadSerializationError
from sqla_proletarian.serialization import DEFAULT_SERIALIZER, Serializer
from sqla_proletarian.types import MAX_NAME_LENGTH

#: The queue a job goes to and a worker polls when none is named.
DEFAULT_QUEUE = "default"

#: A job's priority when none is given; higher priorities run first.
DEFAULT_PRIORITY = 0
#: The priorities a job may have (stored negated in a SMALLINT, on every backend).
MIN_PRIORITY = -32767
MAX_PRIORITY = 32767

Clock = Callable[[], datetime]
JobIdStrategy = Callable[[], uuid.UUID]


def utc_now() -> datetime:
    """The default clock: the current time as an aware UTC datetime."""
    return datetime.now(UTC)


def uuid4() -> uuid.UUID:
    """The default job id strategy: a random UUID."""
    return uuid.uuid4()


#: uuid4()'s version and variant bits: cleared, then set.
_UUID4_CLEAR = ~((0xF << 76) | (0x3 << 62))
_UUID4_SET = (0x4 << 76) | (0x2 << 62)


def _uuid4s() -> Iterator[uuid.UUID]:
    """Random UUIDs as ``uuid4()`` makes them, their random bytes read a block at a time (a
    batch's ids without a system call each)."""
    while True:
        block = os.urandom(16 * 256)
        for start in range(0, len(block), 16):
            value = int.from_bytes(block[start : start + 16], "big")
            yield uuid.UUID(int=(value & _UUID4_CLEAR) | _UUID4_SET)


def uuid7() -> uuid.UUID:
    """A time-ordered UUID (RFC 9562 version 7): ids sort by creation time, to the millisecond."""
    millis = time.time_ns() // 1_000_000
    value = (millis & 0xFFFF_FFFF_FFFF) << 80
    value |= int.from_bytes(os.urandom(10), "big") & ((1 << 80) - 1)
    value &= ~(0xF << 76)
    value |= 0x7 << 76
    value &= ~(0x3 << 62)
    value |= 0x2 << 62
    return uuid.UUID(int=value)


def check_name(field: str, value: object) -> str:
    """A queue name or job type that every backend stores and compares exactly."""
    if not isinstance(value, str):
        raise InvalidJobError(field, f"{value!r} is a {type(value).__name__}; give a string")
    if not value:
        raise InvalidJobError(field, "is empty; give a non-empty string")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidJobError(
            field, f"is {len(value)} characters long; the limit is {MAX_NAME_LENGTH}"
        )
    if "\x00" in value:
        raise InvalidJobError(field, f"{value!r} contains NUL, which databases cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidJobError(
            field, f"{value!r} is not valid Unicode text (a lone surrogate?): {exc.reason}"
        ) from None
    return value


def check_aware(field: str, value: object) -> datetime:
    """An aware datetime, converted to UTC; naive ones are refused."""
    if not isinstance(value, datetime):
        raise InvalidJobError(field, f"{value!r} is not a datetime")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidJobError(
            field,
            f"{value!r} is naive; give an aware datetime, e.g. datetime.now(timezone.utc)",
        )
    return value.astimezone(UTC)


def check_priority(value: object) -> int:
    """A whole number from MIN_PRIORITY to MAX_PRIORITY; higher runs first."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidJobError(
            "priority", f"{value!r} is not a whole number; give an int (higher runs first)"
        )
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise InvalidJobError(
            "priority", f"{value} is out of range; give {MIN_PRIORITY} to {MAX_PRIORITY}"
        )
    return value


def check_unique_key(value: object) -> str | None:
    """None, or a key that every backend stores and compares exactly, like a queue name."""
    return None if value is None else check_name("unique_key", value)


def check_concurrency_key(value: object) -> str | None:
    """None, or a key that per-key limits count by (a name, as a queue's)."""
    return None if value is None else check_name("concurrency_key", value)


def schedule(
    now: datetime, process_at: datetime | None, process_in: timedelta | float | None
) -> datetime:
    """When a job may run: ``process_at`` wins over ``process_in``; the past means now."""
    if process_at is not None:
        return max(now, check_aware("process_at", process_at))
    if process_in is not None:
        if isinstance(process_in, bool) or not isinstance(process_in, timedelta | int | float):
            raise InvalidJobError(
                "process_in", f"{process_in!r}: give a timedelta or a number of seconds"
            )
        seconds = process_in.total_seconds() if isinstance(process_in, timedelta) else process_in
        if seconds != seconds or seconds in (float("inf"), float("-inf")):
            raise InvalidJobError("process_in", f"{process_in!r} is not a finite duration")
        return now + timedelta(seconds=max(0.0, float(seconds)))
    return now


def build_job_values(
    job_type: str,
    payload: Any = None,
    *,
    queue: str = DEFAULT_QUEUE,
    process_at: datetime | None = None,
    process_in: timedelta | float | None = None,
    priority: int = DEFAULT_PRIORITY,
    unique_key: str | None = None,
    job_id: uuid.UUID | None = None,
    serializer: Serializer | None = None,
    job_id_strategy: JobIdStrategy | None = None,
    clock: Clock | None = None,
    concurrency_key: str | None = None,
) -> dict[str, Any]:
    """The column values of a new job, validated; raises before anything is written. With
    OpenTelemetry, the enqueue's span is recorded here and its context kept in the row."""
    check_name("job_type", job_type)
    check_name("queue", queue)
    check_priority(priority)
    check_unique_key(unique_key)
    check_concurrency_key(concurrency_key)
    now = check_aware("clock()", (clock or utc_now)())
    text = (serializer or DEFAULT_SERIALIZER).dumps(payload)
    if job_id is None:
        job_id = (job_id_strategy or uuid4)()
    if not isinstance(job_id, uuid.UUID):
        raise InvalidJobError("job_id", f"{job_id!r} is not a uuid.UUID")
    due = schedule(now, process_at, process_in)
    row = _new_row(job_id, queue, job_type, text, now, due, priority, unique_key)
    row["concurrency_key"] = concurrency_key
    trace_context = telemetry.enqueue_context(queue, job_id=job_id, job_type=job_type)
    if trace_context is not None:
        row["trace_context"] = trace_context
    return row


def _new_row(
    job_id: uuid.UUID,
    queue: str,
    job_type: str,
    payload: str,
    now: datetime,
    due: datetime,
    priority: int,
    unique_key: str | None,
) -> dict[str, Any]:
    """A new job's column values."""
    return {
        "job_id": job_id,
        "queue": queue,
        "job_type": job_type,
        "payload": payload,
        "attempts": 0,
        "enqueued_at": now,
        "process_at": due,
        # Stored negated: the poll reads ascending order (see models).
        "run_order": -priority,
        "unique_key": unique_key,
        "concurrency_key": None,
    }


def build_many_job_values(
    jobs: Iterable[tuple[str, Any] | tuple[str, Any, str | None]],
    *,
    queue: str = DEFAULT_QUEUE,
    process_at: datetime | None = None,
    process_in: timedelta | float | None = None,
    priority: int = DEFAULT_PRIORITY,
    serializer: Serializer | None = None,
    job_id_strategy: JobIdStrategy | None = None,
    clock: Clock | None = None,
    concurrency_key: str | None = None,
) -> list[dict[str, Any]]:
    """The column values of many new jobs, ``(job_type, payload)`` pairs or
    ``(job_type, payload, unique_key)`` triples, validated as ``build_job_values`` does; what
    they share (queue, priority, time, schedule) is checked once. A bad job raises with its
    index (``jobs[3]``)."""
    check_name("queue", queue)
    check_priority(priority)
    check_concurrency_key(concurrency_key)
    now = check_aware("clock()", (clock or utc_now)())
    due = schedule(now, process_at, process_in)
    dumps = (serializer or DEFAULT_SERIALIZER).dumps
    make_id = _uuid4s().__next__ if job_id_strategy in (None, uuid4) else job_id_strategy
    checked: set[str] = set()
    rows = []
    for index, job in enumerate(jobs):
        fields = _job_fields(job)
        if fields is None:
            raise InvalidJobError(
                f"jobs[{index}]",
                f"{job!r} is not a (job_type, payload) pair or a (job_type, payload, "
                "unique_key) triple",
            )
        job_type, payload, unique_key = fields
        try:
            if job_type not in checked:
                checked.add(check_name("job_type", job_type))
            check_unique_key(unique_key)
            text = dumps(payload)
            job_id = make_id()
            if not isinstance(job_id, uuid.UUID):
                raise InvalidJobError("job_id", f"{job_id!r} is not a uuid.UUID")
        except PayloadSerializationError as exc:
            raise PayloadSerializationError(f"jobs[{index}]: {exc}", exc.payload) from exc
        except InvalidJobError as exc:
            raise InvalidJobError(f"jobs[{index}]", str(exc)) from exc
        row = _new_row(job_id, queue, job_type, text, now, due, priority, unique_key)
        row["concurrency_key"] = concurrency_key
        rows.append(row)
    # One span for the batch, whose jobs share its context.
    trace_context = telemetry.enqueue_context(queue, batch=len(rows)) if rows else None
    if trace_context is not None:
        for row in rows:
            row["trace_context"] = trace_context
    return rows


def _job_fields(job: Any) -> tuple[Any, Any, Any] | None:
    """``(job_type, payload, unique_key)`` of one of enqueue_many's jobs; None if malformed."""
    if isinstance(job, str | bytes):
        return None
    try:
        fields: tuple[Any, ...] = tuple(job)
    except TypeError:
        return None
    if len(fields) == 2:
        return fields[0], fields[1], None
    if len(fields) == 3:
        return fields[0], fields[1], fields[2]
    return None
