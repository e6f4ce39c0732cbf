"""A wrong call that ``mypy --strict`` must reject (tests/unit/test_task_typing.py)."""

from __future__ import annotations

from sqlalchemy.orm import Session

import sqla_proletarian as sp

handlers = sp.JobHandlers()


@handlers.task("send-email")
def send_email(to: str, *, urgent: bool = False) -> None: ...


def enqueue_wrong(session: Session) -> None:
    send_email.enqueue(session, 42, urgent="yes")
