"""Run worker processes one after another against a database; some jobs crash their worker.

Used by tests/integration/test_crash_loop.py. The parent imports everything once, then forks
one worker process per round (a real process that really dies: SIGKILL, ``os._exit(137)``
or a segfault), waits for it, and prints one JSON line per round to stdout:
``{"round": n, "exit": code or null, "signal": signum or null, "jobs_left": n,
"ledger_rows": n}``. It stops once the job table is empty, or after ``--rounds`` rounds.

Job types the worker handles (advanced handler mode):

- ``crash``: payload ``{"how": "sigkill" | "exit" | "segfault", "times": n | null}``;
  crashes the worker on its first ``times`` runs (every run when null), then succeeds.
- ``record``: succeeds.

Every handler run appends the job id to ``STATE/runs``; every failed-job-handler call
appends a JSON line ``{"job_id", "error_type", "error"}`` to ``STATE/failed``; every
successful ``record`` run appends its job id to ``STATE/done``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import sqlalchemy as sa

import sqla_proletarian as sp


def append(path: Path, line: str) -> None:
    with path.open("a", encoding="utf-8") as file:
        file.write(line + "\n")


def runs_of(state: Path, job_id: str) -> int:
    path = state / "runs"
    if not path.exists():
        return 0
    return path.read_text(encoding="utf-8").split().count(job_id)


def crash(how: str) -> None:
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(137)
    elif how == "segfault":
        ctypes.string_at(0)
    raise AssertionError(f"still alive after crash {how!r}")


def work(url: str, state: Path, max_unclean_ends: int | None, queue: str) -> None:
    """One worker process: run jobs until the queue has none left that it can claim."""

    def handler(job: sp.JobContext) -> None:
        job_id = str(job.job_id)
        previous_runs = runs_of(state, job_id)
        append(state / "runs", job_id)
        if job.job_type == "crash":
            times = job.payload.get("times")
            if times is None or previous_runs < times:
                crash(job.payload["how"])
        elif job.job_type == "record":
            append(state / "done", job_id)
        else:
            raise ValueError(f"unexpected job type {job.job_type!r}")

    def failed_job_handler(job: sp.JobContext, exc: Exception) -> None:
        record = {"job_id": str(job.job_id), "error_type": type(exc).__name__, "error": str(exc)}
        append(state / "failed", json.dumps(record))

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        while sp.process_next_job(
            engine,
            handler,
            handler_mode="advanced",
            failed_job_handler=failed_job_handler,
            max_unclean_ends=max_unclean_ends,
            queue=queue,
            # The dead worker before this one is gone for good: count its run at once.
            reconnect_grace=0,
        ):
            pass
    finally:
        engine.dispose()


#: Open transactions of other sessions on this database: a dead worker's claim lingers
#: until the server notices the closed connection and rolls it back.
OTHER_TRANSACTIONS = {
    "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND pid <> pg_backend_pid() AND state <> 'idle'",
    "mysql": "SELECT count(*) FROM information_schema.innodb_trx AS t "
    "JOIN information_schema.processlist AS p ON p.id = t.trx_mysql_thread_id "
    "WHERE p.db = database() AND p.id <> connection_id()",
}


def settle(conn: sa.Connection) -> None:
    """Wait until the server has rolled back a dead worker's claim."""
    query = OTHER_TRANSACTIONS.get(conn.dialect.name)
    deadline = time.monotonic() + 10
    while query is not None and conn.exec_driver_sql(query).scalar():
        if time.monotonic() > deadline:
            raise TimeoutError("a dead worker's transaction was not rolled back within 10 s")
        conn.rollback()
        time.sleep(0.01)
    conn.rollback()


def table_counts(url: str) -> tuple[int, int]:
    """Rows left in the job table and in the crash ledger, once the dead worker's gone."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            settle(conn)
            jobs = conn.scalar(sa.select(sa.func.count()).select_from(sp.Job.__table__))
            runs = conn.scalar(sa.select(sa.func.count()).select_from(sp.JobRun.__table__))
        return int(jobs or 0), int(runs or 0)
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("state", type=Path)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-unclean-ends", default="3")
    parser.add_argument("--queue", default=sp.DEFAULT_QUEUE)
    args = parser.parse_args()
    limit = None if args.max_unclean_ends == "none" else int(args.max_unclean_ends)
    for number in range(1, args.rounds + 1):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                work(args.url, args.state, limit, args.queue)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        jobs_left, ledger_rows = table_counts(args.url)
        report = {
            "round": number,
            "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "jobs_left": jobs_left,
            "ledger_rows": ledger_rows,
        }
        print(json.dumps(report), flush=True)
        if jobs_left == 0:
            return


if __name__ == "__main__":
    main()
