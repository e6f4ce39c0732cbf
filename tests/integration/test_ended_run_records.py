"""A run record of a run that ended, brought back with its owner still alive: a failover to
an asynchronous standby that missed the record's removal (docs/guide/databases.md, "Failover
to a standby") restores the record, and its owner, this very worker, takes its owner lock
back on the new primary. The worker knows that run is over: the job runs, uncharged, instead
of waiting until the worker stops."""

from __future__ import annotations

import threading
import uuid
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from helpers import enqueue_committed, wait_for
from sqlalchemy.orm import Session

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database


def test_a_record_of_an_ended_run_brought_back_does_not_hold_its_job(database: Database) -> None:
    engine = database.engine()
    release = threading.Event()
    ran: list[str] = []

    def handler(job_type: str, payload: Any) -> None:
        ran.append(job_type)
        if job_type == "first":
            assert release.wait(30)

    first = enqueue_committed(engine, "first")
    worker = sp.create_queue_worker(engine, handler, polling_interval=0.05)
    with worker:
        assert wait_for(lambda: ran == ["first"])
        with Session(engine) as session:  # the live run's record, and its owner
            record = session.scalars(sa.select(sp.JobRun)).one()
            assert record.job_id == first and record.owner is not None
            owner = record.owner
        release.set()
        assert wait_for(lambda: worker.summary()["succeeded"] == 1)

        # The next job, with a record of an earlier run of this worker: that run ended, but the
        # record's removal was lost with the server that had it.
        second = uuid.uuid4()
        with Session(engine) as session:
            sp.enqueue(session, "second", job_id=second)
            session.add(
                sp.JobRun(
                    run_id=uuid.uuid4(),
                    job_id=second,
                    worker_id=record.worker_id,
                    started_at=sp.utc_now(),
                    owner=owner,
                    batched=False,
                )
            )
            session.commit()
        assert wait_for(lambda: "second" in ran, timeout=20), "the job waited for its run"
        assert wait_for(lambda: worker.summary()["succeeded"] == 2)
    with Session(engine) as session:
        archived = session.get(sp.ArchivedJob, second)
        assert archived is not None and archived.status == "success"
        assert archived.attempts == 1  # the lost end is no unclean end
        assert session.scalars(sa.select(sp.JobRun)).all() == []
    assert ran == ["first", "second"]
