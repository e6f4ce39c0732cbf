"""The job page shows a job's snoozes and concurrency key when it has them."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from dashboard_support import Visitor

import sqla_proletarian as sp
from sqla_proletarian.dashboard import create_dashboard


def test_a_jobs_page_shows_its_snoozes_and_its_concurrency_key(engine: sa.Engine) -> None:
    """A job snoozed once with a key shows both; a job with neither shows neither."""
    with engine.begin() as conn:
        keyed = sp.enqueue(conn, "sync", None, concurrency_key="tenant-<42>")

    def handler(job_type: str, payload: Any) -> None:
        raise sp.Snooze(3600)

    assert sp.process_next_job(engine, handler)
    with engine.begin() as conn:
        plain = sp.enqueue(conn, "other", None)
    visitor = Visitor(create_dashboard(engine))

    page = visitor.get(f"/jobs/{keyed}").get_data(as_text=True)
    assert '<dd id="job-snoozes">1</dd>' in page
    assert '<dd id="job-concurrency-key">tenant-&lt;42&gt;</dd>' in page
    other = visitor.get(f"/jobs/{plain}").get_data(as_text=True)
    assert "job-snoozes" not in other and "job-concurrency-key" not in other
