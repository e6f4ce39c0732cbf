"""A job enqueued again with a job_id that is already archived: the archive tells how it last
ended, and the worker goes on."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp


def _enqueue(engine: sa.Engine, job_id: uuid.UUID, payload: object) -> None:
    with Session(engine) as session:
        sp.enqueue(session, "echo", payload, job_id=job_id)
        session.commit()


def _rows(engine: sa.Engine, model: type[sp.Job] | type[sp.ArchivedJob]) -> list[sa.Row[tuple]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(model.__table__)).all())


def test_a_job_id_already_archived_leaves_the_queue_and_its_new_outcome_replaces_the_old_row(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = uuid.uuid4()
    _enqueue(engine, job_id, {"run": 1})
    assert sp.process_next_job(engine, lambda job_type, payload: None)
    _enqueue(engine, job_id, {"run": 2})
    _enqueue(engine, uuid.uuid4(), {"run": 3})
    seen: list[object] = []
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    with sp.create_queue_worker(
        engine, lambda job_type, payload: seen.append(payload), polling_interval=0.01
    ) as worker:
        deadline = time.monotonic() + 10
        while worker.summary()["succeeded"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.running, "the worker must survive the conflicting archive row"
    assert seen == [{"run": 2}, {"run": 3}]
    assert _rows(engine, sp.Job) == []
    archived = {row.job_id: row for row in _rows(engine, sp.ArchivedJob)}
    assert len(archived) == 2
    assert archived[job_id].payload == '{"run":2}', "the newer run replaces the archive row"
    assert archived[job_id].status == "success"


def test_a_failed_job_enqueued_again_that_succeeds_is_archived_as_success(
    engine: sa.Engine,
) -> None:
    """The stale failure row goes: the archive tells the truth about the job's last run."""
    job_id = uuid.uuid4()
    _enqueue(engine, job_id, {"fail": True})

    def handler(job_type: str, payload: dict[str, bool]) -> None:
        if payload["fail"]:
            raise ValueError("first time")

    assert sp.process_next_job(engine, handler)
    (first,) = _rows(engine, sp.ArchivedJob)
    assert (first.status, first.error is not None) == ("failure", True)
    _enqueue(engine, job_id, {"fail": False})
    assert sp.process_next_job(engine, handler)
    (again,) = _rows(engine, sp.ArchivedJob)
    assert (again.job_id, again.status, again.error) == (job_id, "success", None)
    assert again.payload == '{"fail":false}'
