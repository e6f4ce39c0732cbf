"""What a running job reports of its progress (``job.set_progress``), and how the worker
writes it.

``set_progress`` checks its arguments and hands the report to the worker's ProgressWriter;
it never waits for the database. The writer keeps the latest report of each job and writes
it to ``proletarian_progress`` on a connection of its own, committed at once (never in the
job's transaction), so that other connections see it while the job runs: at most once per
``progress_interval`` per job (reports in between replace each other), and once more when
the handler returns, so the last report is the one stored. The threaded worker writes in a
thread of its own, the asyncio worker in a task of its own: the handler and the event loop
go on meanwhile.

SQLite in transaction mode: the job's transaction holds the database's write lock while
its handler runs, so the reports are written once the handler has returned, when the lock
allows (after the job's transaction ends). A write that fails is logged
(``progress-write-failed``) and tried again at the next interval, a few times at most; it
never fails the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.util import await_only

from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.errors import InvalidProgressError
from sqla_proletarian.logs import log_event
from sqla_proletarian.statements.progress import write_progress
from sqla_proletarian.values import Clock

#: Seconds between two writes of one job's progress (the worker option ``progress_interval``).
DEFAULT_PROGRESS_INTERVAL = 1.0
#: Longest progress message kept, in characters (a longer one is cut, ending with "...").
MAX_MESSAGE_CHARS = 1000
#: Writes of one report tried before it is dropped (each failure is logged).
MAX_WRITE_ATTEMPTS = 3


def check_progress(fraction: object, message: object) -> tuple[float, str | None]:
    """A report's fraction as a float and its message cut to ``MAX_MESSAGE_CHARS``, or an
    InvalidProgressError that says what to give."""
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, int | float)
        or math.isnan(fraction)
        or not 0 <= fraction <= 1
    ):
        raise InvalidProgressError(
            f"set_progress(fraction={fraction!r}): give a number from 0 to 1 "
            "(0.25 for a quarter done)"
        )
    if message is not None and not isinstance(message, str):
        raise InvalidProgressError(f"set_progress(message={message!r}): give a string or None")
    if message is not None and len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return float(fraction), message


@dataclass
class _Report:
    """One job's latest report not yet written."""

    fraction: float
    message: str | None
    #: The handler has returned: write it without waiting for the interval.
    ended: bool = False
    attempts: int = 0


class ProgressWriter:
    """One runner's writer of its jobs' progress (see the module's docstring).

    ``spawn`` (the asyncio worker's) runs the writing in a task of the event loop, in a
    greenlet over the async engine's ``sync_engine``; without it, a thread writes.
    ``after_end_only``: write a job's reports only once its handler has returned (SQLite in
    transaction mode).
    """

    def __init__(
        self,
        engine: Engine,
        interval: float,
        clock: Clock,
        *,
        after_end_only: bool = False,
        spawn: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        self._engine = engine
        self._interval = interval
        self._clock = clock
        self._form = dialect_of(engine).archive_upsert
        self._after_end_only = after_end_only
        self._spawn = spawn
        self._lock = threading.Lock()
        #: Notified when the writing stops, none being left.
        self._idle = threading.Condition(self._lock)
        self._pending: dict[uuid.UUID, _Report] = {}
        #: The reports being written (one that fails is kept again, as it stands then).
        self._in_flight: dict[uuid.UUID, _Report] = {}
        #: When each running job's progress was last written (``time.monotonic``).
        self._written_at: dict[uuid.UUID, float] = {}
        self._writing = False
        self._wake = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_wake: asyncio.Event | None = None

    def report(self, job_id: uuid.UUID, fraction: object, message: object = None) -> None:
        """Keep ``job_id``'s report (checked) to be written; returns at once."""
        checked = check_progress(fraction, message)
        self._loop = self._loop or _running_loop()
        with self._lock:
            self._pending[job_id] = _Report(*checked)
        self._start()

    def ended(self, job_id: uuid.UUID) -> None:
        """The job's handler has returned: its last report, if not written yet, is written
        at once (when the lock allows, on SQLite in transaction mode)."""
        with self._lock:
            self._written_at.pop(job_id, None)
            report = self._pending.get(job_id) or self._in_flight.get(job_id)
            if report is None:
                return
            report.ended = True
        self._start()

    def wait_written(self, timeout: float = 10.0) -> bool:
        """Threaded: wait until every report kept is written (or dropped), at most
        ``timeout`` seconds; True if none is left (``process_next_job`` returns then)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._writing and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())
            return not self._writing

    # --- the writing ----------------------------------------------------------------------

    def _start(self) -> None:
        """Wake the writing, or start it (a thread, or a task of the event loop)."""
        with self._lock:
            starting = not self._writing
            self._writing = True
        if self._spawn is None:
            self._wake.set()
            if starting:
                threading.Thread(
                    target=self._write_all, name="progress-writer", daemon=True
                ).start()
            return
        loop = self._loop = self._loop or _running_loop()
        if loop is None:  # reported from another thread before the loop was known
            with self._lock:
                self._writing = self._writing and not starting
            return
        loop.call_soon_threadsafe(self._wake_task, starting)

    def _wake_task(self, starting: bool) -> None:
        """In the event loop: wake the writing task, or start it."""
        if self._async_wake is None:
            self._async_wake = asyncio.Event()
        self._async_wake.set()
        if starting:
            assert self._spawn is not None
            self._spawn(self._write_all)

    def _write_all(self) -> None:
        """Write what is due, wait for the next report or interval, until none is left."""
        while True:
            with self._lock:
                due, wait = self._take_due(time.monotonic())
                if not due and wait is None:
                    self._writing = False
                    self._idle.notify_all()
                    return
            for job_id, report in due:
                self._write(job_id, report)
            if not due:
                self._sleep(wait)

    def _take_due(self, now: float) -> tuple[list[tuple[uuid.UUID, _Report]], float | None]:
        """The reports to write now, and how long until the next one is due (None: no report
        is waiting, or none can be written before its handler returns)."""
        due: list[tuple[uuid.UUID, _Report]] = []
        wait: float | None = None
        for job_id, report in list(self._pending.items()):
            if not report.ended and self._after_end_only:
                continue
            at = self._written_at.get(job_id, -math.inf) + self._interval
            if report.ended or at <= now:
                due.append((job_id, report))
                del self._pending[job_id]
                self._in_flight[job_id] = report
                if not report.ended:
                    self._written_at[job_id] = now
            else:
                wait = at - now if wait is None else min(wait, at - now)
        return due, wait

    def _sleep(self, seconds: float | None) -> None:
        """Wait until ``seconds`` have passed or a report or an end wakes the writer."""
        if self._spawn is None:
            self._wake.wait(seconds)
            self._wake.clear()
            return
        wake = self._async_wake
        if wake is None:
            wake = self._async_wake = asyncio.Event()
        with_timeout = asyncio.wait_for(wake.wait(), seconds)
        with contextlib.suppress(TimeoutError):
            await_only(with_timeout)
        wake.clear()

    def _write(self, job_id: uuid.UUID, report: _Report) -> None:
        """Write one report, committed at once; a failure is logged and the report kept for
        another try (unless a newer one came, or it was tried enough)."""
        try:
            with self._engine.begin() as conn:
                for statement, params in write_progress(
                    self._form, job_id, report.fraction, report.message, self._clock()
                ):
                    conn.execute(statement, params)
        except Exception as exc:
            self._failed(job_id, report, exc)
        finally:
            with self._lock:
                if self._in_flight.get(job_id) is report:
                    del self._in_flight[job_id]

    def _failed(self, job_id: uuid.UUID, report: _Report, exc: Exception) -> None:
        """Log a failed write; keep the report for another try, unless a newer one came or
        it was tried enough (at once if its handler has returned, else at the interval)."""
        report.attempts += 1
        again = report.attempts < MAX_WRITE_ATTEMPTS
        log_event(
            logging.WARNING,
            "progress-write-failed",
            job_id=str(job_id),
            error=repr(exc),
            hint="the job goes on; "
            + (
                "the report is tried again (at once if its handler has returned)"
                if again
                else f"the report was dropped after {MAX_WRITE_ATTEMPTS} tries"
            ),
        )
        if again:
            with self._lock:
                self._pending.setdefault(job_id, report)
                if not report.ended:
                    self._written_at[job_id] = time.monotonic()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
