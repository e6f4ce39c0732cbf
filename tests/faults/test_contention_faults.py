"""Fault scenarios 5 and 6: lock waits and deadlocks between claimers, and a small pool."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import fault_fleet as ff
import fault_harness as fh
import fault_report as fr
import sqlalchemy as sa

#: Worker session settings that turn long lock waits into errors quickly.
LOCK_TIMEOUTS = {
    "postgresql": ["--pg-options=-c lock_timeout=500 -c deadlock_timeout=100"],
    "mariadb": [
        "--session-sql=SET SESSION innodb_lock_wait_timeout=1",
        "--session-sql=SET SESSION lock_wait_timeout=1",
    ],
}
TRICKLE_JOBS = 120
#: Seconds the test holds the job table: past the workers' lock timeout (MariaDB's is 1 s).
HOLD = {"postgresql": 0.8, "mariadb": 1.3}
CONTENTION_ROUNDS = 3
LOCK_ERRORS = {
    "deadlock": re.compile(r"DeadlockDetected|\(1213,|SerializationFailure"),
    "lock timeout": re.compile(r"LockNotAvailable|\(1205,"),
}


def lock_errors(log: str) -> tuple[Counter[str], int]:
    """Lock errors the workers logged by kind, and how many of them cut off a job's run."""
    found: Counter[str] = Counter()
    for line in ff.events(log, "transient-polling-error"):
        for kind, pattern in LOCK_ERRORS.items():
            found[kind] += bool(pattern.search(line))
    cut_off = sum(
        any(pattern.search(line) for pattern in LOCK_ERRORS.values())
        for line in ff.events(log, "job-connection-lost") + ff.events(log, "job-transaction-lost")
    )
    return found, cut_off


class Contention:
    """From the test: hold the job table locked past the workers' lock timeout, and set
    deadlock traps (block archive inserts, then wait for the rows the workers claimed)."""

    def __init__(self, db: fh.FaultDatabase, fleet: ff.Fleet) -> None:
        self.db = db
        self.fleet = fleet
        self.table_locks = 0
        self.traps = 0

    def hold_job_table(self, seconds: float) -> None:
        with self.db.engine.connect() as conn:
            if self.db.backend == "postgresql":
                with conn.begin():
                    conn.exec_driver_sql("LOCK TABLE proletarian_job IN EXCLUSIVE MODE")
                    time.sleep(seconds)
            else:
                conn.exec_driver_sql("LOCK TABLES proletarian_job WRITE")
                time.sleep(seconds)
                conn.exec_driver_sql("UNLOCK TABLES")
        self.table_locks += 1

    def deadlock_trap(self) -> None:
        """Lock out archive inserts once a handler has started, then ask for the job rows."""
        with self.db.engine.connect() as conn:
            if self.db.backend == "mariadb":
                conn.exec_driver_sql("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 3")
                conn.commit()
            started = any(w.wait_line("start", timeout=1) for w in self.fleet.slots if w.alive())
            if not started:
                return
            try:
                with conn.begin():
                    if self.db.backend == "postgresql":
                        conn.exec_driver_sql("LOCK TABLE proletarian_archived_job IN SHARE MODE")
                        time.sleep(0.03)
                        conn.exec_driver_sql("LOCK TABLE proletarian_job IN EXCLUSIVE MODE")
                    else:
                        conn.exec_driver_sql(
                            "SELECT COUNT(*) FROM proletarian_archived_job FOR UPDATE"
                        )
                        time.sleep(0.03)
                        conn.exec_driver_sql("SELECT COUNT(*) FROM proletarian_job FOR UPDATE")
                    time.sleep(0.05)
            except sa.exc.DBAPIError as exc:
                # The trap may be the deadlock's victim itself, or time out: both are fine.
                if not fh.is_transient_error(exc):
                    raise
        self.traps += 1


def test_lock_timeouts_and_deadlocks_are_retried(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """4 workers x 2 threads poll a nearly empty queue fed one job at a time while the job
    table is locked past their lock timeout and deadlocks are provoked: every lock error is
    retried, no worker dies, no job is lost."""
    db = fault_db
    fleet.start(
        4,
        [
            "--threads=2",
            "--polling-interval=0.01",
            "--sleep-min-ms=20",
            "--sleep-max-ms=60",
            *LOCK_TIMEOUTS[db.backend],
        ],
    )
    fleet.wait_ready()

    stop = threading.Event()

    def trickle() -> None:
        engine = sa.create_engine(db.url, pool_size=1)
        try:
            for kind in fh.job_mix(TRICKLE_JOBS):
                if stop.is_set():
                    return
                db.enqueue([kind], engine)
                time.sleep(0.01)
        finally:
            engine.dispose()

    feeder = threading.Thread(target=trickle, name="trickle")
    feeder.start()
    contention = Contention(db, fleet)
    try:
        for _ in range(CONTENTION_ROUNDS):
            contention.hold_job_table(HOLD[db.backend])
            time.sleep(0.1)
            contention.deadlock_trap()
            time.sleep(0.1)
        feeder.join(60)
    finally:
        stop.set()
        feeder.join()
    ended = time.time()
    since = time.monotonic()
    drain = db.wait_drained(since, timeout=60, give_up=lambda: fleet.alive() == 0)
    check = fleet.check(strict=False)
    alive = fleet.alive()
    errors, cut_off = lock_errors(fleet.logs())
    problems = check.problems(max_duplicated=cut_off)
    if drain is None:
        problems.append("the queue was not drained after the contention ended")
    if alive != len(fleet.slots):
        problems.append(f"only {alive} of {len(fleet.slots)} workers alive at the end")
    if not errors:
        problems.append("no lock timeout or deadlock ever reached a worker")
    faults = (
        f"{contention.table_locks} table locks, {contention.traps} deadlock traps: "
        f"{errors['lock timeout']} lock timeouts, {errors['deadlock']} deadlocks"
    )
    fr.record(
        "5 lock waits + deadlocks",
        db,
        check,
        faults,
        f"{alive}/{len(fleet.slots)}",
        db.first_archived_after(ended),
        drain,
        problems,
    )
    assert not problems, "\n".join(problems) + "\n" + fleet.evidence(check)


POOL_ARGS = ["--threads=4", "--max-overflow=0", "--pool-timeout=1", "--polling-interval=0.02"]


def run_small_pool(
    db: fh.FaultDatabase, fleet: ff.Fleet, pool_size: int, jobs: int, timeout: float
) -> tuple[fh.Check, float | None, list[str]]:
    db.enqueue(fh.job_mix(jobs))
    started = time.monotonic()
    fleet.start(1, [f"--pool-size={pool_size}", *POOL_ARGS])
    drain = db.wait_drained(started, timeout=timeout, give_up=lambda: fleet.alive() == 0)
    check = fleet.check(strict=True)
    problems = check.problems(max_duplicated=0)
    if fleet.alive() != 1:
        problems.append("the worker died:\n" + ff.tail(fleet.logs()))
    if drain is None:
        log = fleet.logs()
        problems.append(
            f"{check.pending} of {jobs} jobs still queued after {timeout:.0f} s; "
            f"{len(ff.events(log, 'transient-polling-error'))} transient polling errors, "
            "the last ones:\n" + ff.tail("\n".join(ff.events(log, "transient-polling-error")), 5)
        )
    return check, drain, problems


def test_a_pool_smaller_than_the_threads_slows_the_worker_down(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """4 threads share a pool of 3 connections (no overflow, 1 s pool timeout), one of them
    held by the worker's crash-ledger owner: the threads wait for connections, the worker
    does not die, and every job is done once."""
    check, drain, problems = run_small_pool(fault_db, fleet, pool_size=3, jobs=100, timeout=60)
    waits = len(ff.events(fleet.logs(), "transient-polling-error"))
    fr.record(
        "6 pool 3 < 4 threads",
        fault_db,
        check,
        f"{waits} pool waits logged",
        f"{fleet.alive()}/1",
        None,
        drain,
        problems,
    )
    assert not problems, "\n".join(problems) + "\n" + fleet.evidence(check)


def test_a_pool_of_one_connection_still_runs_jobs(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """A pool of ONE connection (4 threads): the worker must still get jobs done, or refuse
    the pool at start with an error that says what it needs, never spin without progress.

    A thread takes a claim connection and a crash-ledger connection together, so a pool of
    one can never give it both.
    """
    db = fault_db
    check, drain, problems = run_small_pool(db, fleet, pool_size=1, jobs=20, timeout=8)
    worker = fleet.slots[0]
    refused = not worker.alive() and "pool" in worker.log().lower() and not check.archive_rows
    if refused and worker.seen["ready"] == 0:
        problems = []  # a clear refusal at start is an acceptable answer
    fr.record(
        "6b pool 1 < 4 threads",
        db,
        check,
        "refused at start" if refused else f"{check.archive_rows} of 20 jobs done",
        f"{fleet.alive()}/1",
        None,
        drain,
        problems,
    )
    assert not problems, "\n".join(problems)
