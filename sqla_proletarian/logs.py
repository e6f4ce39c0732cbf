"""Logging: one named logger, events with stable names and structured ``extra`` fields."""

from __future__ import annotations

import logging
from typing import Any

#: The library's logger. Each record carries ``event`` and its fields (``worker_id``,
#: ``job_id``, ``job_type``, ``queue``, ``attempt``, ...) as attributes.
logger = logging.getLogger("sqla_proletarian")


def log_event(level: int, event: str, /, **fields: Any) -> None:
    """Log ``event`` with ``fields``, both in the message and as record attributes."""
    if not logger.isEnabledFor(level):
        return
    detail = " ".join(f"{key}={value}" for key, value in fields.items() if value is not None)
    logger.log(level, "%s %s", event, detail, extra={"event": event, **fields})
