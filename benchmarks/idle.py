"""What an idle worker costs the database, and how fast it still starts a job.

    python -m benchmarks.idle [--seconds S] [--samples N] [--only postgresql,mariadb]

For PostgreSQL (psycopg, LISTEN/NOTIFY, and polling only) and MariaDB (polling): an idle
worker of 4 threads serving 1 queue and 5 queues, all empty, in this process, at its
defaults; what it sends, counted by the server
(PostgreSQL: xact_commit + xact_rollback of pg_stat_database for the worker's database, read
from another database; MariaDB: the Questions counter, less the benchmark's own reads) and by
the client (SQLAlchemy's before_cursor_execute), per second; then, at the default wake-ups,
the idle latency p50 (enqueue's commit to handler start, the worker in another process, the
job on its last queue; benchmarks.procs). Run
it against another commit of the library (PYTHONPATH) to compare. Prints one table and
writes it into its own section of benchmarks/results.md.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import sqla_proletarian as sp
from benchmarks import library
from benchmarks.batch_drain import machine
from benchmarks.fill import fresh_tables
from benchmarks.report import RESULTS, write_section
from benchmarks.servers import Server, durable_servers

SECTION = "idle"
SERVERS = ("postgresql", "mariadb")
#: The short run whose count is taken off the long run's: start-up and shutdown cancel out.
SHORT_RUN = 1.0
#: The queues of each row's worker: the default queue last, where the latency's jobs go.
QUEUES = {1: [sp.DEFAULT_QUEUE], 5: ["first", "second", "third", "fourth", sp.DEFAULT_QUEUE]}

_PG_XACTS = sa.text(
    "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = :database"
)


class ServerCount:
    """The server's own count of what clients sent: PostgreSQL's transactions on the worker's
    database (read from another one, so the reads count nothing; a backend reports its
    counts at the latest when it exits), MariaDB's Questions (less this reader's own)."""

    def __init__(self, server: Server) -> None:
        self.postgresql = server.is_postgresql
        self.database = sa.make_url(server.urls["bench"]).database
        self.reader = sa.create_engine(
            server.urls["bench_deep"], poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT"
        )
        self._own = 0
        if not self.postgresql:
            first = self._read()
            self._own = self._read() - first  # what one read adds

    def _read(self) -> int:
        with self.reader.connect() as conn:
            if self.postgresql:
                return int(conn.execute(_PG_XACTS, {"database": self.database}).scalar_one())
            row = conn.exec_driver_sql("SHOW GLOBAL STATUS LIKE 'Questions'").one()
            return int(row[1])

    def now(self) -> int:
        return self._read() - self._own

    def settled(self) -> int:
        """The count once the worker's sessions have ended and reported theirs."""
        last = self.now()
        for _ in range(20):
            time.sleep(0.1)
            value = self.now()
            if value == last:
                return value
            last = value
        return last


def idle_run(
    server: Server, counts: ServerCount, seconds: float, options: dict[str, Any]
) -> tuple[int, int]:
    """Server-side and client-side counts of a 4-thread worker's life of ``seconds`` on
    empty queues (``options``), its engine disposed at the end (its sessions end)."""
    engine = server.engine()
    sent = 0
    lock = threading.Lock()

    def count(*args: Any) -> None:
        nonlocal sent
        with lock:
            sent += 1

    sa.event.listen(engine, "before_cursor_execute", count)
    before = counts.settled()
    with library.worker(engine, **options):
        threading.Event().wait(seconds)
    engine.dispose()
    return counts.settled() - before, sent


def idle_cost(server: Server, seconds: float, options: dict[str, Any]) -> tuple[float, float]:
    """Per second of idleness: what the server counted, and the statements the client sent."""
    engine = server.engine()
    fresh_tables(engine)
    engine.dispose()
    counts = ServerCount(server)
    short_server, short_sent = idle_run(server, counts, SHORT_RUN, options)
    long_server, long_sent = idle_run(server, counts, SHORT_RUN + seconds, options)
    counts.reader.dispose()
    return (long_server - short_server) / seconds, (long_sent - short_sent) / seconds


def latency_p50(server: Server, samples: int, options: dict[str, Any]) -> float:
    """The median idle latency in milliseconds (benchmarks.library.idle_latency)."""
    engine = server.engine()
    try:
        latencies = library.idle_latency(engine, server.urls["bench"], samples, **options)
        return statistics.median(latencies) * 1e3
    finally:
        engine.dispose()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="idle seconds counted (6)")
    parser.add_argument("--samples", type=int, default=12, help="latency samples (12)")
    parser.add_argument("--only", default="", help=f"servers {SERVERS}")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown file")
    parser.add_argument("--keep-servers", action="store_true", help="leave the servers running")
    args = parser.parse_args()
    args.only = {name.strip() for name in args.only.split(",") if name.strip()}
    if args.only - set(SERVERS):
        parser.error(f"unknown --only name(s) {sorted(args.only - set(SERVERS))}")
    return args


def main() -> None:
    args = parse()
    command = shlex.join(["python", "-m", "benchmarks.idle", *sys.argv[1:]])
    library.count_events()
    started_at, started = datetime.now(UTC), time.perf_counter()
    rows = []
    with durable_servers(keep=args.keep_servers) as found:
        servers = [s for s in found if not args.only or s.label.split()[0].lower() in args.only]
        about = machine(servers)
        for server in servers:
            unit = "transactions" if server.is_postgresql else "Questions"
            # PostgreSQL listens by default; polling only shows what each poll costs.
            for poll_only in (False, True) if server.is_postgresql else (False,):
                wakes = "LISTEN/NOTIFY" if server.is_postgresql and not poll_only else "polling"
                for count, queues in QUEUES.items():
                    options: dict[str, Any] = {"queues": queues}
                    if poll_only:
                        options["poll_only"] = True
                    counted, sent = idle_cost(server, args.seconds, options)
                    latency = (
                        "" if poll_only else f"{latency_p50(server, args.samples, options):.1f} ms"
                    )
                    rows.append(
                        f"| {server.label} ({wakes}) | {count} | {counted:.2f} {unit}/s |"
                        f" {sent:.2f}/s | {latency} |"
                    )
                    print(rows[-1], flush=True)
    minutes = (time.perf_counter() - started) / 60
    lines = [
        f"Command: `{command}`; run {started_at:%Y-%m-%d %H:%M} UTC, {minutes:.1f} min.",
        f"Machine: {about}.",
        f"An idle worker of {library.THREADS} threads serving 1 queue and 5 queues, all empty,"
        " at its defaults (PostgreSQL also polling only, poll_only=True):"
        f" the counts of a {SHORT_RUN + args.seconds:g} s life less those of a {SHORT_RUN:g} s"
        f" one, per second of the {args.seconds:g} s between (start-up and shutdown cancel"
        " out). Server-side: PostgreSQL's xact_commit + xact_rollback for the database"
        " (pg_stat_database), MariaDB's Questions less the reads'. Client-side: statements"
        f" sent. Idle latency: the median of {args.samples} jobs, each enqueued 50-250 ms after"
        " the last started, to a worker in another process, on its last queue.",
    ]
    table = [
        "| server | queues | server-side, per s | statements sent, per s | idle latency p50 |",
        "|---|---|---|---|---|",
        *rows,
    ]
    print("\n".join(lines), "", *table, sep="\n")
    body = [
        "## An idle worker's cost (`python -m benchmarks.idle`)",
        "",
        *(f"- {line}" for line in lines),
        "",
        *table,
    ]
    write_section(args.output, SECTION, "\n".join(body))
    print(f"\nwritten to {args.output} ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
