"""The worker command in lease mode: ``--lease-seconds`` runs each job under a lease, in one
process and in each of ``--processes``; ``--job-timeout`` alone is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cli_support import archived, assert_one_line_error, cli, url_of

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database

#: A handler module that notes, for each job, whether its row holds a lease while it runs.
LEASE_TASKS = """\
import os

import sqlalchemy as sa

import sqla_proletarian as sp

engine = sa.create_engine(os.environ["LEASE_TEST_URL"], poolclass=sa.pool.NullPool)
JOB = sp.Job.__table__


def handler(job):
    with engine.connect() as conn:
        token = conn.execute(
            sa.select(JOB.c.lease_token).where(JOB.c.job_id == job.job_id)
        ).scalar_one()
    with open("leases.log", "a") as log:
        log.write(f"{job.job_id} {token is not None}\\n")
"""


def test_the_worker_command_runs_each_job_under_a_lease_with_lease_seconds(
    database: Database, tmp_path: Path
) -> None:
    """Through --processes 2: the supervisor passes the lease options on to each worker
    process, which parses them as the single-process command does."""
    url = url_of(database)
    (tmp_path / "lease_tasks.py").write_text(LEASE_TASKS)
    engine = database.engine()
    with engine.begin() as conn:
        job_ids = [str(sp.enqueue(conn, "t", n)) for n in range(4)]
    worked = cli(
        *("worker", "lease_tasks:handler", "--handler-mode", "advanced", "--burst"),
        *("--lease-seconds", "60", "--processes", "2", "--url", url),
        cwd=tmp_path,
        LEASE_TEST_URL=url,
    )
    assert worked.returncode == 0, worked.stderr
    noted = sorted((tmp_path / "leases.log").read_text().splitlines())
    assert noted == sorted(f"{job_id} True" for job_id in job_ids)
    done = archived(engine)
    assert sorted(str(job_id) for job_id in done) == sorted(job_ids)
    assert {row.status for row in done.values()} == {"success"}


def test_the_worker_command_refuses_job_timeout_without_lease_seconds(
    database: Database, tmp_path: Path
) -> None:
    (tmp_path / "lease_tasks.py").write_text(LEASE_TASKS)
    refused = cli(
        *("worker", "lease_tasks:handler", "--job-timeout", "5", "--burst"),
        *("--url", url_of(database)),
        cwd=tmp_path,
        LEASE_TEST_URL="sqlite://",
    )
    line = assert_one_line_error(refused, 2)
    assert "lease" in line and "unrecognized" not in line, line
