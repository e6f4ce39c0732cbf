"""The fault suite's machinery: the database side (enqueue, observe, inject faults, check).

Every scenario enqueues a known set of committed jobs, runs real worker processes
(``programs/fault_worker.py``), injects its fault, lets the system recover, and then checks
from the database that every job was archived exactly once with the status its handler and
retry strategy call for, that the queue and the crash ledger are empty, and how many jobs ran
more than once. Each scenario adds one row to ``fault_report.RESULTS``, which the conftest prints
as a table at the end of the run.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa

import sqla_proletarian as sp

T = TypeVar("T")

PROGRAM = Path(__file__).parent / "programs" / "fault_worker.py"
_spec = importlib.util.spec_from_file_location("fault_worker_program", PROGRAM)
assert _spec is not None and _spec.loader is not None
fault_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fault_worker)
#: The table where the worker program records each handler run (job_id, pid).
RUNS: sa.Table = fault_worker.RUNS
#: The handler's writes through job.session (``--effects``), in the same MetaData.
EFFECTS: sa.Table = fault_worker.EFFECTS

JOB = sp.Job.__table__
ARCHIVE = sp.ArchivedJob.__table__
LEDGER = sp.JobRun.__table__


@dataclass(frozen=True)
class Expect:
    """What a job of one kind ends as when nothing goes wrong: status, attempts, runs."""

    status: str
    attempts: int
    runs: int


#: The worker program retries once: ``flaky`` succeeds on its 2nd run, ``bad`` fails twice.
KINDS = {
    "ok": Expect("success", 1, 1),
    "flaky": Expect("success", 2, 2),
    "bad": Expect("failure", 2, 2),
    "slow": Expect("success", 1, 1),
    # Longer than the scenario's idle-transaction limit on every run: charged twice, failed.
    "long": Expect("failure", 2, 2),
}


def job_mix(count: int) -> list[str]:
    """Mostly ``ok`` jobs, one in ten ``flaky`` and one in ten ``bad``."""
    return ["flaky" if i % 10 == 3 else "bad" if i % 10 == 7 else "ok" for i in range(count)]


def is_transient_error(exc: BaseException) -> bool:
    """Whether a test-side database error is worth retrying (restart, killed session, lock)."""
    return isinstance(exc, sa.exc.DBAPIError) and (
        exc.connection_invalidated or sp.errors.is_transient(exc)
    )


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll ``condition`` until it is true (True) or ``timeout`` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# --- the database -------------------------------------------------------------------------


class FaultDatabase:
    """A scenario's fresh database seen from the test: enqueue, observe, inject faults."""

    def __init__(self, backend: str, url: sa.URL, engine: sa.Engine) -> None:
        self.backend = backend
        self.url = url.render_as_string(hide_password=False)
        #: NullPool: every query gets a new connection, so a restart or kill never leaves a
        #: stale one behind.
        self.engine = engine
        self.jobs: dict[uuid.UUID, str] = {}
        self.retrying(lambda: RUNS.metadata.create_all(self.engine))
        self._server_started = self.server_started()

    def server_started(self) -> float:
        """When the server last started (epoch seconds; MariaDB's to the second)."""
        if self.backend == "postgresql":
            query = sa.text("SELECT EXTRACT(EPOCH FROM pg_postmaster_start_time())")
        else:
            query = sa.text(
                "SELECT UNIX_TIMESTAMP() - VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS "
                "WHERE VARIABLE_NAME = 'UPTIME'"
            )
        return float(self.scalar(query))

    def restarted_by_others(self) -> bool:
        """Whether the server was restarted during the scenario by someone else (the servers
        are shared with other test runs): then the duplicates it caused are not ours to judge."""
        return abs(self.server_started() - self._server_started) > 2

    def retrying(self, action: Callable[[], T], deadline: float = 60.0) -> T:
        """Run ``action``, retrying while the server restarts or kills our session."""
        end = time.monotonic() + deadline
        while True:
            try:
                return action()
            except sa.exc.DBAPIError as exc:
                if not is_transient_error(exc) or time.monotonic() > end:
                    raise
                time.sleep(0.1)

    def scalar(self, query: sa.Executable) -> Any:
        def run() -> Any:
            with self.engine.connect() as conn:
                return conn.execute(query).scalar()

        return self.retrying(run)

    def enqueue(self, kinds: Iterable[str], engine: sa.Engine | None = None) -> list[uuid.UUID]:
        """Enqueue one job per kind in one transaction and remember them."""
        batch = [(uuid.uuid4(), kind) for kind in kinds]
        engine = engine or self.engine

        attempts: list[int] = []

        def insert() -> None:
            # A retry after a commit whose reply was lost must not enqueue the batch twice.
            first = batch[0][0]
            if attempts and self.exists(first):
                return
            attempts.append(1)
            with engine.begin() as conn:
                for job_id, kind in batch:
                    sp.enqueue(conn, "fault", {"kind": kind}, job_id=job_id)

        self.retrying(insert)
        self.jobs.update(batch)
        return [job_id for job_id, _ in batch]

    def exists(self, job_id: uuid.UUID) -> bool:
        with self.engine.connect() as conn:
            for table in (JOB, ARCHIVE):
                query = sa.select(sa.func.count()).select_from(table)
                if conn.execute(query.where(table.c.job_id == job_id)).scalar():
                    return True
        return False

    def pending(self) -> int:
        return int(self.scalar(sa.select(sa.func.count()).select_from(JOB)))

    def archived(self) -> int:
        return int(self.scalar(sa.select(sa.func.count()).select_from(ARCHIVE)))

    def wait_archived(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.archived() >= count:
                return True
            time.sleep(0.05)
        return False

    def wait_drained(
        self, since: float, timeout: float, give_up: Callable[[], bool] = lambda: False
    ) -> float | None:
        """Wait until every enqueued job is archived; seconds since ``since`` (monotonic).

        None after ``timeout`` seconds, or as soon as ``give_up()`` (no worker left).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not give_up():
            if self.pending() == 0 and self.archived() >= len(self.jobs):
                return time.monotonic() - since
            time.sleep(0.05)
        return None

    def first_archived_after(self, wall: float) -> float | None:
        """Seconds from ``wall`` (time.time()) to the first job archived after it."""
        moment = datetime.fromtimestamp(wall, tz=UTC)
        first = self.scalar(
            sa.select(sa.func.min(ARCHIVE.c.finished_at)).where(ARCHIVE.c.finished_at > moment)
        )
        return None if first is None else max(0.0, first.timestamp() - wall)

    def archived_at(self, job_id: uuid.UUID) -> float | None:
        when = self.scalar(sa.select(ARCHIVE.c.finished_at).where(ARCHIVE.c.job_id == job_id))
        return None if when is None else float(when.timestamp())

    def runs_of(self, job_id: uuid.UUID) -> list[tuple[int, int]]:
        """(pid, attempt) of each recorded run of a job."""

        def read() -> list[tuple[int, int]]:
            with self.engine.connect() as conn:
                query = sa.select(RUNS.c.pid, RUNS.c.attempt).where(RUNS.c.job_id == str(job_id))
                return [(pid, attempt) for pid, attempt in conn.execute(query)]

        return self.retrying(read)

    def run_count(self, job_id: uuid.UUID) -> int:
        query = sa.select(sa.func.count()).select_from(RUNS)
        return int(self.scalar(query.where(RUNS.c.job_id == str(job_id))))

    # --- faults -----------------------------------------------------------------------------

    def terminate_connections(self) -> int:
        """End every other session on this database from the server side; how many."""

        def run() -> int:
            with self.engine.connect() as conn:
                if self.backend == "postgresql":
                    rows = conn.exec_driver_sql(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    ).all()
                    return sum(1 for (ok,) in rows if ok)
                ids = conn.exec_driver_sql(
                    "SELECT id FROM information_schema.processlist "
                    "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
                ).all()
                killed = 0
                for (session_id,) in ids:
                    try:
                        conn.exec_driver_sql(f"KILL {int(session_id)}")
                        killed += 1
                    except sa.exc.DBAPIError:
                        pass  # it ended by itself meanwhile
                return killed

        return self.retrying(run)

    def restart_server(self) -> None:
        """Restart this backend's server, keeping its data (shared with other test runs)."""
        subprocess.run(
            [os.environ["SP_TESTDB_SCRIPT"], "restart", self.backend],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=90,
        )
        self._server_started = self.server_started()

    # --- the check --------------------------------------------------------------------------

    def check(
        self,
        starts: Counter[str],
        strict: bool,
        rolled_back: Counter[str] | None = None,
        effects: bool = False,
    ) -> Check:
        """Everything the scenario promises, read from the database.

        ``starts`` counts the handler starts of each job (from the workers' ``start`` lines);
        ``rolled_back`` the runs a live worker gave up (lock conflict, lost connection: not
        counted). The archive's ``attempts`` counts every run with an outcome and every run
        that ended with its worker (killed), so it is the attempts the job's kind calls for
        plus its unclean ends; ``strict`` says no run may have ended uncleanly. ``effects``:
        the handlers wrote through job.session, so each succeeded job must have its writes
        committed exactly once, and each failed one none.
        """

        def read() -> tuple[list[Any], list[Any], set[uuid.UUID], int, list[Any]]:
            with self.engine.connect() as conn:
                archived = conn.execute(
                    sa.select(
                        ARCHIVE.c.job_id, ARCHIVE.c.status, ARCHIVE.c.attempts, ARCHIVE.c.error
                    )
                ).all()
                runs = conn.execute(sa.select(RUNS.c.job_id)).all()
                queued = set(conn.execute(sa.select(JOB.c.job_id)).scalars())
                ledger = conn.execute(sa.select(sa.func.count()).select_from(LEDGER)).scalar()
                written = conn.execute(sa.select(EFFECTS.c.job_id)).all()
            return archived, runs, queued, int(ledger or 0), written

        archived, run_rows, queued, ledger, written = self.retrying(read)
        runs = Counter(uuid.UUID(job_id) for (job_id,) in run_rows)
        committed = Counter(uuid.UUID(job_id) for (job_id,) in written)
        by_id = {row.job_id: row for row in archived}
        result = Check(jobs=len(self.jobs), pending=len(queued), ledger=ledger)
        result.disturbed = self.restarted_by_others()
        strict = strict and not result.disturbed
        result.archive_rows = len(archived)
        result.unexpected = [job_id for job_id in by_id if job_id not in self.jobs]
        for job_id, kind in self.jobs.items():
            expect = KINDS[kind]
            row = by_id.get(job_id)
            if row is None:
                if job_id not in queued:
                    result.lost.append(job_id)
                continue
            unclean = row.attempts - expect.attempts
            result.unclean += max(0, unclean)
            started = starts[str(job_id)]
            wrong = []
            if row.status != expect.status:
                wrong.append(f"{row.status}, expected {expect.status}")
            if unclean < 0 or (strict and unclean):
                wrong.append(f"{row.attempts} attempts, expected {expect.attempts}")
            if started > row.attempts + (rolled_back or Counter())[str(job_id)]:
                wrong.append(f"{row.attempts} attempts counted for {started} handler starts")
            if runs[job_id] < expect.runs:
                wrong.append(f"archived after {runs[job_id]} complete handler runs")
            if wrong:
                result.wrong_ids.append(job_id)
                result.wrong.append(f"{job_id} ({kind}): {', '.join(wrong)}; error {row.error}")
            if runs[job_id] > expect.runs:
                result.duplicated.append(job_id)
            if effects and committed[job_id] != (row.status == "success"):
                result.effects_wrong.append(
                    f"{job_id} ({kind}, {row.status}): its handler's writes committed "
                    f"{committed[job_id]} times"
                )
        return result


@dataclass
class Check:
    """What the database says after a scenario."""

    jobs: int
    pending: int
    ledger: int
    archive_rows: int = 0
    #: Jobs neither archived nor still queued: gone.
    lost: list[uuid.UUID] = field(default_factory=list)
    duplicated: list[uuid.UUID] = field(default_factory=list)
    unexpected: list[uuid.UUID] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    wrong_ids: list[uuid.UUID] = field(default_factory=list)
    #: Runs that ended without an outcome, as the archive's attempts count them.
    unclean: int = 0
    #: Someone else restarted the server meanwhile: unclean ends and reruns are excused.
    disturbed: bool = False
    #: Jobs that ran twice at the same time (never allowed: the fleet's start/done lines).
    overlapping: list[str] = field(default_factory=list)
    #: Jobs whose handler's job.session writes were not committed once (success) or not at
    #: all (failure), with ``--effects``.
    effects_wrong: list[str] = field(default_factory=list)

    def problems(self, max_duplicated: int) -> list[str]:
        found = []
        if self.lost:
            found.append(f"{len(self.lost)} jobs lost, e.g. {self.lost[:3]}")
        if self.unexpected:
            found.append(f"{len(self.unexpected)} archived jobs nobody enqueued")
        if self.archive_rows != self.jobs:
            found.append(f"{self.archive_rows} archive rows for {self.jobs} jobs")
        if self.pending:
            found.append(f"{self.pending} jobs still in the job table")
        if self.ledger:
            found.append(f"{self.ledger} run records left in the crash ledger")
        if self.wrong:
            found.append(f"{len(self.wrong)} jobs ended wrongly: " + "; ".join(self.wrong[:3]))
        if self.effects_wrong:
            found.append(
                f"{len(self.effects_wrong)} jobs' handler writes committed wrongly: "
                + "; ".join(self.effects_wrong[:3])
            )
        if self.overlapping:
            found.append(
                f"{len(self.overlapping)} jobs ran twice at the same time, e.g. "
                f"{self.overlapping[:3]}"
            )
        if len(self.duplicated) > max_duplicated and not self.disturbed:
            found.append(
                f"{len(self.duplicated)} jobs ran more than once, at most {max_duplicated} "
                "allowed here"
            )
        return found
