"""Periodic jobs: however many worker processes run, each occurrence is enqueued once, at its
time; after all workers were down, one catch-up occurrence is enqueued, not a burst; a bad
schedule is a ConfigurationError when the worker is created."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import FakeClock, running, wait_for

import sqla_proletarian as sp
from sqla_proletarian.periodic import PeriodicJob

PROGRAM = Path(__file__).parent / "programs" / "periodic_worker.py"
JOB = sp.Job.__table__
ARCHIVE = sp.ArchivedJob.__table__
#: A whole second, so that the first occurrence a worker sees is T0 itself.
T0 = datetime(2040, 2, 29, 12, 0, 0, tzinfo=UTC)


def occurrences(engine: sa.Engine, job_type: str = "tick") -> list[datetime]:
    """The process_at (the occurrence) of every job of ``job_type``, queued or archived."""
    with engine.connect() as conn:
        queued = conn.execute(sa.select(JOB.c.process_at).where(JOB.c.job_type == job_type))
        done = conn.execute(sa.select(ARCHIVE.c.process_at).where(ARCHIVE.c.job_type == job_type))
        return sorted([*queued.scalars(), *done.scalars()])


class Fleet:
    """Worker processes sharing a clock file; stopped (SIGTERM) when the test ends."""

    def __init__(self, url: str, clock_file: Path) -> None:
        self.url = url
        self.clock_file = clock_file
        self.processes: list[subprocess.Popen[str]] = []

    def set_clock(self, when: datetime) -> None:
        staged = self.clock_file.with_suffix(".new")
        staged.write_text(when.isoformat())
        os.replace(staged, self.clock_file)

    def start(self, count: int) -> None:
        started = [
            subprocess.Popen(
                [sys.executable, str(PROGRAM), self.url, str(self.clock_file), "1"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(count)
        ]
        self.processes.extend(started)
        for process in started:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "ready", process.stderr

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
        self.processes = []


@pytest.fixture
def fleet(database: Any, tmp_path: Path) -> Iterator[Fleet]:
    workers = Fleet(database.url.render_as_string(hide_password=False), tmp_path / "clock")
    try:
        yield workers
    finally:
        workers.stop()


def test_three_worker_processes_enqueue_each_occurrence_once_and_one_catch_up_after_downtime(
    database: Any, fleet: Fleet
) -> None:
    """Three processes with ``every=1 s`` and a shared clock moved a second at a time: each
    occurrence is enqueued exactly once, within a few polls; stopped for ten periods and
    started again, they enqueue the latest missed occurrence once."""
    engine = database.engine()
    fleet.set_clock(T0 + timedelta(milliseconds=500))
    fleet.start(3)
    # First sight: the schedule is recorded at T0 and starts with its next occurrence.
    assert wait_for(lambda: len(records(engine)) == 1, timeout=10)
    assert occurrences(engine) == []
    expected: list[datetime] = []
    for step in range(1, 5):
        fleet.set_clock(T0 + timedelta(seconds=step, milliseconds=500))
        expected.append(T0 + timedelta(seconds=step))
        assert wait_for(lambda: len(occurrences(engine)) >= len(expected), timeout=5)
        time.sleep(0.15)  # every worker has polled a few times since
        assert occurrences(engine) == expected

    fleet.stop()
    fleet.set_clock(T0 + timedelta(seconds=14, milliseconds=500))
    fleet.start(3)
    expected.append(T0 + timedelta(seconds=14))
    assert wait_for(lambda: len(occurrences(engine)) >= len(expected), timeout=5)
    time.sleep(0.3)
    assert occurrences(engine) == expected
    assert records(engine) == [("default:tick:every 1s", T0 + timedelta(seconds=14))]


def records(engine: sa.Engine) -> list[tuple[str, datetime]]:
    """Each schedule's record: its name and last enqueued occurrence."""
    table = sp.models.PeriodicSchedule.__table__
    with engine.connect() as conn:
        rows = conn.execute(sa.select(table.c.name, table.c.last_occurrence))
        return [(name, last) for name, last in rows]


def test_a_cron_schedule_in_a_time_zone_enqueues_its_occurrences_with_their_time(
    engine: sa.Engine,
) -> None:
    """A worker with a fake clock and ``cron='0 9 * * *'`` in Europe/Oslo: nothing at first
    sight, one job at 09:00 local (08:00 UTC in winter) with that time as its process_at,
    and after five missed days one job, for the latest."""
    clock = FakeClock(datetime(2040, 1, 10, 7, 0, tzinfo=UTC))
    daily = PeriodicJob("report", cron="0 9 * * *", timezone="Europe/Oslo", payload={"p": 1})
    ran: list[Any] = []
    worker = sp.create_queue_worker(
        engine,
        lambda job_type, payload: ran.append(payload),
        clock=clock,
        polling_interval=0.01,
        periodic_jobs=[daily],
    )
    with running(worker):
        assert wait_for(lambda: len(records(engine)) == 1)
        clock.set(datetime(2040, 1, 10, 7, 59, 59, tzinfo=UTC))
        time.sleep(0.05)
        assert occurrences(engine, "report") == []
        # An idle watcher under LISTEN sleeps until the next occurrence by the clock (up to
        # 10 s): a clock that jumps ahead wakes it, as time passing would.
        clock.set(datetime(2040, 1, 10, 8, 0, 0, 1, tzinfo=UTC))
        worker.wake()
        assert wait_for(lambda: len(ran) == 1)
        clock.set(datetime(2040, 1, 15, 12, 0, tzinfo=UTC))
        worker.wake()
        assert wait_for(lambda: len(ran) == 2)
        time.sleep(0.05)
    assert ran == [{"p": 1}, {"p": 1}]
    assert occurrences(engine, "report") == [
        datetime(2040, 1, 10, 8, 0, tzinfo=UTC),
        datetime(2040, 1, 15, 8, 0, tzinfo=UTC),
    ]


# --- schedules, checked without a database ---------------------------------------------------


def test_every_counts_whole_periods_from_the_epoch_and_cron_follows_the_time_zone() -> None:
    hourly = PeriodicJob("t", every=timedelta(hours=1))
    now = datetime(2040, 3, 1, 10, 59, 59, tzinfo=UTC)
    assert hourly.latest(now) == datetime(2040, 3, 1, 10, tzinfo=UTC)
    assert hourly.latest(now.replace(minute=0, second=0)) == datetime(2040, 3, 1, 10, tzinfo=UTC)
    assert hourly.following(datetime(2040, 3, 1, 10, tzinfo=UTC)) == now.replace(
        hour=11, minute=0, second=0
    )
    oslo = PeriodicJob("t", cron="30 2 * * *", timezone="Europe/Oslo")
    summer = datetime(2040, 7, 1, 0, 30, tzinfo=UTC)  # 02:30 in Oslo (UTC+2)
    assert oslo.latest(summer) == summer
    assert oslo.latest(summer - timedelta(microseconds=1)) == summer - timedelta(days=1)
    assert oslo.following(summer) == summer + timedelta(days=1)
    assert PeriodicJob("t", cron="*/15 * * * *").latest(now) == now.replace(minute=45, second=0)


def test_the_default_name_is_made_of_queue_job_type_and_schedule() -> None:
    assert PeriodicJob("t", every=timedelta(minutes=5)).name == "default:t:every 300s"
    job = PeriodicJob("t", cron="0  3 * * *", timezone="UTC", queue="q")
    assert job.name == "q:t:cron 0 3 * * * UTC"
    assert PeriodicJob("t", every=timedelta(seconds=1), name="mine").name == "mine"


BAD_SCHEDULES: list[tuple[dict[str, Any], str]] = [
    ({}, "exactly one of"),
    ({"cron": "0 3 * * *", "every": timedelta(hours=1)}, "exactly one of"),
    ({"cron": "61 * * * *"}, "not a valid cron"),
    ({"cron": "0 3 * *"}, "five-field"),
    ({"cron": "0 0 3 * * *"}, "five-field"),
    ({"cron": "0 3 * * *", "timezone": "Mars/Olympus"}, "zoneinfo"),
    ({"every": timedelta(0)}, "positive"),
    ({"every": 60}, "timedelta"),
    ({"every": timedelta(hours=1), "timezone": "UTC"}, "cron schedules only"),
    ({"every": timedelta(hours=1), "queue": ""}, "queue"),
    ({"every": timedelta(hours=1), "priority": 10**6}, "priority"),
    ({"every": timedelta(hours=1), "name": "x" * 256}, "name"),
]


@pytest.mark.parametrize(("options", "message"), BAD_SCHEDULES)
def test_a_bad_schedule_is_a_configuration_error(options: dict[str, Any], message: str) -> None:
    with pytest.raises(sp.ConfigurationError, match=message):
        PeriodicJob("t", **options)


def test_the_worker_refuses_periodic_jobs_it_could_not_enqueue(tmp_path: Path) -> None:
    """Not PeriodicJobs, two with one name, or a payload the serializer refuses: a
    ConfigurationError at create_queue_worker."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'jobs.db'}")
    every = timedelta(minutes=1)
    bad: list[tuple[Any, str]] = [
        (PeriodicJob("t", every=every), "list"),
        (["t"], "holds 't'"),
        ([PeriodicJob("t", every=every), PeriodicJob("t", every=every)], "name of its own"),
        ([PeriodicJob("t", every=every, payload={1, 2})], "payload"),
    ]
    for periodic_jobs, message in bad:
        with pytest.raises(sp.ConfigurationError, match=message):
            sp.create_queue_worker(engine, lambda t, p: None, periodic_jobs=periodic_jobs)
    engine.dispose()
