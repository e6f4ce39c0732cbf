"""Enqueue: add a job to the caller's own transaction, never committing it."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from sqla_proletarian.errors import InvalidJobError, NotATransactionError, ProletarianError
from sqla_proletarian.models import DEFAULT_QUEUE, Job
from sqla_proletarian.serialization import DEFAULT_SERIALIZER, Serializer
from sqla_proletarian.statements import insert_job
from sqla_proletarian.types import MAX_NAME_LENGTH

Clock = Callable[[], datetime]
JobIdStrategy = Callable[[], uuid.UUID]


def utc_now() -> datetime:
    """The default clock: the current time as an aware UTC datetime."""
    return datetime.now(UTC)


def uuid4() -> uuid.UUID:
    """The default job id strategy: a random UUID."""
    return uuid.uuid4()


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
    job_id: uuid.UUID | None = None,
    serializer: Serializer | None = None,
    job_id_strategy: JobIdStrategy | None = None,
    clock: Clock | None = None,
) -> dict[str, Any]:
    """The column values of a new job, validated; raises before anything is written."""
    check_name("job_type", job_type)
    check_name("queue", queue)
    now = check_aware("clock()", (clock or utc_now)())
    text = (serializer or DEFAULT_SERIALIZER).dumps(payload)
    if job_id is None:
        job_id = (job_id_strategy or uuid4)()
    if not isinstance(job_id, uuid.UUID):
        raise InvalidJobError("job_id", f"{job_id!r} is not a uuid.UUID")
    return {
        "job_id": job_id,
        "queue": queue,
        "job_type": job_type,
        "payload": text,
        "attempts": 0,
        "enqueued_at": now,
        "process_at": schedule(now, process_at, process_in),
    }


def enqueue(
    session_or_connection: Session | Connection,
    job_type: str,
    payload: Any = None,
    *,
    queue: str = DEFAULT_QUEUE,
    process_at: datetime | None = None,
    process_in: timedelta | float | None = None,
    **options: Any,
) -> uuid.UUID:
    """Add a job to the caller's transaction and return its id. Never commits.

    With a Session the job joins the unit of work (it is flushed with the rest); with a
    Connection it is inserted at once in the connection's transaction. Commit and the job
    will run; roll back and it never existed. Further keyword options: ``job_id``,
    ``serializer``, ``job_id_strategy``, ``clock``.
    """
    if isinstance(session_or_connection, Session):
        _check_session(session_or_connection)
        job = Job(
            job_type=job_type,
            payload=payload,
            queue=queue,
            process_at=process_at,
            process_in=process_in,
            **options,
        )
        session_or_connection.add(job)
        return job.job_id
    if isinstance(session_or_connection, Connection):
        _check_connection(session_or_connection)
        values = build_job_values(
            job_type,
            payload,
            queue=queue,
            process_at=process_at,
            process_in=process_in,
            **options,
        )
        session_or_connection.execute(*insert_job(values))
        job_id: uuid.UUID = values["job_id"]
        return job_id
    if isinstance(session_or_connection, Engine):
        raise NotATransactionError(
            "enqueue() was given an Engine, which has no transaction to join, so the job "
            "could not commit or roll back with your data. Pass the Session or Connection "
            "of the transaction the job belongs to (e.g. `with engine.begin() as conn: "
            "enqueue(conn, ...)`)."
        )
    raise NotATransactionError(
        f"enqueue() needs a sqlalchemy Session or Connection, not "
        f"{type(session_or_connection).__name__}"
    )


def _check_session(session: Session) -> None:
    if not session.is_active:
        raise ProletarianError(
            "the Session's transaction has failed and must be rolled back first "
            "(call session.rollback()); the job was not added"
        )


def _check_connection(connection: Connection) -> None:
    if connection.closed:
        raise ProletarianError(
            "the Connection is closed; enqueue inside an open transaction "
            "(e.g. `with engine.begin() as conn:`)"
        )
    if connection.invalidated:
        raise ProletarianError(
            "the Connection was invalidated (its database connection was lost); roll back "
            "and enqueue again in a new transaction"
        )
