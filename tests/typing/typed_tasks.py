"""Typed uses of tasks that ``mypy --strict`` must accept (tests/unit/test_task_typing.py)."""

from __future__ import annotations

import uuid
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

import sqla_proletarian as sp

handlers = sp.JobHandlers()


@handlers.task("send-email", queue="mail", retry=sp.RetryStrategy.exponential(5))
def send_email(to: str, subject: str = "hi", *, urgent: bool = False) -> int:
    return len(to)


@handlers.task
async def fetch(url: str) -> bytes:
    return url.encode()


def enqueue_some(session: Session) -> list[uuid.UUID]:
    sent: int = send_email("ada@example.com")
    assert sent
    first: uuid.UUID = send_email.enqueue(session, "ada@example.com", urgent=True)
    later = send_email.with_options(process_in=timedelta(minutes=5), priority=3)
    second = later.enqueue(session, to="bob@example.com", subject="yo")
    third = fetch.enqueue(session, "https://example.com")
    many = send_email.enqueue_many(session, [("cy@example.com",), {"to": "di@example.com"}])
    task: sp.Task[[str], Coroutine[Any, Any, bytes]] = fetch.with_options(queue="net")
    assert task.job_type
    job = sp.current_job()
    assert job.job_id
    return [first, second, third, *many]
