"""Fault scenarios 1, 2 and 8: worker processes killed mid-job, stopped by signals, and
frozen past their leases."""

from __future__ import annotations

import random
import re
import signal
import time
from collections import Counter

import fault_fleet as ff
import fault_harness as fh
import fault_report as fr
import pytest
import sqlalchemy as sa
from fault_harness import ARCHIVE, EFFECTS

KILL_WORKERS = 3
KILL_THREADS = 2


class KillStorm:
    """SIGKILLs workers mid-job, replaces the killed ones, and keeps the queue filled.

    Kills land inside the handler (a random moment after it printed ``start``), right after
    the handler's end (on its ``done`` line, racing the commit), and, from inside the worker,
    between the handler's end and the commit (``--kill-before-commit``).
    """

    def __init__(self, db: fh.FaultDatabase, fleet: ff.Fleet, seed: int) -> None:
        self.db = db
        self.fleet = fleet
        self.rng = random.Random(seed)
        self.kills: Counter[str] = Counter()
        self.deaths: list[str] = []
        self.last_kill = time.time()

    def replace_dead(self) -> None:
        """Restart slots whose worker died; a death other than its own SIGKILL is a bug."""
        for index, worker in enumerate(self.fleet.slots):
            if worker.alive():
                continue
            code = worker.wait_exit(5)
            if code == -signal.SIGKILL and worker.seen["dying-before-commit"]:
                self.kills["before commit"] += 1
                self.last_kill = time.time()
            else:
                self.deaths.append(f"{worker.name} exited with {code}:\n{ff.tail(worker.log())}")
            self.fleet.restart(index)

    def run(self, kills_wanted: int, jobs_low: int) -> None:
        deadline = time.monotonic() + 40 + kills_wanted * 1.5
        turn = 0
        while self.kills.total() < kills_wanted and time.monotonic() < deadline:
            if self.db.pending() < jobs_low:
                self.db.enqueue(fh.job_mix(jobs_low))
            self.replace_dead()
            index = turn % len(self.fleet.slots)
            turn += 1
            worker = self.fleet.slots[index]
            mode = self.rng.choice(("in handler", "after handler"))
            if worker.wait_line("start" if mode == "in handler" else "done", timeout=3) is None:
                continue
            if mode == "in handler":
                time.sleep(self.rng.uniform(0, 0.008))
            if not worker.send(signal.SIGKILL):
                continue
            self.kills[mode] += 1
            self.last_kill = time.time()
            worker.wait_exit(5)
            self.fleet.restart(index)

    def drain(self, timeout: float) -> float | None:
        """Supervise until the queue is empty; seconds from the last kill, or None."""
        # Replacements from now on no longer kill themselves.
        for args in self.fleet.args:
            args[:] = [arg for arg in args if not arg.startswith("--kill-before-commit")]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.replace_dead()
            if self.db.pending() == 0 and self.db.archived() >= len(self.db.jobs):
                return time.time() - self.last_kill
            time.sleep(0.05)
        return None


#: Lease mode, with the handler writing through job.session (checked: once per success).
LEASE_ARGS = ["--lease-seconds=1", "--effects"]


def run_kill_scenario(
    db: fh.FaultDatabase,
    fleet: ff.Fleet,
    scenario: str,
    kills_wanted: int,
    jobs: int,
    mode_args: tuple[str, ...] = (),
) -> None:
    db.enqueue(fh.job_mix(jobs))
    fleet.start(
        KILL_WORKERS,
        [
            f"--threads={KILL_THREADS}",
            "--sleep-min-ms=10",
            "--sleep-max-ms=40",
            "--polling-interval=0.02",
            "--kill-before-commit=0.02",
            # Kills hit the head of the queue again and again; the crash ledger's limit is
            # checked by its own test, here every job must end as its handler says.
            "--max-unclean-ends=1000",
            *mode_args,
        ],
    )
    storm = KillStorm(db, fleet, seed=kills_wanted)
    storm.run(kills_wanted, jobs_low=jobs // 4)
    drain = storm.drain(timeout=60)
    alive = fleet.alive()
    check = fleet.check(strict=False)
    recover = db.first_archived_after(storm.last_kill)
    kills = storm.kills
    # A killed worker takes at most the jobs its threads were running with it.
    problems = check.problems(max_duplicated=kills.total() * KILL_THREADS)
    if kills.total() < kills_wanted:
        problems.append(f"only {kills.total()} kills, {kills_wanted} wanted")
    if drain is None:
        problems.append("the queue was not drained within 60 s after the last kill")
    if alive != len(fleet.slots):
        problems.append(f"only {alive} of {len(fleet.slots)} workers alive at the end")
    problems += storm.deaths
    faults = " + ".join(f"{n} {mode}" for mode, n in sorted(kills.items())) + " SIGKILL"
    fr.record(scenario, db, check, faults, f"{alive}/{len(fleet.slots)}", recover, drain, problems)
    assert not problems, "\n".join(problems) + "\n" + fleet.evidence(check)


def test_workers_killed_mid_job_lose_no_job(fault_db: fh.FaultDatabase, fleet: ff.Fleet) -> None:
    """>= 20 SIGKILLs at random points of a job's run: every job still ends archived once."""
    run_kill_scenario(fault_db, fleet, "1 SIGKILL mid-job", kills_wanted=22, jobs=160)


def test_leased_workers_killed_mid_job_lose_no_job(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """Lease mode, >= 10 SIGKILLs at random points of a job's run: a dead worker's leases
    expire and other workers run its jobs; every job is archived once, with its handler's
    writes committed once."""
    run_kill_scenario(
        fault_db, fleet, "1L SIGKILL, leases", kills_wanted=10, jobs=80, mode_args=(*LEASE_ARGS,)
    )


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_soak_many_kills_lose_no_job(fault_db: fh.FaultDatabase, fleet: ff.Fleet) -> None:
    """Soak: 200 SIGKILLs over 2000+ jobs, and still nothing lost or half done."""
    run_kill_scenario(fault_db, fleet, "1 soak SIGKILL", kills_wanted=200, jobs=2000)


SUMMARY = re.compile(r"stopped: \d+ succeeded, \d+ retried, \d+ failed")


def test_sigterm_and_sigint_stop_gracefully(fault_db: fh.FaultDatabase, fleet: ff.Fleet) -> None:
    """SIGTERM/SIGINT mid-job: running jobs finish, nothing runs twice, exit as the signal."""
    db = fault_db
    db.enqueue(fh.job_mix(100))
    fleet.start(
        2,
        [
            "--threads=2",
            "--sleep-min-ms=40",
            "--sleep-max-ms=150",
            "--polling-interval=0.02",
            "--signals",
        ],
    )
    problems: list[str] = []
    signals = [signal.SIGTERM, signal.SIGINT] * 2
    last_signal = time.time()
    stop_times = []
    for turn, signum in enumerate(signals):
        index = turn % 2
        worker = fleet.slots[index]
        if worker.wait_line("start", timeout=10) is None:
            problems.append(f"{worker.name} never started a job")
            break
        worker.send(signum)
        sent = time.monotonic()
        last_signal = time.time()
        code = worker.wait_exit(20)
        stop_times.append(time.monotonic() - sent)
        name = signal.Signals(signum).name
        if code != -signum:
            problems.append(f"{worker.name} got {name} and exited with {code}, not {-signum}")
        log = worker.log()
        if not SUMMARY.search(log):
            problems.append(f"{worker.name} printed no summary after {name}:\n{ff.tail(log)}")
        unfinished = Counter(worker.starts) - Counter(worker.dones)
        if unfinished:
            problems.append(f"{worker.name} left {sorted(unfinished)} half done after {name}")
        fleet.restart(index)
    since = time.monotonic() - (time.time() - last_signal)
    drain = db.wait_drained(since, timeout=60, give_up=lambda: fleet.alive() == 0)
    if drain is None:
        problems.append("the queue was not drained within 60 s after the last signal")
    check = fleet.check(strict=True)
    alive = fleet.alive()
    if alive != len(fleet.slots):
        problems.append(f"only {alive} of {len(fleet.slots)} workers alive at the end")
    # Nothing crashed here, so no job may have run more often than its retries call for.
    problems += check.problems(max_duplicated=0)
    fr.record(
        "2 SIGTERM/SIGINT",
        db,
        check,
        f"2 SIGTERM, 2 SIGINT (stop {max(stop_times, default=0):.2f}s max)",
        f"{alive}/{len(fleet.slots)}",
        db.first_archived_after(last_signal),
        drain,
        problems,
    )
    assert not problems, "\n".join(problems) + "\n" + fleet.evidence(check)


#: The frozen scenario's lease: its slow jobs run longer, so live workers must renew theirs.
FROZEN_LEASE = 1.5
FROZEN_ARGS = [
    f"--lease-seconds={FROZEN_LEASE}",
    "--effects",
    "--slow-ms=2500",
    "--polling-interval=0.02",
]


def test_workers_frozen_past_their_lease_commit_nothing_late(
    fault_db: fh.FaultDatabase, fleet: ff.Fleet
) -> None:
    """Lease mode: two workers are SIGSTOPped while each runs a job longer than its lease;
    live workers take the jobs once the leases expire (an unclean end each) and renew their
    own leases as they run them. One frozen worker is resumed while the new run goes on, the
    other after the job was archived: neither late run commits anything, so each job is
    archived once, with the writes of its live run's handler only."""
    db = fault_db
    slow = db.enqueue(["slow"] * 2)
    # One thread each: each frozen worker holds exactly one slow job's lease. The first one's
    # heartbeat is starved, so that its late outcome meets the token's fence while the new
    # run still holds the job (the other's heartbeat may tell it first that its lease is gone).
    fleet.start(1, [*FROZEN_ARGS, "--threads=1", "--heartbeat-delay=30"])
    frozen = fleet.start(1, [*FROZEN_ARGS, "--threads=1"])[:]
    problems: list[str] = []
    slow_ids = {str(job_id) for job_id in slow}

    def started(workers: list[ff.WorkerProcess]) -> set[str]:
        return slow_ids & {job_id for worker in workers for job_id in worker.starts}

    # Frozen in its sleep, a handler has at most its remaining sleep left once resumed.
    sleeping = fh.wait_until(lambda: all(w.seen["sleeping"] for w in frozen), timeout=30)
    if not sleeping or started(frozen) != slow_ids:
        pytest.fail(f"the slow jobs never started: {started(frozen)}\n{fleet.logs()}")
    for worker in frozen:
        worker.send(signal.SIGSTOP)
    stopped = time.monotonic()
    db.enqueue(fh.job_mix(60))
    live = fleet.start(2, [*FROZEN_ARGS, "--threads=2"])[2:]
    if not fh.wait_until(lambda: started(live) == slow_ids, timeout=20):
        problems.append(f"live workers took only {started(live)} of the frozen jobs' leases")
    taken = time.monotonic() - stopped
    # One resumes while the job's new run goes on, the other once that run archived the job.
    early, late = frozen
    early.send(signal.SIGCONT)
    late_job = next(job_id for job_id in slow if str(job_id) in late.starts)
    if not fh.wait_until(lambda: db.archived_at(late_job) is not None, timeout=20):
        problems.append(f"job {late_job} was not archived while its first worker was frozen")
    late.send(signal.SIGCONT)
    resumed = time.time()
    for worker in frozen:
        job_id = next(job_id for job_id in slow_ids if job_id in worker.starts)
        if worker.wait_line("done", timeout=20, fresh=False, rest=job_id) is None:
            problems.append(f"{worker.name}'s late run of {job_id} never ended")

        def fenced(worker: ff.WorkerProcess = worker, job_id: str = job_id) -> bool:
            return any(job_id in line for line in ff.events(worker.log(), "lease-lost"))

        # The run logs it after its handler's done line.
        if not fh.wait_until(fenced, timeout=5):
            problems.append(f"{worker.name} logged no lease-lost for its late run of {job_id}")
    drain = db.wait_drained(time.monotonic(), timeout=30, give_up=lambda: fleet.alive() == 0)
    if drain is None:
        problems.append("the queue was not drained after the frozen workers resumed")
    check = fleet.check(strict=False)
    early_job = next(job_id for job_id in slow_ids if job_id in early.starts)
    late_end = [run[2] for run in early.runs if run[0] == early_job]
    new_end = [run[2] for worker in live for run in worker.runs if run[0] == early_job]
    if not (late_end and new_end and float(late_end[0] or "inf") < float(new_end[0] or 0)):
        problems.append(f"{early.name}'s late run of {early_job} did not end during the new run")
    # Only the frozen runs may overlap the runs that took their expired leases.
    check.overlapping = [job_id for job_id in check.overlapping if job_id not in slow_ids]
    alive = fleet.alive()
    if alive != len(fleet.slots):
        problems.append(f"only {alive} of {len(fleet.slots)} workers alive at the end")
    problems += check.problems(max_duplicated=len(slow))
    for job_id in slow:
        attempts = db.scalar(sa.select(ARCHIVE.c.attempts).where(ARCHIVE.c.job_id == job_id))
        if attempts != 2:
            problems.append(f"job {job_id} archived with {attempts} attempts, not 2 (1 expired)")
    late_writes = db.scalar(
        sa.select(sa.func.count())
        .select_from(EFFECTS)
        .where(EFFECTS.c.pid.in_([worker.pid for worker in frozen]))
        .where(EFFECTS.c.job_id.in_(slow_ids))
    )
    if late_writes:
        problems.append(f"{late_writes} handler writes of the frozen runs committed")
    fr.record(
        "8 frozen past the lease",
        db,
        check,
        f"2 SIGSTOP for {FROZEN_LEASE}s leases, taken after {taken:.1f}s",
        f"{alive}/{len(fleet.slots)}",
        db.first_archived_after(resumed),
        drain,
        problems,
    )
    assert not problems, "\n".join(problems) + "\n" + fleet.evidence(check)
