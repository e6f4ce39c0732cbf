"""The poll loop's decisions (module ``polling``), which the threaded and the asyncio worker
share: what a poller does after a poll that ran a job, an empty poll, a transient error and a
polling error; the short waits after an in-process enqueue; the idle watcher's hand-over; and
lease mode's poller that feeds the threads. No database: the runner and feeder are fakes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import exc as sa_exc

from sqla_proletarian import polling, wakeups
from sqla_proletarian.errors import transient_hint
from sqla_proletarian.logs import Outage
from sqla_proletarian.polling import (
    DUE_MARGIN,
    LISTENING_POLL_INTERVAL,
    RAN,
    Backoff,
    Feed,
    Idle,
    Poll,
    Polling,
    Stop,
)
from sqla_proletarian.worker import WorkerOptions

INTERVAL = 0.5
NOW = datetime(2030, 1, 1, tzinfo=UTC)


class Connections:
    def __init__(self) -> None:
        self.conn = object()
        self.closed = False
        self.released = 0

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        self.released += 1


class Runner:
    """Polls that give, in turn, the results of ``polls`` (an exception is raised)."""

    def __init__(self, polls: Iterable[bool | Exception] = (), due: datetime | None = None):
        self.polls = list(polls)
        self.due = due
        self.opened: list[Connections] = []
        self.on_claim: Callable[[], None] | None = None

    def open_connections(self) -> Connections:
        self.opened.append(Connections())
        return self.opened[-1]

    def sweep(self, conn: object) -> None:
        """The look for unsettled dependency rows before each poll: nothing to find here."""

    def process_one(self, connections: Connections) -> bool:
        result = self.polls.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    def next_due(self, conn: object) -> datetime | None:
        return self.due

    def next_due_on(self, connections: object) -> datetime | None:
        return self.due

    def now(self) -> datetime:
        return NOW


class Listener:
    def __init__(self, listening: bool) -> None:
        self.listening = listening


class Worker:
    """What a worker gives its Polling: who is polling now, and its wake-ups."""

    def __init__(self, runner: Runner, listener: Listener | None = None, **options: Any):
        self.runner = runner
        self.listener = listener
        self.current = "thread-1"
        self.wakes = 0
        options.setdefault("polling_interval", INTERVAL)
        await_result = options.pop("await_result", None)
        self.polling = Polling(
            WorkerOptions(**options),
            runner,  # type: ignore[arg-type]
            None,
            current=lambda: self.current,
            wake_all=self.wake_all,
            listener=lambda: self.listener,
            await_result=await_result,
        )

    def wake_all(self) -> None:
        self.wakes += 1


def transient() -> Exception:
    return sa_exc.TimeoutError("the pool has no free connection")


def missing_table() -> Exception:
    return sa_exc.ProgrammingError(
        "SELECT", {}, Exception('relation "proletarian_job" does not exist')
    )


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == name]


@pytest.fixture(autouse=True)
def _logs(caplog: pytest.LogCaptureFixture) -> Generator[None]:
    caplog.set_level(logging.DEBUG, logger="sqla_proletarian")
    yield


# --- a poll that ran a job, and transient errors ----------------------------------------------


def test_a_poll_that_ran_a_job_polls_again_at_once_on_the_same_connections() -> None:
    runner = Runner([True, True])
    poll = Poll(Worker(runner).polling)
    assert poll.step() == RAN
    assert poll.step() == RAN
    assert len(runner.opened) == 1 and not runner.opened[0].closed


def test_a_transient_error_backs_off_doubling_with_jitter_on_new_connections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner = Runner([transient(), transient(), transient(), True, transient()])
    poll = Poll(Worker(runner).polling)
    for backoff in (0.05, 0.1, 0.2):
        decision = poll.step()
        assert isinstance(decision, Backoff)
        assert backoff / 2 <= decision.pause <= backoff
    # One line for the outage's first error; its retries are counted, not logged.
    assert [r.retry_in for r in events(caplog, "transient-polling-error")] == [0.05]
    assert all(c.closed for c in runner.opened) and len(runner.opened) == 3
    # A poll that works forgets the backoff: the next error starts again from the minimum.
    assert poll.step() == RAN
    [back] = events(caplog, "database-reconnected")
    assert back.attempts == 3 and back.levelno == logging.INFO
    assert len(runner.opened) == 4
    decision = poll.step()
    assert isinstance(decision, Backoff) and decision.pause <= 0.05
    assert len(events(caplog, "transient-polling-error")) == 2  # a new outage
    assert not events(caplog, "polling-error")


def test_an_outage_logs_its_first_error_in_full_then_a_line_per_interval_then_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """However many pollers fail how often: the first error with the driver's further lines
    after the message, one ``database-still-unreachable`` per OUTAGE_REPORT_INTERVAL (how
    long, how many attempts), one ``database-reconnected`` with the outage's length."""
    now = [100.0]
    outage = Outage("transient-polling-error", clock=lambda: now[0], worker_id="w1")
    error = sa_exc.OperationalError(
        "SELECT 1", {}, Exception("connection refused\n\tIs the server running on port 1?")
    )
    for _ in range(40):  # 40 failed polls over 75 s: a line at 0, 30 and 60 s
        outage.failed(error, None, retry_in=5.0)
        now[0] += 75 / 40
    outage.ended()
    outage.ended()
    first = events(caplog, "transient-polling-error")
    still = events(caplog, "database-still-unreachable")
    back = events(caplog, "database-reconnected")
    assert len(first) == 1 and len(still) == 2 and len(back) == 1
    message = first[0].getMessage()
    assert message.splitlines()[0].startswith("transient-polling-error worker_id=w1 error=")
    assert message.splitlines()[1:] == ["\tIs the server running on port 1?"]
    assert "error=Exception: connection refused retry_in=5.0" in message
    assert "\\n" not in message and "\\t" not in message
    assert [(r.seconds, r.attempts) for r in still] == [(30.0, 17), (60.0, 33)]
    assert all(len(r.getMessage().splitlines()) == 1 for r in still)
    assert (back[0].seconds, back[0].attempts) == (75.0, 40)


def test_a_poll_in_flight_when_an_outage_began_does_not_end_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another thread's poll that began before the outage's first error and then worked
    ends nothing: the next failure is no second first error; a poll that began after the
    first error ends the outage."""
    now = [100.0]
    outage = Outage("transient-polling-error", clock=lambda: now[0], worker_id="w1")
    error = sa_exc.OperationalError("SELECT 1", {}, Exception("server closed the connection"))
    in_flight = outage.now()
    now[0] += 1.0
    outage.failed(error, None, retry_in=0.05)
    outage.ended(in_flight)
    now[0] += 0.1
    outage.failed(error, None, retry_in=0.05)
    assert len(events(caplog, "transient-polling-error")) == 1
    assert events(caplog, "database-reconnected") == []
    began = outage.now()
    outage.ended(began)
    [back] = events(caplog, "database-reconnected")
    assert back.attempts == 2


class ReadOnlySqlTransaction(Exception):
    """A PostgreSQL driver's refusal of a write on a standby (SQLSTATE 25006)."""

    sqlstate = "25006"


def test_a_read_only_server_gets_one_line_with_its_hint_however_long_it_refuses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker pointed at a standby: its first refused poll logs ``database-read-only``
    with what to change; the refusals after it, 75 s of them, log nothing (the server is
    not unreachable); the first poll that works logs ``database-writable``. Its LISTEN
    thread's outage leaves the line to the pollers."""
    now = [100.0]
    outage = Outage("transient-polling-error", clock=lambda: now[0], worker_id="w1")
    listener = Outage("listen-error", clock=lambda: now[0], report_read_only=False, queue="q")
    refused = sa_exc.InternalError(
        "SELECT ... FOR UPDATE",
        {},
        ReadOnlySqlTransaction("cannot execute SELECT FOR UPDATE in a read-only transaction"),
    )
    for _ in range(40):
        outage.failed(refused, transient_hint(refused), retry_in=5.0)
        listener.failed(refused)
        now[0] += 75 / 40
    outage.ended()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.event for r in warnings] == ["database-read-only"]
    [line] = warnings
    assert line.worker_id == "w1"
    assert line.error.endswith("cannot execute SELECT FOR UPDATE in a read-only transaction")
    assert "target_session_attrs=read-write" in line.hint and "primary" in line.hint
    [writable] = events(caplog, "database-writable")
    assert (writable.seconds, writable.attempts) == (75.0, 40)
    assert events(caplog, "database-reconnected") == []


def test_an_outage_that_turns_into_a_read_only_server_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failover seen through one URL: first the server is unreachable, then it answers
    read-only (a standby not yet promoted): the outage's first line, then one
    ``database-read-only`` at once, whatever the report interval."""
    now = [100.0]
    outage = Outage("transient-polling-error", clock=lambda: now[0], worker_id="w1")
    lost = sa_exc.OperationalError("SELECT 1", {}, Exception("server closed the connection"))
    refused = sa_exc.InternalError("SELECT 1", {}, ReadOnlySqlTransaction("read-only"))
    for error in (lost, lost, refused, refused, refused):
        outage.failed(error)
        now[0] += 1.0
    outage.ended()
    assert [getattr(r, "event", None) for r in caplog.records] == [
        "transient-polling-error",
        "database-read-only",
        "database-writable",
    ]


# --- empty polls: the watcher, the burst, LISTEN ------------------------------------------------


def test_the_first_idle_poller_watches_for_all_and_the_others_wait_for_a_wake_up() -> None:
    worker = Worker(Runner([False] * 4))
    first, second = Poll(worker.polling), Poll(worker.polling)
    assert first.step() == Idle(INTERVAL)
    worker.current = "thread-2"
    assert second.step() == Idle(None)
    assert worker.polling.watcher == "thread-1"
    # Only the watcher's claim (or end) hands the watch on, and it wakes every idle poller.
    worker.polling.end_watch()
    assert worker.wakes == 0 and worker.polling.watcher == "thread-1"
    worker.current = "thread-1"
    assert worker.runner.on_claim == worker.polling.end_watch  # a claim ends the watch
    worker.polling.end_watch()
    assert worker.wakes == 1 and worker.polling.watcher is None
    worker.current = "thread-2"
    assert second.step() == Idle(INTERVAL)
    assert worker.polling.watcher == "thread-2"


def test_a_poller_that_ends_hands_the_watch_on_and_closes_its_connections() -> None:
    worker = Worker(Runner([False]))
    poll = Poll(worker.polling)
    poll.step()
    poll.end()
    assert worker.polling.watcher is None and worker.wakes == 1
    assert worker.runner.opened[0].closed


def test_after_a_committing_in_process_enqueue_the_watcher_polls_again_after_short_waits() -> None:
    worker = Worker(Runner([False] * 7), Listener(listening=True))
    poll = Poll(worker.polling)
    worker.polling.enqueued(committing=False)
    assert worker.polling.burst == 0
    worker.polling.enqueued(committing=True)
    pauses = [poll.step() for _ in range(len(wakeups.BURST) + 1)]
    # Short waits first, even under LISTEN; then LISTEN's long wait.
    assert pauses == [Idle(p) for p in wakeups.BURST] + [Idle(LISTENING_POLL_INTERVAL)]


@pytest.mark.parametrize(
    ("due", "pause"),
    [
        (None, LISTENING_POLL_INTERVAL),
        (NOW + timedelta(seconds=2), 2 + DUE_MARGIN),
        (NOW + timedelta(hours=1), LISTENING_POLL_INTERVAL),
        (NOW - timedelta(seconds=1), INTERVAL),
    ],
)
def test_a_listening_watcher_waits_until_the_next_job_is_due(
    due: datetime | None, pause: float
) -> None:
    poll = Poll(Worker(Runner([False], due=due), Listener(listening=True)).polling)
    assert poll.step() == Idle(pytest.approx(pause))


def test_a_watcher_whose_listener_is_not_listening_polls_every_polling_interval() -> None:
    poll = Poll(Worker(Runner([False], due=None), Listener(listening=False)).polling)
    assert poll.step() == Idle(INTERVAL)


def test_in_lease_mode_each_idle_poller_waits_on_its_own_and_no_claim_ends_a_watch() -> None:
    worker = Worker(Runner([False, False]), lease_seconds=30)
    assert worker.runner.on_claim is None
    assert Poll(worker.polling).step() == Idle(INTERVAL)
    worker.current = "task-2"
    assert Poll(worker.polling).step() == Idle(INTERVAL)
    assert worker.polling.watcher is None


# --- polling errors ---------------------------------------------------------------------------


def test_a_polling_error_is_logged_with_its_hint_and_stops_the_worker_by_default(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = missing_table()
    runner = Runner([error])
    decision = Poll(Worker(runner).polling).step()
    assert decision == Stop(error)
    [record] = events(caplog, "polling-error")
    assert record.levelno == logging.ERROR
    assert record.worker_id == "proletarian[default]"
    assert record.error == repr(error)
    assert "job tables are missing" in record.hint
    assert runner.opened[0].closed


def test_on_polling_error_false_polls_again_after_the_pollers_own_pause() -> None:
    seen: list[Exception] = []

    def keep_polling(exc: Exception) -> bool:
        seen.append(exc)
        return False

    error = missing_table()
    worker = Worker(Runner([error, error]), on_polling_error=keep_polling)
    poll = Poll(worker.polling)
    assert poll.step() == Idle(INTERVAL)
    worker.polling.enqueued(committing=True)
    assert poll.step() == Idle(wakeups.BURST[0])
    assert seen == [error, error]
    assert len(worker.runner.opened) == 2


def test_an_on_polling_error_that_raises_stops_the_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(exc: Exception) -> bool:
        raise ValueError("broken handler")

    error = missing_table()
    assert Poll(Worker(Runner([error]), on_polling_error=broken).polling).step() == Stop(error)
    [record] = events(caplog, "polling-error-handler-error")
    assert "broken handler" in record.error


class Answer:
    """An awaitable that is no coroutine (so that leaving it unawaited warns nothing)."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __await__(self) -> Generator[None, None, bool]:
        return self.value
        yield


def test_an_awaitable_answer_is_awaited_where_the_worker_awaits_and_is_true_elsewhere() -> None:
    awaited: list[Answer] = []

    def await_result(answer: Answer) -> bool:
        awaited.append(answer)
        return answer.value

    error = missing_table()
    worker = Worker(
        Runner([error]), on_polling_error=lambda exc: Answer(False), await_result=await_result
    )
    assert Poll(worker.polling).step() == Idle(INTERVAL)
    assert [a.value for a in awaited] == [False]
    # The threaded worker awaits nothing: the answer object itself counts, and is true.
    threaded = Worker(Runner([error]), on_polling_error=lambda exc: Answer(False))
    assert Poll(threaded.polling).step() == Stop(error)


# --- lease mode's poller that feeds the threads ----------------------------------------------


class Feeder:
    """Room for ``rooms`` in turn; each claim takes the next of ``claims``."""

    def __init__(self, runner: Runner, rooms: Iterable[int], claims: Iterable[int | Exception]):
        self.runner = runner
        self.rooms = list(rooms)
        self.claims = list(claims)
        self.ended = False

    def room(self) -> int:
        return self.rooms.pop(0)

    def claim(self, connections: Connections) -> int:
        claimed = self.claims.pop(0)
        if isinstance(claimed, Exception):
            raise claimed
        return claimed

    def next_due_in(self, connections: Connections) -> float | None:
        due = self.runner.due
        return None if due is None else (due - NOW).total_seconds()

    def end(self) -> None:
        self.ended = True


def feed(
    rooms: Iterable[int],
    claims: Iterable[int | Exception],
    due: datetime | None = None,
    listener: Listener | None = None,
    **options: Any,
) -> tuple[Worker, Feeder, Feed]:
    runner = Runner(due=due)
    worker = Worker(runner, listener, lease_seconds=30, **options)
    feeder = Feeder(runner, rooms, claims)
    return worker, feeder, Feed(worker.polling, feeder)  # type: ignore[arg-type]


def test_the_feeding_poller_claims_again_at_once_while_a_thread_has_room() -> None:
    _, _, poller = feed(rooms=[4, 2, 2, 0], claims=[2, 2])
    assert poller.step() == RAN
    # Every thread busy: wait until one is free (it wakes the poller), at most the safety net.
    assert poller.step() == Idle(LISTENING_POLL_INTERVAL)


def test_the_feeding_poller_holds_no_connection_while_every_thread_is_busy() -> None:
    _, _, poller = feed(rooms=[0], claims=[])
    assert poller.step() == Idle(LISTENING_POLL_INTERVAL)
    assert poller.connections.released == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("due", "pause"),
    [
        (None, INTERVAL),
        (NOW + timedelta(seconds=0.1), 0.1 + DUE_MARGIN),
        (NOW + timedelta(seconds=5), INTERVAL),
        (NOW - timedelta(seconds=1), INTERVAL),
    ],
)
def test_a_drained_feeding_poller_waits_at_most_until_the_next_job_is_due(
    due: datetime | None, pause: float
) -> None:
    _, _, poller = feed(rooms=[4], claims=[0], due=due)
    assert poller.step() == Idle(pytest.approx(pause))


def test_a_drained_feeding_poller_waits_as_a_listening_watcher_under_listen() -> None:
    _, _, poller = feed(
        rooms=[4], claims=[0], due=NOW + timedelta(seconds=3), listener=Listener(True)
    )
    assert poller.step() == Idle(pytest.approx(3 + DUE_MARGIN))


def test_a_drained_feeding_poller_whose_listener_is_not_listening_polls_every_interval() -> None:
    """While LISTEN is not in effect (its connection is being made again), no notification
    can come: the poller waits the polling interval, not until the next due job."""
    _, _, poller = feed(
        rooms=[4], claims=[0], due=NOW + timedelta(seconds=3), listener=Listener(False)
    )
    assert poller.step() == Idle(INTERVAL)


def test_a_drained_feeding_poller_takes_the_short_waits_after_an_enqueue() -> None:
    worker, _, poller = feed(rooms=[4, 4], claims=[0, 0])
    worker.polling.enqueued(committing=True)
    assert [poller.step(), poller.step()] == [Idle(p) for p in wakeups.BURST[:2]]


def test_the_feeding_poller_backs_off_after_a_transient_error_and_keeps_its_connections() -> None:
    _, _, poller = feed(rooms=[4, 4, 0], claims=[transient(), 1])
    decision = poller.step()
    assert isinstance(decision, Backoff) and decision.pause <= 0.05
    assert poller.connections.closed  # type: ignore[attr-defined]
    assert poller.step() == Idle(LISTENING_POLL_INTERVAL) and poller.backoff == 0.0


def test_the_feeding_poller_after_a_polling_error_stops_or_waits_the_polling_interval() -> None:
    error = missing_table()
    _, feeder, poller = feed(rooms=[4], claims=[error])
    assert poller.step() == Stop(error)
    poller.end()
    assert feeder.ended
    worker, _, poller = feed(rooms=[4], claims=[error], on_polling_error=lambda exc: False)
    worker.polling.enqueued(committing=True)
    # Unlike a worker thread's poll, the burst's short waits do not apply here.
    assert poller.step() == Idle(INTERVAL)


def test_the_pause_rules_live_in_polling_and_the_threaded_worker_still_names_its_constant() -> None:
    from sqla_proletarian import worker

    assert worker.LISTENING_POLL_INTERVAL == polling.LISTENING_POLL_INTERVAL == 10.0
