"""sp.queue_status and sp.failed_jobs, called directly: counts per queue (ready, scheduled,
running, the oldest ready job's age, what finished in the last hour) and the archived
failures, on every backend; "running" means claimed by a live worker, told without taking
any lock."""

from __future__ import annotations

import subprocess
import threading
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from cli_support import cli, url_of, wait_until

import sqla_proletarian as sp
from sqla_proletarian import ledger, statements
from sqla_proletarian.dialects import dialect_of


def archive(engine: sa.Engine, *rows: tuple[str, str, str, datetime]) -> list[uuid.UUID]:
    """Archived jobs as a worker writes them, each ``(queue, job_type, status, finished_at)``."""
    values = [
        {
            "job_id": uuid.uuid4(),
            "queue": queue,
            "job_type": job_type,
            "payload": "{}",
            "attempts": 1,
            "enqueued_at": finished_at - timedelta(seconds=1),
            "process_at": finished_at - timedelta(seconds=1),
            "status": status,
            "finished_at": finished_at,
            "error": f"RuntimeError: {job_type}" if status == "failure" else None,
        }
        for queue, job_type, status, finished_at in rows
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(statements.ARCHIVE), values)
    return [value["job_id"] for value in values]


def by_queue(statuses: list[sp.QueueStatus]) -> dict[str, sp.QueueStatus]:
    return {status.queue: status for status in statuses}


def test_queue_status_counts_ready_scheduled_and_the_last_hour_per_queue(
    engine: sa.Engine,
) -> None:
    """Due and later jobs per queue, the oldest due job's age, and archived successes and
    failures of the last hour only; a queue with nothing left but old archive rows is not
    listed."""
    now = sp.utc_now()
    with engine.begin() as conn:
        sp.enqueue(conn, "work", clock=lambda: now - timedelta(seconds=30))
        sp.enqueue(conn, "work", clock=lambda: now)
        sp.enqueue(conn, "work", process_in=3600, clock=lambda: now)
        sp.enqueue(conn, "work", queue="billing", process_in=60, clock=lambda: now)
    archive(
        engine,
        ("default", "work", "success", now - timedelta(minutes=5)),
        ("default", "work", "failure", now - timedelta(minutes=59)),
        ("default", "work", "success", now - timedelta(minutes=61)),
        ("recent", "work", "failure", now - timedelta(seconds=1)),
        ("old", "work", "success", now - timedelta(days=2)),
    )

    statuses = sp.queue_status(engine, clock=lambda: now)

    assert [status.queue for status in statuses] == ["billing", "default", "recent"]
    default = by_queue(statuses)["default"]
    assert (default.ready, default.scheduled, default.running) == (2, 1, 0)
    assert default.oldest_ready_age_s == pytest.approx(30, abs=0.01)
    assert (default.succeeded_last_hour, default.failed_last_hour) == (1, 1)
    assert default.by_priority == {0: 3} and not default.paused
    billing = sp.QueueStatus("billing", 0, 1, 0, None, 0, 0, by_priority={0: 1})
    assert by_queue(statuses)["billing"] == billing
    assert by_queue(statuses)["recent"] == sp.QueueStatus("recent", 0, 0, 0, None, 0, 1)
    with engine.connect() as conn:
        assert sp.queue_status(conn, clock=lambda: now) == statuses
    with pytest.raises(sp.ConfigurationError, match="Engine or Connection"):
        sp.queue_status("sqlite://")  # type: ignore[arg-type]


def dead_owner(engine: sa.Engine) -> str:
    """An owner token of a worker that is gone (nobody holds its lock, or its process
    exited)."""
    kind = dialect_of(engine).owner_lock
    if kind == "process":
        finished = subprocess.Popen(["true"])
        finished.wait()
        return f"{finished.pid}:{uuid.uuid4().hex}"
    owner = ledger.new_owner(kind)
    assert owner is not None
    return owner


def test_running_counts_jobs_claimed_by_live_workers_and_no_record_of_a_dead_one(
    engine: sa.Engine,
) -> None:
    """A job a live worker runs is running, not ready, and is not the oldest ready job; a
    run record whose owner is gone counts for nothing (its job is ready)."""
    release = threading.Event()
    with engine.begin() as conn:
        # The held job is the oldest; the oldest ready one is 20 s old.
        sp.enqueue(conn, "block", clock=lambda: sp.utc_now() - timedelta(seconds=60))
        sp.enqueue(conn, "work", clock=lambda: sp.utc_now() - timedelta(seconds=20))
        orphan = sp.enqueue(conn, "work")
        conn.execute(
            sa.insert(statements.RUN).values(
                run_id=uuid.uuid4(),
                job_id=orphan,
                worker_id="gone-0",
                owner=dead_owner(engine),
                started_at=sp.utc_now(),
                batched=False,
            )
        )
    started = threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        if job_type == "block":
            started.set()
            assert release.wait(30)

    worker = sp.create_queue_worker(engine, handler, max_unclean_ends=10)
    worker.start()
    try:
        assert started.wait(10)
        [status] = sp.queue_status(engine)
        assert (status.ready, status.running) == (2, 1)
        assert status.oldest_ready_age_s == pytest.approx(20, abs=2)
    finally:
        release.set()
        worker.stop()


def test_a_worker_with_crash_accounting_off_runs_jobs_that_count_as_ready(
    engine: sa.Engine,
) -> None:
    """With max_unclean_ends=None a worker writes no run records, so the job it runs is
    counted as ready, as the docstring of queue_status says."""
    release, started = threading.Event(), threading.Event()
    with engine.begin() as conn:
        sp.enqueue(conn, "block")

    def handler(job_type: str, payload: Any) -> None:
        started.set()
        assert release.wait(30)

    worker = sp.create_queue_worker(engine, handler, max_unclean_ends=None)
    worker.start()
    try:
        assert started.wait(10)
        [status] = sp.queue_status(engine)
        assert (status.ready, status.running) == (1, 0)
    finally:
        release.set()
        worker.stop()
    wait_until(lambda: sp.queue_status(engine)[0].ready == 0, "the job to finish")


def test_failed_jobs_lists_archived_failures_newest_first_filtered_and_limited(
    engine: sa.Engine,
) -> None:
    """Only failures, newest first, with their error; by queue, by job type, at most
    ``limit``; bad arguments are refused."""
    now = sp.utc_now()
    old, new, other, typed = archive(
        engine,
        ("default", "work", "failure", now - timedelta(hours=2)),
        ("default", "work", "failure", now - timedelta(minutes=1)),
        ("billing", "work", "failure", now - timedelta(minutes=2)),
        ("default", "charge", "failure", now - timedelta(minutes=3)),
    )
    archive(engine, ("default", "work", "success", now))

    everything = sp.failed_jobs(engine)
    assert [job.job_id for job in everything] == [new, other, typed, old]
    assert everything[0].error == "RuntimeError: work" and everything[0].payload == "{}"
    assert everything[0].finished_at == now - timedelta(minutes=1)
    assert [job.job_id for job in sp.failed_jobs(engine, queue="default")] == [new, typed, old]
    assert [job.job_id for job in sp.failed_jobs(engine, job_type="charge")] == [typed]
    with engine.connect() as conn:
        assert [job.job_id for job in sp.failed_jobs(conn, limit=2)] == [new, other]
    with pytest.raises(sp.ConfigurationError, match="limit=0"):
        sp.failed_jobs(engine, limit=0)
    with pytest.raises(sp.InvalidJobError, match="queue"):
        sp.failed_jobs(engine, queue="")


def test_queue_status_sums_a_queues_priorities_and_finds_its_oldest_ready_job_among_them(
    engine: sa.Engine,
) -> None:
    """Counts are summed over the priorities of a queue, ``by_priority`` holds each (highest
    first), and the oldest ready job is the oldest of any priority."""
    now = sp.utc_now()
    with engine.begin() as conn:
        sp.enqueue(conn, "work", priority=5, clock=lambda: now - timedelta(seconds=10))
        sp.enqueue(conn, "work", priority=-1, clock=lambda: now - timedelta(seconds=40))
        sp.enqueue(conn, "work", priority=-1, process_in=60, clock=lambda: now)
    [status] = sp.queue_status(engine, clock=lambda: now)
    assert (status.ready, status.scheduled) == (2, 1)
    assert status.oldest_ready_age_s == pytest.approx(40, abs=0.01)
    assert list(status.by_priority.items()) == [(5, 1), (-1, 2)]


def test_status_flags_queued_job_types_the_last_workers_handlers_did_not_know(
    database: Any,
) -> None:
    """A job type no handler knew failed in the last hour and more of it is queued:
    queue_status names it in ``unhandled_job_types`` and ``status`` warns, saying what to
    do; once a job of the type succeeds (a handler was registered) the flag is gone."""
    engine = database.engine()
    handlers = sp.JobHandlers()
    handlers.register("known")(lambda job_type, payload: None)
    with engine.begin() as conn:
        sp.enqueue(conn, "mystery", queue="mail")
        sp.enqueue(conn, "known", queue="mail")
    while sp.process_next_job(engine, handlers, queue="mail"):
        pass
    with engine.begin() as conn:
        sp.enqueue(conn, "mystery", queue="mail")
        sp.enqueue(conn, "known", queue="mail")
        sp.enqueue(conn, "mystery", queue="other")  # never run here: nothing known of it
    statuses = {status.queue: status for status in sp.queue_status(engine)}
    assert statuses["mail"].unhandled_job_types == ("mystery",)
    assert statuses["other"].unhandled_job_types == ()
    done = cli("status", "--url", url_of(database))
    assert done.returncode == 0, done.stderr
    [warning] = [line for line in done.stderr.splitlines() if "warning" in line]
    assert "queue 'mail'" in warning and "'mystery'" in warning
    assert "retry-failed --all --job-type mystery" in warning

    handlers.register("mystery")(lambda job_type, payload: None)
    while sp.process_next_job(engine, handlers, queue="mail"):
        pass
    with engine.begin() as conn:
        sp.enqueue(conn, "mystery", queue="mail")
    statuses = {status.queue: status for status in sp.queue_status(engine)}
    assert statuses["mail"].unhandled_job_types == ()


def test_queue_status_shows_each_queues_limits_and_its_ready_jobs_waiting(
    engine: sa.Engine,
) -> None:
    """A queue with limits is listed from the moment it has them, jobs or not, with its
    limits and ``waiting``: its ready jobs (an expired lease's included), not those due later
    nor those running under a live lease. A queue without limits has None for both."""
    now = sp.utc_now()
    with engine.begin() as conn:
        sp.set_queue_limits(conn, "api", max_running=2, rate_limit=(10, 1.0))
        sp.set_queue_limits(conn, "reports", max_running_per_key=1)
        due = [sp.enqueue(conn, "call", queue="api", clock=lambda: now) for _ in range(4)]
        sp.enqueue(conn, "call", queue="api", process_in=600, clock=lambda: now)
        sp.enqueue(conn, "mail", queue="mail", clock=lambda: now)
    job = statements.JOB
    with engine.begin() as conn:
        for job_id, expires_in in ((due[0], 600), (due[1], -5)):  # a live and an expired lease
            conn.execute(
                sa.update(job)
                .where(job.c.job_id == job_id)
                .values(
                    lease_token=uuid.uuid4(),
                    lease_owner="w@host:1/MainThread",
                    heartbeat_at=now,
                    due_at=now,
                    process_at=now + timedelta(seconds=expires_in),
                    attempts=1,
                )
            )

    statuses = by_queue(sp.queue_status(engine, clock=lambda: now))

    api = statuses["api"]
    assert api.limits == sp.QueueLimits(max_running=2, rate_limit=(10, 1.0))
    assert (api.ready, api.running, api.scheduled, api.waiting) == (3, 1, 1, 3)
    reports = statuses["reports"]
    assert (reports.limits, reports.ready, reports.waiting) == (
        sp.QueueLimits(max_running_per_key=1),
        0,
        0,
    )
    assert (statuses["mail"].limits, statuses["mail"].waiting) == (None, None)
    with engine.begin() as conn:
        sp.clear_queue_limits(conn, "reports")
    assert "reports" not in by_queue(sp.queue_status(engine, clock=lambda: now))
