"""Server time per statement of a drain on PostgreSQL, from pg_stat_statements.

    python -m benchmarks.statements [--jobs 5000] [--top 12] [--output PATH] [--keep-servers]

For the raw 1-job loop and the library at batch_size=1 (transaction mode with the ledger on
and off, lease mode) and at batch_size=50 (both modes), each draining ``--jobs`` no-op jobs
with 4 threads (benchmarks.raw, benchmarks.library): pg_stat_statements is reset once the
queue is filled, and after the drain (its sessions ended) each statement's calls per job,
mean server time and server time per job are read, with the transactions per job
(``xact_commit`` of pg_stat_database) and the WAL bytes per job (benchmarks.server_work).
The benchmark server loads pg_stat_statements (scripts/benchdb.sh) but counts only while
this runs (``pg_stat_statements.track`` set to ``top`` here, then back to ``none``). Prints
a table per setting and writes them into their own section of benchmarks/results.md.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from benchmarks import library, raw, server_work
from benchmarks.batch_drain import machine
from benchmarks.plan import LEASE_SECONDS
from benchmarks.report import RESULTS, write_section
from benchmarks.servers import Server, durable_servers

SECTION = "statements"
#: Statements run less often than this per job are summed up in one line.
MIN_CALLS = 0.005
#: Each setting's drain of ``jobs`` queued jobs, 4 threads.
SETTINGS: dict[str, Callable[[sa.Engine, int], object]] = {
    "raw SQL, 1 job/transaction": lambda engine, jobs: raw.drain(engine, jobs, 1),
    "sqla-proletarian, batch_size=1, ledger on (defaults)": library.drain_counted,
    "sqla-proletarian, batch_size=1, ledger off": lambda engine, jobs: library.drain_counted(
        engine, jobs, max_unclean_ends=None
    ),
    f"sqla-proletarian lease_seconds={LEASE_SECONDS:g}, batch_size=1": (
        lambda engine, jobs: library.drain_counted(engine, jobs, lease_seconds=LEASE_SECONDS)
    ),
    "sqla-proletarian, batch_size=50": lambda engine, jobs: library.drain_counted(
        engine, jobs, batch_size=50
    ),
    f"sqla-proletarian lease_seconds={LEASE_SECONDS:g}, batch_size=50": (
        lambda engine, jobs: library.drain_counted(
            engine, jobs, batch_size=50, lease_seconds=LEASE_SECONDS
        )
    ),
}

_RESET = sa.text("SELECT pg_stat_statements_reset()")
_XACTS = sa.text("SELECT xact_commit FROM pg_stat_database WHERE datname = :database")
_STATEMENTS = sa.text(
    "SELECT s.query, s.calls, s.total_exec_time FROM pg_stat_statements s"
    " JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = :database AND s.toplevel"
)
_LOADED = sa.text("SELECT current_setting('shared_preload_libraries')")


@dataclass
class Statement:
    """One statement's figures over a drain."""

    text: str
    calls: int
    total_ms: float


@dataclass
class Drain:
    """One setting's drain: its statements, transactions, WAL and speed."""

    name: str
    jobs: int
    rate: float
    statements: list[Statement]
    transactions: int
    wal_bytes: float


class Counts:
    """pg_stat_statements and pg_stat_database for the drains' database, read from another
    database (``bench_deep``), so that the reads count nothing there."""

    def __init__(self, server: Server) -> None:
        self.database = sa.make_url(server.urls["bench"]).database
        self.reader = sa.create_engine(
            server.urls["bench_deep"], poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT"
        )
        self.xacts_before = 0

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """pg_stat_statements counting top-level statements, for the block only."""
        with self.reader.connect() as conn:
            if "pg_stat_statements" not in conn.execute(_LOADED).scalar_one():
                raise SystemExit(
                    "pg_stat_statements is not loaded on the benchmark PostgreSQL: its data"
                    " directory predates it; stop the servers (bash scripts/benchdb.sh stop)"
                    " and run again (they start with it)"
                )
            conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.exec_driver_sql("ALTER SYSTEM SET pg_stat_statements.track = 'top'")
            conn.exec_driver_sql("SELECT pg_reload_conf()")
        time.sleep(0.5)  # the postmaster and new sessions take the setting
        try:
            yield
        finally:
            with self.reader.connect() as conn:
                conn.exec_driver_sql("ALTER SYSTEM RESET pg_stat_statements.track")
                conn.exec_driver_sql("SELECT pg_reload_conf()")
            self.reader.dispose()

    def start(self, url: sa.URL) -> None:
        """At a metered drain's start (server_work.starting): reset, and note xact_commit."""
        if url.database != self.database:
            return
        with self.reader.connect() as conn:
            conn.execute(_RESET)
        self.xacts_before = self.xacts()

    def xacts(self) -> int:
        with self.reader.connect() as conn:
            return int(conn.execute(_XACTS, {"database": self.database}).scalar_one())

    def settled_xacts(self) -> int:
        """xact_commit once the drain's sessions have ended and reported theirs."""
        last = self.xacts()
        for _ in range(30):
            time.sleep(0.1)
            value = self.xacts()
            if value == last:
                return value
            last = value
        return last

    def statements(self) -> list[Statement]:
        """The statements counted, those that differ only in how many values a list of
        placeholders has (``IN ($1, $2, ...)``, rows of VALUES) as one."""
        with self.reader.connect() as conn:
            rows = conn.execute(_STATEMENTS, {"database": self.database}).all()
        grouped: dict[str, Statement] = {}
        for query, calls, total in rows:
            text = normalise(query)
            found = grouped.setdefault(text, Statement(text, 0, 0.0))
            found.calls += calls
            found.total_ms += total
        return list(grouped.values())


def drain(server: Server, counts: Counts, name: str, jobs: int) -> Drain:
    """Drain ``jobs`` with setting ``name``, counting between the fill and the end."""
    engine = server.engine()
    started = time.perf_counter()
    found: Any = SETTINGS[name](engine, jobs)
    rate = found if isinstance(found, float) else found.rate
    engine.dispose()  # the sessions end and report their transactions
    elapsed = time.perf_counter() - started
    transactions = counts.settled_xacts() - counts.xacts_before
    work = server_work.take() or {}
    print(f"  {name}: {rate:,.0f} jobs/s ({elapsed:.1f} s with the fill)", flush=True)
    return Drain(
        name, jobs, rate, counts.statements(), transactions, work.get("WAL bytes", float("nan"))
    )


#: A table's name before a column's (not ``excluded.``, which says something).
_QUALIFIER = re.compile(r"\b(?!excluded\.)[a-z_][a-z0-9_]*\.(?=[a-z_])")
_SPACE = re.compile(r"\s+")
#: A placeholder (``$1::UUID``), a list of them, and repeated rows of them.
_PLACEHOLDER = re.compile(r"\$\d+(?:::(?:[A-Z]+(?: WITH(?:OUT)? TIME ZONE)?)(?:\[\])?)?")
_LIST = re.compile(r"\$n(?:, \$n)+")
_ROWS = re.compile(r"\(\$n, …\)(?:, \(\$n, …\))+")


def normalise(query: str) -> str:
    """One line, every placeholder ``$n`` and any list of them ``$n, …`` (and one row of
    them): statements that differ only in how many values they take read the same."""
    text = _PLACEHOLDER.sub("$n", _SPACE.sub(" ", query).strip())
    return _ROWS.sub("($n, …)", _LIST.sub("$n, …", text))


def _list_cut(items: str, keep: int = 2) -> str:
    """``a, b, c, d`` as ``a, b, …`` (top-level commas only)."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(items):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(items[start:index].strip())
            start = index + 1
    parts.append(items[start:].strip())
    return ", ".join([*parts[:keep], "…"]) if len(parts) > keep + 1 else items


def shorten(query: str, width: int = 100) -> str:
    """A statement made short but recognisable: one line, no table qualifiers, long column
    and value lists cut to their first items, then its start and end within ``width``
    characters."""
    text = _QUALIFIER.sub("", normalise(query))
    text = re.sub(
        r"^(SELECT (?:DISTINCT )?)(.*?)( FROM )",
        lambda m: m.group(1) + _list_cut(m.group(2)) + m.group(3),
        text,
        count=1,
    )
    text = re.sub(r"\(([^()]*)\)", lambda m: f"({_list_cut(m.group(1))})", text)
    text = re.sub(r"( RETURNING )(.*)$", lambda m: m.group(1) + _list_cut(m.group(2)), text)
    if len(text) <= width:
        return text
    tail = width // 3
    return f"{text[: width - tail - 3]} … {text[-tail:]}"


def table(found: Drain, top: int) -> list[str]:
    """One setting's statements, most server time per job first (up to ``top`` of those
    run at least once per ``1 / MIN_CALLS`` jobs), the rest summed up."""
    per_job = sorted(found.statements, key=lambda s: s.total_ms, reverse=True)
    frequent = [s for s in per_job if s.calls / found.jobs >= MIN_CALLS][:top]
    shown, rest = frequent, [s for s in per_job if s not in frequent]
    total = sum(s.total_ms for s in found.statements) / found.jobs
    wall = library.THREADS * 1000 / found.rate
    lines = [
        f"**{found.name}**: {found.rate:,.0f} jobs/s ({wall:.2f} ms of wall time per job and"
        f" thread); server time {total:.3f} ms/job;"
        f" {found.transactions / found.jobs:.2f} transactions/job;"
        f" WAL {found.wal_bytes:,.0f} B/job",
        "",
        "| statement | calls/job | mean ms | ms/job |",
        "|---|---:|---:|---:|",
    ]
    for statement in shown:
        text = shorten(statement.text).replace("|", "\\|")
        lines.append(
            f"| `{text}` | {statement.calls / found.jobs:.3f} |"
            f" {statement.total_ms / statement.calls:.3f} |"
            f" {statement.total_ms / found.jobs:.3f} |"
        )
    if rest:
        calls = sum(s.calls for s in rest)
        rest_ms = sum(s.total_ms for s in rest)
        lines.append(
            f"| ({len(rest)} others) | {calls / found.jobs:.3f} | {rest_ms / calls:.3f} |"
            f" {rest_ms / found.jobs:.3f} |"
        )
    return lines


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5_000, help="jobs per drain (5,000)")
    parser.add_argument("--top", type=int, default=12, help="statements shown per drain (12)")
    parser.add_argument("--only", default="", help="comma-separated setting numbers (1-6)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown file")
    parser.add_argument("--keep-servers", action="store_true", help="leave the servers running")
    args = parser.parse_args()
    names = list(SETTINGS)
    try:
        picked = [int(n) for n in args.only.split(",") if n.strip()]
        args.settings = [names[n - 1] for n in picked] if picked else names
    except (ValueError, IndexError):
        parser.error(f"--only takes numbers 1-{len(names)}: {names}")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    return args


def main() -> None:
    args = parse()
    command = shlex.join(["python", "-m", "benchmarks.statements", *sys.argv[1:]])
    library.count_events()
    started_at, started = datetime.now(UTC), time.perf_counter()
    with durable_servers(keep=args.keep_servers) as servers:
        server = servers[0]
        about = machine([server])
        counts = Counts(server)
        server_work.starting.append(counts.start)
        try:
            with counts.tracking():
                drains = [drain(server, counts, name, args.jobs) for name in args.settings]
        finally:
            server_work.starting.remove(counts.start)
    minutes = (time.perf_counter() - started) / 60
    lines = [
        f"Command: `{command}`; run {started_at:%Y-%m-%d %H:%M} UTC, {minutes:.1f} min.",
        f"Machine: {about}.",
        f"Each setting drains {args.jobs:,} queued no-op jobs with 4 threads on PostgreSQL,"
        " once (one run: figures within about 20% of each other are noise here).",
        "pg_stat_statements (track = top) is reset once the queue is filled; after the drain,"
        " each statement's calls per job, mean server time (total_exec_time / calls) and server"
        " time per job; statements normalised by pg_stat_statements ($n for values), shown"
        " without table qualifiers, long column lists cut to their first items.",
        "Server time is the time the server spent executing a statement; the commit's wait"
        " for its WAL flush is not in it (it comes after the COMMIT statement's execution),"
        " nor are the round trips: the transactions per job (xact_commit of pg_stat_database)"
        " count the flushes, jobs/s the wall time.",
        "WAL bytes per job: pg_wal_lsn_diff of pg_current_wal_lsn() after and before the"
        " drain (benchmarks.server_work).",
    ]
    body = [
        "## Server time per statement (`python -m benchmarks.statements`, `make bench-statements`)",
        "",
        *(f"- {line}" for line in lines),
    ]
    for found in drains:
        body += ["", *table(found, args.top)]
    print("\n".join(body))
    write_section(args.output, SECTION, "\n".join(body))
    print(f"\nwritten to {args.output} ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
