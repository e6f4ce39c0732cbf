"""Jobs that crash their worker process are stopped from looping by the crash ledger.

Each test runs crashers/crash_worker.py, which forks real worker processes one after
another against the test's database. A ``crash`` job kills its worker (SIGKILL,
``os._exit(137)`` or a segfault); the run record it leaves in proletarian_job_run is an
unclean end, and after ``max_unclean_ends`` of them the next worker archives the job as failed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database

CRASH_WORKER = Path(__file__).parent / "crashers" / "crash_worker.py"
CRASH_SIGNAL = {"sigkill": signal.SIGKILL, "segfault": signal.SIGSEGV}


def run_workers(
    database: Database, state: Path, *, max_unclean_ends: int | None = 3, rounds: int = 10
) -> list[dict[str, Any]]:
    """Run worker processes one after another until the job table is empty; their reports."""
    limit = "none" if max_unclean_ends is None else str(max_unclean_ends)
    url = database.url.render_as_string(hide_password=False)
    command = [sys.executable, str(CRASH_WORKER), url, str(state), "--rounds", str(rounds)]
    command += ["--max-unclean-ends", limit]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def enqueue_jobs(engine: sa.Engine, *jobs: tuple[str, Any]) -> list[uuid.UUID]:
    with Session(engine) as session:
        ids = [sp.enqueue(session, job_type, payload) for job_type, payload in jobs]
        session.commit()
    return ids


def archived(engine: sa.Engine) -> dict[uuid.UUID, sp.ArchivedJob]:
    with Session(engine) as session:
        return {row.job_id: row for row in session.scalars(sa.select(sp.ArchivedJob))}


def table_count(engine: sa.Engine, model: type[sp.Job] | type[sp.JobRun]) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(model)) or 0)


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def crashed(report: dict[str, Any], how: str) -> bool:
    """Whether a worker round ended the way the crash ``how`` ends a process."""
    if how == "exit":
        return report["exit"] == 137
    return report["signal"] == CRASH_SIGNAL[how]


def test_a_job_that_keeps_killing_its_worker_is_archived_as_failed_after_three_unclean_ends(
    engine: sa.Engine, database: Database, tmp_path: Path
) -> None:
    """Three SIGKILLed runs, then the 4th worker archives the job as crashed, calls the
    failed-job handler, and runs the job queued behind it."""
    crasher, follower = enqueue_jobs(
        engine, ("crash", {"how": "sigkill", "times": None}), ("record", {})
    )

    reports = run_workers(database, tmp_path)

    assert [crashed(r, "sigkill") for r in reports] == [True, True, True, False]
    assert reports[-1]["exit"] == 0
    # Each crash leaves one more run record behind: the ledger counts unclean ends.
    assert [r["ledger_rows"] for r in reports] == [1, 2, 3, 0]
    assert lines(tmp_path / "runs").count(str(crasher)) == 3
    jobs = archived(engine)
    assert jobs[crasher].status == "failure"
    assert jobs[crasher].attempts == 3
    assert "JobCrashedError" in (jobs[crasher].error or "")
    assert "crashed its worker" in (jobs[crasher].error or "")
    assert "3 runs ended without an outcome" in (jobs[crasher].error or "")
    assert jobs[follower].status == "success"
    assert lines(tmp_path / "done") == [str(follower)]
    failed = [json.loads(line) for line in lines(tmp_path / "failed")]
    assert [(f["job_id"], f["error_type"]) for f in failed] == [(str(crasher), "JobCrashedError")]
    assert "crashed its worker" in failed[0]["error"]
    assert table_count(engine, sp.Job) == 0
    assert table_count(engine, sp.JobRun) == 0


def test_one_crash_alone_never_fails_a_job(
    engine: sa.Engine, database: Database, tmp_path: Path
) -> None:
    """A job whose first run exits the worker with os._exit(137) runs again and succeeds."""
    (job_id,) = enqueue_jobs(engine, ("crash", {"how": "exit", "times": 1}))

    reports = run_workers(database, tmp_path)

    assert [crashed(r, "exit") for r in reports] == [True, False]
    assert reports[-1]["exit"] == 0
    assert [r["ledger_rows"] for r in reports] == [1, 0]
    job = archived(engine)[job_id]
    assert job.status == "success"
    assert job.error is None
    assert lines(tmp_path / "runs") == [str(job_id)] * 2
    assert lines(tmp_path / "failed") == []
    assert table_count(engine, sp.JobRun) == 0


def test_max_unclean_ends_one_fails_a_segfaulting_job_after_its_first_crash(
    engine: sa.Engine, database: Database, tmp_path: Path
) -> None:
    """With max_unclean_ends=1 one segfault is enough: the next worker archives it as crashed."""
    crasher, follower = enqueue_jobs(
        engine, ("crash", {"how": "segfault", "times": None}), ("record", {})
    )

    reports = run_workers(database, tmp_path, max_unclean_ends=1)

    assert [crashed(r, "segfault") for r in reports] == [True, False]
    assert reports[-1]["exit"] == 0
    assert [r["ledger_rows"] for r in reports] == [1, 0]
    assert lines(tmp_path / "runs").count(str(crasher)) == 1
    jobs = archived(engine)
    assert jobs[crasher].status == "failure"
    assert "crashed its worker" in (jobs[crasher].error or "")
    assert jobs[follower].status == "success"
    failed = [json.loads(line) for line in lines(tmp_path / "failed")]
    assert [(f["job_id"], f["error_type"]) for f in failed] == [(str(crasher), "JobCrashedError")]
    assert table_count(engine, sp.JobRun) == 0


def test_max_unclean_ends_none_keeps_no_ledger_and_never_fails_a_crashing_job(
    engine: sa.Engine, database: Database, tmp_path: Path
) -> None:
    """With the ledger off no run is recorded, so four crashes do not fail the job."""
    (job_id,) = enqueue_jobs(engine, ("crash", {"how": "sigkill", "times": 4}))

    reports = run_workers(database, tmp_path, max_unclean_ends=None)

    assert [crashed(r, "sigkill") for r in reports] == [True] * 4 + [False]
    assert reports[-1]["exit"] == 0
    assert [r["ledger_rows"] for r in reports] == [0] * 5
    assert lines(tmp_path / "runs") == [str(job_id)] * 5
    job = archived(engine)[job_id]
    assert job.status == "success"
    assert lines(tmp_path / "failed") == []
    assert table_count(engine, sp.JobRun) == 0
