"""Lease mode (``lease_seconds``) beside transaction mode, measured in one run: drains, polls
and drains while a long job runs, the connections long jobs hold, and the recovery of a
killed worker's job.

    python -m benchmarks.leases [--rounds R] [--jobs N] [--only PART|SERVER,...]

Parts (``--only``): ``drain`` (4 threads at batch_size 1 and the batch sizes of
``--batch-sizes``, beside the raw-SQL loop), ``vacuum`` (PostgreSQL: the worker's poll of an
empty queue after ``--deletes`` deletes and a VACUUM, with no job, a leased job or a
transaction-mode job running all along), ``beside-long`` (``--short`` short jobs drained while
one long job runs, and with none), ``connections`` (PostgreSQL: what a worker of 8 threads
running 8 long jobs has checked out of its pool, and its sessions in pg_stat_activity),
``recovery`` (seconds from the SIGKILL of a lease-mode worker process in a job to the job's
second start in another worker, for lease_seconds 2 and 5). Servers: ``postgresql``,
``mariadb``. Prints one table of medians (min-max) and ratios and writes it into its own
section of benchmarks/results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import random
import shlex
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import sqla_proletarian as sp
from benchmarks import raw, server_work
from benchmarks.batch_drain import machine
from benchmarks.fill import check_drained, fill, fresh_tables
from benchmarks.library import EVENTS, THREADS, count_events, drain, worker
from benchmarks.procs import Crew, Crews
from benchmarks.report import RESULTS, Results, write_section
from benchmarks.scale import polls_per_second
from benchmarks.servers import Server, durable_servers
from sqla_proletarian import statements as sql

SECTION = "leases"
PARTS = ("drain", "vacuum", "beside-long", "connections", "recovery")
SERVERS = ("postgresql", "mariadb")
#: The lease of the drains and the long jobs: far longer than any of them needs.
LEASE = 60.0
#: The recovery's leases.
RECOVERY_LEASES = (2.0, 5.0)
#: The worker and the long jobs of the connections figure.
CONNECTION_THREADS = 8
APPLICATION_NAME = "sp-bench-leases"
#: The handler that holds its job until the measurement is over.
LONG = "long"


def modes(lease: float = LEASE) -> dict[str, dict[str, Any]]:
    """The worker options of each mode."""
    return {
        "transaction mode": {},
        f"lease mode (lease_seconds={lease:g})": {"lease_seconds": lease},
    }


# --- long jobs ----------------------------------------------------------------------------------


class Holder:
    """A handler that holds every ``long`` job until ``release`` and passes the others."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)

    def __call__(self, job_type: str, payload: Any) -> None:
        if job_type == LONG:
            self.started.release()
            if not self.release.wait(600):
                raise RuntimeError("a long job was never released")

    def wait_started(self, jobs: int) -> None:
        for _ in range(jobs):
            if not self.started.acquire(timeout=60):
                raise RuntimeError("a long job did not start within 60 s")


def enqueue_long(engine: sa.Engine, jobs: int) -> None:
    with engine.begin() as conn:
        for n in range(jobs):
            sp.enqueue(conn, LONG, {"n": n})


@contextlib.contextmanager
def long_jobs_running(
    engine: sa.Engine, options: dict[str, Any] | None, jobs: int = 1, threads: int = 1
) -> Iterator[sp.QueueWorker | None]:
    """A worker running ``jobs`` long jobs (enqueued now) until the block ends, then finishing
    them; with ``options`` None, nothing runs."""
    if options is None:
        yield None
        return
    holder = Holder()
    enqueue_long(engine, jobs)
    queue_worker = sp.create_queue_worker(engine, holder, worker_threads=threads, **options)
    with queue_worker:
        holder.wait_started(jobs)
        try:
            yield queue_worker
        finally:
            holder.release.set()
        deadline = time.monotonic() + 60
        while queue_worker.summary()["succeeded"] < jobs and time.monotonic() < deadline:
            time.sleep(0.01)


# --- the parts ----------------------------------------------------------------------------------


def drains(results: Results, server: Server, args: argparse.Namespace) -> list[Measure]:
    engine, jobs = server.engine(), args.jobs
    section = f"drain, {server.label}: {jobs:,} queued jobs, {THREADS} threads"
    raw1, rawn = "raw SQL, 1 job/transaction", "raw SQL, 50 jobs/transaction"
    found = [
        _rate(results, section, raw1, None, "jobs/s", lambda: raw.drain(engine, jobs, 1)),
        _rate(results, section, rawn, raw1, "jobs/s", lambda: raw.drain(engine, jobs, 50)),
    ]
    for batch in (1, *args.batch_sizes):
        ref = None
        for mode, options in modes().items():
            name = f"{mode}, batch_size={batch}"
            found.append(
                _rate(
                    results,
                    section,
                    name,
                    ref or (raw1 if batch == 1 else rawn),
                    "jobs/s",
                    lambda options=options, batch=batch: drain(
                        engine, jobs, batch_size=batch, **options
                    ),
                )
            )
            ref = name
    return found


def best_batches(results: Results, server: Server, args: argparse.Namespace) -> None:
    """A row per mode repeating its best batch size, the lease row against the transaction's."""
    section = f"drain, {server.label}: {args.jobs:,} queued jobs, {THREADS} threads"
    ref = "raw SQL, 50 jobs/transaction"
    for mode in modes():
        name = f"{mode}, best batch_size"
        results.best(section, name, [f"{mode}, batch_size={b}" for b in args.batch_sizes], ref)
        ref = name


def vacuum_polls(
    engine: sa.Engine, deletes: int, seconds: float, options: dict[str, Any] | None, later: bool
) -> float:
    """Polls/s of an empty queue after ``deletes`` jobs were queued and deleted and the table
    VACUUMed, while one long job (of ``options``' mode) runs all along, or none (``later``:
    one job due in an hour stays in the table, as a leased job's row does)."""
    fresh_tables(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE proletarian_job SET (autovacuum_enabled = false)")
        if later:
            sp.enqueue(conn, LONG, {"n": 0}, process_in=3600)
    with long_jobs_running(engine, options):
        fill(engine, deletes)
        with engine.begin() as conn:
            conn.execute(sa.delete(sql.JOB).where(sql.JOB.c.job_type != LONG))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM proletarian_job")
        return polls_per_second(engine, seconds)


def drain_beside_long(engine: sa.Engine, jobs: int, options: dict[str, Any], long: bool) -> float:
    """Jobs/s of a worker (4 threads, batch_size=1) over ``jobs`` short jobs, while one of its
    threads runs a long job all along (``long``), or with no long job."""
    fresh_tables(engine)
    holder = Holder()
    if long:
        enqueue_long(engine, 1)
    fill(engine, jobs)
    queue_worker = worker(engine, holder, **options)
    started = time.perf_counter()
    with queue_worker:
        if long:
            holder.wait_started(1)
        while queue_worker.summary()["succeeded"] < jobs:
            if not queue_worker.running or time.perf_counter() - started > 600:
                raise RuntimeError(f"the worker stopped or stalled: {queue_worker.summary()}")
            time.sleep(0.002)
        elapsed = time.perf_counter() - started
        holder.release.set()
        while long and queue_worker.summary()["succeeded"] < jobs + 1:
            time.sleep(0.01)
    check_drained(engine, jobs + long, "a drain beside a long job")
    return jobs / elapsed


def vacuum(results: Results, server: Server, args: argparse.Namespace) -> list[Measure]:
    """Polls after many deletes and a VACUUM, with a long job running or not (PostgreSQL)."""
    if not server.is_postgresql:
        return []
    engine = server.engine()
    polls = (
        f"polls of an empty queue after {args.deletes:,} deletes and a VACUUM,"
        f" {server.label}: the worker's poll, 1 thread"
    )
    none = "no job running"
    cases: list[tuple[str, dict[str, Any] | None, bool]] = [
        (none, None, False),
        ("no job running, one job due in an hour in the table", None, True),
    ]
    cases += [(f"one {mode} job running", options, False) for mode, options in modes().items()]
    return [
        _rate(
            results,
            polls,
            name,
            None if name == none else none,
            "polls/s",
            lambda options=options, later=later: vacuum_polls(
                engine, args.deletes, args.poll_seconds, options, later
            ),
        )
        for name, options, later in cases
    ]


def beside_long(results: Results, server: Server, args: argparse.Namespace) -> list[Measure]:
    """Short jobs drained while one long job runs, and with none, in each mode."""
    engine = server.engine()
    found = []
    section = (
        f"drain of {args.short:,} short jobs, {server.label}, {THREADS} threads,"
        " batch_size=1, one of them running a long job all along"
    )
    # Lease mode against transaction mode; transaction mode's long-job row against its own
    # drain with no long job.
    for long in (False, True):
        ref = f"{next(iter(modes()))}, no long job" if long else None
        for mode, options in modes().items():
            name = f"{mode}, " + ("one long job running" if long else "no long job")
            found.append(
                _rate(
                    results,
                    section,
                    name,
                    ref,
                    "jobs/s",
                    lambda options=options, long=long: drain_beside_long(
                        engine, args.short, options, long
                    ),
                )
            )
            ref = name
    return found


def connections(results: Results, server: Server, args: argparse.Namespace) -> list[Measure]:
    """What a worker of 8 threads running 8 long jobs holds, in each mode (PostgreSQL)."""
    if not server.is_postgresql:
        return []
    section = (
        f"connections of a worker of {CONNECTION_THREADS} threads running"
        f" {CONNECTION_THREADS} long jobs, {server.label} (the most of 10 samples)"
    )

    admin = server.engine()

    def measure(mode: str, options: dict[str, Any]) -> None:
        fresh_tables(admin)
        engine = sa.create_engine(
            server.urls["bench"],
            pool_size=2 * CONNECTION_THREADS + 2,
            connect_args={"application_name": APPLICATION_NAME},
        )
        seen: Counter[str] = Counter()
        with long_jobs_running(engine, options, CONNECTION_THREADS, CONNECTION_THREADS):
            for _ in range(10):
                for name, value in sessions(admin, engine).items():
                    seen[name] = max(seen[name], value)
                time.sleep(0.1)
        engine.dispose()
        transaction = next(iter(modes()))
        for name, value in seen.items():
            ref = None if mode == transaction else f"{transaction}: {name}"
            results.add(section, f"{mode}: {name}", value, "connections", ref)

    return [
        Measure(section, lambda mode=mode, options=options: measure(mode, options))
        for mode, options in modes().items()
    ]


def sessions(admin: sa.Engine, engine: sa.Engine) -> dict[str, int]:
    """The worker engine's checked-out connections, and its sessions on the server by state."""
    with admin.connect() as conn:
        states = dict(
            conn.execute(
                sa.text(
                    "SELECT state, count(*) FROM pg_stat_activity"
                    " WHERE application_name = :name GROUP BY state"
                ),
                {"name": APPLICATION_NAME},
            ).all()
        )
    return {
        "engine.pool.checkedout()": engine.pool.checkedout(),  # type: ignore[attr-defined]
        "sessions in pg_stat_activity": sum(states.values()),
        "of them idle in transaction": states.get("idle in transaction", 0),
    }


def _doomed(crew: Crew, url: str, lease_seconds: float) -> None:
    """A lease-mode worker process whose handler reports its start and never returns."""
    count_events()
    engine = sa.create_engine(url)

    def handler(job_type: str, payload: Any) -> None:
        crew.report("start", time.monotonic())
        time.sleep(3600)

    with sp.create_queue_worker(engine, handler, lease_seconds=lease_seconds):
        crew.ready_and_wait()
        # Not crew.stop.wait(): a process killed while waiting on a multiprocessing Event
        # would leave the parent's set() waiting for it to wake.
        time.sleep(3600)


def recovery_seconds(engine: sa.Engine, url: str, lease_seconds: float) -> float:
    """Seconds from the SIGKILL of a worker process running a job (killed at a random moment
    of its first lease) to the job's second start, in a worker of this process."""
    fresh_tables(engine)
    enqueue_long(engine, 1)
    starts: queue.SimpleQueue[float] = queue.SimpleQueue()
    with Crews(1, _doomed, url, lease_seconds) as crews:
        crews.next_report(60)
        time.sleep(random.uniform(0, lease_seconds))
        os.kill(crews.processes[0].pid or 0, signal.SIGKILL)
        killed = time.monotonic()
        crews.processes[0].join(10)
    second = sp.create_queue_worker(
        engine, lambda job_type, payload: starts.put(time.monotonic()), lease_seconds=lease_seconds
    )
    with second:
        started = starts.get(timeout=lease_seconds + 60)
        while second.summary()["succeeded"] < 1:
            time.sleep(0.01)
    check_drained(engine, 1, f"recovery, lease_seconds={lease_seconds:g}")
    if not starts.empty():
        raise RuntimeError("the job ran more than once after the kill")
    return started - killed


def recovery(results: Results, server: Server, args: argparse.Namespace) -> list[Measure]:
    engine, url = server.engine(), server.urls["bench"]
    section = (
        f"recovery after SIGKILL of a lease-mode worker process in a job, {server.label}:"
        " seconds from the kill to the job's second start"
    )
    return [
        _rate(
            results,
            section,
            f"lease_seconds={lease:g} (heartbeat every {lease / 3:.2f} s)",
            None,
            "s",
            lambda lease=lease: recovery_seconds(engine, url, lease),
        )
        for lease in RECOVERY_LEASES
    ]


# --- the run ------------------------------------------------------------------------------------


class Measure:
    """One measurement of a round, and what the library logged while it ran."""

    def __init__(self, label: str, run: Callable[[], None]) -> None:
        self.label = label
        self.run = run


def _rate(
    results: Results,
    section: str,
    name: str,
    ref: str | None,
    unit: str,
    measure: Callable[[], float],
) -> Measure:
    def run() -> None:
        results.add(section, name, measure(), unit, ref)
        results.work(section, name, server_work.take())  # a drain's (benchmarks.server_work)

    return Measure(f"{section}: {name}", run)


PART_OF: dict[str, Callable[[Results, Server, argparse.Namespace], list[Measure]]] = {
    "drain": drains,
    "vacuum": vacuum,
    "beside-long": beside_long,
    "connections": connections,
    "recovery": recovery,
}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts, one round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, interleaved (3)")
    parser.add_argument("--jobs", type=int, default=3_000, help="jobs per drain (3,000)")
    parser.add_argument(
        "--batch-sizes",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=(50, 100),
        help="the batch sizes tried besides 1 (50,100)",
    )
    parser.add_argument("--deletes", type=int, default=100_000, help="jobs deleted before polls")
    parser.add_argument("--poll-seconds", type=float, default=2.0, help="seconds of polls (2)")
    parser.add_argument("--short", type=int, default=5_000, help="short jobs beside a long one")
    parser.add_argument("--only", default="", help=f"parts {PARTS} and servers {SERVERS}")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown file")
    parser.add_argument("--keep-servers", action="store_true", help="leave the servers running")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.jobs, args.deletes, args.short, args.poll_seconds = (
            1,
            1_000,
            20_000,
            1_000,
            1.0,
        )
    args.only = {name.strip() for name in args.only.split(",") if name.strip()}
    if args.only - {*PARTS, *SERVERS}:
        parser.error(f"unknown --only name(s) {sorted(args.only - {*PARTS, *SERVERS})}")
    return args


def method(args: argparse.Namespace) -> list[str]:
    """How each figure is taken, in a sentence each."""
    return [
        f"Drains: {args.jobs:,} no-op jobs filled in one statement into fresh tables, one"
        f" in-process worker of {THREADS} threads at its defaults but batch_size (and"
        f" lease_seconds={LEASE:g} in lease mode), timed from its start until its summary"
        " counts every job; each drain checked (all archived once, none left). The raw-SQL"
        " loop is benchmarks/raw.py's (SELECT ... SKIP LOCKED, INSERT archive, DELETE, COMMIT).",
        f"Polls: autovacuum off for the table; {args.deletes:,} jobs filled and deleted, then"
        " VACUUM, then the worker's poll in one-statement transactions for"
        f" {args.poll_seconds:g} s (after 100 to warm up), while a worker of 1 thread runs one"
        " long job (claimed before the fill, released after the polls) or none; a leased"
        " job's row stays in the table (due at its lease's expiry), so a job due in an hour"
        " stands for it in the second row.",
        f"Drain beside a long job: {args.short:,} short jobs behind one long job; the worker's"
        " 4 threads (batch_size=1) drain them while one thread holds the long job, timed until"
        " the summary counts the short ones; the same with no long job.",
        f"Connections: a worker of {CONNECTION_THREADS} threads runs {CONNECTION_THREADS} jobs"
        " that wait until the samples are taken; engine.pool.checkedout() of its engine, and"
        " its sessions in pg_stat_activity (by application_name: pooled idle ones too), the"
        " most of 10 samples 0.1 s apart.",
        "Recovery: a spawned lease-mode worker process (1 thread) starts a job that never"
        " returns and is SIGKILLed a random 0 to lease_seconds later; a worker in this process"
        " (polling_interval 0.1 s) is started at once, and the time from the kill to its"
        " handler's start is taken. A lease is renewed every lease_seconds / 3, so the job is"
        " due again 2/3 to 3/3 of lease_seconds after the kill.",
    ]


def main() -> None:
    args = parse()
    command = shlex.join(["python", "-m", "benchmarks.leases", *sys.argv[1:]])
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    count_events()
    started_at, started = datetime.now(UTC), time.perf_counter()
    parts = [p for p in PARTS if not args.only & set(PARTS) or p in args.only]
    results, notes = Results(), []
    events: dict[str, Counter[str]] = {}
    with durable_servers(keep=args.keep_servers) as found:
        servers = [
            s
            for s in found
            if not args.only & set(SERVERS) or s.label.split()[0].lower() in args.only
        ]
        about = machine(servers)
        measures = [m for s in servers for part in parts for m in PART_OF[part](results, s, args)]
        if not measures:
            sys.exit(
                f"nothing to measure for --only {','.join(sorted(args.only))}: vacuum and"
                " connections are measured on PostgreSQL only"
            )
        for round_number in range(1, args.rounds + 1):
            print(f"round {round_number} of {args.rounds}", flush=True)
            for measure in measures:
                began, before = time.perf_counter(), Counter(EVENTS.counts)
                try:
                    measure.run()
                except Exception as exc:
                    notes.append(f"{measure.label}: failed ({type(exc).__name__}: {exc})")
                    print(f"    failed: {exc!r}", flush=True)
                logged = EVENTS.counts - before
                if logged:
                    events.setdefault(measure.label, Counter()).update(logged)
                print(f"    {measure.label} ({time.perf_counter() - began:.1f} s)", flush=True)
        if "drain" in parts:
            for server in servers:
                best_batches(results, server, args)
    for label, counts in events.items():
        logged = ", ".join(f"{n} {event}" for event, n in counts.most_common())
        notes.append(f"{label}: the library logged {logged} (all rounds, in-process workers)")
    minutes = (time.perf_counter() - started) / 60
    lines = [
        f"Command: `{command}`; run {started_at:%Y-%m-%d %H:%M} UTC, {minutes:.1f} min.",
        f"Machine: {about}.",
        f"{args.rounds} round(s), interleaved; each cell is the median over the rounds"
        " (min-max); ratio: this row's median over the named row's.",
        *method(args),
    ]
    print("\n".join(lines), "", results.table(), sep="\n")
    if notes:
        print("\n".join(f"- {note}" for note in notes))
    body = [
        "## Lease mode (`python -m benchmarks.leases`, `make bench-leases`)",
        "",
        *(f"- {line}" for line in lines),
        "",
        results.markdown(),
    ]
    if notes:
        body += ["", *(f"- {note}" for note in notes)]
    write_section(args.output, SECTION, "\n".join(body))
    print(f"\nwritten to {args.output} ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
