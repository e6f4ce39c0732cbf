"""The dashboard shows jobs waiting for their dependencies: their state in the lists and
the overview's counts, and on a job's page its graph and its progress."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from dashboard_support import Visitor

import sqla_proletarian as sp
from sqla_proletarian.dashboard import create_dashboard


def test_waiting_jobs_are_listed_counted_and_drawn_with_their_graph(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        first = sp.enqueue(conn, "first", None)
        then = sp.enqueue(conn, "then", None, depends_on=[first])
    visitor = Visitor(create_dashboard(engine))

    listed = visitor.get("/jobs?state=waiting").get_data(as_text=True)
    assert str(then) in listed and str(first) not in listed
    overview = json.loads(visitor.get("/api/overview").get_data(as_text=True))
    [queue] = overview["queues"]
    assert (queue["ready"], queue["scheduled"], queue["waiting_on_dependencies"]) == (1, 0, 1)
    assert 'data-field="waiting_on_dependencies">1<' in visitor.get("/").get_data(as_text=True)

    page = visitor.get(f"/jobs/{then}").get_data(as_text=True)
    assert 'id="job-state">waiting<' in page
    assert f'href="/jobs/{first}"' in page.replace("http://localhost", "")
    assert 'class="state state-ready">ready<' in page
    assert "job-progress" not in page  # nothing reported

    def handler(job_type: str, payload: Any) -> None:
        sp.current_job().set_progress(0.75, "three <quarters>")

    assert sp.process_next_job(engine, handler)
    done = visitor.get(f"/jobs/{first}").get_data(as_text=True)
    assert '<progress max="1" value="0.75">' in done
    assert 'id="job-progress-message">three &lt;quarters&gt;<' in done
    assert f"/jobs/{then}" in done and "Depended on by" in done
