"""Polling errors that are not transient go to ``on_polling_error``: a true answer (the
default) stops the worker, a false one keeps it polling, and one that raises stops it.

The error here is a real one: the worker polls a database whose job tables were never created.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import archived_job, enqueue_committed, events, running, wait_for

import sqla_proletarian as sp
from sqla_proletarian import logs

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


# --- an outage: the database unreachable for a while -------------------------------------


class Gate:
    """A TCP forwarder to the test server that can refuse every connection for a while (its
    listening socket closed, the connections through it cut): the worker finds the database
    unreachable, while the shared server itself keeps running."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.listener: socket.socket | None = None
        self.links: list[socket.socket] = []
        self.lock = threading.Lock()
        self.open()

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 10
        while True:
            try:
                listener.bind(("127.0.0.1", self.port))
                break
            except OSError:  # the closed listener is not gone yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Refuse new connections and cut those open now."""
        assert self.listener is not None
        # shutdown() stops the listening at once (and wakes the accepting thread); a bare
        # close() could leave the socket listening while that thread waits in accept().
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.listener = None
        with self.lock:
            links, self.links = self.links, []
        for link in links:
            with contextlib.suppress(OSError):
                link.shutdown(socket.SHUT_RDWR)
            link.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                server = socket.create_connection(self.target)
            except OSError:
                return
            with self.lock:
                self.links += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


@pytest.mark.parametrize("mode", [{}, {"lease_seconds": 30.0}], ids=["transaction", "lease"])
def test_an_outage_is_logged_as_its_first_error_a_bounded_report_and_its_end(
    database: Database,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    mode: dict[str, Any],
) -> None:
    """The database refuses connections for 3 s while a worker of 3 threads polls: one
    ``transient-polling-error`` with the driver's text in full, at most one
    ``database-still-unreachable`` per report interval (1 s here), one
    ``database-reconnected`` with the outage's length; then jobs run again."""
    if database.backend == "sqlite":
        pytest.skip("SQLite has no server to become unreachable")
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    monkeypatch.setattr(logs, "OUTAGE_REPORT_INTERVAL", 1.0)
    url = database.url
    gate = Gate(url.host or "127.0.0.1", url.port or 0)
    direct = database.engine()
    through_gate = sa.create_engine(url.set(host="127.0.0.1", port=gate.port))
    worker = sp.create_queue_worker(
        through_gate, _ok, worker_threads=3, polling_interval=0.02, **mode
    )
    outage = 3.0
    with running(worker):
        before = enqueue_committed(direct, "before")
        assert wait_for(lambda: archived_job(direct, before) is not None, timeout=30)
        gate.cut()
        time.sleep(outage)
        gate.open()
        after = enqueue_committed(direct, "after")
        assert wait_for(lambda: archived_job(direct, after) is not None, timeout=30)
        assert wait_for(lambda: events(caplog.records, "database-reconnected"), timeout=10)
    through_gate.dispose()
    polls = [r for r in caplog.records if hasattr(r, "worker_id")]
    first = events(polls, "transient-polling-error")
    still = events(polls, "database-still-unreachable")
    [back] = events(polls, "database-reconnected")
    assert len(first) == 1, [r.getMessage() for r in first]
    assert "\n" not in first[0].error
    assert 1 <= len(still) <= outage / 1.0 + 1, [r.getMessage() for r in still]
    assert [r.seconds for r in still] == sorted(r.seconds for r in still)
    assert outage - 0.5 <= back.seconds < outage + 30
    assert back.attempts >= len(still) + 1
    # PostgreSQL's LISTEN thread reports its own outage the same way: one listen-error.
    assert len(events(caplog.records, "listen-error")) <= 1
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    bound = 2 * (outage / 1.0 + 1) + 4
    assert len(warnings) <= bound, "\n".join(r.getMessage() for r in warnings)
