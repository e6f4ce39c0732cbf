"""A worker's life and death: it runs once, says why it stopped by itself, can be stopped from
any thread (its own callbacks included), starts no job once stop() is called, and ends its
process cleanly on a signal wherever the main thread is at that moment."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import archived_job, count, enqueue_committed, events, job_row, running, wait_for

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database

PROGRAM = Path(__file__).parent / "programs" / "lifecycle_worker.py"
LIBRARY_LOGGER = logging.getLogger("sqla_proletarian")


def _ok(job_type: str, payload: Any) -> None:
    return None


class _OnEvent(logging.Handler):
    """Calls ``action`` in the logging thread when the library logs ``event``."""

    def __init__(self, event: str, action: Callable[[], None]) -> None:
        super().__init__(logging.DEBUG)
        self.event = event
        self.action = action

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == self.event:
            self.action()


@pytest.fixture
def on_event() -> Iterator[Callable[[str, Callable[[], None]], None]]:
    """Install ``_OnEvent`` handlers on the library's logger (INFO and up) for one test."""
    installed: list[logging.Handler] = []
    level = LIBRARY_LOGGER.level
    LIBRARY_LOGGER.setLevel(logging.INFO)

    def install(event: str, action: Callable[[], None]) -> None:
        handler = _OnEvent(event, action)
        LIBRARY_LOGGER.addHandler(handler)
        installed.append(handler)

    try:
        yield install
    finally:
        for handler in installed:
            LIBRARY_LOGGER.removeHandler(handler)
        LIBRARY_LOGGER.setLevel(level)


# --- a worker that stopped by itself says why (5, 13) ----------------------------------------


def test_a_worker_stopped_by_a_polling_error_is_not_running_and_holds_the_error(
    empty_database: Database,
) -> None:
    """Missing tables: on_polling_error says stop; the worker is down and tells why."""
    seen: list[Exception] = []

    def on_polling_error(exc: Exception) -> bool:
        seen.append(exc)
        return True

    worker = sp.create_queue_worker(
        empty_database.engine(), _ok, polling_interval=0.02, on_polling_error=on_polling_error
    )
    with running(worker):
        assert worker.wait(10), "the worker kept running after the polling error"
        assert not worker.running
        assert isinstance(worker.exception, sa.exc.DBAPIError), worker.exception
        assert seen == [worker.exception]
    assert worker.exception is seen[0], "stop() afterwards keeps the reason"


def test_a_worker_whose_thread_died_of_a_base_exception_holds_it(engine: sa.Engine) -> None:
    enqueue_committed(engine, "exits", None)

    def handler(job_type: str, payload: Any) -> None:
        raise SystemExit(3)

    worker = sp.create_queue_worker(engine, handler, polling_interval=0.02)
    with running(worker):
        assert worker.wait(10), "the worker kept running after its thread died"
        assert not worker.running
        assert isinstance(worker.exception, SystemExit)
        assert worker.exception.code == 3


def test_exception_is_none_while_running_and_after_a_normal_stop(engine: sa.Engine) -> None:
    job_id = enqueue_committed(engine, "t", None)
    worker = sp.create_queue_worker(engine, _ok, polling_interval=0.02)
    assert worker.exception is None
    with running(worker):
        assert wait_for(lambda: archived_job(engine, job_id) is not None)
        assert worker.exception is None
    assert not worker.running and worker.wait(0)
    assert worker.exception is None


def test_a_worker_thread_that_dies_outside_a_job_stops_the_worker_visibly(
    empty_database: Database, on_event: Callable[[str, Callable[[], None]], None]
) -> None:
    """An error escaping the polling loop itself (here: a log handler that raises while the
    worker logs a polling error it would otherwise survive) ends the thread; the worker
    must not stay 'running' with no thread polling."""

    def broken_log_handler() -> None:
        raise RuntimeError("the log handler is broken")

    on_event("polling-error", broken_log_handler)
    worker = sp.create_queue_worker(
        empty_database.engine(), _ok, polling_interval=0.02, on_polling_error=lambda exc: False
    )
    with running(worker):
        assert worker.wait(10), "the worker looks alive with no thread polling"
        assert not worker.running
        assert isinstance(worker.exception, RuntimeError)
        assert str(worker.exception) == "the log handler is broken"


# --- stop() from anywhere (11) ----------------------------------------------------------------


def _stop_in_a_thread(worker: sp.QueueWorker) -> threading.Thread:
    thread = threading.Thread(target=worker.stop, daemon=True)
    thread.start()
    return thread


def test_on_shutdown_may_call_stop(engine: sa.Engine) -> None:
    calls: list[str] = []

    def on_shutdown() -> None:
        calls.append("on_shutdown")
        worker.stop()
        calls.append("stop returned")

    worker = sp.create_queue_worker(engine, _ok, polling_interval=0.02, on_shutdown=on_shutdown)
    worker.start()
    stopping = _stop_in_a_thread(worker)
    stopping.join(10)
    assert not stopping.is_alive(), "stop() deadlocked on on_shutdown's stop()"
    assert calls == ["on_shutdown", "stop returned"]
    assert not worker.running and worker.exception is None


def test_a_handler_may_call_stop_and_its_job_still_finishes_first(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """stop() from a worker thread asks for the stop and returns at once; the stop waits for
    that very job, and on_shutdown comes after its outcome is recorded."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    job_id = enqueue_committed(engine, "stops", None)
    took: list[float] = []
    shutdowns: list[str | None] = []

    def handler(job_type: str, payload: Any) -> None:
        began = time.monotonic()
        worker.stop()
        took.append(time.monotonic() - began)

    def on_shutdown() -> None:
        done = archived_job(engine, job_id)
        shutdowns.append(done.status if done else None)

    worker = sp.create_queue_worker(
        engine, handler, polling_interval=0.02, await_termination_timeout=5, on_shutdown=on_shutdown
    )
    with running(worker):
        assert worker.wait(10)
    assert len(took) == 1 and took[0] < 1, took
    assert shutdowns == ["success"], "on_shutdown before the job's outcome was recorded"
    assert events(caplog.records, "queue-worker-shutdown-timeout") == []
    assert worker.exception is None
    assert worker.summary() == {"succeeded": 1, "retried": 0, "failed": 0}


def test_stop_from_several_threads_returns_in_each_once_the_stop_is_complete(
    engine: sa.Engine,
) -> None:
    enqueue_committed(engine, "slow", None)
    started = threading.Event()
    shutdowns: list[int] = []

    def handler(job_type: str, payload: Any) -> None:
        started.set()
        time.sleep(0.4)

    worker = sp.create_queue_worker(
        engine, handler, polling_interval=0.02, on_shutdown=lambda: shutdowns.append(1)
    )
    worker.start()
    assert started.wait(10)
    seen: list[tuple[int, bool]] = []

    def stop_and_look() -> None:
        worker.stop()
        seen.append((len(shutdowns), worker.running))

    callers = [threading.Thread(target=stop_and_look) for _ in range(3)]
    for caller in callers:
        caller.start()
    worker.stop()
    for caller in callers:
        caller.join(10)
    assert seen == [(1, False)] * 3, "a stop() returned before the stop was complete"
    assert shutdowns == [1]
    assert worker.summary()["succeeded"] == 1


# --- no job after stop() (12) -----------------------------------------------------------------


def test_no_job_starts_after_stop_even_in_a_thread_that_was_waiting_to_claim(
    database: Database, on_event: Callable[[str, Callable[[], None]], None]
) -> None:
    """Two threads, one stuck in a job; the other waits for SQLite's claim lock, or on a
    server for a pool connection (pool of one). The first job is released while stop() is
    only beginning: neither thread may start the second job, queued all along."""
    if database.backend == "sqlite":
        engine = database.engine()
    else:
        engine = database.engine(pool_size=1, max_overflow=0)
    first = enqueue_committed(engine, "stuck", None)
    second = enqueue_committed(engine, "next", None)
    started: list[uuid.UUID] = []
    stuck, release = threading.Event(), threading.Event()

    def handler(job: sp.JobContext) -> None:
        started.append(job.job_id)
        if job.job_type == "stuck":
            stuck.set()
            release.wait(20)

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        worker_threads=2,
        polling_interval=0.02,
        max_unclean_ends=None,  # one connection per thread
        worker_id=f"late-{uuid.uuid4().hex[:8]}",
    )

    def threads_alive() -> int:
        return sum(t.name.startswith(f"{worker.worker_id}-") for t in threading.enumerate())

    def release_the_stuck_job() -> None:
        release.set()
        # Until the second job starts (the bug) or both threads have ended (the fix).
        wait_for(lambda: second in started or threads_alive() == 0, timeout=5)

    worker.start()
    try:
        assert stuck.wait(10)
        on_event("shutting-down", release_the_stuck_job)
        worker.stop()
    finally:
        release.set()
    assert started == [first], "a job started after stop()"
    done = archived_job(engine, first)
    assert done is not None and done.status == "success"
    row = job_row(engine, second)
    assert row is not None and row.attempts == 0


# --- one life only; a polling interval > 0 (14) ---------------------------------------------


def test_a_stopped_worker_cannot_be_restarted(engine: sa.Engine) -> None:
    job_id = enqueue_committed(engine, "t", None)
    worker = sp.create_queue_worker(engine, _ok, polling_interval=0.02)
    with running(worker):
        assert wait_for(lambda: archived_job(engine, job_id) is not None)
    with pytest.raises(sp.ConfigurationError, match=r"cannot be restarted.*create a new one"):
        worker.start()
    assert not worker.running

    never_started = sp.create_queue_worker(engine, _ok, polling_interval=0.02)
    never_started.stop()
    later = enqueue_committed(engine, "t", None)
    with pytest.raises(sp.ConfigurationError, match="cannot be restarted"):
        never_started.start()
    assert not never_started.running
    assert count(engine, sp.Job) == 1 and job_row(engine, later) is not None


@pytest.mark.parametrize("interval", [0, 0.0, -1])
def test_a_polling_interval_of_zero_or_less_is_refused(engine: sa.Engine, interval: float) -> None:
    with pytest.raises(sp.ConfigurationError, match=r"polling_interval .*> 0"):
        sp.create_queue_worker(engine, _ok, polling_interval=interval)


# --- signals (11, 15): worker processes -----------------------------------------------------


class Program:
    """The lifecycle worker program, its events file, and its standard error read as it
    comes (so a test can wait for a line, and a full pipe never blocks it unless wanted)."""

    def __init__(self, database: Database, tmp_path: Path, mode: str, *args: str) -> None:
        self.events_file = tmp_path / "events.log"
        url = database.url.render_as_string(hide_password=False)
        self.process = subprocess.Popen(
            [sys.executable, str(PROGRAM), url, str(self.events_file), mode, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._stderr = bytearray()
        self._reader: threading.Thread | None = None

    def events(self) -> list[str]:
        if not self.events_file.exists():
            return []
        return self.events_file.read_text().splitlines()

    def wait_event(self, line: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while line not in self.events():
            assert self.process.poll() is None, self.finish()[1]
            assert time.monotonic() < deadline, f"no {line!r} in {self.events()}"
            time.sleep(0.02)

    def read_stderr(self) -> None:
        """Read standard error from now on, in a thread of the test."""
        assert self.process.stderr is not None
        stream = self.process.stderr

        def read() -> None:
            while chunk := stream.read1(65536):
                self._stderr += chunk

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def stderr_text(self) -> str:
        return self._stderr.decode(errors="replace")

    def send(self, signum: int) -> None:
        self.process.send_signal(signum)

    def finish(self, timeout: float = 15) -> tuple[int | None, str]:
        """The exit status and standard error; None if it had not ended within ``timeout``
        (then it is killed: a deadlocked signal handler hangs until SIGKILL)."""
        if self._reader is None:
            self.read_stderr()
        try:
            code: int | None = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            self.process.kill()
            self.process.wait(10)
        assert self._reader is not None
        self._reader.join(10)
        return code, self.stderr_text()


@pytest.fixture
def program(database: Database, tmp_path: Path) -> Iterator[Callable[..., Program]]:
    started: list[Program] = []

    def start(mode: str, *args: str) -> Program:
        started.append(Program(database, tmp_path, mode, *args))
        return started[-1]

    try:
        yield start
    finally:
        for each in started:
            if each.process.poll() is None:
                each.process.kill()
            each.finish(10)
            assert each.process.stderr is not None
            each.process.stderr.close()


def _exited_by_sigterm_with_summary(program: Program, code: int | None, stderr: str) -> None:
    assert code is not None, f"hung after SIGTERM until killed; events {program.events()}"
    assert code == -signal.SIGTERM, stderr
    pid = program.process.pid
    assert f"lifecycle-{pid}: SIGTERM received, finishing running jobs..." in stderr
    assert f"lifecycle-{pid} stopped: " in stderr
    assert "reentrant call" not in stderr
    assert "Traceback" not in stderr, stderr


def test_sigterm_while_the_main_thread_is_inside_stop_exits_by_the_signal(
    program: Callable[..., Program],
) -> None:
    worker = program("in-stop")
    code, stderr = worker.finish()
    _exited_by_sigterm_with_summary(worker, code, stderr)
    assert "main-returned" not in worker.events()


def test_sigterm_while_the_main_thread_is_inside_summary_exits_by_the_signal(
    program: Callable[..., Program], engine: sa.Engine
) -> None:
    """The signal comes while summary() holds its lock, during a job: the handler returns at
    once (summary() returns), and the job finishes before the exit."""
    job_id = enqueue_committed(engine, "slow", None)
    worker = program("in-summary", "--hang-seconds", "0.6")
    code, stderr = worker.finish()
    _exited_by_sigterm_with_summary(worker, code, stderr)
    assert "stopped: 1 succeeded, 0 retried, 0 failed" in stderr
    events = worker.events()
    assert "summary-returned" in events, "the signal handler blocked the main thread"
    assert events.index("summary-returned") < events.index(f"end {job_id}")


def test_sigterm_when_on_shutdown_calls_stop_exits_by_the_signal(
    program: Callable[..., Program],
) -> None:
    worker = program("on-shutdown-stops")
    worker.wait_event("ready")
    worker.send(signal.SIGTERM)
    code, stderr = worker.finish()
    _exited_by_sigterm_with_summary(worker, code, stderr)
    assert "on-shutdown-returned" in worker.events()


def test_sigterm_runs_atexit_handlers_and_flushes_logging_then_exits_by_the_signal(
    program: Callable[..., Program], engine: sa.Engine, tmp_path: Path
) -> None:
    """The running job finishes; the main thread, in wait(), never returns to race the
    signal's exit; atexit handlers ran and buffered log records were written out."""
    job_id = enqueue_committed(engine, "slow", None)
    atexit_file, log_file = tmp_path / "atexit.txt", tmp_path / "worker.log"
    worker = program(
        "wait",
        *("--hang-seconds", "0.3", "--atexit-file", str(atexit_file)),
        *("--log-file", str(log_file)),
    )
    worker.wait_event(f"start {job_id}")
    worker.send(signal.SIGTERM)
    code, stderr = worker.finish()
    _exited_by_sigterm_with_summary(worker, code, stderr)
    assert "stopped: 1 succeeded, 0 retried, 0 failed" in stderr
    assert f"end {job_id}" in worker.events()
    assert "main-returned" not in worker.events(), "wait() returned during the signal's exit"
    assert atexit_file.read_text() == "atexit ran\n"
    logged = log_file.read_text()
    assert "shutting-down" in logged and "completed-shutdown" in logged


def test_sigterm_while_the_main_thread_writes_to_stderr_exits_by_the_signal(
    program: Callable[..., Program],
) -> None:
    """The signal comes while the main thread is inside a write to standard error, whose
    stream refuses a write from the same thread meanwhile (as io's buffered writer does): a
    handler that printed would fail with "reentrant call"."""
    worker = program("writing")
    worker.wait_event("writing")
    worker.send(signal.SIGTERM)
    code, stderr = worker.finish()
    _exited_by_sigterm_with_summary(worker, code, stderr)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_second_signal_while_jobs_finish_exits_at_once(
    program: Callable[..., Program], engine: sa.Engine, second: signal.Signals
) -> None:
    job_id = enqueue_committed(engine, "slow", None)
    worker = program("wait", "--hang-seconds", "60")
    worker.wait_event(f"start {job_id}")
    worker.read_stderr()
    worker.send(signal.SIGTERM)
    assert wait_for(lambda: "received, finishing running jobs" in worker.stderr_text())
    began = time.monotonic()
    worker.send(second)
    code, stderr = worker.finish()
    assert code == -second, stderr
    assert time.monotonic() - began < 5
    assert f"end {job_id}" not in worker.events()
    assert "Traceback" not in stderr, stderr
