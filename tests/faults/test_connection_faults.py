"""Fault scenarios 3, 4 and 7: the server restarts, kills sessions, or times a job out."""

from __future__ import annotations

import time

import fault_fleet as ff
import fault_harness as fh
import fault_report as fr
import sqlalchemy as sa
from fault_harness import ARCHIVE

BUSY_ARGS = ["--threads=2", "--sleep-min-ms=10", "--sleep-max-ms=40", "--polling-interval=0.02"]
#: Lease mode, with the handler writing through job.session (checked: once per success); the
#: lease outlasts the fault, so no live worker's job is taken while it runs.
LEASE_ARGS = ["--lease-seconds=3", "--effects"]


def finish(
    scenario: str,
    db: fh.FaultDatabase,
    fleet: ff.Fleet,
    faults: str,
    fault_end: float,
    problems: list[str],
    max_duplicated: int,
    strict: bool = False,
    leases: bool = False,
) -> None:
    """Wait for the queue to drain, check everything, record the row, fail on problems.

    ``strict``: no run may count as an unclean end (the fault killed no worker). ``leases``:
    a job may run twice only where a run's outcome could not be written.
    """
    since = time.monotonic() - (time.time() - fault_end)
    drain = db.wait_drained(since, timeout=60, give_up=lambda: fleet.alive() == 0)
    if drain is None:
        problems.append("the queue was not drained after the fault")
    check = fleet.check(strict=strict)
    alive = fleet.alive()
    if alive != len(fleet.slots):
        problems.append(f"only {alive} of {len(fleet.slots)} workers alive at the end")
    problems += check.problems(max_duplicated=max_duplicated)
    if leases:
        rerun = [str(job_id) for job_id in check.duplicated]
        unexplained = sorted(set(rerun) - fleet.lost_outcomes())
        if unexplained:
            problems.append(f"jobs ran twice with their outcome written: {unexplained[:3]}")
    recover = db.first_archived_after(fault_end)
    fr.record(scenario, db, check, faults, f"{alive}/{len(fleet.slots)}", recover, drain, problems)
    assert not problems, "\n".join(problems) + "\n" + fleet.evidence(check)


def test_workers_survive_a_server_restart(fault_db: fh.FaultDatabase, fleet: ff.Fleet) -> None:
    """The server restarts while workers are busy: they reconnect, and finish every job."""
    db = fault_db
    db.enqueue(fh.job_mix(240))
    fleet.start(2, BUSY_ARGS)
    fleet.wait_ready()
    assert db.wait_archived(30, timeout=30), "the workers did not start working"
    busy = [worker.name for worker in fleet.slots if worker.wait_line("start", 2, fresh=False)]
    db.restart_server()
    restarted = time.time()
    problems = [] if len(busy) == 2 else [f"only {busy} were busy when the server restarted"]
    if db.pending() == 0:
        problems.append("the queue was empty after the restart: too few jobs to test it")
    # Jobs running when the server went down lost their transaction and run again, but the
    # restart charges none of them.
    finish(
        "3 server restart",
        db,
        fleet,
        "1 restart",
        restarted,
        problems,
        max_duplicated=4,
        strict=True,
    )


def test_long_jobs_outlive_a_server_restart_alone_and_uncharged(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """The server restarts while four long jobs run, with idle threads polling in both
    workers: the restart ends the jobs' sessions but not their handlers. No other thread
    starts a long job while its first run goes on, and no run is charged as an unclean
    end; each long job runs again after its first run (whose transaction died) ends."""
    db = fault_db
    slow = db.enqueue(["slow"] * 4)
    db.enqueue(fh.job_mix(40))
    fleet.start(2, ["--threads=3", "--slow-ms=8000", "--polling-interval=0.02"])
    fleet.wait_ready()
    problems: list[str] = []
    deadline = time.monotonic() + 30
    started = {str(job_id) for job_id in slow}
    while time.monotonic() < deadline:
        if started <= {job_id for worker in fleet.slots for job_id in worker.starts}:
            break
        time.sleep(0.05)
    else:
        problems.append("the long jobs never all started")
    db.restart_server()
    restarted = time.time()
    finish(
        "3b restart during long jobs",
        db,
        fleet,
        "1 restart, 4 jobs of 8 s",
        restarted,
        problems,
        max_duplicated=len(slow) + 2,
        strict=True,
    )


def test_leased_jobs_survive_a_server_restart(fault_db: fh.FaultDatabase, fleet: ff.Fleet) -> None:
    """Lease mode: the server restarts while workers run short jobs and two jobs longer than
    their lease. The handlers run on (no transaction is open), the heartbeats renew the
    leases once the server is back, no job runs twice at the same time, and each job's
    handler writes commit once."""
    db = fault_db
    slow = {str(job_id) for job_id in db.enqueue(["slow"] * 2)}
    db.enqueue(fh.job_mix(160))
    # A restart takes well under a second here: a lease of 2 s outlasts it.
    fleet.start(2, [*BUSY_ARGS, "--slow-ms=3000", "--lease-seconds=2", "--effects"])
    fleet.wait_ready()
    problems: list[str] = []

    def running() -> bool:
        return slow <= {job for worker in fleet.slots for job in worker.starts}

    if not fh.wait_until(running, timeout=30) or not db.wait_archived(30, timeout=30):
        problems.append("the workers did not start working")
    db.restart_server()
    restarted = time.time()
    if db.pending() <= len(slow):
        problems.append("the queue was empty after the restart: too few jobs to test it")
    # Jobs whose outcome could not be written when the server went down run again (the lost
    # write ends their lease at once, as an unclean end): one a thread at most.
    finish(
        "3L server restart, leases",
        db,
        fleet,
        "1 restart, 2 jobs over the 2 s lease",
        restarted,
        problems,
        max_duplicated=4,
        leases=True,
    )


def kill_sessions(
    db: fh.FaultDatabase, fleet: ff.Fleet, args: list[str], seconds: float, jobs: int
) -> tuple[int, int, float]:
    """Two busy workers; end every session of theirs every 0.3 s for ``seconds``, keeping
    the queue fed: the sessions killed, the rounds, and when the last round ended."""
    db.enqueue(fh.job_mix(jobs))
    fleet.start(2, args)
    fleet.wait_ready()
    killed = rounds = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if db.pending() < jobs // 4:
            db.enqueue(fh.job_mix(jobs // 2))
        killed += db.terminate_connections()
        rounds += 1
        time.sleep(0.3)
    return killed, rounds, time.time()


def test_workers_survive_sessions_killed_by_the_server(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """Every worker session is ended server-side every 0.3 s for 4 s: no job is lost."""
    db = fault_db
    killed, rounds, ended = kill_sessions(db, fleet, BUSY_ARGS, seconds=4.0, jobs=200)
    problems = [] if killed else ["no worker session was ever found to kill"]
    # Each round can take the running jobs (two threads in each of two workers) with it,
    # and charges none of them: the workers live.
    finish(
        "4 sessions killed",
        db,
        fleet,
        f"{killed} sessions in {rounds} rounds",
        ended,
        problems,
        max_duplicated=4 * rounds,
        strict=True,
    )


def test_leased_jobs_survive_sessions_killed_by_the_server(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """Lease mode: every worker session is ended server-side every 0.3 s for 3 s, the
    heartbeat's too: no job is lost, none runs twice at the same time, and each job's
    handler writes commit once."""
    db = fault_db
    args = [*BUSY_ARGS, *LEASE_ARGS]
    killed, rounds, ended = kill_sessions(db, fleet, args, seconds=3.0, jobs=160)
    problems = [] if killed else ["no worker session was ever found to kill"]
    finish(
        "4L sessions killed, leases",
        db,
        fleet,
        f"{killed} sessions in {rounds} rounds",
        ended,
        problems,
        max_duplicated=4 * rounds,
        leases=True,
    )


def test_a_pooled_connection_killed_before_use_is_a_transient_error(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """The server ends connections between their checkout and first use: the worker goes on.

    As when the server ended a connection idle in the pool (a KILL, MariaDB's wait_timeout):
    the worker's first command on it fails, and that is a lost connection like any other.
    """
    db = fault_db
    db.enqueue(fh.job_mix(20))
    started = time.time()
    fleet.start(1, ["--threads=1", "--polling-interval=0.02", "--kill-on-checkout=3"])
    problems: list[str] = []
    worker = fleet.slots[0]
    if worker.wait_line("killed-on-checkout", timeout=30, fresh=False) is None:
        problems.append("the worker never took a connection from its pool")
    finish(
        "4b killed in pool",
        db,
        fleet,
        "3 sessions killed at checkout",
        started,
        problems,
        max_duplicated=1,
    )


#: The server setting that ends a session idle in a transaction, per backend, and how the
#: worker's sessions get it (one second).
IDLE_TIMEOUTS = {
    "postgresql": (
        "idle_in_transaction_session_timeout",
        ["--pg-options=-c idle_in_transaction_session_timeout=1000"],
    ),
    "mariadb": (
        "idle_transaction_timeout",
        ["--session-sql=SET SESSION idle_transaction_timeout=1"],
    ),
}


def test_a_job_longer_than_the_idle_transaction_timeout_runs_again(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """A job outlives the server's idle-in-transaction timeout: the worker survives, the
    job runs again and succeeds, and the log names the setting to change."""
    db = fault_db
    setting, args = IDLE_TIMEOUTS[db.backend]
    [slow] = db.enqueue(["slow"])
    db.enqueue(fh.job_mix(10))
    fleet.start(1, ["--threads=2", "--slow-ms=2500", "--polling-interval=0.02", *args])
    worker = fleet.slots[0]
    problems: list[str] = []
    # The slow job's first run ends 2.5 s after it started, 1.5 s after the server gave up.
    if worker.wait_line("done", timeout=30, fresh=False, rest=str(slow)) is None:
        problems.append("the slow job's first run never ended")
    first_run_end = time.time()
    drain = db.wait_drained(time.monotonic(), timeout=30, give_up=lambda: fleet.alive() == 0)
    if drain is None:
        problems.append("the queue was not drained after the timeout")
    check = fleet.check(strict=False)
    alive = fleet.alive()
    if alive != 1:
        problems.append("the worker died")
    problems += check.problems(max_duplicated=1)
    if db.run_count(slow) < 2:
        problems.append(f"the slow job ran {db.run_count(slow)} times: it was not run again")
    archived = db.archived_at(slow)
    recover = None if archived is None else archived - first_run_end
    log = worker.log()
    lines = [line for line in log.splitlines() if str(slow) in line and " WARNING " in line]
    lines += [line for line in log.splitlines() if str(slow) in line and " ERROR " in line]
    fr.record(
        "7 idle-in-transaction timeout",
        db,
        check,
        f"1 job over {setting}=1s",
        f"{alive}/1",
        recover,
        drain,
        problems + ([] if any(setting in line for line in lines) else ["no hint in the log"]),
    )
    assert not problems, "\n".join(problems) + "\n" + fleet.evidence(check)
    # What the operator reads: the job's run was cut off, by which setting, what to change.
    assert any(setting in line for line in lines), (
        f"no log line about job {slow} names {setting}; its warnings and errors:\n"
        + "\n".join(lines)
    )


def test_a_job_always_longer_than_the_idle_transaction_timeout_ends_as_failed(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """A job that outlives the idle-in-transaction timeout on every run: each run lost to
    the limit counts as an unclean end, the job never runs twice at the same time, and after
    max_unclean_ends runs it is archived as failed with an error naming the setting."""
    db = fault_db
    setting, args = IDLE_TIMEOUTS[db.backend]
    [long] = db.enqueue(["long"])
    db.enqueue(fh.job_mix(10))
    started = time.time()
    fleet.start(
        1,
        [
            "--threads=2",
            "--slow-ms=1800",
            "--polling-interval=0.02",
            "--max-unclean-ends=2",
            *args,
        ],
    )
    problems: list[str] = []
    finish(
        "7b always over the idle timeout",
        db,
        fleet,
        f"1 job always over {setting}=1s",
        started,
        problems,
        max_duplicated=1,
    )
    error = db.scalar(sa.select(ARCHIVE.c.error).where(ARCHIVE.c.job_id == long))
    assert "lost its database session while running" in (error or "")
    assert setting in (error or "")
    assert db.run_count(long) == 2
