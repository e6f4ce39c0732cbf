"""The reads the dashboard is made of, called directly, on every backend: sp.list_jobs pages
through each state with a cursor (never an offset), sp.get_job finds a job queued or
archived, and sp.finished_per_minute counts what each queue archived minute by minute."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa
from dashboard_support import archive, holding

import sqla_proletarian as sp


def every_page(engine: sa.Engine, state: str, limit: int, **filters: str) -> list[list[sp.JobInfo]]:
    pages, after = [], None
    while True:
        page = sp.list_jobs(engine, state, after=after, limit=limit, **filters)
        pages.append(list(page.jobs))
        if page.next_cursor is None:
            return pages
        after = page.next_cursor


def test_ready_jobs_page_through_every_queue_in_claim_order_without_repeats(
    engine: sa.Engine,
) -> None:
    """Due jobs come queue by queue in the order workers claim them (oldest due first,
    equal times by enqueue order), a page at a time, each exactly once; scheduled jobs are
    listed apart; the queue and job type filters narrow both."""
    now = sp.utc_now()
    expected = []
    with engine.begin() as conn:
        for queue in ("beta", "alpha", "gamma"):
            for index in range(5):
                due = now - timedelta(seconds=50 - index // 2)  # pairs share a time
                job_id = sp.enqueue(
                    conn, f"type-{index % 2}", {"i": index}, queue=queue, clock=lambda d=due: d
                )
                expected.append((queue, due, index, job_id))
        later = sp.enqueue(conn, "later", queue="alpha", process_in=600)
    expected.sort(key=lambda row: (row[0], row[1], row[2]))

    pages = every_page(engine, "ready", limit=4)

    assert [len(page) for page in pages] == [4, 4, 4, 3]
    listed = [job for page in pages for job in page]
    assert [job.job_id for job in listed] == [row[3] for row in expected]
    assert {job.state for job in listed} == {"ready"}
    assert not hasattr(listed[0], "payload")
    [scheduled] = sp.list_jobs(engine, "scheduled").jobs
    assert (scheduled.job_id, scheduled.state) == (later, "scheduled")
    in_beta = [job for page in every_page(engine, "ready", 2, queue="beta") for job in page]
    assert [job.job_id for job in in_beta] == [row[3] for row in expected if row[0] == "beta"]
    typed = sp.list_jobs(engine, "ready", queue="gamma", job_type="type-1").jobs
    assert [job.job_id for job in typed] == [
        row[3] for row in expected if row[0] == "gamma" and row[2] % 2
    ]
    assert sp.list_jobs(engine, "scheduled", queue="beta").jobs == ()
    with engine.connect() as conn:
        assert sp.list_jobs(conn, "ready", limit=3).jobs == tuple(listed[:3])


def test_ready_jobs_list_higher_priorities_first_across_pages(engine: sa.Engine) -> None:
    """Within a queue the list follows the claim order with priorities: higher first, then
    due time; pages cut inside one priority and between priorities repeat and skip nothing."""
    now = sp.utc_now()
    expected = []
    with engine.begin() as conn:
        for index in range(9):
            priority = (index % 3) - 1  # -1, 0, 1 in turn
            due = now - timedelta(seconds=60 - index)
            job_id = sp.enqueue(
                conn, "work", {"i": index}, priority=priority, clock=lambda d=due: d
            )
            expected.append((-priority, due, job_id))
    expected.sort(key=lambda row: (row[0], row[1]))

    pages = every_page(engine, "ready", limit=2)

    assert [len(page) for page in pages] == [2, 2, 2, 2, 1]
    assert [job.job_id for page in pages for job in page] == [row[2] for row in expected]


def test_archived_jobs_page_newest_first_with_ties_broken_by_id(engine: sa.Engine) -> None:
    """Succeeded and failed jobs are listed apart, newest first; jobs that finished at the
    same instant still come once each across pages; filters narrow them."""
    now = sp.utc_now()
    same = now - timedelta(minutes=5)
    failed = archive(
        engine,
        *[("default", "charge", "failure", same) for _ in range(5)],
        ("default", "mail", "failure", now - timedelta(minutes=1)),
        ("billing", "charge", "failure", now - timedelta(minutes=9)),
    )
    succeeded = archive(engine, ("default", "mail", "success", now))

    pages = every_page(engine, "failed", limit=2)

    listed = [job for page in pages for job in page]
    assert [len(page) for page in pages] == [2, 2, 2, 1]
    assert sorted(job.job_id for job in listed) == sorted(failed)
    assert listed[0].job_id == failed[5] and listed[-1].job_id == failed[6]
    assert [job.finished_at for job in listed] == sorted(
        (job.finished_at for job in listed), reverse=True
    )
    assert listed[0].state == "failed" and listed[0].error.startswith("RuntimeError: mail")
    [success] = sp.list_jobs(engine, "succeeded").jobs
    assert (success.job_id, success.state, success.error) == (succeeded[0], "succeeded", None)
    assert [job.job_id for job in sp.list_jobs(engine, "failed", queue="billing").jobs] == [
        failed[6]
    ]
    assert len(sp.list_jobs(engine, "failed", job_type="charge", queue="default").jobs) == 5
    assert sp.list_jobs(engine, "cancelled").jobs == ()


def test_running_jobs_are_those_a_live_worker_holds_and_are_not_ready(engine: sa.Engine) -> None:
    """A job a live worker runs is listed as running, and not as ready; get_job says so.
    (On SQLite the running job's transaction holds the write lock: nothing is enqueued
    meanwhile.)"""
    with engine.begin() as conn:
        held = sp.enqueue(conn, "block", clock=lambda: sp.utc_now() - timedelta(seconds=5))
        waiting = sp.enqueue(conn, "block", queue="other")  # no worker serves it
    with holding(engine):
        [running] = sp.list_jobs(engine, "running").jobs
        assert (running.job_id, running.state) == (held, "running")
        assert [job.job_id for job in sp.list_jobs(engine, "ready").jobs] == [waiting]
        assert sp.list_jobs(engine, "running", queue="other").jobs == ()
        detail = sp.get_job(engine, held)
        assert detail is not None and detail.state == "running"


def test_get_job_finds_a_queued_or_archived_job_with_its_payload(engine: sa.Engine) -> None:
    """A queued job is ready or scheduled, with its payload text; an archived one has its
    status as a state, its error and finish time; an unknown id is None."""
    with engine.begin() as conn:
        ready = sp.enqueue(conn, "mail", {"to": "ada@example.com"})
        later = sp.enqueue(conn, "mail", process_in=60)
    [failed] = archive(engine, ("default", "charge", "failure", sp.utc_now()))

    job = sp.get_job(engine, ready)
    assert job is not None
    assert (job.state, job.job_type, job.attempts) == ("ready", "mail", 0)
    assert job.payload == '{"to":"ada@example.com"}' and job.finished_at is None
    scheduled = sp.get_job(engine, str(later))
    assert scheduled is not None and scheduled.state == "scheduled"
    archived = sp.get_job(engine, failed)
    assert archived is not None
    assert (archived.state, archived.payload) == ("failed", '{"n": 1}')
    assert archived.error is not None and archived.error.startswith("RuntimeError: charge")
    assert archived.finished_at is not None
    assert sp.get_job(engine, "00000000-0000-0000-0000-000000000000") is None
    with pytest.raises(sp.ConfigurationError, match="not a job id"):
        sp.get_job(engine, "nope")


def test_finished_per_minute_counts_each_queues_successes_and_failures_by_minute(
    engine: sa.Engine,
) -> None:
    """Every archived job of the window lands in the minute it finished in; older ones and
    minutes with nothing are left out."""
    now = sp.utc_now().replace(second=30, microsecond=0)
    minute = now.replace(second=0)
    archive(
        engine,
        ("default", "t", "success", now),
        ("default", "t", "success", minute),
        ("default", "t", "failure", now - timedelta(seconds=1)),
        ("default", "t", "success", minute - timedelta(microseconds=1)),  # the minute before
        ("billing", "t", "failure", minute - timedelta(minutes=59)),  # the window's first
        ("billing", "t", "failure", minute - timedelta(minutes=60)),  # before the window
    )

    counts = sp.finished_per_minute(engine, clock=lambda: now)

    assert counts == [
        sp.FinishedMinute("billing", minute - timedelta(minutes=59), 0, 1),
        sp.FinishedMinute("default", minute - timedelta(minutes=1), 1, 0),
        sp.FinishedMinute("default", minute, 2, 1),
    ]
    assert sp.finished_per_minute(engine, minutes=1, clock=lambda: now) == [counts[-1]]


def test_bad_arguments_are_refused_with_what_to_give(engine: sa.Engine) -> None:
    """An unknown state, a limit out of range, a cursor of another list or a made-up one,
    and a window of no minutes are each refused with a message that says what to give."""
    archive(engine, *[("default", "t", "failure", sp.utc_now()) for _ in range(2)])
    archived_cursor = sp.list_jobs(engine, "failed", limit=1).next_cursor
    assert archived_cursor is not None
    with pytest.raises(sp.ConfigurationError, match="give one of ready, scheduled"):
        sp.list_jobs(engine, "done")
    with pytest.raises(sp.ConfigurationError, match="limit=0"):
        sp.list_jobs(engine, "ready", limit=0)
    with pytest.raises(sp.ConfigurationError, match="not a cursor of this list"):
        sp.list_jobs(engine, "ready", after=archived_cursor)
    with pytest.raises(sp.ConfigurationError, match="not a cursor of this list"):
        sp.list_jobs(engine, "failed", after="bm90IGEgY3Vyc29y")
    with pytest.raises(sp.InvalidJobError, match="queue"):
        sp.list_jobs(engine, "ready", queue="")
    with pytest.raises(sp.ConfigurationError, match="minutes=0"):
        sp.finished_per_minute(engine, minutes=0)
