"""What job control costs a batched drain: the paused-queue check of the poll, the unique
index on (queue, unique_key) and a wider job row, each taken away (or added) in turn, A/B on
the same servers in interleaved rounds.

    python -m benchmarks.job_control_cost [--jobs N] [--rounds R] [--batch-sizes 50,100]
        [--only postgresql|mariadb]

Variants (none changes the library; each is made here): ``as shipped``; ``no paused check``
(the poll's and the priority reads' ``NOT EXISTS (... proletarian_paused_queue ...)`` cut
out of the SQL by a ``before_cursor_execute`` hook, which every variant runs so that all pay
the same for it); ``no unique index`` (ix_proletarian_job_unique_key dropped after the
tables are made, and on MariaDB ix_proletarian_job_unique_slot with it); ``6 more NULL
columns`` (six nullable columns like the lease columns added to the job table: what a wider
row costs); ``neither check nor index``. Each round takes the variants in an order turned by
one from the last round's.

Prints one table of medians (min-max) and ratios to ``as shipped`` and writes it into its own
section of results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import sqla_proletarian as sp
from benchmarks.batch_drain import machine
from benchmarks.fill import check_drained, fill, fresh_tables
from benchmarks.library import THREADS, count_events, noop, run_until, worker
from benchmarks.report import RESULTS, Results, write_section
from benchmarks.servers import Server, durable_servers
from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.running import due_run_orders

SECTION = "job_control_cost"
#: The queue the statements alone are timed over.
STATEMENT_JOBS = 10_000
#: The paused-queue check as the dialects render it, with what precedes it.
_PAUSED = re.compile(
    r"(?P<lead> AND |WHERE )NOT \(EXISTS \(SELECT proletarian_paused_queue\.queue \n"
    r"FROM proletarian_paused_queue \nWHERE proletarian_paused_queue\.queue ="
    r" (?P<param>%s|%\(queue\)s(?:::VARCHAR)?|\?)\)\)"
)
_EXTRA_COLUMNS = ("x_token", "x_owner", "x_beat", "x_due", "x_ends", "x_cancel")


def cut_paused_check(statement: str, parameters: Any) -> tuple[str, Any]:
    """The statement without its paused-queue check (and, for positional parameters, the
    check's parameter taken out)."""
    while (match := _PAUSED.search(statement)) is not None:
        if match["param"] == "%s" and isinstance(parameters, (tuple, list)):
            index = statement[: match.start("param")].count("%s")
            parameters = type(parameters)(value for i, value in enumerate(parameters) if i != index)
        kept = " " if match["lead"] == " AND " else "WHERE 1 = 1"
        statement = statement[: match.start()] + kept + statement[match.end() :]
    return statement, parameters


class Rewriter:
    """A ``before_cursor_execute`` hook on an engine: cuts the paused check when ``on``, and
    looks for it either way (so every variant pays the same for the hook)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.on = False
        self.cut = 0
        sa.event.listen(engine, "before_cursor_execute", self, retval=True)

    def __call__(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
    ) -> tuple[str, Any]:
        if not self.on or many:
            _PAUSED.search(statement)
            return statement, parameters
        cut, parameters = cut_paused_check(statement, parameters)
        self.cut += cut != statement
        return cut, parameters


def drop_unique_index(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("DROP INDEX ix_proletarian_job_unique_key")
        else:
            # MySQL and MariaDB hold the keys in the unique slot's index (sqlap_0011).
            conn.exec_driver_sql(
                "ALTER TABLE proletarian_job DROP INDEX ix_proletarian_job_unique_key, "
                "DROP INDEX ix_proletarian_job_unique_slot"
            )


#: The lease columns' types, for the wider row.
_TYPES = {
    "postgresql": ("uuid", "varchar(255)", "timestamptz", "timestamptz", "smallint", "timestamptz"),
    "mysql": ("char(32)", "varchar(255)", "datetime(6)", "datetime(6)", "smallint", "datetime(6)"),
}


def widen(engine: sa.Engine) -> None:
    types = _TYPES[engine.dialect.name]
    added = ", ".join(
        f"ADD COLUMN {name} {kind} NULL" for name, kind in zip(_EXTRA_COLUMNS, types, strict=True)
    )
    with engine.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE proletarian_job {added}")


VARIANTS: dict[str, tuple[bool, Callable[[sa.Engine], None] | None]] = {
    "as shipped": (False, None),
    "no paused check": (True, None),
    "no unique index": (False, drop_unique_index),
    "6 more NULL columns": (False, widen),
    "neither check nor index": (True, drop_unique_index),
}


def drain(engine: sa.Engine, rewriter: Rewriter, jobs: int, batch_size: int, variant: str) -> float:
    cut, prepare = VARIANTS[variant]
    fresh_tables(engine)
    if prepare is not None:
        prepare(engine)
    fill(engine, jobs)
    queue_worker = worker(engine, noop, batch_size=batch_size)
    rewriter.on, rewriter.cut = cut, 0
    try:
        elapsed = run_until(queue_worker, jobs)
    finally:
        rewriter.on = False
    if cut and not rewriter.cut:
        raise RuntimeError("no statement had a paused check to cut: the pattern is stale")
    check_drained(engine, jobs, variant)
    return jobs / elapsed


def _median_us(run: Callable[[], None], times: int) -> float:
    took = []
    for _ in range(times):
        began = time.perf_counter()
        run()
        took.append(time.perf_counter() - began)
    return 1e6 * statistics.median(took)


def statement_costs(engine: sa.Engine, rewriter: Rewriter, variant: str) -> dict[str, float]:
    """Microseconds (median of many) of the worker's poll for 50 jobs (in a transaction that
    is rolled back) and of a delete of 50 queued jobs by id (all in one transaction, rolled
    back), over a queue of ``STATEMENT_JOBS`` jobs, in one variant."""
    cut, prepare = VARIANTS[variant]
    fresh_tables(engine)
    if prepare is not None:
        prepare(engine)
    fill(engine, STATEMENT_JOBS, analyze=True)
    dialect = dialect_of(engine)
    now = datetime.now(UTC)
    job = sp.Job.__table__

    def poll() -> None:
        with engine.begin() as conn:
            if dialect.poll_finds_priority:
                conn.execute(*sql.poll_first(sp.DEFAULT_QUEUE, now, 50)).all()
            else:
                orders = due_run_orders(conn, sp.DEFAULT_QUEUE, now, dialect.priority_scan)
                run_order = next(iter(orders))
                conn.execute(*sql.poll(sp.DEFAULT_QUEUE, now, 50, run_order=run_order)).all()
            conn.rollback()

    rewriter.on = cut
    try:
        polls = _median_us(poll, 300)
    finally:
        rewriter.on = False
    with engine.connect() as conn:
        ids = list(conn.execute(sa.select(job.c.job_id)).scalars())  # type: ignore[attr-defined]
        chunks = iter([ids[i : i + 50] for i in range(0, len(ids), 50)])
        deletes = _median_us(
            lambda: conn.execute(sa.delete(job).where(job.c.job_id.in_(next(chunks)))),  # type: ignore[attr-defined]
            len(ids) // 50,
        )
        conn.rollback()
    return {"poll of 50 jobs": polls, "delete of 50 jobs by id": deletes}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs per drain (10,000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, interleaved (3)")
    parser.add_argument(
        "--batch-sizes",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=(50, 100),
        help="batch sizes (50,100)",
    )
    parser.add_argument("--only", choices=("postgresql", "mariadb"), help="one server")
    parser.add_argument(
        "--statements",
        action="store_true",
        help="time the poll and a delete of 50 jobs by id alone instead of drains",
    )
    parser.add_argument(
        "--urls",
        default="",
        help="comma-separated SQLAlchemy URLs of databases to use instead of the durable"
        " servers' (for --statements, which commits nothing)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown file")
    parser.add_argument("--keep-servers", action="store_true", help="leave the servers running")
    return parser.parse_args()


def main() -> None:
    args = parse()
    command = shlex.join(["python", "-m", "benchmarks.job_control_cost", *sys.argv[1:]])
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    count_events()
    started_at, started = datetime.now(UTC), time.perf_counter()
    results = Results()
    notes: list[str] = []
    given = [
        Server(
            ("PostgreSQL" if url.startswith("postgresql") else "MariaDB") + " (given)",
            {"bench": url},
        )
        for url in args.urls.split(",")
        if url
    ]
    with contextlib.nullcontext(given) if given else durable_servers(args.keep_servers) as found:
        servers: list[Server] = [
            s for s in found if not args.only or s.is_postgresql == (args.only == "postgresql")
        ]
        about = machine(servers)
        engines = {server.label: server.engine() for server in servers}
        rewriters = {label: Rewriter(engine) for label, engine in engines.items()}
        for round_number in range(1, args.rounds + 1):
            print(f"round {round_number} of {args.rounds}", flush=True)
            for server in servers:
                if args.statements:
                    order = list(VARIANTS)[:4]
                    turn = (round_number - 1) % len(order)
                    for variant in order[turn:] + order[:turn]:
                        found = statement_costs(
                            engines[server.label], rewriters[server.label], variant
                        )
                        for name, value in found.items():
                            section = (
                                f"{name}, {server.label}, over {STATEMENT_JOBS:,} queued jobs"
                                " (median of many)"
                            )
                            for each in order:  # the rows in one order, whatever the turn
                                results.row(
                                    section, each, "us", None if each == order[0] else order[0]
                                )
                            results.add(section, variant, value, "us")
                        print(f"    {server.label}: {variant}: {found}", flush=True)
                    continue
                for batch in args.batch_sizes:
                    section = (
                        f"batched drain, {server.label}: {args.jobs:,} queued jobs,"
                        f" {THREADS} threads, batch_size={batch}, transaction mode"
                    )
                    order = list(VARIANTS)
                    turn = (round_number - 1) % len(order)
                    for variant in order[turn:] + order[:turn]:
                        label = f"{section}: {variant}"
                        try:
                            rate = drain(
                                engines[server.label],
                                rewriters[server.label],
                                args.jobs,
                                batch,
                                variant,
                            )
                        except Exception as exc:
                            notes.append(f"{label}: failed ({type(exc).__name__}: {exc})")
                            print(f"    {label}: failed: {exc!r}", flush=True)
                            continue
                        ref = None if variant == "as shipped" else "as shipped"
                        results.add(section, variant, rate, "jobs/s", ref)
                        print(f"    {label}: {rate:,.0f} jobs/s", flush=True)
    minutes = (time.perf_counter() - started) / 60
    lines = [
        f"Command: `{command}`; run {started_at:%Y-%m-%d %H:%M} UTC, {minutes:.1f} min.",
        f"Machine: {about}; load average at the end {os.getloadavg()[0]:.1f}.",
        f"{args.rounds} round(s), interleaved; each cell is the median over the rounds"
        " (min-max); ratio: the variant's median over as shipped's.",
        " ".join(__doc__.split("\n\n")[2].split()),
    ]
    print("\n".join(lines), "", results.table(), sep="\n")
    if notes:
        print("\n".join(f"- {note}" for note in notes))
    body = [
        (
            "## What job control costs the poll and a delete, timed alone"
            " (`python -m benchmarks.job_control_cost --statements`)"
            if args.statements
            else "## What job control costs a batched drain"
            " (`python -m benchmarks.job_control_cost`)"
        ),
        "",
        *(f"- {line}" for line in lines),
        "",
        results.markdown(),
        *(["", *(f"- {note}" for note in notes)] if notes else []),
    ]
    write_section(
        args.output, SECTION + ("_statements" if args.statements else ""), "\n".join(body)
    )
    print(f"\nwritten to {args.output} ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
