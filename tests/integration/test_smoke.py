import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp


def test_a_committed_job_runs_and_is_archived_as_success(engine: sa.Engine) -> None:
    with Session(engine) as session:
        job_id = sp.enqueue(session, "greet", {"name": "Ada"})
        session.commit()
    seen = []
    assert sp.process_next_job(engine, lambda job_type, payload: seen.append(payload))
    assert seen == [{"name": "Ada"}]
    with Session(engine) as session:
        archived = session.get(sp.ArchivedJob, job_id)
        assert archived is not None and archived.status == "success"
        assert session.scalar(sa.select(sa.func.count()).select_from(sp.Job)) == 0
