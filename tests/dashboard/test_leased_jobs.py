"""Jobs running in lease mode, seen from outside, on every backend: a job under a live
lease is running (with its owner, lease expiry and last heartbeat), never scheduled; one
whose lease expired is ready, flagged, from its own due time; cancel_job asks a live lease's
worker to stop and cancels an expired one as a queued job. Leases are written as a
lease-mode worker's claim writes them."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from dashboard_support import LEASE_OWNER, Visitor, lease

import sqla_proletarian as sp
from sqla_proletarian.dashboard import create_dashboard
from sqla_proletarian.testing import enqueued_jobs
from sqla_proletarian.values import Clock

if TYPE_CHECKING:
    from conftest import Database


def at(moment: datetime) -> Clock:
    return lambda: moment


def listed(engine: sa.Engine, state: str, now: datetime) -> list[sp.JobInfo]:
    return list(sp.list_jobs(engine, state, clock=at(now)).jobs)


def test_a_job_under_a_live_lease_is_running_with_its_owner_lease_and_heartbeat(
    engine: sa.Engine,
) -> None:
    """A live lease's job counts and lists as running, not as scheduled (its process_at is
    the lease's expiry, in the future); every reader shows its own due time; the oldest
    ready age is that of the other, unleased job."""
    now = sp.utc_now()
    with engine.begin() as conn:
        leased = sp.enqueue(conn, "report", clock=at(now - timedelta(seconds=30)))
        ready = sp.enqueue(conn, "report", clock=at(now - timedelta(seconds=10)))
        later = sp.enqueue(conn, "report", process_in=3600, clock=at(now))
    lease(engine, leased, expires_in=60, now=now)

    [status] = sp.queue_status(engine, clock=at(now))
    assert (status.ready, status.scheduled, status.running) == (1, 1, 1)
    assert status.expired_leases == 0
    assert status.oldest_ready_age_s == pytest.approx(10, abs=0.01)
    assert status.by_priority == {0: 3}
    [running] = listed(engine, "running", now)
    assert (running.job_id, running.state, running.owner) == (leased, "running", LEASE_OWNER)
    assert running.process_at == now - timedelta(seconds=30)
    assert (running.lease_expires_at, running.heartbeat_at) == (now + timedelta(seconds=60), now)
    assert (running.attempts, running.lease_expired, running.cancel_requested_at) == (
        1,
        False,
        None,
    )
    assert [job.job_id for job in listed(engine, "ready", now)] == [ready]
    [scheduled] = listed(engine, "scheduled", now)
    assert (scheduled.job_id, scheduled.owner, scheduled.lease_expires_at) == (later, None, None)
    detail = sp.get_job(engine, leased, clock=at(now))
    assert detail is not None and (detail.state, detail.owner) == ("running", LEASE_OWNER)
    queued = enqueued_jobs(engine)
    assert [job.job_id for job in queued] == [leased, ready, later]
    assert queued[0].process_at == now - timedelta(seconds=30)


def test_a_job_whose_lease_expired_is_ready_and_flagged_from_its_own_due_time(
    engine: sa.Engine,
) -> None:
    """An expired lease (its worker died or froze) leaves its job ready, in the order the
    poll takes it, flagged and with the dead worker's name; the oldest ready age counts from
    the job's own due time, not from the lease's expiry."""
    now = sp.utc_now()
    with engine.begin() as conn:
        orphan = sp.enqueue(conn, "report", clock=at(now - timedelta(seconds=30)))
        ready = sp.enqueue(conn, "report", clock=at(now - timedelta(seconds=10)))
    lease(engine, orphan, expires_in=-5, now=now - timedelta(seconds=20))

    [status] = sp.queue_status(engine, clock=at(now))
    assert status.oldest_ready_age_s == pytest.approx(30, abs=0.01)
    assert (status.ready, status.scheduled, status.running, status.expired_leases) == (2, 0, 0, 1)
    assert listed(engine, "running", now) == []
    first, second = listed(engine, "ready", now)
    assert (first.job_id, first.lease_expired, first.owner) == (orphan, True, LEASE_OWNER)
    assert first.process_at == now - timedelta(seconds=30)
    assert first.lease_expires_at == now - timedelta(seconds=25)
    assert (second.job_id, second.lease_expired, second.owner) == (ready, False, None)
    detail = sp.get_job(engine, orphan, clock=at(now))
    assert detail is not None and (detail.state, detail.lease_expired) == ("ready", True)


def test_cancelling_a_job_under_a_live_lease_asks_its_worker_and_archives_nothing(
    engine: sa.Engine,
) -> None:
    """cancel_job on a live lease's job is True and records when it was asked (a second
    request keeps that time); the job stays queued and running for its worker to stop."""
    now = sp.utc_now()
    with engine.begin() as conn:
        job_id = sp.enqueue(conn, "report")
    lease(engine, job_id, expires_in=60, now=now)

    with engine.begin() as conn:
        assert sp.cancel_job(conn, job_id, clock=at(now + timedelta(seconds=1)))
    detail = sp.get_job(engine, job_id, clock=at(now + timedelta(seconds=1)))
    assert detail is not None and detail.state == "running"
    with engine.begin() as conn:
        assert sp.cancel_job(conn, job_id, clock=at(now + timedelta(seconds=2)))

    detail = sp.get_job(engine, job_id, clock=at(now + timedelta(seconds=3)))
    assert detail is not None and detail.state == "running"
    assert detail.cancel_requested_at == now + timedelta(seconds=1)
    assert sp.list_jobs(engine, "cancelled").jobs == ()


def test_cancelling_a_job_whose_lease_expired_archives_it_at_its_own_due_time(
    engine: sa.Engine,
) -> None:
    """An expired lease's job is cancelled as a queued one (its worker is gone): archived as
    cancelled with its own due time and the run it had, and no worker runs it after."""
    now = sp.utc_now()
    with engine.begin() as conn:
        job_id = sp.enqueue(conn, "report", clock=at(now - timedelta(seconds=30)))
    lease(engine, job_id, expires_in=-5, now=now)

    with engine.begin() as conn:
        assert sp.cancel_job(conn, job_id, clock=at(now))

    detail = sp.get_job(engine, job_id)
    assert detail is not None and (detail.state, detail.attempts) == ("cancelled", 1)
    assert detail.process_at == now - timedelta(seconds=30)
    assert not sp.process_next_job(engine, lambda job_type, payload: None)


def test_the_dashboard_shows_leases_and_requests_a_running_jobs_cancel(
    engine: sa.Engine,
) -> None:
    """The running list shows the lease's owner, the job page its lease, the ready list
    flags an expired lease; cancelling a running leased job says its worker was asked."""
    now = sp.utc_now()
    with engine.begin() as conn:
        running = sp.enqueue(conn, "report")
        orphan = sp.enqueue(conn, "report", queue="other")
    lease(engine, running, expires_in=600, now=now)
    lease(engine, orphan, expires_in=-5, now=now)
    visitor = Visitor(create_dashboard(engine))

    page = visitor.get("/jobs?state=running").get_data(as_text=True)
    assert page.count("<tr data-job-id=") == 1 and f'href="/jobs/{running}"' in page
    assert f'<td class="lease-owner">{LEASE_OWNER}</td>' in page
    assert "lease expired" in visitor.get("/jobs?state=ready").get_data(as_text=True)
    detail = visitor.get(f"/jobs/{running}").get_data(as_text=True)
    assert 'id="job-state">running<' in detail and f'id="job-owner">{LEASE_OWNER}<' in detail
    visitor.act("cancel", {"job_id": str(running)}, next=f"/jobs/{running}")
    assert "its worker was asked to stop it" in visitor.page
    assert 'id="job-cancel-requested"' in visitor.page


def test_the_cancel_command_says_a_running_leased_job_was_asked_to_stop(
    database: Database,
) -> None:
    """``cancel`` of a job under a live lease succeeds and says the worker stops it; of a
    queued job it says the job was archived as cancelled."""
    engine = database.engine()
    with engine.begin() as conn:
        running = sp.enqueue(conn, "report")
        queued = sp.enqueue(conn, "report")
    lease(engine, running, expires_in=600, now=sp.utc_now())
    url = database.url.render_as_string(hide_password=False)

    def cancel(job_id: uuid.UUID) -> str:
        command = [sys.executable, "-m", "sqla_proletarian", "cancel", str(job_id), "--url", url]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert cancel(running).startswith(
        f"job {running} cancel requested: it is running under a lease, and its worker stops "
        "it at its next heartbeat if it is still running then"
    )
    assert cancel(queued) == f"job {queued} cancelled (archived as cancelled)"


def test_a_lease_mode_workers_running_job_is_running_and_its_cancel_reaches_the_handler(
    engine: sa.Engine,
) -> None:
    """While a worker with ``lease_seconds`` runs a job (no transaction open), queue_status
    and list_jobs show it running under the worker's lease; cancel_job is True, the
    heartbeat sets the handler's cancel_requested, and the job ends archived as cancelled."""
    with engine.begin() as conn:
        job_id = sp.enqueue(conn, "report")
    started, done = threading.Event(), threading.Event()
    asked: list[bool] = []

    def handler(job: sp.JobContext) -> None:
        started.set()
        asked.append(job.cancel_requested.wait(10))
        done.set()

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        worker_id="lease-worker",
        lease_seconds=5,
        heartbeat_interval=0.05,
    )
    worker.start()
    try:
        assert started.wait(10), "the worker never started the job"
        now = sp.utc_now()
        [status] = sp.queue_status(engine, clock=at(now))
        assert (status.ready, status.scheduled, status.running) == (0, 0, 1)
        [running] = listed(engine, "running", now)
        assert (running.job_id, running.lease_expired) == (job_id, False)
        assert running.owner is not None and running.owner.startswith("lease-worker@")
        assert running.lease_expires_at is not None and running.lease_expires_at > now
        with engine.begin() as conn:
            assert sp.cancel_job(conn, job_id)
        assert done.wait(10), "the handler never returned"
    finally:
        worker.stop()
    assert asked == [True]
    detail = sp.get_job(engine, job_id)
    assert detail is not None and detail.state == "cancelled"
