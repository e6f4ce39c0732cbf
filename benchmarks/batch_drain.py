"""The batched drain, counted: 10,000 jobs drained by worker processes of 4 threads with
batch_size 10, 50 and 100, on MariaDB and on PostgreSQL, each drain checked for what a
batch must never do.

    python -m benchmarks.batch_drain [--jobs N] [--batch-sizes 10,50,100] [--processes 1,2]
        [--rounds R] [--only mariadb|postgresql] [--debug-events] [--output FILE]

Per setting (summed over the rounds; jobs/s is the median, min-max): handler runs and the
extra ones (runs - jobs: a job run twice), the library's ``job-transaction-lost`` and
``run-record-cleanup-error`` events and its other warnings, the deadlocks the server
detected (``Innodb_deadlocks``, ``pg_stat_database.deadlocks``), the lock errors that
reached the log (deadlock, lock wait timeout, serialization failure), and the jobs left or
archived more or less than once. Each process counts its own handler runs by job id and
reports them at the end. Prints one table, with the command and the machine, and writes it
into its own section of benchmarks/results.md (``benchmarks.run`` keeps that section).
Servers: scripts/benchdb.sh's durable ones (``SP_BENCHDB_PG_PORT``/``SP_BENCHDB_MY_PORT``).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import re
import shlex
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

import sqla_proletarian as sp
from benchmarks.fill import count, fill, fresh_tables
from benchmarks.library import THREADS, worker
from benchmarks.procs import Crew, Crews
from benchmarks.report import RESULTS, library_commit, write_section
from benchmarks.servers import Server, durable_servers

SECTION = "batch_drain"
#: The events the table has a column of; every other warning is counted together.
NAMED_EVENTS = ("job-transaction-lost", "run-record-cleanup-error")
#: Lock errors in a logged record's ``error`` (PyMySQL's errno, psycopg's exception names).
LOCK_ERRORS = re.compile(
    r"\((?:1213|1205),|Deadlock|LockNotAvailable|SerializationFailure|deadlock detected"
    r"|could not serialize"
)
_VERSION = {
    "mysql": "SELECT concat('MariaDB ', version())",
    "postgresql": "SELECT 'PostgreSQL ' || current_setting('server_version')",
}
_DEADLOCKS = {
    "mysql": "SELECT variable_value FROM information_schema.global_status "
    "WHERE variable_name = 'INNODB_DEADLOCKS'",
    "postgresql": "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
}


class EventTally(logging.Handler):
    """Counts the library's warnings (and the named events at any level it is given) by
    event name, and the lock errors among them."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.events: Counter[str] = Counter()
        self.lock_errors = 0

    def emit(self, record: logging.LogRecord) -> None:
        event = str(getattr(record, "event", record.getMessage()))
        if record.levelno < logging.WARNING and event not in NAMED_EVENTS:
            return
        self.events[event] += 1
        if LOCK_ERRORS.search(str(getattr(record, "error", ""))):
            self.lock_errors += 1


def _child(crew: Crew, url: str, batch_size: int, debug_events: bool) -> None:
    """One worker process: count every handler run by job id, and the library's events,
    then report them once the parent says stop."""
    level = logging.DEBUG if debug_events else logging.WARNING
    tally = EventTally(level)
    logger = logging.getLogger("sqla_proletarian")
    logger.addHandler(tally)
    logger.setLevel(level)
    logger.propagate = False
    runs: Counter[str] = Counter()
    lock = threading.Lock()

    def handler(job: sp.JobContext) -> None:
        with lock:
            runs[job.job_id.hex] += 1

    engine = sa.create_engine(url, pool_size=2 * THREADS + 2)
    queue_worker = worker(engine, handler, handler_mode="advanced", batch_size=batch_size)
    crew.ready_and_wait()
    with queue_worker:
        while not crew.stop.wait(0.01):
            if not queue_worker.running:
                raise RuntimeError(f"the worker stopped: {queue_worker.exception!r}")
    engine.dispose()
    with lock:
        crew.report("counts", dict(runs), dict(tally.events), tally.lock_errors)


def server_deadlocks(engine: sa.Engine) -> int:
    """The deadlocks the server has detected so far (PostgreSQL: in this database)."""
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(_DEADLOCKS[engine.dialect.name]).scalar_one())


@dataclass
class Tally:
    """One setting's figures over the rounds."""

    rates: list[float] = field(default_factory=list)
    runs: int = 0
    extra: int = 0
    never_run: int = 0
    events: Counter[str] = field(default_factory=Counter)
    lock_errors: int = 0
    deadlocks: int = 0
    badly_drained: int = 0
    failures: list[str] = field(default_factory=list)

    def rate(self) -> str:
        if not self.rates:
            return "failed"
        text = f"{statistics.median(self.rates):,.0f}"
        if len(self.rates) > 1:
            text += f" ({min(self.rates):,.0f}-{max(self.rates):,.0f})"
        return text

    def others(self) -> int:
        return sum(n for event, n in self.events.items() if event not in NAMED_EVENTS)


def drain(
    server: Server, jobs: int, batch_size: int, processes: int, debug_events: bool, into: Tally
) -> None:
    """Drain ``jobs`` with ``processes`` worker processes and add what was counted."""
    engine = server.engine()
    fresh_tables(engine)
    fill(engine, jobs)
    before = server_deadlocks(engine)
    job_table: sa.Table = sp.Job.__table__  # type: ignore[assignment]
    with Crews(processes, _child, server.urls["bench"], batch_size, debug_events) as crews:
        elapsed = crews.wait_until(lambda: count(engine, job_table) == 0)
        crews.stop.set()
        reports = [crews.next_report(120) for _ in range(processes)]
    runs: Counter[str] = Counter()
    for _, counted, events, lock_errors in reports:
        runs.update(counted)
        into.events.update(events)
        into.lock_errors += lock_errors
    into.rates.append(jobs / elapsed)
    into.runs += sum(runs.values())
    into.extra += sum(runs.values()) - len(runs)
    into.never_run += jobs - len(runs)
    archived = count(engine, sp.ArchivedJob.__table__)  # type: ignore[arg-type]
    into.badly_drained += count(engine, job_table) + abs(archived - jobs)
    into.deadlocks += server_deadlocks(engine) - before
    engine.dispose()


def machine(servers: list[Server]) -> str:
    """Cores, processor, Python, SQLAlchemy, the library's commit and the servers' versions."""
    model = "unknown processor"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = []
    for server in servers:
        engine = server.engine()
        with engine.connect() as conn:
            versions.append(str(conn.exec_driver_sql(_VERSION[engine.dialect.name]).scalar_one()))
        engine.dispose()
    return (
        f"{os.cpu_count()} cores ({model}), {platform.system()} {platform.release()},"
        f" Python {platform.python_version()}, SQLAlchemy {sa.__version__},"
        f" sqla-proletarian {sp.__version__} ({library_commit()});"
        f" servers on 127.0.0.1, durable (scripts/benchdb.sh), sharing the cores:"
        f" {', '.join(versions)}"
    )


COLUMNS = (
    "server",
    "batch_size",
    "processes x threads",
    "jobs/s",
    "handler runs",
    "extra runs",
    "job-transaction-lost",
    "run-record-cleanup-error",
    "other warnings",
    "deadlocks (server)",
    "lock errors logged",
    "jobs left or not archived once",
)


def rows(tallies: dict[tuple[str, int, int], Tally]) -> list[tuple[str, ...]]:
    return [
        (
            label,
            str(batch),
            f"{processes} x {THREADS}",
            t.rate(),
            f"{t.runs:,}",
            f"{t.extra:,}" + (f" ({t.never_run:,} never run)" if t.never_run else ""),
            *(f"{t.events[event]:,}" for event in NAMED_EVENTS),
            f"{t.others():,}",
            f"{t.deadlocks:,}",
            f"{t.lock_errors:,}",
            f"{t.badly_drained:,}",
        )
        for (label, batch, processes), t in tallies.items()
    ]


def markdown(lines: list[str], table: list[tuple[str, ...]], notes: list[str]) -> str:
    out = [*(f"- {line}" for line in lines), ""]
    out.append("| " + " | ".join(COLUMNS) + " |")
    out.append("|" + "|".join("---" if i < 3 else "---:" for i in range(len(COLUMNS))) + "|")
    out += ["| " + " | ".join(row) + " |" for row in table]
    if notes:
        out += ["", *(f"- {note}" for note in notes)]
    return "\n".join(out)


def text_table(table: list[tuple[str, ...]]) -> str:
    cells = [COLUMNS, *table]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(
            cell.ljust(width) if i < 3 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    )


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(",") if n.strip())


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs per drain (10,000)")
    parser.add_argument("--batch-sizes", type=_numbers, default=(10, 50, 100))
    parser.add_argument("--processes", type=_numbers, default=(1, 2))
    parser.add_argument("--rounds", type=int, default=3, help="drains per setting (3)")
    parser.add_argument("--only", choices=("mariadb", "postgresql"), help="one server")
    parser.add_argument(
        "--debug-events",
        action="store_true",
        help="count DEBUG events too (the run-record-cleanup-error of a failed fallback"
        " connection; slows every drain)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown file")
    parser.add_argument("--title", default="Batched drain, counted", help="the section title")
    parser.add_argument("--keep-servers", action="store_true", help="leave the servers running")
    return parser.parse_args()


def main() -> None:
    args = parse()
    command = shlex.join(["python", "-m", "benchmarks.batch_drain", *sys.argv[1:]])
    started_at, started = datetime.now(UTC), time.perf_counter()
    with durable_servers(keep=args.keep_servers) as found:
        # MariaDB first: the batches this benchmark is about.
        servers = sorted(found, key=lambda server: server.is_postgresql)
        if args.only:
            servers = [s for s in servers if s.is_postgresql == (args.only == "postgresql")]
        about = machine(servers)
        tallies = {
            (server.label, batch, processes): Tally()
            for server in servers
            for batch in args.batch_sizes
            for processes in args.processes
        }
        by_key = {server.label: server for server in servers}
        for round_number in range(1, args.rounds + 1):
            print(f"round {round_number} of {args.rounds}", flush=True)
            for (label, batch, processes), tally in tallies.items():
                began = time.perf_counter()
                try:
                    drain(by_key[label], args.jobs, batch, processes, args.debug_events, tally)
                except Exception as exc:
                    tally.failures.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
                print(
                    f"    {label}, batch_size={batch}, {processes} process(es):"
                    f" {tally.rate()} jobs/s, {tally.extra} extra runs so far"
                    f" ({time.perf_counter() - began:.1f} s)",
                    flush=True,
                )
    minutes = (time.perf_counter() - started) / 60
    lines = [
        f"Command: `{command}`; run {started_at:%Y-%m-%d %H:%M} UTC, {minutes:.1f} min.",
        f"Machine: {about}.",
        f"{args.jobs:,} no-op jobs per drain, filled in one statement, drained by spawned"
        f" worker processes of {THREADS} threads each (defaults but batch_size), timed from"
        f" their start together until the queue table is empty; {args.rounds} drain(s) per"
        " setting, interleaved: jobs/s is their median (min-max), every count their sum.",
        "Handler runs are counted by job id in each process; extra runs = runs - jobs."
        " Events: the library's log at "
        + ("DEBUG" if args.debug_events else "WARNING")
        + " and above, by event name; lock errors: logged deadlocks (1213, 40P01), lock wait"
        " timeouts (1205, 55P03) and serialization failures (40001).",
    ]
    notes = []
    for (label, batch, processes), tally in tallies.items():
        setting = f"{label}, batch_size={batch}, {processes} x {THREADS}"
        other = [f"{n} {e}" for e, n in tally.events.most_common() if e not in NAMED_EVENTS]
        if other:
            notes.append(f"{setting}: other warnings: {', '.join(other)}")
        notes += [f"{setting}: a drain failed ({failure})" for failure in tally.failures]
    table = rows(tallies)
    print()
    print("\n".join(lines))
    print()
    print(text_table(table))
    if notes:
        print()
        print("\n".join(f"- {note}" for note in notes))
    write_section(args.output, SECTION, f"## {args.title}\n\n" + markdown(lines, table, notes))
    print(f"\nwritten to {args.output}")


if __name__ == "__main__":
    main()
