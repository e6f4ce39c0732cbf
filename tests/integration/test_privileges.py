"""Least privilege: a worker role and an enqueue-only role work with exactly the grants
docs/privileges.md lists, on PostgreSQL and MariaDB, and every one of those grants is needed.

Each test creates its roles (PostgreSQL roles are cluster-wide: unique names) in the test's
fresh database, with PUBLIC's default rights on that database revoked, and drops them after.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import FakeClock
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.errors import driver_error, mysql_errno, sqlstate
from sqla_proletarian.models import Dependency, Progress
from sqla_proletarian.periodic import PeriodicJob, Scheduler

if TYPE_CHECKING:
    from conftest import Database

SERVER_BACKENDS = [
    name
    for name in ("postgresql", "mariadb")
    if name in os.environ.get("SP_TEST_BACKENDS", "postgresql,mariadb").split(",")
]
pytestmark = pytest.mark.parametrize("empty_database", SERVER_BACKENDS, indirect=True)

DEPENDENCY = Dependency.__table__
PROGRESS = Progress.__table__

#: (privilege, object) pairs: the grants of docs/privileges.md, one privilege each.
Grant = tuple[str, str]

WORKER_GRANTS: list[Grant] = [
    ("SELECT", "proletarian_job"),
    ("UPDATE", "proletarian_job"),
    ("DELETE", "proletarian_job"),
    # The archive insert is an upsert (a job id archived before is replaced), which reads
    # the columns it sets: SELECT as well as INSERT and UPDATE.
    ("SELECT", "proletarian_archived_job"),
    ("INSERT", "proletarian_archived_job"),
    ("UPDATE", "proletarian_archived_job"),
    ("SELECT", "proletarian_job_run"),
    ("INSERT", "proletarian_job_run"),
    ("DELETE", "proletarian_job_run"),
    # Each poll checks whether its queue is paused, and whether it has limits.
    ("SELECT", "proletarian_paused_queue"),
    ("SELECT", "proletarian_queue_limit"),
    # Each job's end settles its dependents (their rows locked: FOR UPDATE needs UPDATE on
    # PostgreSQL, and the settled rows are updated) and deletes its waiters' rows.
    ("SELECT", "proletarian_dependency"),
    ("UPDATE", "proletarian_dependency"),
    ("DELETE", "proletarian_dependency"),
]
#: What a worker whose handlers report progress (``job.set_progress``) needs besides: its
#: upsert of the job's row, which reads the columns it sets (as the archive's).
PROGRESS_GRANTS: list[Grant] = [
    ("SELECT", "proletarian_progress"),
    ("INSERT", "proletarian_progress"),
    ("UPDATE", "proletarian_progress"),
]
#: What a worker of queues with limits needs besides: the limit rows' locks (a rate's
#: reservations take turns on them; FOR UPDATE needs UPDATE on PostgreSQL), the slots it
#: locks, makes (per key) and names (lease mode), and the starts a rate limit counts.
FLOW_GRANTS: list[Grant] = [
    ("UPDATE", "proletarian_queue_limit"),
    ("SELECT", "proletarian_slot"),
    ("INSERT", "proletarian_slot"),
    ("UPDATE", "proletarian_slot"),
    ("SELECT", "proletarian_start"),
    ("INSERT", "proletarian_start"),
    ("DELETE", "proletarian_start"),
]
#: What a worker with periodic jobs needs besides: its schedules' records, and enqueueing.
PERIODIC_GRANTS: dict[str, list[Grant]] = {
    "postgresql": [
        ("SELECT", "proletarian_periodic"),
        ("INSERT", "proletarian_periodic"),
        ("UPDATE", "proletarian_periodic"),
        ("INSERT", "proletarian_job"),
        ("USAGE", "SEQUENCE proletarian_job_seq_seq"),
    ],
    "mariadb": [
        ("SELECT", "proletarian_periodic"),
        ("INSERT", "proletarian_periodic"),
        ("UPDATE", "proletarian_periodic"),
        ("INSERT", "proletarian_job"),
    ],
}
#: What an enqueuing role needs besides for jobs with a unique key: reading the holder's id.
UNIQUE_KEY_GRANTS: list[Grant] = [("SELECT (job_id, queue, unique_key)", "proletarian_job")]
#: An enqueue with depends_on reads which dependencies are queued (their ids) and how the
#: others ended (the archive's ids and statuses), and writes the dependent's rows.
DEPENDS_ON_GRANTS: list[Grant] = [
    ("SELECT (job_id)", "proletarian_job"),
    ("SELECT (job_id, status)", "proletarian_archived_job"),
    ("INSERT", "proletarian_dependency"),
]
#: And to archive a dependent of a failed job as cancelled at once (the archive's upsert).
CANCELLED_AT_ONCE_GRANTS: list[Grant] = [
    ("SELECT", "proletarian_archived_job"),
    ("INSERT", "proletarian_archived_job"),
    ("UPDATE", "proletarian_archived_job"),
]
ENQUEUER_GRANTS: dict[str, list[Grant]] = {
    # BIGSERIAL's nextval() needs USAGE on its sequence. A Session's flush of one job reads
    # back the server-made seq (INSERT ... RETURNING seq: one round trip, not a nextval()
    # first), which needs SELECT on that one column; payloads stay unreadable.
    "postgresql": [
        ("INSERT", "proletarian_job"),
        ("SELECT (seq)", "proletarian_job"),
        ("USAGE", "SEQUENCE proletarian_job_seq_seq"),
    ],
    "mariadb": [("INSERT", "proletarian_job")],
}

#: MariaDB's any-host wildcard '%', doubled because pymysql %-formats driver SQL.
ANY_HOST = "%%"
PG_INSUFFICIENT_PRIVILEGE = "42501"
#: MariaDB: database, table and column access denied.
MARIADB_ACCESS_DENIED = {1044, 1142, 1143}


def permission_denied(exc: BaseException) -> bool:
    """Whether a database error is the server refusing for lack of a privilege."""
    # SQLAlchemy 2.0 wraps an ORM flush's DBAPIError in a StatementError.
    orig = driver_error(exc)
    if orig is None:
        return False
    if sqlstate(orig) == PG_INSUFFICIENT_PRIVILEGE:
        return True
    return mysql_errno(orig) in MARIADB_ACCESS_DENIED


@dataclass
class Role:
    """A login role/user on the test database and an engine connected as it."""

    backend: str
    name: str
    engine: sa.Engine
    admin: sa.Engine
    database: str

    def _account(self) -> str:
        return self.name if self.backend == "postgresql" else f"'{self.name}'@'{ANY_HOST}'"

    def _target(self, obj: str) -> str:
        return obj if self.backend == "postgresql" else f"`{self.database}`.`{obj}`"

    def grant(self, grant: Grant) -> None:
        privilege, obj = grant
        self.admin_sql(f"GRANT {privilege} ON {self._target(obj)} TO {self._account()}")

    def revoke(self, grant: Grant) -> None:
        privilege, obj = grant
        self.admin_sql(f"REVOKE {privilege} ON {self._target(obj)} FROM {self._account()}")

    def admin_sql(self, statement: str) -> None:
        with self.admin.connect() as conn:
            conn.exec_driver_sql(statement)


@dataclass
class Roles:
    """Makes roles with given grants; drops them all at teardown."""

    database: Database
    admin: sa.Engine
    made: list[Role] = field(default_factory=list)

    @property
    def backend(self) -> str:
        return self.database.backend

    def make(self, kind: str, grants: list[Grant]) -> Role:
        name = f"sp_{kind}_{uuid.uuid4().hex[:8]}"
        password = uuid.uuid4().hex
        dbname = self.database.url.database
        assert dbname is not None
        with self.admin.connect() as conn:
            if self.backend == "postgresql":
                conn.exec_driver_sql(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
                conn.exec_driver_sql(f"GRANT CONNECT ON DATABASE {dbname} TO {name}")
                conn.exec_driver_sql(f"GRANT USAGE ON SCHEMA public TO {name}")
            else:
                conn.exec_driver_sql(
                    f"CREATE USER '{name}'@'{ANY_HOST}' IDENTIFIED BY '{password}'"
                )
        url = self.database.url.set(username=name, password=password)
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        role = Role(self.backend, name, engine, self.admin, dbname)
        self.made.append(role)
        for grant in grants:
            role.grant(grant)
        return role

    def drop_all(self) -> None:
        for role in self.made:
            role.engine.dispose()
            with self.admin.connect() as conn:
                if self.backend == "postgresql":
                    conn.exec_driver_sql(f"DROP OWNED BY {role.name}")
                    conn.exec_driver_sql(f"DROP ROLE {role.name}")
                else:
                    conn.exec_driver_sql(f"DROP USER IF EXISTS '{role.name}'@'{ANY_HOST}'")


@pytest.fixture
def roles(database: Database) -> Iterator[Roles]:
    """Roles on the test database, which PUBLIC may not use unless granted."""
    admin = database.engine(isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    if database.backend == "postgresql":
        with admin.connect() as conn:
            conn.exec_driver_sql(f"REVOKE ALL ON DATABASE {database.url.database} FROM PUBLIC")
            conn.exec_driver_sql("REVOKE ALL ON SCHEMA public FROM PUBLIC")
    made = Roles(database, admin)
    try:
        yield made
    finally:
        made.drop_all()


# --- what each role does ------------------------------------------------------------------


def enqueue_as_admin(engine: sa.Engine, queue: str, *job_types: str) -> dict[str, uuid.UUID]:
    with Session(engine) as session:
        ids = {job_type: sp.enqueue(session, job_type, {}, queue=queue) for job_type in job_types}
        session.commit()
    return ids


def leave_unclean_end(engine: sa.Engine, job_id: uuid.UUID) -> None:
    """A run record with no outcome, as a worker that died mid-job leaves behind."""
    with engine.begin() as conn:
        conn.execute(
            sa.insert(sp.JobRun.__table__).values(
                run_id=uuid.uuid4(),
                job_id=job_id,
                worker_id="a worker that died",
                started_at=datetime.now(UTC),
            )
        )


def work_off(worker: Role, queue: str, max_unclean_ends: int | None) -> list[str]:
    """Run the queue dry as the worker role: success, a retry, a failure and a crash, in
    claims of up to two jobs."""
    flaked: set[str] = set()
    failed: list[str] = []

    def handler(job_type: str, payload: Any) -> None:
        if job_type == "flaky" and job_type not in flaked:
            flaked.add(job_type)
            raise RuntimeError("first run fails")
        if job_type == "doomed":
            raise RuntimeError("always fails")

    def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy | None:
        return sp.RetryStrategy(1) if job.job_type == "flaky" else None

    while sp.process_next_job(
        worker.engine,
        handler,
        queue=queue,
        retry_strategy=retry_strategy,
        failed_job_handler=lambda job, exc: failed.append(type(exc).__name__),
        max_unclean_ends=max_unclean_ends,
        batch_size=2,
    ):
        pass
    return failed


def exercise_worker(admin: sa.Engine, worker: Role, queue: str, *, ledger: bool = True) -> None:
    """Jobs to success, retry and failure run by the worker role; with the crash ledger on,
    also a job that already crashed a worker, which is archived as crashed."""
    expected = {"ok": ("success", 1), "flaky": ("success", 2), "doomed": ("failure", 1)}
    if ledger:
        expected["crashed"] = ("failure", 1)
    ids = enqueue_as_admin(admin, queue, *expected)
    # A job waiting for "ok", and a wait_for_result caller's row on it.
    with admin.begin() as conn:
        sp.enqueue(conn, "then", {}, queue=queue, depends_on=[ids["ok"]])
        conn.execute(
            sa.insert(DEPENDENCY),
            {"job_id": uuid.uuid4(), "depends_on": ids["ok"], "kind": "wait", "pending": True},
        )
    expected["then"] = ("success", 1)
    if ledger:
        leave_unclean_end(admin, ids["crashed"])
    failed = work_off(worker, queue, 1 if ledger else None)
    assert sorted(failed) == (["JobCrashedError", "RuntimeError"] if ledger else ["RuntimeError"])
    with Session(admin) as session:
        archived = {
            row.job_type: (row.status, row.attempts)
            for row in session.scalars(
                sa.select(sp.ArchivedJob).where(sp.ArchivedJob.queue == queue)
            )
        }
        assert archived == expected
        runs = session.scalar(
            sa.select(sa.func.count())
            .select_from(sp.JobRun)
            .where(sp.JobRun.job_id.in_(ids.values()))
        )
        assert runs == 0
        left = session.scalar(
            sa.select(sa.func.count()).select_from(sp.Job).where(sp.Job.queue == queue)
        )
        assert left == 0
        settled = session.execute(
            sa.select(DEPENDENCY.c.kind, DEPENDENCY.c.pending).where(
                DEPENDENCY.c.depends_on == ids["ok"]
            )
        ).all()
        assert [tuple(row) for row in settled] == [("cancel", False)]  # the wait row is gone


def enqueue_both_ways(enqueuer: Role, queue: str) -> list[uuid.UUID]:
    with Session(enqueuer.engine) as session:
        first = sp.enqueue(session, "from-session", {"n": 1}, queue=queue)
        session.commit()
    with enqueuer.engine.begin() as conn:
        second = sp.enqueue(conn, "from-connection", {"n": 2}, queue=queue)
    return [first, second]


def assert_refused(action: Callable[[], object]) -> None:
    with pytest.raises(sa.exc.StatementError) as info:
        action()
    assert permission_denied(info.value), info.value


# --- tests --------------------------------------------------------------------------------


def test_a_worker_role_runs_jobs_with_exactly_the_documented_grants(
    roles: Roles, engine: sa.Engine
) -> None:
    """With only the worker grants, jobs run to success, retry, failure and crash-failure,
    and the crash ledger records and clears its rows."""
    worker = roles.make("worker", list(WORKER_GRANTS))
    exercise_worker(engine, worker, "work")


def test_a_worker_without_the_crash_ledger_only_removes_leftover_run_records(
    roles: Roles, engine: sa.Engine
) -> None:
    """With max_unclean_ends=None the worker writes no run records; it only deletes those
    left by earlier runs when their job leaves the queue (SELECT and DELETE)."""
    ledger_grants = [("INSERT", "proletarian_job_run")]
    grants = list(WORKER_GRANTS)
    worker = roles.make("worker", [g for g in grants if g not in ledger_grants])
    exercise_worker(engine, worker, "no-ledger", ledger=False)


@pytest.mark.parametrize("lease", [False, True], ids=["transaction", "lease"])
def test_a_worker_role_with_the_flow_grants_runs_a_limited_queue(
    roles: Roles, engine: sa.Engine, lease: bool
) -> None:
    """With the worker grants and the flow-control ones, a queue with every kind of limit
    is drained, in both modes."""
    worker = roles.make("worker", [*WORKER_GRANTS, *FLOW_GRANTS])
    with engine.begin() as conn:
        sp.set_queue_limits(
            conn,
            "limited",
            max_running=2,
            max_running_per_key=1,
            rate_limit=(100, 1.0),
            rate_limit_per_key=(100, 1.0),
        )
        for n in range(6):
            sp.enqueue(conn, "ok", {"n": n}, queue="limited", concurrency_key=f"k{n % 2}")
    ran: list[Any] = []
    options: dict[str, Any] = {"lease_seconds": 30.0} if lease else {}
    deadline = time.monotonic() + 30
    while len(ran) < 6 and time.monotonic() < deadline:
        if not sp.process_next_job(
            worker.engine, lambda t, p: ran.append(p), queue="limited", **options
        ):
            time.sleep(0.05)
    assert sorted(p["n"] for p in ran) == list(range(6))


def test_an_enqueue_only_role_enqueues_but_cannot_delete_read_or_change_jobs(
    roles: Roles, engine: sa.Engine
) -> None:
    """With only the enqueue grants, enqueue works through a Session and a Connection; the
    role cannot delete, update or read jobs, nor read the archive."""
    enqueuer = roles.make("enqueuer", ENQUEUER_GRANTS[roles.backend])
    job_ids = enqueue_both_ways(enqueuer, "enq")

    def sql(statement: sa.Executable) -> Callable[[], object]:
        def run() -> object:
            with enqueuer.engine.begin() as conn:
                return conn.execute(statement)

        return run

    job = sp.Job.__table__
    assert_refused(sql(sa.delete(job)))
    assert_refused(sql(sa.update(job).values(attempts=5)))
    assert_refused(sql(sa.select(job.c.payload)))
    assert_refused(sql(sa.select(sp.ArchivedJob.__table__.c.job_id)))

    ran: list[Any] = []
    while sp.process_next_job(engine, lambda t, p: ran.append((t, p)), queue="enq"):
        pass
    assert sorted(ran) == [("from-connection", {"n": 2}), ("from-session", {"n": 1})]
    with Session(engine) as session:
        statuses = [session.get(sp.ArchivedJob, job_id) for job_id in job_ids]
    assert [s.status if s else None for s in statuses] == ["success", "success"]


def test_every_documented_worker_grant_is_needed(roles: Roles, engine: sa.Engine) -> None:
    """Take away any one worker grant and the worker is refused by the server."""
    grants = list(WORKER_GRANTS)
    worker = roles.make("worker", grants)
    for number, grant in enumerate(grants):
        worker.revoke(grant)
        try:
            with pytest.raises(sa.exc.StatementError) as info:
                exercise_worker(engine, worker, f"without-{number}")
            assert permission_denied(info.value), (grant, info.value)
        finally:
            worker.grant(grant)


def test_every_documented_enqueue_grant_is_needed(roles: Roles) -> None:
    """Take away any one enqueue grant and enqueue through a Session is refused."""
    grants = ENQUEUER_GRANTS[roles.backend]
    enqueuer = roles.make("enqueuer", grants)
    for grant in grants:
        enqueuer.revoke(grant)
        try:
            with pytest.raises(sa.exc.StatementError) as info:
                enqueue_both_ways(enqueuer, "needed")
            assert permission_denied(info.value), (grant, info.value)
        finally:
            enqueuer.grant(grant)
    enqueue_both_ways(enqueuer, "needed")


def enqueue_keyed(enqueuer: Role) -> None:
    """A keyed job twice, by a Session and by a Connection: one job."""
    with Session(enqueuer.engine) as session:
        first = sp.enqueue(session, "keyed", unique_key="k", queue="keyed")
        session.commit()
    with enqueuer.engine.begin() as conn:
        assert sp.enqueue(conn, "keyed", unique_key="k", queue="keyed") == first


def test_unique_keys_need_select_on_three_job_columns_and_each_is_needed(roles: Roles) -> None:
    """An enqueue-only role enqueues keyed jobs with SELECT on job_id, queue and unique_key
    besides; without it the server refuses; payloads stay unreadable."""
    enqueuer = roles.make("enqueuer", ENQUEUER_GRANTS[roles.backend] + UNIQUE_KEY_GRANTS)
    enqueue_keyed(enqueuer)
    with enqueuer.engine.connect() as conn:
        assert_refused(lambda: conn.execute(sa.select(sp.Job.__table__.c.payload)))
    enqueuer.revoke(UNIQUE_KEY_GRANTS[0])
    assert_refused(lambda: enqueue_keyed(enqueuer))


def enqueue_dependents(enqueuer: Role, engine: sa.Engine) -> None:
    """Dependents of a queued job and of an archived one, by a Session and a Connection."""
    queued = enqueue_both_ways(enqueuer, "deps-before")[0]
    with Session(engine) as session:
        done = sp.enqueue(session, "done", queue="deps-done")
        session.commit()
    while sp.process_next_job(engine, lambda t, p: None, queue="deps-done"):
        pass
    with Session(enqueuer.engine) as session:
        sp.enqueue(session, "after", queue="deps", depends_on=[queued, done])
        session.commit()
    with enqueuer.engine.begin() as conn:
        sp.enqueue_many(conn, [("after", 1), ("after", 2)], queue="deps", depends_on=[queued])


def test_dependencies_need_the_documented_grants_and_each_of_them(
    roles: Roles, engine: sa.Engine
) -> None:
    """An enqueue-only role enqueues jobs with depends_on given the dependency grants
    besides; take away any one and the server refuses; payloads stay unreadable."""
    enqueuer = roles.make("enqueuer", ENQUEUER_GRANTS[roles.backend] + DEPENDS_ON_GRANTS)
    enqueue_dependents(enqueuer, engine)
    with enqueuer.engine.connect() as conn:
        assert_refused(lambda: conn.execute(sa.select(sp.Job.__table__.c.payload)))
    for grant in DEPENDS_ON_GRANTS:
        enqueuer.revoke(grant)
        try:
            assert_refused(lambda: enqueue_dependents(enqueuer, engine))
        finally:
            enqueuer.grant(grant)
    # A dependent of a failed job is archived as cancelled at once: the archive's upsert.
    with Session(engine) as session:
        failed = sp.enqueue(session, "fails", queue="deps-failed")
        session.commit()

    def fail(job_type: str, payload: Any) -> None:
        raise ValueError("fails")

    sp.process_next_job(engine, fail, queue="deps-failed", retry_strategy=lambda job, exc: None)

    def after_failed() -> uuid.UUID:
        with enqueuer.engine.begin() as conn:
            return sp.enqueue(conn, "after", queue="deps", depends_on=[failed])

    assert_refused(after_failed)
    for grant in CANCELLED_AT_ONCE_GRANTS:
        enqueuer.grant(grant)
    cancelled = after_failed()
    with Session(engine) as session:
        row = session.get(sp.ArchivedJob, cancelled)
        assert row is not None and row.status == "cancelled"


def test_a_worker_with_periodic_jobs_needs_the_documented_grants_and_each_of_them(
    roles: Roles, engine: sa.Engine
) -> None:
    """The worker grants and the periodic ones: the schedule's record is made, moved on
    and its occurrence enqueued; take away any periodic grant and the server refuses."""
    grants = PERIODIC_GRANTS[roles.backend]
    worker = roles.make("worker", list(WORKER_GRANTS) + grants)
    start = datetime(2040, 1, 1, 12, 0, 30, tzinfo=UTC)

    def tick(clock: datetime, name: str) -> None:
        """A schedule's first look (its record made), then its next occurrence enqueued."""
        moment = FakeClock(clock)
        scheduler = Scheduler(
            dialect_of(worker.engine),
            (PeriodicJob("tick", every=timedelta(minutes=1), name=name),),
            serializer=sp.JsonSerializer(),
            clock=moment,
            interval=0.0,
        )
        for _ in range(2):
            with dialect_of(worker.engine).claim_connection(worker.engine) as conn:
                scheduler.tick(conn)
            moment.advance(60)

    tick(start, "granted")
    with engine.connect() as conn:
        job = sp.Job.__table__
        assert conn.scalar(sa.select(sa.func.count()).where(job.c.job_type == "tick")) == 1
    for number, grant in enumerate(grants):
        worker.revoke(grant)
        try:
            with pytest.raises(sa.exc.StatementError) as info:
                tick(start, f"without-{number}")
            assert permission_denied(info.value), (grant, info.value)
        finally:
            worker.grant(grant)


def test_a_worker_whose_handlers_report_progress_needs_the_progress_grants_and_each(
    roles: Roles, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """With the progress grants a handler's report is stored; without any one of them the
    server refuses the write, which is logged, and the job still succeeds."""
    grants = [*WORKER_GRANTS, *PROGRESS_GRANTS]
    worker = roles.make("worker", grants)

    def handler(job_type: str, payload: Any) -> None:
        sp.current_job().set_progress(0.5, "halfway")

    for grant in PROGRESS_GRANTS:
        worker.revoke(grant)
        try:
            [job_id] = enqueue_as_admin(engine, f"without-{grant[0]}", "report").values()
            caplog.clear()
            assert sp.process_next_job(worker.engine, handler, queue=f"without-{grant[0]}")
            [failure, *_] = [r for r in caplog.records if r.message.startswith("progress-write")]
            assert "denied" in failure.error, (grant, failure.error)
            with Session(engine) as session:
                assert session.get(sp.ArchivedJob, job_id).status == "success"  # type: ignore[union-attr]
        finally:
            worker.grant(grant)
    [job_id] = enqueue_as_admin(engine, "reports", "report").values()
    assert sp.process_next_job(worker.engine, handler, queue="reports")
    job = sp.get_job(engine, job_id)
    assert job is not None
    assert (job.progress, job.progress_message) == (0.5, "halfway")
    # Reporting twice replaces the row (the upsert's UPDATE).
    [again] = enqueue_as_admin(engine, "reports", "report").values()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(PROGRESS), {"job_id": again, "progress": 0.1, "updated_at": datetime.now(UTC)}
        )
    assert sp.process_next_job(worker.engine, handler, queue="reports")
    replaced = sp.get_job(engine, again)
    assert replaced is not None and replaced.progress == 0.5
