"""What the dashboard's buttons do: each one call of the library's public API.

Retrying failures and pruning the archive are always there. Cancelling a queued job and
pausing or resuming a queue need the library's job control (``cancel_job``,
``pause_queue``, ``resume_queue``, ``paused_queues``); where the installed version has none,
``job_control()`` is False, the dashboard shows no such buttons, and ``paused()`` is None.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine

import sqla_proletarian

#: The job control functions the dashboard calls, when the library has them all.
JOB_CONTROL = ("cancel_job", "pause_queue", "resume_queue", "paused_queues")


def job_control() -> bool:
    """Whether the library can cancel jobs and pause queues."""
    return all(hasattr(sqla_proletarian, name) for name in JOB_CONTROL)


def retry(
    engine: Engine,
    job_ids: list[uuid.UUID] | None,
    *,
    queue: str | None = None,
    job_type: str | None = None,
) -> int:
    """Put failures back in the queue: these ids, or every failure of the queue and type."""
    return sqla_proletarian.retry_failed(engine, job_ids, queue=queue, job_type=job_type)


def prune(engine: Engine, older_than: timedelta, status: str | None) -> int:
    """Delete archived jobs that finished more than ``older_than`` ago."""
    return sqla_proletarian.prune_archive(
        engine,
        older_than=older_than,
        status=status,  # type: ignore[arg-type]
    )


def cancel(engine: Engine, job_id: uuid.UUID) -> bool:
    """Cancel a queued job; False when it was no longer there to cancel."""
    with engine.begin() as conn:
        return bool(_control("cancel_job")(conn, job_id))


def pause(engine: Engine, queue: str) -> None:
    """Stop the workers of a queue from claiming its jobs."""
    with engine.begin() as conn:
        _control("pause_queue")(conn, queue)


def resume(engine: Engine, queue: str) -> None:
    """Let the workers of a paused queue claim its jobs again."""
    with engine.begin() as conn:
        _control("resume_queue")(conn, queue)


def paused(engine: Engine) -> set[str] | None:
    """The paused queues; None when the library cannot pause queues."""
    if not job_control():
        return None
    return set(_control("paused_queues")(engine))


def _control(name: str) -> Any:
    return getattr(sqla_proletarian, name)
