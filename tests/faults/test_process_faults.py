"""Fault scenarios 1 and 2: worker processes killed mid-job, and stopped by signals."""

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


def run_kill_scenario(
    db: fh.FaultDatabase, fleet: ff.Fleet, scenario: str, kills_wanted: int, jobs: int
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
