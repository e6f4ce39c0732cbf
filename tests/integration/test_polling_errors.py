"""Polling errors that are not transient go to ``on_polling_error``: a true answer (the
default) stops the worker, a false one keeps it polling, and one that raises stops it.

The error here is a real one: the worker polls a database whose job tables were never created.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import archived_job, enqueue_committed, events, running, wait_for

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database


def _ok(job_type: str, payload: Any) -> None:
    return None


def test_by_default_a_polling_error_stops_the_worker_with_a_hint(
    empty_database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """Missing tables: the worker logs polling-error saying how to install them, then stops
    itself (and calls on_shutdown), as the original does."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    shutdowns: list[int] = []
    worker = sp.create_queue_worker(
        empty_database.engine(), _ok, polling_interval=0.02, on_shutdown=lambda: shutdowns.append(1)
    )
    with running(worker):
        assert worker.wait(10), "the worker kept running after a polling error"
    assert not worker.running
    assert shutdowns == [1]
    [error] = events(caplog.records, "polling-error")
    assert error.levelno == logging.ERROR
    assert "migrations" in error.hint and "create_all" in error.hint
    assert events(caplog.records, "transient-polling-error") == []


def test_on_polling_error_returning_false_keeps_the_worker_polling(
    empty_database: Database,
) -> None:
    """The handler sees each error; answering False, the worker polls again and runs jobs
    as soon as the tables exist."""
    engine = empty_database.engine()
    seen: list[Exception] = []
    lock = threading.Lock()

    def on_polling_error(exc: Exception) -> bool:
        with lock:
            seen.append(exc)
        return False

    worker = sp.create_queue_worker(
        engine, _ok, polling_interval=0.02, on_polling_error=on_polling_error
    )
    with running(worker):
        assert wait_for(lambda: len(seen) >= 2), "the worker did not poll again after an error"
        assert worker.running
        assert all(isinstance(exc, sa.exc.DBAPIError) for exc in seen), seen
        sp.metadata.create_all(engine)
        job_id = enqueue_committed(engine, "t", None)
        assert wait_for(lambda: archived_job(engine, job_id) is not None)
        assert worker.running
    assert worker.summary() == {"succeeded": 1, "retried": 0, "failed": 0}


@pytest.mark.parametrize("answer", ["true", "raises"])
def test_on_polling_error_returning_true_or_raising_stops_the_worker(
    empty_database: Database, caplog: pytest.LogCaptureFixture, answer: str
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    calls: list[Exception] = []

    def on_polling_error(exc: Exception) -> bool:
        calls.append(exc)
        if answer == "raises":
            raise RuntimeError("the polling-error handler is broken")
        return True

    worker = sp.create_queue_worker(
        empty_database.engine(), _ok, polling_interval=0.02, on_polling_error=on_polling_error
    )
    with running(worker):
        assert worker.wait(10), "the worker kept running"
    assert len(calls) == 1
    broken = events(caplog.records, "polling-error-handler-error")
    if answer == "raises":
        [record] = broken
        assert "the polling-error handler is broken" in record.error
    else:
        assert broken == []
