"""Logging: one named logger, events with stable names and structured ``extra`` fields."""

from __future__ import annotations

import logging
from typing import Any

#: The library's logger. Each record carries ``event`` and its fields (``worker_id``,
#: ``job_id``, ``job_type``, ``queue``, ``attempt``, ...) as attributes.
logger = logging.getLogger("sqla_proletarian")

#: The logger of ``job-finished``, one INFO line per succeeded job: a child of ``logger``
#: (its records reach the same handlers), so setting its level to WARNING quiets just them.
finished_logger = logging.getLogger("sqla_proletarian.finished")

#: Fields of many lines, carried as record attributes only: the message stays one line.
NOT_IN_MESSAGE = frozenset({"traceback"})


def log_event(level: int, event: str, /, **fields: Any) -> None:
    """Log ``event`` with ``fields`` as record attributes, and in the message but for
    ``NOT_IN_MESSAGE``."""
    log_to(logger, level, event, **fields)


def log_to(target: logging.Logger, level: int, event: str, /, **fields: Any) -> None:
    """``log_event`` through ``target``, a child of the library's logger."""
    if not target.isEnabledFor(level):
        return
    detail = " ".join(
        f"{key}={value}"
        for key, value in fields.items()
        if value is not None and key not in NOT_IN_MESSAGE
    )
    target.log(level, "%s %s", event, detail, extra={"event": event, **fields})
