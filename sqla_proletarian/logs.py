"""Logging: one named logger, events with stable names and structured ``extra`` fields."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqla_proletarian.errors import driver_error, is_read_only

#: The library's logger. Each record carries ``event`` and its fields (``worker_id``,
#: ``job_id``, ``job_type``, ``queue``, ``attempt``, ...) as attributes.
logger = logging.getLogger("sqla_proletarian")

#: The logger of ``job-finished``, one INFO line per succeeded job: a child of ``logger``
#: (its records reach the same handlers), so setting its level to WARNING quiets just them.
finished_logger = logging.getLogger("sqla_proletarian.finished")

#: Fields of many lines, carried as record attributes only: the message stays one line.
NOT_IN_MESSAGE = frozenset({"traceback"})
#: Fields of many lines that plain-text logs show in full, on the lines after the message
#: (a driver's error text as it wrote it, once per outage).
AFTER_MESSAGE = frozenset({"detail"})


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
        if value is not None and key not in NOT_IN_MESSAGE and key not in AFTER_MESSAGE
    )
    after = "".join(f"\n{fields[key]}" for key in AFTER_MESSAGE if fields.get(key))
    target.log(level, "%s %s%s", event, detail, after, extra={"event": event, **fields})


#: Seconds between two ``database-still-unreachable`` lines while an outage lasts.
OUTAGE_REPORT_INTERVAL = 30.0


class Outage:
    """A run of transient database errors of one worker's pollers, or of its LISTEN thread
    (the ``fields`` of its lines say which), from the first error until an attempt works,
    logged in a few lines whatever its length and the number of threads failing: the first
    error in full (``first_event``, the driver's further lines after the message), at most
    one ``database-still-unreachable`` per ``OUTAGE_REPORT_INTERVAL`` (how long, how many
    attempts), and, if it took more than one attempt, one ``database-reconnected`` with
    its length.

    A server that answers but takes no writes (a standby: ``errors.is_read_only``) is not
    an outage of the network: it gets one ``database-read-only`` line (with ``hint``), no
    ``database-still-unreachable`` while it lasts, and ``database-writable`` once an attempt
    works. ``report_read_only=False`` leaves that line to others (the pollers say it for
    their worker's LISTEN thread)."""

    def __init__(
        self,
        first_event: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        report_read_only: bool = True,
        **fields: Any,
    ) -> None:
        self.first_event = first_event
        self.fields = fields
        self._clock = clock
        self._report_read_only = report_read_only
        self._lock = threading.Lock()
        #: When the outage began (None: no outage), its failed attempts, its last line.
        self.started: float | None = None
        self.attempts = 0
        self._reported = 0.0
        #: Whether the last failure was a read-only server's refusal, already reported.
        self.read_only = False

    def failed(self, exc: BaseException, hint: str | None = None, **extra: Any) -> None:
        """An attempt failed: log it if it begins the outage, if the last line about the
        outage is ``OUTAGE_REPORT_INTERVAL`` old, or if it is the first refusal of a
        read-only server (which is not logged again while the refusals go on)."""
        read_only = is_read_only(exc)
        with self._lock:
            now = self._clock()
            self.attempts += 1
            first = self.started is None
            if first:
                self.started = now
            if read_only:
                if self.read_only:
                    return
                self.read_only = first = True
            elif not first and now - self._reported < OUTAGE_REPORT_INTERVAL:
                return
            else:
                self.read_only = False
            self._reported = now
            seconds, attempts = now - (self.started or now), self.attempts
        # The driver's own text (without SQLAlchemy's statement): its first line in the
        # message, its further lines after it.
        cause = driver_error(exc) or exc
        lines = str(cause).strip().splitlines() or [""]
        error = f"{type(cause).__name__}: {lines[0]}"
        if read_only and not self._report_read_only:
            log_event(logging.DEBUG, "database-read-only", **self.fields, error=error)
            return
        if first:
            detail = "\n".join(lines[1:]) or None
            log_event(
                logging.WARNING,
                "database-read-only" if read_only else self.first_event,
                **self.fields,
                error=error,
                **extra,
                hint=hint,
                detail=detail,
            )
            return
        log_event(
            logging.WARNING,
            "database-still-unreachable",
            **self.fields,
            seconds=round(seconds, 1),
            attempts=attempts,
            error=error,
            hint=f"retrying; the next line comes once an attempt works, or in "
            f"{OUTAGE_REPORT_INTERVAL:g} s",
        )

    def now(self) -> float:
        """The outage's clock: when an attempt begins (see ended)."""
        return self._clock()

    def ended(self, began: float | None = None) -> None:
        """An attempt worked: the outage is over (logged if it took retries). An attempt
        that ``began`` before the outage's first error (another thread's, in flight as the
        database went away) ends nothing."""
        if self.started is None:  # the common case, read without the lock
            return
        with self._lock:
            if self.started is None or (began is not None and began < self.started):
                return
            seconds, attempts = self._clock() - self.started, self.attempts
            read_only, self.read_only = self.read_only, False
            self.started, self.attempts = None, 0
        if attempts > 1:
            log_event(
                logging.INFO,
                "database-writable" if read_only else "database-reconnected",
                **self.fields,
                seconds=round(seconds, 1),
                attempts=attempts,
            )
